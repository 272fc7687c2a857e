"""torchvision's automatic augmentation operations, for pipeline/tests/auto_augment.rs.

Reads one JSON object from stdin: {"side": S, "image": [S*S*3 bytes, packed RGB],
"ops": [[name, magnitude], ...]}. Applies each operation alone to the image as a uint8
tensor, through torchvision's own `_apply_op` with bilinear interpolation and no fill (what
TrivialAugmentWide and RandAugment call), and writes the results, packed RGB, one after
another to stdout.
"""
import json
import sys

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.autoaugment import _apply_op


def main():
    request = json.load(sys.stdin)
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
