"""birdtrain.Loader against PyTorch's DataLoader, as a user iterating both sees it.

The peer: torchvision's ImageFolder with RandomResizedCrop(224), RandomHorizontalFlip and
PILToTensor in a DataLoader with 2 workers. birdtrain.Loader: the same augmentation, 2 decode
workers, a fresh pixel cache each round (its first epoch fills it; later epochs read it).
Synthetic 500×375 JPEGs. Each round runs both (paired); the figures are medians over rounds.

    python benches/python_loader.py --images 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def write_images(root: Path, count: int, classes: int = 10) -> None:
    """Smooth colour fields with noise, 500×375 JPEG quality 90, `classes` folders."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:375, 0:500].astype(np.float32)
    for i in range(count):
        a, b, c = rng.uniform(0.005, 0.05, 3)
        base = np.stack(
            [np.sin(x * a + i), np.cos(y * b + i), np.sin((x + y) * c)], axis=-1
        )
        pixels = (base * 100 + 128 + rng.normal(0, 12, base.shape)).clip(0, 255)
        path = root / "train" / f"class{i % classes:02d}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)


def images_per_second(batches) -> float:
    start, images = time.perf_counter(), 0
    for pixels, _ in batches:
        images += pixels.shape[0]
    return images / (time.perf_counter() - start)


def dataloader_epoch(root: Path, batch_size: int, workers: int) -> float:
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )
    data = datasets.ImageFolder(root / "train", transform=transform)
    loader = torch.utils.data.DataLoader(
        data, batch_size=batch_size, shuffle=True, num_workers=workers
    )
    return images_per_second(loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cached-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", type=Path, help="reuse this folder (written if missing)")
    args = parser.parse_args()

    import birdtrain

    work = Path(tempfile.mkdtemp(prefix="birdtrain-bench-"))
    root = args.data or work / "data"
    if not (root / "train").is_dir():
        write_images(root, args.images)
    rounds = []
    for r in range(args.rounds):
        cache = work / f"cache{r}"
        loader = birdtrain.Loader(
            root, image_size=224, batch_size=args.batch_size, workers=args.workers,
            seed=r, cache_dir=cache, pin_memory=False,
        )
        first = images_per_second(loader)
        cached = statistics.median(images_per_second(loader) for _ in range(args.cached_epochs))
        peer = dataloader_epoch(root, args.batch_size, args.workers)
        rounds.append({"first": first, "cached": cached, "dataloader": peer})
        print(
            f"round {r}: birdtrain first epoch {first:.0f} img/s, cached {cached:.0f} img/s; "
            f"DataLoader {peer:.0f} img/s",
            flush=True,
        )
    median = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    summary = {
        "images": args.images,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "torch": torch.__version__,
        "median_images_per_s": median,
        "first_epoch_speedup": median["first"] / median["dataloader"],
        "cached_epoch_speedup": median["cached"] / median["dataloader"],
        "rounds": rounds,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
