"""The loader's GPU delivery (device="cuda"): run with ``-m gpu`` on a machine with a GPU
(``scripts/gpu-run.sh python``); the default run deselects these tests."""

from __future__ import annotations

import pytest
import torch

import birdtrain
from birdtrain import _output
from helpers import digest

pytestmark = pytest.mark.gpu

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@pytest.fixture(autouse=True)
def needs_cuda():
    assert torch.cuda.is_available(), "the gpu tests need torch with a CUDA GPU"


def loader(dataset, cache_dir, **options):
    settings = dict(image_size=24, batch_size=4, workers=2, seed=3, cache_dir=cache_dir)
    settings.update(options)
    return birdtrain.Loader(dataset, **settings)


def max_difference(gpu_batches, cpu_batches) -> float:
    worst = 0.0
    assert len(gpu_batches) == len(cpu_batches)
    for (x, y), (a, b) in zip(gpu_batches, cpu_batches):
        assert x.shape == a.shape and x.dtype == a.dtype and torch.equal(y.cpu(), b)
        worst = max(worst, (x.float().cpu() - a.float()).abs().max().item())
    return worst


@pytest.mark.parametrize("channels_last", [False, True])
def test_normalised_gpu_batches_equal_the_cpu_ones(dataset, cache_dir, channels_last):
    options = dict(mean=MEAN, std=STD, channels_last=channels_last)
    cpu = list(loader(dataset, cache_dir, device="cpu", **options))
    gpu = list(loader(dataset, cache_dir, device="cuda", **options))
    for x, y in gpu:
        assert x.device.type == "cuda" and y.device.type == "cuda" and y.dtype == torch.int64
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        assert x.is_contiguous(memory_format=memory_format)
    assert max_difference(gpu, cpu) <= 1e-6


def test_uint8_batches_are_copied_unchanged_and_bfloat16_rounded(dataset, cache_dir):
    plain = [digest(x, y) for x, y in loader(dataset, cache_dir)]
    gpu = [digest(x.cpu(), y.cpu()) for x, y in loader(dataset, cache_dir, device="cuda:0")]
    assert gpu == plain
    options = dict(mean=MEAN, std=STD, channels_last=True, dtype=torch.bfloat16)
    cpu = list(loader(dataset, cache_dir, device="cpu", **options))
    gpu = list(loader(dataset, cache_dir, device=torch.device("cuda", 0), **options))
    assert max_difference(gpu, cpu) <= 0.02  # one bfloat16 step near 2.6


def test_the_consumer_on_its_own_stream_waits_for_each_batch(dataset, cache_dir):
    options = dict(mean=MEAN, std=STD)
    cpu = list(loader(dataset, cache_dir, device="cpu", **options))
    stream, gpu = torch.cuda.Stream(), []
    with torch.cuda.stream(stream):
        for x, y in loader(dataset, cache_dir, device="cuda", **options):
            torch.cuda._sleep(2_000_000)  # a slow step: the next copy runs meanwhile
            gpu.append((x * 1, y))
    torch.cuda.synchronize()
    assert max_difference(gpu, cpu) <= 1e-6


def test_a_buffer_goes_back_to_the_engine_only_after_its_copy(dataset, cache_dir, monkeypatch):
    # The side stream sleeps before each copy: a buffer handed back before its copy finished
    # would be rewritten by a later batch first. prefetch=1 keeps the pool small.
    launch = _output._GpuDelivery._launch

    def slow_launch(self, images, labels):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)
        return launch(self, images, labels)

    monkeypatch.setattr(_output._GpuDelivery, "_launch", slow_launch)
    plain = [digest(x, y) for x, y in loader(dataset, cache_dir, prefetch=1)]
    gpu = loader(dataset, cache_dir, device="cuda", prefetch=1)
    assert [digest(x.cpu(), y.cpu()) for x, y in gpu] == plain
    assert gpu.stats()["page_locked_buffers"] > 0


def test_pin_memory_page_locks_the_engines_own_buffers(dataset, cache_dir):
    pinned = loader(dataset, cache_dir, pin_memory=True)
    kept = [(x, y) for x, y in pinned]
    assert all(x.is_pinned() and x.device.type == "cpu" for x, _ in kept)
    stats = pinned.stats()
    assert stats["page_lock_failures"] == 0 and stats["page_locked_buffers"] >= len(kept)
    # One pass over the plain loader: a second would be its next epoch.
    plain = list(loader(dataset, cache_dir, pin_memory=False))
    assert not any(x.is_pinned() for x, _ in plain)
    assert [digest(x, y) for x, y in kept] == [digest(x, y) for x, y in plain]


def test_breaking_out_early_then_resuming_on_the_gpu(dataset, cache_dir):
    options = dict(device="cuda", mean=MEAN, std=STD)
    full = [x.cpu() for x, _ in loader(dataset, cache_dir, **options)]
    first = loader(dataset, cache_dir, **options)
    head = []
    for x, _ in first:
        head.append(x.cpu())
        if len(head) == 3:
            break
    resumed = loader(dataset, cache_dir, **options)
    resumed.load_state_dict(first.state_dict())
    tail = [x.cpu() for x, _ in resumed]
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))
