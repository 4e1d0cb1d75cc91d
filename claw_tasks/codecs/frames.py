"""Encoded rows of one field: the frames of a batch side by side in one buffer.

One frame per row (a step's field), concatenated, with ``offsets`` (n + 1, int64): what
a message carries and what the store writes, one hash entry per frame. Never pickled:
it travels as msgpack bytes plus a framed offsets array.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CodecFrames:
    """``data[offsets[i]:offsets[i + 1]]`` is row i's frame."""

    data: bytes
    offsets: np.ndarray

    @classmethod
    def of(cls, frames: Sequence[bytes | memoryview]) -> CodecFrames:
        offsets = np.zeros(len(frames) + 1, np.int64)
        np.cumsum([len(f) for f in frames], out=offsets[1:])
        return cls(b"".join(frames), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> memoryview:
        return memoryview(self.data)[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __iter__(self) -> Iterator[memoryview]:
        view, off = memoryview(self.data), self.offsets.tolist()
        return (view[a:b] for a, b in itertools.pairwise(off))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def take(self, rows: np.ndarray | Sequence[int]) -> CodecFrames:
        return CodecFrames.of([self[int(i)] for i in np.asarray(rows).tolist()])
