"""Ops on feature vectors with fixed parameters: normalisation and Gaussian noise."""

from __future__ import annotations

import numpy as np

from orchestrator.transforms.base import Op, check_number, check_vector


class Normalize(Op):
    """``(x / scale - mean) / std`` as float32; mean/std are numbers or per-last-axis lists."""

    name = "normalize"

    def __init__(
        self, mean: float | list[float] = 0.0, std: float | list[float] = 1.0, scale: float = 1.0
    ) -> None:
        self.mean, self.std = check_vector("mean", mean), check_vector("std", std)
        if (self.std <= 0).any():
            raise ValueError(f"std must be > 0, got {std!r}")
        scale = check_number("scale", scale, 0.0)
        if scale == 0:
            raise ValueError("scale must be > 0")
        self._mul = (1.0 / (scale * self.std)).astype(np.float32)
        self._add = (-self.mean / self.std).astype(np.float32)

    def out_spec(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.float32), shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        for arr in (self._mul, self._add):
            if arr.size > 1 and (x.ndim == 0 or x.shape[-1] != arr.size):
                raise ValueError(f"{arr.size} mean/std values for last axis of shape {x.shape}")
        out = x.astype(np.float32)
        out *= self._mul
        out += self._add
        return out


class GaussianNoise(Op):
    """Add ``N(0, std^2)`` noise to each row with probability ``p``; float64 stays float64,
    anything else becomes float32."""

    name = "gaussian_noise"

    def __init__(self, std: float, p: float = 1.0) -> None:
        self.std = check_number("std", std, 0.0)
        self.p = check_number("p", p, 0.0, 1.0)

    def out_spec(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.float64 if dtype == np.float64 else np.float32), shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        dtype = np.float64 if x.dtype == np.float64 else np.float32
        out = x.astype(dtype)
        noise = rng.standard_normal(x.shape, dtype=dtype)
        noise *= dtype(self.std)
        if self.p < 1.0:
            noise *= (rng.random(x.shape[0]) < self.p).reshape(-1, *[1] * (x.ndim - 1))
        out += noise
        return out
