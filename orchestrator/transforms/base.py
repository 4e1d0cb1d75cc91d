"""The augmentation op interface and the parameter and shape checks every op uses."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np


def check_number(key: str, value: Any, lo: float, hi: float = np.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def jitter_range(key: str, value: Any, center: float, lo: float, hi: float) -> tuple[float, float]:
    """A jitter range: ``v`` means ``[center - v, center + v]`` (low end clamped to ``lo``), a
    ``[low, high]`` pair is taken as is."""
    if isinstance(value, list | tuple) and len(value) == 2:
        a, b = (check_number(key, v, lo, hi) for v in value)
        if a > b:
            raise ValueError(f"{key} range must be [low, high], got {list(value)}")
        return a, b
    v = check_number(key, value, 0.0, hi - center)
    return max(lo, center - v), center + v


def check_vector(key: str, value: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim > 1 or arr.size == 0 or not np.isfinite(arr).all():
        raise ValueError(f"{key} must be a finite number or list of numbers, got {value!r}")
    return arr


def as_images(x: np.ndarray) -> np.ndarray:
    if x.ndim < 4:
        raise ValueError(f"expects NHWC images (ndim >= 4), got shape {x.shape}")
    return x.reshape(-1, *x.shape[-3:])


def as_rows(x: np.ndarray) -> np.ndarray:
    """Samples as rows: features are the last axis (a 1-d field has scalar features)."""
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(-1)


class Op:
    """One augmentation step. Subclasses validate their params in ``__init__``.

    An op that knows its output's dtype and shape from its input's says so in
    :meth:`out_spec` (then a batch can be laid out before it runs); one that can write its
    output into a given array sets ``writes_out`` and takes ``out=``."""

    name: ClassVar[str]
    writes_out: ClassVar[bool] = False

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return the transformed copy of ``x``."""
        raise NotImplementedError

    def out_spec(
        self, dtype: np.dtype, shape: tuple[int, ...]
    ) -> tuple[np.dtype, tuple[int, ...]] | None:
        """The output's dtype and shape for an input of ``dtype`` and ``shape``; None when
        only running the op tells."""
        return None

    def observe(self, x: np.ndarray) -> None:
        """Update state from the data about to be transformed (stateful ops only)."""
