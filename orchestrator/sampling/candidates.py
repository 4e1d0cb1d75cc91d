"""What every sampler shares: which rows may be drawn at all, and the error a source raises
when it cannot fill its share of a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.format.stepmeta import UNTRAINABLE

Columns = Mapping[str, np.ndarray]


def eligible(columns: Columns, rows: np.ndarray | None = None) -> np.ndarray:
    """Rows that may be sampled at all: alive and trainable."""
    alive, flags = columns["alive"], columns["flags"]
    if rows is not None:
        alive, flags = alive[rows], flags[rows]
    return alive & ((flags & UNTRAINABLE) == 0)


def sorted_unique(rows: Any) -> np.ndarray:
    """``rows`` as sorted unique int64 (a sync's changed rows already are: one compare
    instead of a ``np.unique`` per sampler and sync)."""
    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) < 2 or (rows[1:] > rows[:-1]).all():
        return rows
    return unique(rows)


def unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` of a 1-D array, by a sort: numpy 2's ``np.unique`` hashes, ~8x slower
    for the few hundred rows of a batch or a sync (31 against 3.8 µs at 512 int64)."""
    out = np.sort(values)
    if len(out) > 1:
        out = out[np.concatenate(([True], out[1:] != out[:-1]))]
    return out


def recheck(
    cand: np.ndarray, columns: Columns, rows: np.ndarray, where: Any, params: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray, int]:
    """Re-evaluate ``rows`` of a candidate mask in place (their metadata changed); returns
    the unique rows, their new values and the change in the candidate count."""
    rows = sorted_unique(rows)
    new = eligible(columns, rows) & where.mask(columns, params, rows)
    delta = int(new.sum()) - int(cand[rows].sum())
    cand[rows] = new
    return rows, new, delta


class InsufficientData(RuntimeError):
    """A source cannot supply its rows of the batch."""

    def __init__(self, source: str, candidates: int, need: int, detail: str = ""):
        self.source, self.candidates, self.need = source, candidates, need
        msg = f"source {source!r}: {candidates} candidates, needs {need}"
        super().__init__(f"{msg} ({detail})" if detail else msg)
