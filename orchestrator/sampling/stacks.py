"""Frame stacks: each step's k most recent steps of its episode, found through ``next``.

The store links a step to its successor only (``next``, see
:mod:`orchestrator.sampling.sequences`); a frame stack needs the predecessors.
:class:`Predecessors` keeps the inverse link for every row, built once from the index and
kept current from the rows each sync reports changed (a link is set on the older row, so
a new link always arrives as a changed row). An entry is trusted only after checking that
the link still holds (the predecessor is alive and its ``next`` still reaches the row), so
a slot the ring reused since never passes for a predecessor.

A stack is complete when the step's k - 1 predecessors are stored, or when the chain
reaches the episode's first step (``step_index`` 0) before that: the frames before the
episode's start are zeros (as Stable-Baselines3's ``VecFrameStack`` fills them after a
reset). A step whose stack has a gap (a predecessor evicted, or not stored yet) is not
drawn.
"""

from __future__ import annotations

import numpy as np

from orchestrator.sampling.candidates import Columns, unique
from orchestrator.sampling.sequences import follow


class Predecessors:
    """The previous step of each row's episode (global rows; -1 = none known)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._prev: np.ndarray | None = None
        self._pending: list[np.ndarray] = []  # rows changed since the links were read

    def refresh(self, rows: np.ndarray | None) -> None:
        """Forget everything (``rows`` None: the index was rebuilt) or note changed rows;
        links are read from the columns on the next :meth:`back`."""
        if rows is None:
            self._prev = None
        elif self._prev is not None and len(rows):
            self._pending.append(np.asarray(rows, np.int64))

    def _current(self, columns: Columns) -> np.ndarray:
        n = len(columns["id"])
        if self._prev is None or len(self._prev) != n:
            self._prev = np.full(n, -1, np.int64)
            self._pending = [np.arange(n, dtype=np.int64)]
        if self._pending:
            rows = unique(np.concatenate(self._pending))
            self._pending = []
            nxt = follow(columns, rows, self.cap)
            has = nxt >= 0
            self._prev[nxt[has]] = rows[has]
        return self._prev

    def back(self, columns: Columns, rows: np.ndarray) -> np.ndarray:
        """The stored, live predecessor of each row; -1 where none (or ``rows`` is -1)."""
        prev = self._current(columns)
        rows = np.asarray(rows, np.int64)
        p = np.where(rows >= 0, prev[np.maximum(rows, 0)], -1)
        has = p >= 0
        src = np.where(has, p, 0)
        has &= columns["alive"][src] & (follow(columns, src, self.cap) == rows)
        return np.where(has, p, -1)

    def chain(self, columns: Columns, rows: np.ndarray, k: int) -> np.ndarray:
        """``(len(rows), k)`` rows: each row's k - 1 predecessors and itself, oldest first;
        -1 where the episode has no such step stored."""
        out = np.empty((len(rows), k), np.int64)
        out[:, -1] = cur = np.asarray(rows, np.int64)
        for j in range(k - 2, -1, -1):
            cur = self.back(columns, cur)
            out[:, j] = cur
        return out

    def complete(self, columns: Columns, rows: np.ndarray, k: int) -> np.ndarray:
        """Whether each row's stack of ``k`` has no gap (see the module docstring)."""
        ch = self.chain(columns, rows, k)
        found = ch >= 0
        oldest = ch[np.arange(len(ch)), np.argmax(found, axis=1)]
        return found[:, 0] | (columns["step_index"][oldest] == 0)
