#!/usr/bin/env python3
"""Peer for the engine's training augmentation: torchvision's ImageNet training transform in
a PyTorch DataLoader, the input pipeline a PyTorch user trains ResNet-50 with.

Per image, every epoch: PIL decode, Resize(store) of the shorter side, RandomResizedCrop(size)
(area 0.08-1, aspect 3/4-4/3), RandomHorizontalFlip, TrivialAugmentWide, RandAugment(magnitude=M), AugMix(severity=S) or
AutoAugment(policy) with --auto-augment ta_wide|ra|augmix|imagenet|cifar10|svhn (bilinear, as torchvision's reference script passes), ColorJitter(F, F, F, H) when
--color-jitter F or --color-jitter-hue H is above 0, PILToTensor (uint8 CHW: no float conversion, as the engine hands out uint8 pixels).
The counterpart is `birdtrain bench pipeline --image-size SIZE --store-size STORE --augment
resized-crop --auto-augment P --color-jitter F --color-jitter-hue H`, which crops, augments and jitters the cached STORE squares (its mirror
is the device's, not the engine's).

Prints one JSON line per epoch:
  {"peer": "torch-augment", "epoch": 0, "images": 400, "seconds": 0.7, "images_per_sec": 571.4}

Install on Debian (CPU-only PyTorch): apt-get install -y python3-torch python3-torchvision
Run with the system interpreter:
  /usr/bin/python3 benches/torch_augment.py --data DIR --workers 2 --epochs 2 --color-jitter 0.4
"""
import argparse
import json
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="dataset root holding <split>/<class>/<image>")
    ap.add_argument("--split", default="train")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--store-size", type=int, default=256,
                    help="shorter side after the first resize")
    ap.add_argument("--color-jitter", type=float, default=0.4)
    ap.add_argument("--color-jitter-hue", type=float, default=0.0)
    ap.add_argument("--auto-augment", choices=["none", "ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn"],
                    default="none")
    ap.add_argument("--ra-magnitude", type=int, default=9)
    ap.add_argument("--augmix-severity", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    steps = [
        transforms.Resize(a.store_size),
        transforms.RandomResizedCrop(a.image_size),
        transforms.RandomHorizontalFlip(),
    ]
    bilinear = transforms.InterpolationMode.BILINEAR
    if a.auto_augment == "ta_wide":
        steps.append(transforms.TrivialAugmentWide(interpolation=bilinear))
    elif a.auto_augment == "ra":
        steps.append(transforms.RandAugment(magnitude=a.ra_magnitude, interpolation=bilinear))
    elif a.auto_augment == "augmix":
        steps.append(transforms.AugMix(severity=a.augmix_severity, interpolation=bilinear))
    elif a.auto_augment != "none":
        policy = transforms.AutoAugmentPolicy(a.auto_augment)
        steps.append(transforms.AutoAugment(policy, interpolation=bilinear))
    if a.color_jitter > 0 or a.color_jitter_hue > 0:
        f = a.color_jitter
        steps.append(transforms.ColorJitter(f, f, f, a.color_jitter_hue))
    steps.append(transforms.PILToTensor())
    ds = datasets.ImageFolder(f"{a.data}/{a.split}", transform=transforms.Compose(steps))
    dl = DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                    drop_last=False, persistent_workers=a.workers > 0)
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        n = 0
        for x, _y in dl:
            n += x.shape[0]
        dt = time.perf_counter() - t0
        print(json.dumps({"peer": "torch-augment", "epoch": epoch, "images": n,
                          "seconds": round(dt, 4), "images_per_sec": round(n / dt, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
