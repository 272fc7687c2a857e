"""What a run of the loader yields, comparable across runs and processes."""

from __future__ import annotations

import hashlib
from typing import List, Tuple

import torch


def digest(images: torch.Tensor, labels: torch.Tensor) -> Tuple[int, str, List[int]]:
    """Batch size, a hash of the pixels, the labels."""
    data = images.contiguous().numpy().tobytes()
    return images.shape[0], hashlib.sha256(data).hexdigest(), labels.tolist()


def image_hashes(images: torch.Tensor) -> List[str]:
    return [hashlib.sha256(img.contiguous().numpy().tobytes()).hexdigest() for img in images]
