"""Skill transitions: the steps around a change of ``skill_tag`` from one skill to another
inside an episode, what a source's ``transition`` selects (docs/recipes.md, "Transitions").

An *A→B change* is a pair of consecutive stored steps of one episode, linked by ``next``
(as n-step returns and sequences follow them, :mod:`orchestrator.sampling.sequences`),
whose skills are A then B. Its *window* of k is the k steps of the episode up to the
change and the k steps from it (2k steps; fewer where the stored episode ends first). A
step is a *member* when it is alive and in some change's window; an episode with several
A→B changes has several windows, which may overlap.

:class:`Transitions` keeps every row's member flag, with each row's verified successor and
predecessor (``succ``/``pred``: a link holds only while both rows are alive and the
successor still has the id the link names). Built whole from the columns (O(k·N)), it is
then kept current from the rows each sync reports changed (an insert, an eviction, a ring
overwrite, a link the commit set on an older row), vectorized, in O(changed·k): the links
of the changed rows and of their old predecessors are read again, and only the rows
within k steps of a link or a skill that changed are evaluated again. So an episode
whose change arrives late (its B steps committed after its A steps) becomes a member as
the link arrives. 16 bytes a row for the links, one for the flags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from orchestrator.sampling.candidates import Columns, unique
from orchestrator.sampling.sequences import follow

Encode = Callable[[str, Sequence[str]], np.ndarray]
SKILL = "skill_tag"


class Transitions:
    """The members of the A→B windows of ``window`` steps (``a``, ``b``: skill names,
    encoded through ``encode``; ``cap``: slots per shard)."""

    def __init__(self, a: str, b: str, window: int, encode: Encode, cap: int) -> None:
        self.names, self.k, self.encode, self.cap = (a, b), window, encode, cap
        self.codes: tuple[int, int] = (-1, -1)
        self.members: np.ndarray | None = None  # bool per global row
        self.succ = self.pred = np.zeros(0, np.int64)

    def current_codes(self) -> tuple[int, int]:
        """The two skills' dictionary codes now (-1: not stored yet)."""
        a, b = self.encode(SKILL, list(self.names)).tolist()
        return int(a), int(b)

    def invalidate(self) -> None:
        """Forget everything (the index was rebuilt): built again on next use."""
        self.members = None

    def mask(self, columns: Columns) -> np.ndarray:
        """The member flags, current for ``columns`` (built on first use, and again when a
        skill's code appears)."""
        codes = self.current_codes()
        if self.members is None or codes != self.codes or len(self.members) != len(columns["id"]):
            self.codes = codes
            self._build(columns)
        assert self.members is not None
        return self.members

    def changes(self, columns: Columns) -> int:
        """The A→B changes stored now (one window each; :meth:`mask` first)."""
        return len(self._starts(columns, np.flatnonzero(columns["alive"])))

    def update(self, columns: Columns, rows: np.ndarray) -> np.ndarray:
        """Account for the changed ``rows`` (sorted, unique); returns the rows, beyond them,
        whose member flag may have changed (sorted, unique)."""
        if self.members is None or not len(rows):
            return np.zeros(0, np.int64)
        succ, pred, alive = self.succ, self.pred, columns["alive"]
        before = pred[rows]
        q = unique(np.concatenate([rows, before[before >= 0]]))  # whose own link may change
        old = succ[q]
        pred[old[old >= 0]] = -1
        succ[q] = -1
        pred[rows] = -1
        live = q[alive[q]]
        nxt = follow(columns, live, self.cap)
        ok = nxt >= 0
        live, nxt = live[ok], nxt[ok]
        other = pred[nxt]  # a row that linked there before (its link no longer holds)
        succ[other[(other >= 0) & (other != live)]] = -1
        succ[live], pred[nxt] = nxt, live
        seeds = unique(np.concatenate([q, old[old >= 0], nxt]))
        near = self._near(seeds)
        self.members[near] = self._evaluate(columns, near)
        return near

    # ---- internals -------------------------------------------------------------------
    def _build(self, columns: Columns) -> None:
        n = len(columns["id"])
        self.succ, self.pred = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        rows = np.flatnonzero(columns["alive"])
        nxt = follow(columns, rows, self.cap)
        ok = nxt >= 0
        self.succ[rows[ok]], self.pred[nxt[ok]] = nxt[ok], rows[ok]
        members = np.zeros(n, bool)
        before = self._starts(columns, rows)  # the last A step of each change
        after = self.succ[before]
        for _ in range(self.k):
            members[before[before >= 0]] = True
            members[after[after >= 0]] = True
            before, after = self._step(self.pred, before), self._step(self.succ, after)
        self.members = members

    def _starts(self, columns: Columns, rows: np.ndarray) -> np.ndarray:
        """The rows among ``rows`` that are the A side of an A→B change."""
        a, b = self.codes
        if a <= 0 or b <= 0:
            return np.zeros(0, np.int64)
        skill = columns[SKILL]
        rows = rows[skill[rows] == a]
        nxt = self.succ[rows]
        return rows[(nxt >= 0) & (skill[np.maximum(nxt, 0)] == b)]

    @staticmethod
    def _step(link: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.where(rows >= 0, link[np.maximum(rows, 0)], -1)

    def _near(self, seeds: np.ndarray) -> np.ndarray:
        """``seeds`` and every row within k steps of one, either way (sorted, unique)."""
        out, back, fwd = [seeds], seeds, seeds
        for _ in range(self.k):
            back, fwd = self._step(self.pred, back), self._step(self.succ, fwd)
            out += [back[back >= 0], fwd[fwd >= 0]]
        return unique(np.concatenate(out))

    def _evaluate(self, columns: Columns, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` is a member: alive, and some A→B pair among the 2k + 1
        steps around it (its chain, -1 past the stored episode) has it in its window."""
        k, (a, b) = self.k, self.codes
        if a <= 0 or b <= 0 or not len(rows):
            return np.zeros(len(rows), bool)
        chain = np.empty((len(rows), 2 * k + 1), np.int64)
        chain[:, k] = rows
        for j in range(1, k + 1):
            chain[:, k - j] = self._step(self.pred, chain[:, k - j + 1])
            chain[:, k + j] = self._step(self.succ, chain[:, k + j - 1])
        skill = np.where(chain >= 0, columns[SKILL][np.maximum(chain, 0)], -1)
        change = (skill[:, :-1] == a) & (skill[:, 1:] == b)  # pair j: chain[j] -> chain[j + 1]
        return columns["alive"][rows] & change.any(axis=1)
