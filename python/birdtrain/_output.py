"""What a batch becomes after the engine: the ``device=``, ``mean=``, ``std=``,
``channels_last=`` and ``dtype=`` arguments of ``birdtrain.Loader``.

Without ``mean``/``std`` a batch stays the engine's ``uint8 [B, H, W, 3]`` (a view of its
buffer on the CPU, a copy of it on a GPU). With them it becomes torchvision's
``ToTensor()`` followed by ``Normalize(mean, std)``: ``(x / 255 - mean) / std`` computed in
float32 in that order (the same operations as torchvision, so the same bits), then cast to
``dtype``, as ``[B, 3, H, W]``, ``channels_last`` when asked.

On a GPU the uint8 batch is copied from the engine's (page-locked) buffer on a side stream and
normalised there, one batch ahead of the one handed out; the consumer's stream waits on an
event recorded after that work, and the engine's buffer is released only once the copy that
reads it has completed (its event), never while the DMA may still read it.
"""

from __future__ import annotations

import collections
import ctypes
import math
from typing import Any, Deque, Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch

#: The float types a normalised batch may have (computed in float32, then cast).
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)

Batch = Tuple[torch.Tensor, torch.Tensor, int]


def cuda_forked() -> bool:
    """Whether this process was forked after its parent initialised CUDA: torch then refuses
    every CUDA call, so nothing here may page-lock or copy to a GPU."""
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return bool(in_bad_fork and in_bad_fork())


