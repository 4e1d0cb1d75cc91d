"""Image observations as PNG thumbnails, made on request within size limits and cached."""

from __future__ import annotations

import io

import numpy as np

MAX_SIDE = 4096  # an image field with a larger side is not drawn
MAX_BYTES = 64 * 1024 * 1024  # nor one whose stored row is larger
THUMB_SIDE = 128


class NotAnImage(ValueError):
    """The field is not an image the inspector draws; the message says why."""


def image_layout(dtype: str, shape: tuple[int, ...]) -> str | None:
    """``"hwc"``, ``"chw"`` or ``"hw"`` when a field of this dtype and shape is an image
    (uint8, spatial sides >= 8, 1/3/4 channels or more stacked ones), else None."""
    if np.dtype(dtype) != np.uint8:
        return None
    if len(shape) == 2 and min(shape) >= 8:
        return "hw"
    if len(shape) == 3:
        if min(shape[:2]) >= 8 and shape[2] <= 12:
            return "hwc"
        if min(shape[1:]) >= 8 and shape[0] <= 12:
            return "chw"
    return None


def check_limits(shape: tuple[int, ...], row_bytes: int) -> None:
    if max(shape) > MAX_SIDE or row_bytes > MAX_BYTES:
        raise NotAnImage(
            f"image {shape} is over the inspector's limits ({MAX_SIDE} px a side, "
            f"{MAX_BYTES >> 20} MiB)"
        )


def to_png(array: np.ndarray, layout: str, side: int = THUMB_SIDE) -> bytes:
    """PNG of an image array (the first 3 channels of a frame stack), at most ``side``
    pixels on its longer side (nearest neighbour: pixels stay sharp)."""
    from PIL import Image

    a = np.asarray(array, np.uint8)
    if layout == "chw":
        a = np.moveaxis(a, 0, -1)
    if a.ndim == 3:
        a = a[..., 0] if a.shape[2] in (1, 2) else a[..., :3]
    img = Image.fromarray(np.ascontiguousarray(a))
    scale = side / max(img.size)
    if scale < 1:
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        img = img.resize(size, Image.Resampling.BILINEAR)
    elif scale >= 2:
        k = int(scale)
        img = img.resize((img.width * k, img.height * k), Image.Resampling.NEAREST)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=False)
    return out.getvalue()
