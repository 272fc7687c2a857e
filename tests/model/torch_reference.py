#!/usr/bin/python3
"""Reference step in PyTorch (float64) for tests/model/torch_reference.rs.

usage: torch_reference.py ARCH CLASSES SMOOTHING WEIGHTS.safetensors INPUT.safetensors OUT.safetensors

Loads birdtrain's safetensors into torchvision's model with load_state_dict(strict=True) (so
names and shapes must match torchvision exactly), runs one training-mode forward/backward on
the u8 NHWC batch normalised as torchvision does, and writes the loss, every parameter's
gradient (torchvision layout) and the BN buffers after the step. Needs only torch,
torchvision and numpy (the safetensors format is read and written by hand).
"""
import json
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F
import torchvision

DT = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "U8": np.uint8, "U32": np.uint32}


def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        out[name] = np.frombuffer(data[s:e], dtype=DT[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    arch, classes, smoothing, wpath, ipath, opath = sys.argv[1:7]
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=int(classes)).double()
    sd = {k: torch.from_numpy(v) for k, v in load(wpath).items()}
    sd = {k: (v if v.dtype == torch.int64 else v.double()) for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)
    inp = load(ipath)
    px = torch.from_numpy(inp["pixels"]).double() / 255.0
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)
    x = ((px - mean) / std).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(inp["labels"].astype(np.int64))
    model.train()
    logits = model(x)
    loss = F.cross_entropy(logits, labels, label_smoothing=float(smoothing))
    loss.backward()
    out = {"loss": np.array([loss.item()])}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.numpy()
    for name, b in model.named_buffers():
        if not name.endswith("num_batches_tracked"):
            out["buffer." + name] = b.numpy()
    save(opath, out)


if __name__ == "__main__":
    main()
