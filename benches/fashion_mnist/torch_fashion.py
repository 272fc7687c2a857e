#!/usr/bin/env python3
"""PyTorch peer of the Fashion-MNIST time-to-accuracy benchmark: birdtrain's resnet20 recipe
as a PyTorch user writes it, on the image folder convert.py writes.

Trains the CIFAR-style resnet20 exactly as birdtrain builds it (3x3 stem of 16 channels, three
stages of three BasicBlocks at 16-32-64 channels, the first block of stages 2 and 3 striding
by 2 with a 1x1 convolution + batch norm shortcut, global average pool, linear head; the
parameter names are birdtrain's and torchvision's, so state dicts move between them;
torchvision's initialisation: convolutions Kaiming-normal fan-out, batch norm 1/0, the head
nn.Linear's default; no zero-init of residual gammas) with birdtrain's recipe:

- data: torchvision ImageFolder over DATA/train and DATA/valid (the 10 000 test images), a
  DataLoader with --workers processes; each image decoded by PIL as RGB, resized to
  --image-size bilinearly (birdtrain's default --resize-mode direct: the whole image stretched
  to the square; Fashion-MNIST is square), scaled to [0, 1] and normalised with ImageNet's
  mean and std; training images then shifted by up to S/8 pixels with zero padding in
  normalised space (RandomCrop(S, padding=S/8) on the normalised tensor: birdtrain pads with
  the mean colour, its input op's 0) and mirrored half the time; validation sees the image;
- SGD, momentum 0.9, Nesterov (birdtrain's default), weight decay on convolution and linear
  weights only (not on batch norm or biases), --lr for a global batch of 256 scaled linearly;
- the rate per optimizer step: linear warm-up from lr/warm to lr over --warmup-epochs, then a
  half cosine to 0 at the last step (birdtrain's src/optim/schedule.rs); the last partial
  batch is kept (birdtrain's --last-batch partial);
- cross-entropy, --label-smoothing (default 0).

On a GPU: bf16 autocast, channels_last, torch.compile (its compile time is part of the wall
time; off with --no-compile). On the CPU (--device cpu): f32, no compile (a smoke test).

After every epoch it evaluates the test set and prints one JSON line:
  {"peer": "torch-compile", "epoch": 1, "epochs": 12, "seconds": 41.2, "train_loss": 0.61,
   "train_accuracy": 0.78, "valid_loss": 0.42, "valid_accuracy": 0.85, "images_per_sec": 21000.0}
where "seconds" is the wall time since this script started (before torch was imported).

Runs where PyTorch is (standard library + torch + torchvision):
  python3 benches/fashion_mnist/torch_fashion.py --data /tmp/fmnist --epochs 12 --batch-size 256 \
      --lr 0.2
  /usr/bin/python3 benches/fashion_mnist/torch_fashion.py --data /tmp/fm-small --device cpu \
      --epochs 2 --batch-size 64 --workers 1 --threads 1
"""
import time

START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets, transforms  # noqa: E402

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class BasicBlock(nn.Module):
    """birdtrain's basic block: conv-bn-relu, conv-bn, + shortcut, relu."""

    def __init__(self, c_in, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or c_in != planes:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, planes, 1, stride, 0, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x if self.downsample is None else self.downsample(x)
        return self.relu(out + short)


class CifarResNet(nn.Module):
    """birdtrain's resnet8/20/56 (src/model/graph.rs): n blocks per stage, 16-32-64."""

    def __init__(self, blocks_per_stage, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        c = 16
        for i, (planes, stride) in enumerate([(16, 1), (32, 2), (64, 2)]):
            layers = []
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(c, planes, stride if j == 0 else 1))
                c = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        # torchvision's ResNet initialisation (the head keeps nn.Linear's own).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


MODELS = {"resnet8": 1, "resnet20": 3, "resnet56": 9}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64}


def load_safetensors(path):
    """A safetensors file's tensors by name (the format: a little-endian u64 header length,
    a JSON header of dtype, shape and byte range per tensor, then the bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        raw = bytearray(data[8 + n + start:8 + n + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"]).clone()
    return tensors


def lr_factor(step, steps_per_epoch, warmup_epochs, epochs):
    """birdtrain's Schedule::lr_at with the cosine decay, as a factor of the peak rate."""
    warm = warmup_epochs * steps_per_epoch
    total = max(epochs * steps_per_epoch, 1)
    if step < warm:
        return (step + 1) / warm
    span = max(total - warm, 1)
    p = min((step - warm) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * p))


