"""torchvision's automatic augmentation operations, for pipeline/tests/engine/auto_augment.rs.

Reads one JSON object from stdin: {"side": S, "image": [S*S*3 bytes, packed RGB],
"ops": [[name, magnitude], ...]}. Applies each operation alone to the image as a uint8
tensor, through torchvision's own `_apply_op` with bilinear interpolation and no fill (what
TrivialAugmentWide, RandAugment and AutoAugment call), and writes the results, packed RGB,
one after another to stdout.

With {"spaces": S} instead, writes one JSON object: each class's `_augmentation_space` for
S x S images, {"TrivialAugmentWide": {op: [magnitude per bin] | [] , ...}, "RandAugment": ...,
"AutoAugment": ..., "AugMix": ...} (an empty list for the operations without a strength).
"""
import json
import sys

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import AugMix, AutoAugment, RandAugment, TrivialAugmentWide
from torchvision.transforms.autoaugment import _apply_op


def spaces(side):
    out = {}
    for cls, bins in [(TrivialAugmentWide, 31), (RandAugment, 31), (AutoAugment, 10), (AugMix, 10)]:
        space = cls()._augmentation_space(bins, (side, side)) if cls is not TrivialAugmentWide \
            else cls()._augmentation_space(bins)
        out[cls.__name__] = {name: [float(v) for v in m.reshape(-1)] if m.ndim > 0 else []
                             for name, (m, _signed) in space.items()}
    return out


def main():
    request = json.load(sys.stdin)
    if "spaces" in request:
        json.dump(spaces(request["spaces"]), sys.stdout)
        return
    side = request["side"]
    image = torch.tensor(request["image"], dtype=torch.uint8).reshape(side, side, 3)
    chw = image.permute(2, 0, 1).contiguous()
    out = bytearray()
    for name, magnitude in request["ops"]:
        result = _apply_op(chw.clone(), name, float(magnitude), InterpolationMode.BILINEAR, None)
        out += result.permute(1, 2, 0).contiguous().numpy().tobytes()
    sys.stdout.buffer.write(bytes(out))


if __name__ == "__main__":
    main()
