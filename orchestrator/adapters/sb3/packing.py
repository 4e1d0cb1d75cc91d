"""Dict observations as one uint8 row: a Claw step has one ``obs`` field, so the SB3
adapters for ``spaces.Dict`` (``MultiInputPolicy``) store each observation's arrays'
bytes side by side and unpack them with every key's own dtype and shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_obs_shape


class DictLayout:
    """Where each key of a ``spaces.Dict`` lives in a packed row (``space``: the row's Box)."""

    def __init__(self, observation_space: spaces.Dict) -> None:
        self.keys: list[tuple[str, tuple[int, ...], np.dtype, int, int]] = []
        offset = 0
        for key, sub in observation_space.spaces.items():
            shape, dtype = tuple(get_obs_shape(sub)), np.dtype(sub.dtype)
            size = int(np.prod(shape)) * dtype.itemsize
            self.keys.append((key, shape, dtype, offset, size))
            offset += size
        self.space = spaces.Box(0, 255, (offset,), np.uint8)

    def pack(self, obs: Mapping[str, Any], n: int) -> np.ndarray:
        """``n`` observations (each key's array of ``n`` rows) as ``(n, row_bytes)`` uint8."""
        parts = [
            np.ascontiguousarray(np.asarray(obs[key], dtype).reshape(n, *shape))
            .reshape(n, -1)
            .view(np.uint8)
            for key, shape, dtype, _, _ in self.keys
        ]
        return np.concatenate(parts, axis=1)

    def unpack(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Each key's ``(n, *shape)`` array, copied out of ``rows`` into fresh arrays
        (their strides are the canonical ones torch needs, even for an axis of one)."""
        n, out = len(rows), {}
        for key, shape, dtype, off, size in self.keys:
            part = np.empty((n, size), np.uint8)
            part[:] = rows[:, off : off + size]
            out[key] = part.view(dtype).reshape(n, *shape)
        return out


class NotDictSpace(TypeError, AssertionError):
    """A Dict buffer given another observation space: a ``TypeError``, and the
    ``AssertionError`` SB3's own Dict buffers raise (its tests expect that)."""
