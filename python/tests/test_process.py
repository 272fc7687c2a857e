"""Ctrl-C interrupts a blocked iteration; a loader used after fork refuses clearly, one built
after fork works; rank and world size from torch.distributed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

import birdtrain

def python_path(here: Path) -> str:
    """The tests' folder first, then the caller's path (where birdtrain may be installed)."""
    return os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])


SLOW_CHILD = """
import sys, birdtrain
loader = birdtrain.Loader(sys.argv[1], image_size=224, batch_size=64, workers=1,
                          prefetch=1, augment="none", cache_dir=sys.argv[2])
print("iterating", flush=True)
try:
    for images, labels in loader:
        pass
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
print("finished", flush=True)
"""


def test_ctrl_c_interrupts_a_blocked_iteration(tmp_path):
    # One batch of large JPEGs decoded by one worker: the wait for it takes seconds (1.5 s
    # for 24 on a busy 2-core machine), so an interrupt seen only once it arrives is late.
    big = tmp_path / "big.jpg"
    Image.radial_gradient("L").resize((3000, 2200)).convert("RGB").save(big, quality=95)
    for i in range(64):
        path = tmp_path / "data" / "train" / ("a" if i % 2 else "b") / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(big.read_bytes())
    (tmp_path / "cache").mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD, str(tmp_path / "data"), str(tmp_path / "cache")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "iterating"
        time.sleep(0.1)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline().strip()
        waited = time.monotonic() - sent
        child.communicate(timeout=60)
    finally:
        child.kill()
    assert line == "interrupted", line
    assert child.returncode == 3
    assert waited < 1.0, f"the interrupt took {waited:.1f} s"


def iterate_in_child(loader, queue, dataset, cache_dir):
    try:
        next(iter(loader))
        queue.put("iterated")
    except RuntimeError as e:
        queue.put(str(e))
    # A loader built in the child works.
    fresh = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    queue.put(sum(x.shape[0] for x, _ in fresh))


def test_a_loader_used_after_fork_refuses_with_a_clear_error(dataset, cache_dir):
    loader = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=iterate_in_child, args=(loader, queue, dataset, cache_dir))
    child.start()
    message = queue.get(timeout=60)
    built_in_child = queue.get(timeout=120)
    child.join(timeout=60)
    assert "another process" in message and "fork" in message
    assert built_in_child == 33
    assert child.exitcode == 0
    # The parent's loader still works.
    assert sum(x.shape[0] for x, _ in loader) == 33


def test_a_child_forked_after_cuda_was_initialised_builds_without_pinning(
    dataset, cache_dir, monkeypatch
):
    # What torch reports in such a child on a GPU machine (any CUDA call there raises): the
    # loader is built with ordinary buffers and says so; a GPU device is refused by name.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True, raising=False)

    def no_cuda(*args, **kwargs):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    with pytest.warns(UserWarning, match="forked after its parent initialised CUDA"):
        loader = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    assert sum(x.shape[0] for x, _ in loader) == 33
    assert loader.stats()["page_locked_buffers"] == 0
    with pytest.raises(ValueError, match="device='cuda'.*spawn"):
        birdtrain.Loader(dataset, image_size=16, batch_size=4, device="cuda")


def test_rank_and_world_size_come_from_torch_distributed(dataset, tmp_path):
    import json

    here = Path(__file__).parent
    # The environment says otherwise: an initialised process group wins.
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", PYTHONPATH=python_path(here))
    children = [
        subprocess.Popen(
            [sys.executable, str(here / "ddp_worker.py"), str(dataset),
             str(tmp_path / f"cache{rank}"), str(tmp_path / "store"), str(rank)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    results = [json.loads(child.communicate(timeout=300)[0]) for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    seen = [set(r["seen"]) for r in results]
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 33


def test_the_ranks_of_a_node_fill_one_cache_in_the_first_epoch(dataset, tmp_path):
    import json

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=python_path(here))
    children = [
        subprocess.Popen(
            [sys.executable, str(here / "ddp_worker.py"), str(dataset),
             str(tmp_path / "cache"), str(tmp_path / "store"), str(rank), "2"],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    results = [json.loads(child.communicate(timeout=300)[0]) for child in children]
    assert [child.returncode for child in children] == [0, 0]
    # Each rank decodes its own share in the first epoch, into the one cache file they share;
    # the second epoch (another permutation: the other rank's images too) decodes nothing.
    for r in results:
        first, second = r["decoded"]
        assert first == len(r["epochs"][0]), r["decoded"]
        assert second == first, r["decoded"]
    assert sum(r["decoded"][0] for r in results) == 33
    assert len(set(results[0]["epochs"][1]) | set(results[1]["epochs"][1])) == 33