def loaders(a, device):
    size = a.image_size
    base = [transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train_tf = transforms.Compose(base + [transforms.RandomCrop(size, padding=size // 8, fill=0),
                                          transforms.RandomHorizontalFlip()])
    train = datasets.ImageFolder(os.path.join(a.data, "train"), transform=train_tf)
    valid = datasets.ImageFolder(os.path.join(a.data, "valid"), transform=transforms.Compose(base))
    if train.classes != valid.classes:
        sys.exit(f"error: {a.data}: train and valid have other class folders")
    common = dict(num_workers=a.workers, pin_memory=device.type == "cuda",
                  persistent_workers=a.workers > 0)
    train_loader = DataLoader(train, batch_size=a.batch_size, shuffle=True, drop_last=False, **common)
    valid_loader = DataLoader(valid, batch_size=a.eval_batch_size, shuffle=False, **common)
    return train_loader, valid_loader, len(train.classes)


def run_epoch(model, loader, device, amp, fmt, train, opt=None, sched=None, loss_fn=None):
    """One pass; the totals stay on the device until the end (no host sync per step)."""
    model.train(train)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    hits = torch.zeros((), device=device, dtype=torch.int64)
    images = 0
    with torch.set_grad_enabled(train):
        for x, y in loader:
            x = x.to(device, non_blocking=True).contiguous(memory_format=fmt)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(x)
                loss = loss_fn(logits, y)
            if train:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            loss_sum += loss.detach().double() * y.shape[0]
            hits += (logits.argmax(1) == y).sum()
            images += y.shape[0]
    return float(loss_sum) / max(images, 1), int(hits) / max(images, 1), images


def eval_weights(a, model, valid_loader, device, amp, fmt):
    """The test set's figures with another trainer's weights in this script's model."""
    state = {k: v.long() if k.endswith("num_batches_tracked") else v.float()
             for k, v in load_safetensors(a.eval_weights).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        sys.exit(f"error: {a.eval_weights}: missing {missing}, unexpected {unexpected}")
    loss, acc, n = run_epoch(model, valid_loader, device, amp, fmt, False,
                             loss_fn=nn.CrossEntropyLoss())
    print(json.dumps({"eval_weights": a.eval_weights, "images": n, "valid_loss": round(loss, 4),
                      "valid_accuracy": round(acc, 4)}), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with train/<class>/ and valid/<class>/")
    ap.add_argument("--model", default="resnet20", choices=sorted(MODELS))
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--eval-batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.2, help="for a global batch of 256, scaled linearly")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", default="true", choices=["true", "false"])
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=min(len(os.sched_getaffinity(0)), 16),
                    help="DataLoader worker processes (default: one per core, at most 16)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (the CPU run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true", help="no torch.compile (always off on the CPU)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (always off on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-weights", metavar="FILE",
                    help="only evaluate these weights (birdtrain's RUN/model.safetensors) on the "
                         "test set with this script's model and transforms, and exit")
    a = ap.parse_args()
    for name in ("train", "valid"):
        if not os.path.isdir(os.path.join(a.data, name)):
            sys.exit(f"error: {os.path.join(a.data, name)} is not a folder (convert.py writes it)")
    if a.epochs < 1 or a.batch_size < 1:
        sys.exit("error: --epochs and --batch-size must be at least 1")

    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if on_gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = on_gpu and not a.fp32
    compiled = on_gpu and not a.no_compile
    if compiled and not hasattr(torch, "compile"):
        sys.exit(f"error: torch {torch.__version__} has no torch.compile (PyTorch 2 does; or --no-compile)")
    fmt = torch.channels_last if on_gpu else torch.contiguous_format

    train_loader, valid_loader, classes = loaders(a, device)
    model = CifarResNet(MODELS[a.model], classes).to(device, memory_format=fmt)
    if a.eval_weights:
        return eval_weights(a, model, valid_loader, device, amp, fmt)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    lr = a.lr * a.batch_size / 256
    opt = torch.optim.SGD([{"params": decay, "weight_decay": a.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=a.momentum, nesterov=a.nesterov == "true")
    steps = len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, a.warmup_epochs, a.epochs))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=a.label_smoothing)
    net = torch.compile(model) if compiled else model
    peer = "torch" + ("-compile" if compiled else "") + ("" if on_gpu else "-cpu")
    print(json.dumps({"peer": peer, "start": True, "model": a.model, "device": str(device),
                      "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
                      "torch": torch.__version__, "batch_size": a.batch_size, "lr": lr,
                      "steps_per_epoch": steps, "workers": a.workers, "bf16": amp,
                      "seconds": round(time.perf_counter() - START, 3)}), flush=True)
    for epoch in range(1, a.epochs + 1):
        t0 = time.perf_counter()
        tl, ta, n = run_epoch(net, train_loader, device, amp, fmt, True, opt, sched, loss_fn)
        train_s = time.perf_counter() - t0
        vl, va, _ = run_epoch(net, valid_loader, device, amp, fmt, False, loss_fn=loss_fn)
        if not math.isfinite(tl):
            sys.exit(f"error: the training loss is {tl} in epoch {epoch}")
        print(json.dumps({"peer": peer, "epoch": epoch, "epochs": a.epochs,
                          "seconds": round(time.perf_counter() - START, 3),
                          "train_loss": round(tl, 4), "train_accuracy": round(ta, 4),
                          "valid_loss": round(vl, 4), "valid_accuracy": round(va, 4),
                          "images_per_sec": round(n / train_s, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
