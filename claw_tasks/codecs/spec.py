"""A payload field's codec: its name and parameters, how it is written in a schema, and
which fields it fits.

Written as text in the Python API and the stored schema: ``zstd`` (level 3), ``zstd:9``,
``lz4``, ``png`` (lossless, uint8), ``png:1`` (zlib level), ``jpeg:90`` and ``webp:80``
(lossy: only with a quality, so nobody loses bits by accident), ``delta`` / ``delta:16``
(within an episode, a key frame every K steps; zstd level 3). No codec (``None`` or
``"none"``) stores the raw bytes, as before codecs existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.codecs.errors import CodecError

LOSSLESS = ("zstd", "lz4", "png", "delta")
LOSSY = ("jpeg", "webp")
NAMES = (*LOSSLESS, *LOSSY)
IMAGE = ("png", "jpeg", "webp")
DEFAULT_ZSTD_LEVEL = 3
DEFAULT_PNG_LEVEL = 6
DEFAULT_KEY_EVERY = 16
MAX_KEY_EVERY = 256


@dataclass(frozen=True)
class Codec:
    """One codec with its parameter (``param``: zstd or png level, lossy quality, delta's
    key interval; None: the default). ``str(codec)`` is its text form, ``Codec.of`` parses
    it back."""

    name: str
    param: int | None = None

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise CodecError(f"codec {self.name!r}: known codecs are {', '.join(NAMES)} or none")
        p = self.param
        if p is not None and (type(p) is not int):
            raise CodecError(f"codec {self.name}: parameter {p!r} is not an integer")
        bounds = {
            "zstd": (1, 22),
            "png": (0, 9),
            "jpeg": (1, 100),
            "webp": (1, 100),
            "delta": (2, MAX_KEY_EVERY),
        }
        if self.name in LOSSY and p is None:
            raise CodecError(
                f"codec {self.name} is lossy: give its quality explicitly ({self.name}:90), "
                "or use png (lossless) for uint8 images"
            )
        if p is not None:
            if self.name not in bounds:
                raise CodecError(f"codec {self.name} takes no parameter (got {p})")
            lo, hi = bounds[self.name]
            if not lo <= p <= hi:
                raise CodecError(f"codec {self.name}: parameter {p} outside [{lo}, {hi}]")

    @classmethod
    def of(cls, value: Codec | str | None) -> Codec | None:
        """A codec from its text form (``"zstd:9"``); None or ``"none"`` is no codec."""
        if value is None or isinstance(value, Codec):
            return value
        if not isinstance(value, str):
            raise CodecError(f"codec {value!r:.40}: expected text such as 'zstd' or 'png'")
        text = value.strip().lower()
        if text in ("", "none", "raw"):
            return None
        name, _, param = text.partition(":")
        if param:
            if not param.isdigit():
                raise CodecError(f"codec {value!r}: parameter {param!r} is not an integer")
            return cls(name, int(param))
        return cls(name)

    def __str__(self) -> str:
        return self.name if self.param is None else f"{self.name}:{self.param}"

    @property
    def level(self) -> int:
        """zstd level (zstd and delta) or zlib level (png)."""
        if self.name == "png":
            return DEFAULT_PNG_LEVEL if self.param is None else self.param
        return self.param if self.name == "zstd" and self.param is not None else DEFAULT_ZSTD_LEVEL

    @property
    def key_every(self) -> int:
        """delta: a key frame at least every this many steps of an episode."""
        return DEFAULT_KEY_EVERY if self.param is None else self.param

    def check_field(self, dtype: Any, shape: tuple[int | None, ...], what: str) -> None:
        """Refuse a field this codec cannot hold (CodecError naming the field and the fix)."""
        dt = np.dtype(dtype)
        ragged = bool(shape) and shape[0] is None
        if self.name in IMAGE:
            if dt != np.uint8:
                raise CodecError(
                    f"{what}: codec {self} holds uint8 images, not {dt.name}; use zstd or lz4"
                )
            if ragged or not shape:
                raise CodecError(f"{what}: codec {self} needs a fixed shape; use zstd or lz4")
            mode, _ = image_layout(tuple(shape))  # type: ignore[arg-type]  # checked above: a fixed shape (no None)
            if self.name == "jpeg" and mode == "RGBA":
                raise CodecError(f"{what}: jpeg has no alpha channel; use png or webp")
            if self.name == "webp" and mode == "L":
                raise CodecError(f"{what}: webp holds RGB(A) images; use jpeg or png for gray")
        if self.name == "delta" and ragged:
            raise CodecError(f"{what}: delta needs a fixed shape (frames of equal size)")


def image_layout(shape: tuple[int, ...]) -> tuple[str, tuple[int, int]]:
    """How a uint8 row of ``shape`` is drawn as an image for png/jpeg/webp: its Pillow
    mode and (width, height). ``(H, W, 3|4)`` is RGB(A); anything else is one grayscale
    image of ``shape[-1]`` columns and the other dimensions as rows (a frame stack
    ``(4, 84, 84)`` is 336 rows of 84; a trailing 1 is dropped first)."""
    if len(shape) >= 2 and shape[-1] == 1:  # (H, W, 1): a grayscale (H, W)
        shape = shape[:-1]
    if len(shape) == 3 and shape[2] in (3, 4):
        return ("RGB" if shape[2] == 3 else "RGBA"), (shape[1], shape[0])
    width = shape[-1] if shape else 1
    height = math.prod(int(d) for d in shape[:-1])  # math.prod: np.prod cost ~4 µs a frame
    return "L", (int(width), height)
