#!/usr/bin/env python3
"""Fashion-MNIST's idx files (Debian's dataset-fashion-mnist) as an image folder birdtrain reads.

Writes DEST/train/<class>/<index>.png (the 60 000 training images) and DEST/valid/<class>/
<index>.png (the 10 000 test images: what both sides of the benchmark validate on), 8-bit
greyscale PNGs at 28x28 as stored; birdtrain (--image-size 32) and the PyTorch peer both
resize them to 32x32 bilinearly. Class folders are "0-t-shirt-top" ... "9-ankle-boot": they
sort in label order, so birdtrain's class index (sorted folder names) is the dataset's label.

Reads SRC/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (or the same names without .gz).
Standard library only, with PIL when it is there (a pure-Python PNG writer otherwise).
Bad input (a missing file, a wrong magic number, counts or sizes that do not match) is
refused with one line naming the file, exit 1.

  apt-get install -y dataset-fashion-mnist     # here; the GPU machine has no apt: carry the .gz
  python3 benches/fashion_mnist/convert.py --src /usr/share/datasets/fashion-mnist --dest /tmp/fmnist
  python3 benches/fashion_mnist/convert.py --src ... --dest /tmp/fm-small --limit 100   # 100 a class

--limit N keeps the first N images of each class in each split (a small set for smoke tests).
An existing DEST that holds exactly what this run would write is left as it is; any other
non-empty DEST is refused (use --overwrite to replace it).
"""
import argparse
import gzip
import os
import shutil
import struct
import sys
import zlib

CLASSES = ["t-shirt-top", "trouser", "pullover", "dress", "coat",
           "sandal", "shirt", "sneaker", "bag", "ankle-boot"]
SPLITS = (("train", "train", 60000), ("valid", "t10k", 10000))
SIDE = 28


class BadInput(Exception):
    pass


def class_folder(label):
    return f"{label}-{CLASSES[label]}"


def read_idx(src, stem, magic, count):
    """The payload of one idx file after its header, checked against the magic and count."""
    for name in (stem + ".gz", stem):
        path = os.path.join(src, name)
        if os.path.exists(path):
            break
    else:
        raise BadInput(f"{os.path.join(src, stem)}(.gz) not found")
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise BadInput(f"{path}: cannot be read ({e})")
    dims = magic & 0xFF
    header = 4 + 4 * dims
    if len(data) < header or struct.unpack(">I", data[:4])[0] != magic:
        raise BadInput(f"{path}: not an idx file of the expected kind (magic {magic:#010x})")
    shape = struct.unpack(">" + "I" * dims, data[4:header])
    want = (count,) if dims == 1 else (count, SIDE, SIDE)
    if shape != want:
        raise BadInput(f"{path}: shape {shape}, expected {want}")
    size = 1
    for d in shape:
        size *= d
    if len(data) != header + size:
        raise BadInput(f"{path}: {len(data) - header} bytes of data, expected {size}")
    return data[header:]


def png_bytes(pixels):
    """An 8-bit greyscale PNG of one SIDE x SIDE image (pure Python)."""
    raw = b"".join(b"\x00" + pixels[r * SIDE:(r + 1) * SIDE] for r in range(SIDE))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", SIDE, SIDE, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))


def writer():
    try:
        from PIL import Image
    except ImportError:
        def write(path, pixels):
            with open(path, "wb") as f:
                f.write(png_bytes(pixels))
        return write, "pure Python"

    def write(path, pixels):
        Image.frombytes("L", (SIDE, SIDE), pixels).save(path, format="PNG")
    return write, "PIL"


def plan(src, limit):
    """Per split: (folder, [(label, index, pixels)]) in file order."""
    out = []
    for split, stem, count in SPLITS:
        images = read_idx(src, f"{stem}-images-idx3-ubyte", 0x00000803, count)
        labels = read_idx(src, f"{stem}-labels-idx1-ubyte", 0x00000801, count)
        bad = [lab for lab in labels if lab >= len(CLASSES)]
        if bad:
            raise BadInput(f"{stem}-labels-idx1-ubyte: label {bad[0]} out of range 0..9")
        kept, seen = [], [0] * len(CLASSES)
        n = SIDE * SIDE
        for i, lab in enumerate(labels):
            if limit is not None and seen[lab] >= limit:
                continue
            seen[lab] += 1
            kept.append((lab, i, images[i * n:(i + 1) * n]))
        out.append((split, kept))
    return out


def expected_files(splits):
    return {os.path.join(split, class_folder(lab), f"{i:05d}.png")
            for split, kept in splits for lab, i, _ in kept}


def existing_files(dest):
    found = set()
    for root, _, files in os.walk(dest):
        for f in files:
            found.add(os.path.relpath(os.path.join(root, f), dest))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="/usr/share/datasets/fashion-mnist",
                    help="folder of the four idx files (.gz or not)")
    ap.add_argument("--dest", required=True, help="image folder to write")
    ap.add_argument("--limit", type=int, help="at most this many images of each class per split")
    ap.add_argument("--overwrite", action="store_true", help="replace a DEST that holds something else")
    a = ap.parse_args()
    if a.limit is not None and a.limit < 1:
        print(f"error: --limit {a.limit}: must be at least 1", file=sys.stderr)
        return 1
    try:
        splits = plan(a.src, a.limit)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    want = expected_files(splits)
    if os.path.isdir(a.dest) and os.listdir(a.dest):
        have = existing_files(a.dest)
        if have == want:
            print(f"{a.dest}: already holds these {len(want)} images; left as it is")
            return 0
        if not a.overwrite:
            print(f"error: {a.dest} is not empty and holds another set (--overwrite replaces it)",
                  file=sys.stderr)
            return 1
        shutil.rmtree(a.dest)
    elif os.path.exists(a.dest) and not os.path.isdir(a.dest):
        print(f"error: {a.dest} is a file, not a folder", file=sys.stderr)
        return 1
    write, how = writer()
    for split, kept in splits:
        for lab in range(len(CLASSES)):
            os.makedirs(os.path.join(a.dest, split, class_folder(lab)), exist_ok=True)
        for lab, i, pixels in kept:
            write(os.path.join(a.dest, split, class_folder(lab), f"{i:05d}.png"), pixels)
    counts = ", ".join(f"{split} {len(kept)}" for split, kept in splits)
    print(f"{a.dest}: wrote {counts} images, 28x28 greyscale PNG ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
