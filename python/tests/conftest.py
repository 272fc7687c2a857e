"""Synthetic datasets for the loader's tests: real JPEGs written by PIL."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

CLASSES = ["crow", "finch", "wren"]


def write_image(path: Path, width: int, height: int, rng: random.Random) -> None:
    """A smooth gradient with a few shapes: real photographs' mix of flat and edged areas."""
    img = Image.new("RGB", (width, height))
    base = [rng.randrange(256) for _ in range(3)]
    img.putdata(
        [
            (
                (base[0] + x * 255 // width) % 256,
                (base[1] + y * 255 // height) % 256,
                (base[2] + (x + y) * 127 // (width + height)) % 256,
            )
            for y in range(height)
            for x in range(width)
        ]
    )
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(10, width // 2), y0 + rng.randrange(10, height // 2)
        color = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x1, y1], fill=color)
        else:
            draw.rectangle([x0, y0, x1, y1], fill=color)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, quality=90)


def write_dataset(root: Path, per_class: dict, sizes, seed: int = 1) -> Path:
    """``per_class``: split -> images per class; sizes cycle through ``sizes``."""
    rng = random.Random(seed)
    n = 0
    for split, count in per_class.items():
        for cls in CLASSES:
            for i in range(count):
                w, h = sizes[n % len(sizes)]
                n += 1
                write_image(root / split / cls / f"{cls}_{i:03d}.jpg", w, h, rng)
    return root


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """3 classes, 11 train and 4 valid images each, JPEGs of several shapes."""
    root = tmp_path_factory.mktemp("birds")
    return write_dataset(
        root, {"train": 11, "valid": 4}, [(500, 375), (375, 500), (320, 320), (401, 299)]
    )


@pytest.fixture()
def cache_dir(tmp_path) -> str:
    path = tmp_path / "cache"
    path.mkdir()
    return os.fspath(path)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU; deselected unless selected with -m gpu (scripts/gpu-run.sh python)",
    )


def pytest_collection_modifyitems(config, items):
    """The default run deselects the GPU tests (the summary counts them as deselected); with
    ``-m gpu`` they run and fail, never skip, where torch has no CUDA."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("gpu") is None]
    dropped = [item for item in items if item.get_closest_marker("gpu") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
