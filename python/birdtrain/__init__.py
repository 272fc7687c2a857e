"""birdtrain's input engine as a PyTorch data loader.

``birdtrain.Loader`` reads an image folder (``train/valid/test/<class>/`` or flat
``<class>/``) or a CSV listing images, decodes each image once into a memory-mapped pixel
cache, and hands out batches of ``torch.uint8 [B, H, W, 3]`` images and ``torch.int64 [B]``
labels, or, with ``mean``/``std``, normalised float ``[B, 3, H, W]`` images, on a GPU when
``device`` names one. Augmentation draws come from ``(seed, epoch, sample)`` alone, so a run
does not depend on the number of workers, and ``state_dict()`` resumes an epoch exactly.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.dlpack

from birdtrain._engine import BadImageError, Engine, LoaderError
from birdtrain._output import Output, cuda_forked, page_lock_functions

__all__ = ["Loader", "LoaderError", "BadImageError"]

#: The ``state_dict`` layout this version writes and reads.
STATE_VERSION = 1

#: Bad files named one by one in warnings; the rest are counted once (``bad_files`` has all).
WARNED_BAD_FILES = 20


def _check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: expected an integer")
    if value < least:
        raise ValueError(f"{name}={value!r}: must be at least {least}")
    return value


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r}: expected a number")
    if not (low <= float(value) <= high):
        raise ValueError(f"{name}={value!r}: must be in [{low}, {high}]")
    return float(value)


def _check_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    if value not in choices:
        words = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r}: expected one of {words}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected True or False")
    return value


def _default_rank_world_size() -> Tuple[int, int]:
    """torch.distributed's group if initialised, else RANK/WORLD_SIZE, else 0/1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    try:
        return (int(rank) if rank else 0), (int(world) if world else 1)
    except ValueError:
        raise ValueError(
            f"rank/world_size: the environment's RANK={rank!r} WORLD_SIZE={world!r} are not integers"
        ) from None


