"""Column types of a step batch: strings as a vocabulary plus a per-row index,
variable-length (ragged) rows, and fields the client wrote in place;
``claw_tasks.format.batch`` puts them together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.format.encoded import Encoded


@dataclass
class StrColumn:
    """Strings as a small vocabulary plus a per-row index into it (-1 = missing)."""

    values: list[str]
    index: np.ndarray

    @classmethod
    def of(cls, items: Sequence[Any] | np.ndarray) -> StrColumn:
        if isinstance(items, np.ndarray) and items.dtype.kind in "US" and items.ndim == 1:
            return cls._of_runs(items)
        vocab: dict[str, int] = {}
        index = np.fromiter(
            (-1 if v is None else vocab.setdefault(str(v), len(vocab)) for v in items),
            dtype=np.int32,
            count=len(items),
        )
        return cls(list(vocab), index)

    @classmethod
    def _of_runs(cls, items: np.ndarray) -> StrColumn:
        """A numpy string column, one Python step per run of equal values, not per row:
        episode ids come in runs (a million rows of 1,000-step episodes: 1,000 runs)."""
        n = len(items)
        if n == 0:
            return cls([], np.zeros(0, np.int32))
        heads = np.flatnonzero(np.concatenate([[True], items[1:] != items[:-1]]))
        vocab: dict[str, int] = {}
        codes = np.fromiter(
            (vocab.setdefault(str(v), len(vocab)) for v in items[heads].tolist()),
            dtype=np.int32,
            count=len(heads),
        )
        return cls(list(vocab), np.repeat(codes, np.diff(np.append(heads, n))))

    @classmethod
    def constant(cls, value: Any, n: int) -> StrColumn:
        if value is None:
            return cls([], np.full(n, -1, np.int32))
        return cls([str(value)], np.zeros(n, np.int32))

    def take(self, rows: np.ndarray | slice) -> StrColumn:
        """The ``rows``, with only the strings they use: a part of a large batch (16,384
        of a million steps) carries and hashes its own episodes, not all of them."""
        index = self.index[rows]
        used = np.zeros(len(self.values) + 1, bool)
        used[index + 1] = True  # slot 0: missing (-1)
        keep = np.flatnonzero(used[1:])
        if len(keep) == len(self.values):
            return StrColumn(self.values, index)
        code = np.full(len(self.values) + 1, -1, np.int32)
        code[keep + 1] = np.arange(len(keep), dtype=np.int32)
        return StrColumn([self.values[i] for i in keep.tolist()], code[index + 1])

    def strings(self) -> list[str | None]:
        return [None if i < 0 else self.values[i] for i in self.index.tolist()]


@dataclass
class Ragged:
    """Variable-length rows: ``values`` concatenated along axis 0, ``lengths`` per row."""

    values: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[np.ndarray], dtype: Any = None) -> Ragged:
        arrays = [np.asarray(r, dtype=dtype) for r in rows]
        lengths = np.fromiter((a.shape[0] if a.ndim else 1 for a in arrays), np.int32, len(arrays))
        if not arrays:
            return cls(np.zeros(0, dtype or np.float32), lengths)
        return cls(np.concatenate([np.atleast_1d(a) for a in arrays]), lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> np.ndarray:
        out = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def row(self, i: int) -> np.ndarray:
        off = self.offsets
        return self.values[off[i] : off[i + 1]]

    def take(self, rows: np.ndarray) -> Ragged:
        off = self.offsets
        parts = [self.values[off[i] : off[i + 1]] for i in rows.tolist()]
        vals = np.concatenate(parts) if parts else self.values[:0]
        return Ragged(vals, self.lengths[rows])

    def row_nbytes(self) -> np.ndarray:
        per = self.values.itemsize * int(np.prod(self.values.shape[1:], dtype=np.int64))
        return self.lengths.astype(np.int64) * per


@dataclass
class Placed:
    """A fixed-shape field the client already wrote into its slots (see ``Store.place``);
    only its dtype and shape travel with the batch."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))


FieldValue = np.ndarray | Ragged | Placed | Encoded
