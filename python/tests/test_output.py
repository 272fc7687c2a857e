"""device=, mean=, std=, channels_last=, dtype= and pin_memory= on the CPU: values against
torchvision's ToTensor + Normalize, types, shapes, memory format, argument checks, resume."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch
from torchvision import transforms

import birdtrain
from helpers import digest

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def loader(dataset, cache_dir, **options):
    settings = dict(image_size=24, batch_size=8, workers=2, seed=3, cache_dir=cache_dir)
    settings.update(options)
    return birdtrain.Loader(dataset, **settings)


def torchvision_reference(images: torch.Tensor) -> torch.Tensor:
    """Each uint8 HWC image through torchvision's ToTensor then Normalize, stacked."""
    to_tensor, normalize = transforms.ToTensor(), transforms.Normalize(MEAN, STD)
    return torch.stack([normalize(to_tensor(image.numpy())) for image in images])


def test_mean_and_std_give_torchvisions_to_tensor_and_normalize_bit_for_bit(dataset, cache_dir):
    raw = list(loader(dataset, cache_dir))
    normalised = list(loader(dataset, cache_dir, device="cpu", mean=MEAN, std=STD))
    assert len(normalised) == len(raw) == 5
    for (images, labels), (x, y) in zip(raw, normalised):
        assert x.dtype == torch.float32 and x.device.type == "cpu"
        assert x.shape == (images.shape[0], 3, 24, 24) and x.is_contiguous()
        assert torch.equal(x, torchvision_reference(images))
        assert y.dtype == torch.int64 and y.device.type == "cpu" and torch.equal(y, labels)


def test_channels_last_has_its_memory_format_and_the_same_values(dataset, cache_dir):
    plain = list(loader(dataset, cache_dir, mean=MEAN, std=STD))
    last = list(loader(dataset, cache_dir, mean=MEAN, std=STD, channels_last=True))
    for (a, _), (b, _) in zip(plain, last):
        assert b.is_contiguous(memory_format=torch.channels_last) and not b.is_contiguous()
        assert b.shape == a.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_dtype_is_the_float32_result_rounded(dataset, cache_dir, dtype):
    raw = list(loader(dataset, cache_dir))
    half = list(loader(dataset, cache_dir, mean=MEAN, std=STD, dtype=dtype, channels_last=True))
    for (images, _), (x, _) in zip(raw, half):
        assert x.dtype == dtype and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x, torchvision_reference(images).to(dtype))


def test_device_cpu_without_mean_and_std_is_the_default_output(dataset, cache_dir):
    default = [digest(x, y) for x, y in loader(dataset, cache_dir)]
    for device in ("cpu", torch.device("cpu")):
        batches = list(loader(dataset, cache_dir, device=device))
        assert all(x.dtype == torch.uint8 and x.shape[1:] == (24, 24, 3) for x, _ in batches)
        assert [digest(x, y) for x, y in batches] == default


def test_the_options_leave_state_dict_and_resume_unchanged(dataset, cache_dir):
    options = dict(device="cpu", mean=MEAN, std=STD, channels_last=True, dtype=torch.bfloat16)
    plain, shaped = loader(dataset, cache_dir), loader(dataset, cache_dir, **options)
    assert plain.state_dict() == shaped.state_dict()
    full = [x for x, _ in shaped]
    first = loader(dataset, cache_dir, **options)
    it = iter(first)
    head = [next(it)[0] for _ in range(2)]
    state = first.state_dict()
    del it
    assert state == dict(plain.state_dict(), epoch=0, step=2)
    resumed = loader(dataset, cache_dir, **options)
    resumed.load_state_dict(state)
    tail = [x for x, _ in resumed]
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))


def test_pin_memory_without_cuda_keeps_the_engines_ordinary_buffers(
    dataset, cache_dir, monkeypatch
):
    # As where torch has no CUDA (here, or on a GPU machine told so).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pinned = loader(dataset, cache_dir, pin_memory=True)
    stats = pinned.stats()
    assert (stats["page_locked_buffers"], stats["page_lock_failures"]) == (0, 0)
    assert pinned._engine.page_lock_report() == (0, 0, None)
    free, digests = pinned._engine.free_buffers(), []
    for images, labels in pinned:
        assert not images.is_pinned()
        digests.append(digest(images, labels))
    # Each tensor viewed a pool buffer (no copy), back in the pool once released.
    assert pinned._engine.free_buffers() > free
    assert digests == [
        digest(x, y) for x, y in loader(dataset, cache_dir, pin_memory=False)
    ]


def test_a_driver_that_cannot_be_loaded_leaves_ordinary_buffers_with_a_warning(
    dataset, cache_dir, monkeypatch
):
    # torch claims CUDA, but libcuda.so.1 cannot be loaded: the loader warns and works.
    real_cdll = ctypes.CDLL

    def no_driver(name, *args, **kwargs):
        if name == "libcuda.so.1":
            raise OSError(f"{name}: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pinned = loader(dataset, cache_dir, pin_memory=True)
    assert any("libcuda.so.1" in str(w.message) for w in caught)
    assert pinned._engine.page_lock_report() == (0, 0, None)
    assert sum(x.shape[0] for x, _ in pinned) == 33


@pytest.mark.parametrize(
    "argument, value, others",
    [
        ("device", "gpu", {}),
        ("device", "mps", {}),
        ("device", "cuda:99", {}),  # no such GPU, with or without CUDA
        ("device", 0, {}),
        ("mean", (0.5, 0.5), {"std": STD}),
        ("mean", (123.7, 116.3, 103.5), {"std": STD}),  # the 0-255 scale
        ("mean", "rgb", {"std": STD}),
        ("mean", (0.5, float("nan"), 0.5), {"std": STD}),
        ("std", (0.0, 0.2, 0.2), {"mean": MEAN}),
        ("std", (58.4, 57.1, 57.4), {"mean": MEAN}),
        ("std", None, {"mean": MEAN}),
        ("mean", None, {"std": STD}),
        ("channels_last", "yes", {"mean": MEAN, "std": STD}),
        ("channels_last", True, {}),
        ("dtype", torch.int32, {"mean": MEAN, "std": STD}),
        ("dtype", torch.float32, {}),
    ],
)
def test_bad_output_arguments_raise_value_error_naming_the_argument(
    dataset, cache_dir, argument, value, others
):
    settings = dict(others)
    settings[argument] = value
    with pytest.raises(ValueError, match=f"^{argument}="):
        loader(dataset, cache_dir, **settings)


def test_device_cuda_without_cuda_is_refused_naming_device(dataset, cache_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^device='cuda': torch sees no CUDA GPU"):
        loader(dataset, cache_dir, device="cuda", mean=MEAN, std=STD)
