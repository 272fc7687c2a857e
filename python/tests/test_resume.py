"""state_dict taken mid-epoch and loaded in a new process continues with the next batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run(*args) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [sys.executable, str(HERE / "resume_worker.py"), *map(str, args)],
        check=True, capture_output=True, text=True, env=env, timeout=300,
    )
    return [tuple(x) if isinstance(x, list) else x for x in json.loads(out.stdout)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_new_process_resumes_mid_epoch_exactly(dataset, tmp_path, world_size):
    for rank in range(world_size):
        cache = tmp_path / f"cache{rank}"
        cache.mkdir()
        full = run(dataset, cache, rank, world_size, "full")
        steps = len(full) // 2
        stop = steps // 2
        assert 0 < stop < steps
        state = tmp_path / f"state{rank}.json"
        before = run(dataset, cache, rank, world_size, "save", stop, state)
        # Another cache folder: the resumed process decodes afresh, as on another machine.
        other = tmp_path / f"other{rank}"
        other.mkdir()
        after = run(dataset, other, rank, world_size, "load", state)
        assert before == full[:stop]
        assert after == full[stop:], f"rank {rank} of {world_size}"
        saved = json.loads(state.read_text())
        assert (saved["epoch"], saved["step"]) == (1, stop)


def test_a_state_from_other_settings_is_refused(dataset, cache_dir):
    import birdtrain

    a = birdtrain.Loader(dataset, image_size=16, batch_size=4, cache_dir=cache_dir)
    b = birdtrain.Loader(dataset, image_size=16, batch_size=5, cache_dir=cache_dir)
    with pytest.raises(ValueError, match="batch_size"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="state"):
        b.load_state_dict({"epoch": 1})
