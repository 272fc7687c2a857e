#!/usr/bin/env python3
"""Peer for `cargo bench -p pipeline --bench auto_augment`: torchvision's own automatic
augmentation operations (`torchvision.transforms.autoaugment._apply_op`, what
TrivialAugmentWide and RandAugment call), one thread, on one SIDE x SIDE photo-like RGB image,
at bin 15 of TrivialAugmentWide's ranges, bilinear.

Times each operation REPS times after one warm-up, on the PIL image (what torchvision's
ImageNet reference script augments) and on a uint8 tensor; prints one line per operation with
the median milliseconds of each, and the mean of the 14 (TrivialAugmentWide's cost per image).

Install on Debian (CPU-only PyTorch): apt-get install -y python3-torch python3-torchvision
Run with the system interpreter:
  /usr/bin/python3 benches/torch_augment_ops.py --side 224 --reps 50
"""
import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.autoaugment import _apply_op

OPS = [("Identity", 0.0), ("ShearX", 0.495), ("ShearY", 0.495), ("TranslateX", 16.0),
       ("TranslateY", 16.0), ("Rotate", 67.5), ("Brightness", 0.495), ("Color", 0.495),
       ("Contrast", 0.495), ("Sharpness", 0.495), ("Posterize", 5.0), ("Solarize", 127.5),
       ("AutoContrast", 0.0), ("Equalize", 0.0)]


def image(side):
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    rgb = np.stack([128 + 100 * np.sin(x / 17), 128 + 90 * np.cos(y / 23 + x / 41),
                    (x + y) * 0.3], axis=-1)
    return rgb.clip(0, 255).astype(np.uint8)


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rgb = image(a.side)
    pil = Image.fromarray(rgb)
    tensor = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()
    bilinear = InterpolationMode.BILINEAR
    print(f"operation      PIL ms  tensor ms per {a.side}x{a.side} image (median of {a.reps})")
    totals = [0.0, 0.0]
    for name, magnitude in OPS:
        fill = None
        pil_ms = median_ms(lambda: _apply_op(pil, name, magnitude, bilinear, fill), a.reps)
        tensor_ms = median_ms(lambda: _apply_op(tensor, name, magnitude, bilinear, fill), a.reps)
        totals[0] += pil_ms
        totals[1] += tensor_ms
        print(f"{name:<14} {pil_ms:6.3f}  {tensor_ms:8.3f}")
    print(f"mean of the 14 (TrivialAugmentWide's cost per image) "
          f"{totals[0] / 14:.3f}  {totals[1] / 14:.3f}")


if __name__ == "__main__":
    main()