class Loader:
    """Batches of one split of an image dataset, for this rank, epoch after epoch.

    Iterating yields ``(images, labels)``: ``torch.uint8 [B, image_size, image_size, 3]``
    (RGB, NHWC) and ``torch.int64 [B]``. The images view the engine's buffer without a copy;
    the buffer is reused only after the tensor is released. With ``mean`` and ``std`` (three
    values each, in torchvision's 0-1 scale) the images are ``(x / 255 - mean) / std`` as
    ``dtype`` (float32 by default) ``[B, 3, H, W]``, ``channels_last`` if asked; ``device``
    (``"cpu"``, ``"cuda"``, ``"cuda:N"``) is where images and labels are delivered, a GPU's
    copied and normalised on a side stream. ``B`` is ``batch_size`` except
    in the last batch (``last_batch="partial"``) and where a bad file was skipped (its batch
    is one image short; later batches keep their boundaries).

    A loader is a position in the stream of epochs: iterating yields the batches from the
    position to the end of the epoch, then moves to the next epoch; ``set_epoch`` moves to
    the start of an epoch; ``state_dict``/``load_state_dict`` save and restore the position.
    """

    def __init__(
        self,
        path: "str | os.PathLike[str]",
        split: str = "train",
        image_size: int = 224,
        batch_size: int = 256,
        seed: int = 0,
        shuffle: Optional[bool] = None,
        augment: Optional[str] = None,
        crop_scale: float = 0.08,
        flip: Optional[bool] = None,
        color_jitter: float = 0.0,
        auto_augment: Optional[str] = None,
        store_size: Optional[int] = None,
        resize_mode: str = "direct",
        crop_pct: float = 1.0,
        last_batch: str = "partial",
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        workers: Optional[int] = None,
        prefetch: int = 2,
        cache_dir: "Optional[str | os.PathLike[str]]" = None,
        on_bad_image: str = "skip",
        pin_memory: bool = True,
        valid_fraction: Optional[float] = None,
        device: "Optional[str | torch.device]" = None,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        channels_last: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path={path!r}: expected a folder or CSV file path")
        split = _check_choice("split", split, ("train", "valid", "test"))
        train = split == "train"
        image_size = _check_int("image_size", image_size, 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        seed = _check_int("seed", seed, 0)
        shuffle = train if shuffle is None else _check_bool("shuffle", shuffle)
        augment = ("resized-crop" if train else "none") if augment is None else augment
        augment = _check_choice("augment", augment, ("resized-crop", "none"))
        crop_scale = _check_float("crop_scale", crop_scale, 0.0, 1.0)
        if crop_scale == 0.0:
            raise ValueError("crop_scale=0: the least area share must be above 0")
        flip = train if flip is None else _check_bool("flip", flip)
        color_jitter = _check_float("color_jitter", color_jitter, 0.0, 1.0)
        if auto_augment is not None and not isinstance(auto_augment, str):
            raise ValueError(f"auto_augment={auto_augment!r}: expected a policy name or None")
        if store_size is not None:
            store_size = _check_int("store_size", store_size, 1)
            if store_size < image_size:
                raise ValueError(
                    f"store_size={store_size}: must be at least image_size={image_size}"
                )
        resize_mode = _check_choice("resize_mode", resize_mode, ("direct", "center-crop"))
        crop_pct = _check_float("crop_pct", crop_pct, 0.0, 1.0)
        if crop_pct == 0.0:
            raise ValueError("crop_pct=0: the centre crop's share must be above 0")
        if crop_pct != 1.0 and augment == "resized-crop":
            raise ValueError(
                f"crop_pct={crop_pct}: the centre crop is for augment='none' (evaluation); "
                "augment='resized-crop' cuts its own random crop"
            )
        last_batch = _check_choice("last_batch", last_batch, ("partial", "drop", "pad"))
        if rank is None or world_size is None:
            default_rank, default_world = _default_rank_world_size()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        world_size = _check_int("world_size", world_size, 1)
        rank = _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank={rank}: must be below world_size={world_size}")
        if workers is not None:
            workers = _check_int("workers", workers, 1)
        prefetch = _check_int("prefetch", prefetch, 1)
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir={cache_dir!r}: expected a folder path or None")
        on_bad_image = _check_choice("on_bad_image", on_bad_image, ("skip", "fail"))
        pin_memory = _check_bool("pin_memory", pin_memory)
        if valid_fraction is not None:
            valid_fraction = _check_float("valid_fraction", valid_fraction, 0.0, 1.0)
            if valid_fraction in (0.0, 1.0):
                raise ValueError(
                    f"valid_fraction={valid_fraction}: the held-out share is between 0 and 1"
                )
        self._output = Output(device, mean, std, channels_last, dtype)
        # The engine's own buffers page-locked (no staging copy for an H2D copy); a no-op, and
        # the engine's ordinary allocator, where torch has no CUDA.
        page_lock, page_lock_device = None, 0
        if pin_memory and torch.cuda.is_available() and cuda_forked():
            # torch refuses CUDA in such a child (its DataLoader's pinning would raise): the
            # buffers stay ordinary memory, which is what pin_memory does without CUDA.
            warnings.warn(
                "birdtrain: pin_memory=True in a process forked after its parent initialised "
                "CUDA: batch buffers stay ordinary memory (start the process with 'spawn' to pin)",
                stacklevel=2,
            )
        elif pin_memory and torch.cuda.is_available():
            page_lock = page_lock_functions(Engine.page_lock_functions())
            output = self._output
            page_lock_device = output.device.index if output.on_gpu else torch.cuda.current_device()
            if page_lock is None:
                warnings.warn(
                    "birdtrain: pin_memory=True but the CUDA driver (libcuda.so.1) cannot be "
                    "loaded: batch buffers stay ordinary memory",
                    stacklevel=2,
                )

        self._engine = Engine(
            os.fspath(path),
            split=split,
            image_size=image_size,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            crop_scale=crop_scale if augment == "resized-crop" else None,
            flip=flip,
            color_jitter=color_jitter,
            auto_augment=auto_augment,
            store_size=store_size,
            resize_mode=resize_mode,
            crop_pct=crop_pct,
            last_batch=last_batch,
            rank=rank,
            world_size=world_size,
            workers=workers,
            prefetch=prefetch,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            on_bad_image=on_bad_image,
            valid_fraction=valid_fraction,
            page_lock=page_lock,
            page_lock_device=page_lock_device,
        )
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.image_size = image_size
        self._page_lock_warned = page_lock is None
        self._epoch = 0
        self._step = 0
        self._warned = 0
        self._warn_new_bad_files()

    @property
    def classes(self) -> List[str]:
        """Class names, sorted; a label indexes this list."""
        return self._engine.classes

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def cache_path(self) -> str:
        """The memory-mapped pixel cache file."""
        return os.fspath(self._engine.cache_path())

    @property
    def bad_files(self) -> List[Tuple[str, str]]:
        """Bad files skipped so far: ``(path, kind)``, kind e.g. ``"truncated"``."""
        return [(os.fspath(p), kind) for p, kind in self._engine.bad_files()]

    def stats(self) -> Dict[str, Any]:
        """The engine's counters: ``decoded``, ``cache_hits``, ``bad_files``, ``batches``,
        ``decode_images_per_sec``, ``consumer_wait_seconds``, ``cache_fill`` (0 to 1),
        ``page_locked_buffers`` and ``page_lock_failures`` (``pin_memory``)."""
        return self._engine.stats()

    def _warn_new_bad_files(self) -> None:
        count = self._engine.stats()["bad_files"]
        if count <= self._warned:
            return
        files = self.bad_files
        for path, kind in files[self._warned : WARNED_BAD_FILES]:
            warnings.warn(f"birdtrain: skipping bad file {path}: {kind}", stacklevel=3)
        if self._warned <= WARNED_BAD_FILES < len(files):
            warnings.warn(
                f"birdtrain: more than {WARNED_BAD_FILES} bad files; loader.bad_files lists them all",
                stacklevel=3,
            )
        self._warned = len(files)

    def _warn_page_lock_refused(self) -> None:
        if self._page_lock_warned:
            return
        _, failures, message = self._engine.page_lock_report()
        if failures:
            self._page_lock_warned = True
            warnings.warn(
                f"birdtrain: pin_memory: a batch buffer could not be page-locked ({message}); "
                "such buffers are copied to the GPU as ordinary memory",
                stacklevel=3,
            )

    def __len__(self) -> int:
        """Batches of this rank per epoch (the same on every rank)."""
        return self._engine.steps_per_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch`` (its order and augmentation draws)."""
        self._epoch = _check_int("epoch", epoch, 0)
        self._step = 0

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        steps = len(self)
        if self._step >= steps:
            self._epoch, self._step = self._epoch + 1, 0
        epoch = self._epoch
        delivered = self._output.batches(self._tensors(self._engine.epoch(epoch, self._step)))
        try:
            for images, labels, step in delivered:
                if self._epoch == epoch:
                    self._step = step + 1
                self._warn_new_bad_files()
                self._warn_page_lock_refused()
                yield images, labels
        finally:
            delivered.close()
        if self._epoch == epoch and self._step >= steps:
            self._epoch, self._step = epoch + 1, 0

    @staticmethod
    def _tensors(batches: Any) -> Iterator[Tuple[torch.Tensor, torch.Tensor, int]]:
        """The engine's capsules as tensors viewing its buffers."""
        for images, labels, step in batches:
            from_dlpack = torch.utils.dlpack.from_dlpack
            yield from_dlpack(images), from_dlpack(labels), step

    def state_dict(self) -> Dict[str, Any]:
        """The position: the next batch is ``step`` of ``epoch``. The same on every rank, so
        rank 0's state resumes every rank."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "steps_per_epoch": len(self),
            "fingerprint": self._engine.fingerprint(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from a ``state_dict()``: the next batch is the one that followed it."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state: expected a birdtrain.Loader state_dict of version {STATE_VERSION}"
            )
        mine = self.state_dict()
        for key in ("seed", "world_size", "batch_size", "steps_per_epoch", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"state: {key}={state.get(key)!r} was saved, this loader has {mine[key]!r} "
                    "(resume with the same data and settings)"
                )
        epoch = _check_int("state['epoch']", state.get("epoch"), 0)
        step = _check_int("state['step']", state.get("step"), 0)
        if step > len(self):
            raise ValueError(f"state['step']={step}: the epoch has {len(self)} steps")
        self._epoch, self._step = epoch, step

    def __repr__(self) -> str:
        return (
            f"birdtrain.Loader(classes={len(self.classes)}, batches={len(self)}, "
            f"rank={self.rank}/{self.world_size}, epoch={self._epoch}, step={self._step})"
        )