def check_device(device: Any) -> Optional[torch.device]:
    """``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``; a bare ``"cuda"``
    means torch's current GPU when the loader is built."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device={device!r}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"device={device!r}: the loader delivers to 'cpu' or 'cuda' devices")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: torch sees no CUDA GPU (torch.cuda.is_available() is False)"
        )
    if cuda_forked():
        raise ValueError(
            f"device={device!r}: this process was forked after its parent initialised CUDA, "
            "and CUDA cannot be used again here; start it with the 'spawn' method"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if index >= count:
        raise ValueError(f"device={device!r}: torch sees {count} CUDA GPU(s)")
    return torch.device("cuda", index)


def _check_channel_values(name: str, value: Any, positive: bool) -> Tuple[float, float, float]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"{name}={value!r}: expected three numbers, one per channel (R, G, B)")
    numbers = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}={value!r}: expected three finite numbers")
        numbers.append(float(v))
    low_ok = all(v > 0 for v in numbers) if positive else all(v >= 0 for v in numbers)
    if not low_ok or any(v > 1 for v in numbers):
        bound = "in (0, 1]" if positive else "in [0, 1]"
        raise ValueError(
            f"{name}={value!r}: each value must be {bound}, the scale of torchvision's "
            "Normalize after ToTensor (e.g. (0.485, 0.456, 0.406)); divide 0-255 values by 255"
        )
    return numbers[0], numbers[1], numbers[2]


class Output:
    """The checked output settings, and the conversion of the engine's batches."""

    def __init__(
        self,
        device: Any,
        mean: Any,
        std: Any,
        channels_last: Any,
        dtype: Any,
    ) -> None:
        self.device = check_device(device)
        if (mean is None) != (std is None):
            missing = "std" if std is None else "mean"
            raise ValueError(
                f"{missing}=None: mean and std normalise together; give both or neither"
            )
        self.normalise = mean is not None
        if self.normalise:
            self.mean = _check_channel_values("mean", mean, positive=False)
            self.std = _check_channel_values("std", std, positive=True)
        if not isinstance(channels_last, bool):
            raise ValueError(f"channels_last={channels_last!r}: expected True or False")
        if channels_last and not self.normalise:
            raise ValueError(
                "channels_last=True: it shapes the normalised [B, 3, H, W] batch; give mean and "
                "std (without them a batch is uint8 [B, H, W, 3], already channels-last in memory)"
            )
        self.channels_last = channels_last
        if dtype is not None and not self.normalise:
            raise ValueError(
                f"dtype={dtype!r}: the type of the normalised batch; give mean and std"
            )
        if dtype is not None and dtype not in FLOAT_TYPES:
            raise ValueError(
                f"dtype={dtype!r}: expected torch.float32, torch.float16 or torch.bfloat16"
            )
        self.dtype = torch.float32 if dtype is None else dtype

    @property
    def on_gpu(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _constants(self, device: Optional[torch.device]) -> Tuple[torch.Tensor, torch.Tensor]:
        # torchvision's Normalize: float32 tensors shaped [C, 1, 1], broadcast over the batch.
        mean = torch.tensor(self.mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        return mean, std

    def convert(
        self, images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
    ) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` → ``(x / 255 - mean) / std`` as ``[B, 3, H, W]``, on the
        device ``images`` is on."""
        x = images.permute(0, 3, 1, 2)  # channels-last strides already
        if not self.channels_last:
            x = x.contiguous()  # on the uint8 batch: a quarter of the float's bytes
        x = x.to(torch.float32).div_(255).sub_(mean).div_(std)
        return x if self.dtype == torch.float32 else x.to(self.dtype)

    def batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The engine's ``(images, labels, step)`` as the user asked for them."""
        if self.on_gpu:
            return _GpuDelivery(self).batches(batches)
        if not self.normalise:
            return iter(batches)
        return self._cpu_batches(batches)

    def _cpu_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        mean, std = self._constants(None)
        for images, labels, step in batches:
            yield self.convert(images, mean, std), labels, step


class _GpuDelivery:
    """One epoch's copies to a GPU: on a side stream, one batch ahead, ordered by events."""

    def __init__(self, output: Output) -> None:
        self.output = output
        self.device = output.device
        self.stream = torch.cuda.Stream(self.device)
        if output.normalise:
            self.mean, self.std = output._constants(self.device)
            # The constants were copied on the current stream; the side stream reads them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        # (copy finished, host tensors the copy reads): released once the event completes.
        self.reading: Deque[Tuple[torch.cuda.Event, Tuple[torch.Tensor, ...]]] = collections.deque()

    def _launch(self, images: torch.Tensor, labels: torch.Tensor) -> Tuple[Any, ...]:
        # Labels live in an ordinary vector: torch's pinned copy is tiny, and its own host
        # allocator keeps it until the copy that reads it is done.
        if images.is_pinned() and not labels.is_pinned():
            labels = labels.pin_memory()
        with torch.cuda.stream(self.stream):
            on_device = images.to(self.device, non_blocking=True)
            device_labels = labels.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
            if self.output.normalise:
                on_device = self.output.convert(on_device, self.mean, self.std)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.reading.append((copied, (images, labels)))
        return on_device, device_labels, ready

    def _release_copied(self, wait: bool) -> None:
        while self.reading and (wait or self.reading[0][0].query()):
            copied, _ = self.reading.popleft()
            copied.synchronize()

    def _hand_over(self, launched: Tuple[Any, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
        images, labels, ready = launched
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        # The side stream made them; the consumer's work on them must end before the caching
        # allocator hands their memory out again.
        images.record_stream(consumer)
        labels.record_stream(consumer)
        return images, labels

    def batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        ahead: Optional[Tuple[Tuple[Any, ...], int]] = None
        try:
            for images, labels, step in batches:
                launched = self._launch(images, labels)
                del images, labels
                if ahead is not None:
                    yield (*self._hand_over(ahead[0]), ahead[1])
                ahead = (launched, step)
                self._release_copied(wait=False)
            if ahead is not None:
                launched, step = ahead
                ahead = None
                yield (*self._hand_over(launched), step)
        finally:
            # A loop left early: the engine's buffers go back only after their copies.
            self._release_copied(wait=True)


def page_lock_functions(names: Iterable[str]) -> Optional[Dict[str, int]]:
    """The CUDA driver functions' addresses in the ``libcuda.so.1`` torch uses, or ``None``
    where it cannot be loaded (the buffers then stay ordinary memory)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        return {name: ctypes.cast(getattr(driver, name), ctypes.c_void_p).value for name in names}
    except (OSError, AttributeError):
        return None
