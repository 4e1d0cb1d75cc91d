"""Albumentations called directly, the reference a recipe's transforms must equal."""

from __future__ import annotations

import albumentations as A
import numpy as np

DROPOUT = {
    "num_holes_range": [2, 4],
    "hole_height_range": [0.1, 0.3],
    "hole_width_range": [0.1, 0.3],
    "fill": 0,
    "p": 1.0,
}


def direct(images: np.ndarray, seed: int) -> np.ndarray:
    """CoarseDropout as albumentations runs it: seeded once, then image by image."""
    t = A.CoarseDropout(**{k: tuple(v) if isinstance(v, list) else v for k, v in DROPOUT.items()})
    t.set_random_seed(seed)
    return np.stack([t(image=im)["image"] for im in images])


def images(n: int) -> np.ndarray:
    """``n`` seeded 32x32 RGB images without a 0 pixel (a hole shows)."""
    return np.random.default_rng(0).integers(1, 256, (n, 32, 32, 3), dtype=np.uint8)
