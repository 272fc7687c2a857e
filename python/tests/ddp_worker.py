"""One rank of the DDP test: the loader's rank and world size come from torch.distributed."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

import birdtrain
from helpers import image_hashes


def main() -> None:
    data, cache, store, rank = sys.argv[1:5]
    epochs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=2)
    loader = birdtrain.Loader(data, image_size=16, batch_size=4, augment="none", cache_dir=cache)
    seen, decoded = [], []
    for _ in range(epochs):
        seen.append([h for x, _ in loader for h in image_hashes(x)])
        decoded.append(loader.stats()["decoded"])
        # The next epoch starts once every rank has served (and cached) this one.
        dist.barrier()
    print(json.dumps({
        "rank": loader.rank, "world_size": loader.world_size, "seen": seen[0], "epochs": seen,
        "decoded": decoded,
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
