#!/usr/bin/env python3
"""CPU training-step peer for `birdtrain bench step --gpus 0`: the same step in PyTorch.

f32 on the CPU, channels_last, SGD (momentum 0.9, lr 0.1, weight decay 5e-5), a random u8
NHWC batch converted and normalised every step, warm-up steps excluded. ResNet-18/34/50 come
from torchvision; the CIFAR-style ResNet-8/20/56 are defined here exactly as birdtrain builds
them (3x3 stem with 16 channels, stages 16-32-64, 1x1 conv + BN shortcuts where shapes change).

Prints one JSON line: {"peer": "torch-cpu", "model": ..., "images_per_sec": ..., ...}
Run with Debian's CPU PyTorch: /usr/bin/python3 benches/torch_cpu_step.py --model resnet8
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torchvision


class Basic(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


def cifar_resnet(depth, classes):
    n = (depth - 2) // 6
    layers, cin = [], 16
    for stage, cout in enumerate([16, 32, 64]):
        blocks = []
        for b in range(n):
            blocks.append(Basic(cin, cout, 2 if (stage > 0 and b == 0) else 1))
            cin = cout
        layers.append(nn.Sequential(*blocks))
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet8")
    ap.add_argument("--classes", type=int, default=285)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model in ("resnet8", "resnet20", "resnet56"):
        model = cifar_resnet(int(a.model[6:]), a.classes)
    else:
        model = getattr(torchvision.models, a.model)(num_classes=a.classes)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    s = a.image_size
    host = torch.randint(0, 256, (a.batch_size, s, s, 3), dtype=torch.uint8)
    labels = torch.randint(0, a.classes, (a.batch_size,))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    loss_fn = nn.CrossEntropyLoss()

    def step():
        x = ((host.permute(0, 3, 1, 2).float() - mean) / std).contiguous(memory_format=torch.channels_last)
        loss = loss_fn(model(x), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    dt = time.perf_counter() - t0
    print(json.dumps({"peer": "torch-cpu", "model": a.model, "batch_size": a.batch_size,
                      "image_size": s, "threads": a.threads, "steps": a.steps,
                      "ms_per_step": round(dt * 1e3 / a.steps, 2),
                      "images_per_sec": round(a.batch_size * a.steps / dt, 1),
                      "final_loss": round(float(loss), 4), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
