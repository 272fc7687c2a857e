"""One process of the resume test: ``full``, ``save K`` or ``load``; prints JSON digests."""

from __future__ import annotations

import json
import sys

import birdtrain
from helpers import digest


def main() -> None:
    data, cache, rank, world, mode = sys.argv[1:6]
    loader = birdtrain.Loader(
        data,
        image_size=40,
        batch_size=3,
        seed=11,
        color_jitter=0.3,
        rank=int(rank),
        world_size=int(world),
        workers=2,
        cache_dir=cache,
    )
    loader.set_epoch(1)
    seen = []
    if mode == "full":
        for _ in range(2):  # epoch 1 and the next
            seen += [digest(x, y) for x, y in loader]
    elif mode == "save":
        stop = int(sys.argv[6])
        for x, y in loader:
            seen.append(digest(x, y))
            if len(seen) == stop:
                with open(sys.argv[7], "w") as f:
                    json.dump(loader.state_dict(), f)
                break
    elif mode == "load":
        with open(sys.argv[6]) as f:
            loader.load_state_dict(json.load(f))
        seen += [digest(x, y) for x, y in loader]  # the rest of epoch 1
        seen += [digest(x, y) for x, y in loader]  # epoch 2
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
