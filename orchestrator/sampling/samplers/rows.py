"""What the samplers of single rows share: the source's window, and redrawing rows that
are not complete.

Windows: ``last_steps: n`` keeps the n newest candidates by step id; ``max_age_s: s``
keeps the candidates with ``timestamp >= now - s``. They work on the candidate row list,
cached per change, and cost O(candidates).

When the recipe needs transitions (``next_obs`` in its fields, or ``n_step > 1``) a row is
drawn only if its n-step bootstrap row has its ``next_obs`` (or the episode terminated);
with ``sequence_length > 1`` only if the whole window is stored; with ``frame_stack > 1``
only if its stack has no gap (:mod:`orchestrator.sampling.stacks`): the recipe's
:data:`~orchestrator.sampling.samplers.base.Accept`. Rejected draws are redrawn, which
samples exactly the distribution restricted to the acceptable rows.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from claw_tasks.where import Where
from orchestrator.recipe.model import Source
from orchestrator.sampling.candidates import Columns, InsufficientData
from orchestrator.sampling.samplers.base import Accept, Context, Part, Sampler

_MAX_TRIES = 1 << 20  # draws per source and batch before giving up on rejections
_MAX_ROUND = 1 << 16

Distribution = tuple[Callable[[int], np.ndarray], float]
"""A function drawing m rows, and the total mass it draws from."""


class Windowed(Sampler):
    """A sampler of rows within the source's ``window``."""

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        super().__init__(source, where, tags)
        self._cache: dict[str, Any] = {}

    def built(self, columns: Columns) -> None:
        self._cache.clear()

    def dropped(self) -> None:
        self._cache.clear()

    def candidate_rows(self, columns: Columns) -> tuple[np.ndarray, np.ndarray]:
        """Candidate rows and their step ids, cached per version."""
        if self._cache.get("version") != self.version:
            rows = np.flatnonzero(self.cand)
            self._cache = {"version": self.version, "rows": rows, "ids": columns["id"][rows]}
        return self._cache["rows"], self._cache["ids"]

    def pool(self, columns: Columns, now: float) -> tuple[np.ndarray | None, int]:
        """The window's rows (None when the window holds every candidate) and how many."""
        window = self.source.window
        if window is None or (window.last_steps is not None and window.last_steps >= self.n):
            return None, self.n
        rows, ids = self.candidate_rows(columns)
        if window.max_age_s is not None:
            pool = rows[columns["timestamp"][rows] >= now - window.max_age_s]
            return pool, len(pool)
        if "last" not in self._cache:
            cut = len(ids) - window.last_steps
            self._cache["last"] = rows[np.argpartition(ids, cut)[cut:]]
        return self._cache["last"], len(self._cache["last"])


class WithReplacement(Windowed):
    """Independent draws from a distribution over the window: a subclass gives the
    distribution and the importance weights. It may keep sum trees over all global rows
    (leaf = the row's sampling mass) for draws over every candidate, O(log N) each and
    O(changed · log N) to keep current: :attr:`trees` says whether to (not for an age
    window, whose rows change with the clock)."""

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        super().__init__(source, where, tags)
        window = source.window
        self.trees = window is None or window.max_age_s is None

    @abstractmethod
    def distribution(self, columns: Columns, pool: np.ndarray | None, ctx: Context) -> Distribution:
        """How to draw from ``pool`` (None: every candidate, from the trees)."""

    def weights(
        self, columns: Columns, rows: np.ndarray, n: int, total: float, ctx: Context
    ) -> np.ndarray:
        """The importance weights of the drawn ``rows`` (float32); 1 unless overridden."""
        return np.ones(len(rows), dtype=np.float32)

    def draw(self, columns: Columns, k: int, ctx: Context) -> Part:
        self.candidates(columns, ctx.params)
        pool, n = self.pool(columns, ctx.now)
        if n < 1:
            raise InsufficientData(self.source.name, n, 1)
        sample, total = self.distribution(columns, pool, ctx)
        rows = redraw(self.source.name, columns, sample, k, n, ctx.accept)
        return Part(rows, self.weights(columns, rows, n, total, ctx))


def redraw(
    name: str,
    columns: Columns,
    sample: Callable[[int], np.ndarray],
    k: int,
    n: int,
    accept: Accept | None,
) -> np.ndarray:
    """``k`` draws of ``sample``, redrawing those ``accept`` rejects (source ``name`` with
    ``n`` candidates gives up after many rejections)."""
    rows = sample(k)
    if accept is None:
        return rows
    bad = np.flatnonzero(~accept(columns, rows))
    tries, good = k, k - len(bad)
    limit = min(_MAX_TRIES, 64 * (k + n))
    while len(bad):
        if tries >= limit:
            raise InsufficientData(name, n, k, f"only {good} of {tries} draws were complete")
        m = min(int(len(bad) * 2 * tries / max(good, 1)) + 8, _MAX_ROUND)
        more = sample(m)
        more = more[accept(columns, more)]
        tries, good = tries + m, good + len(more)
        take = min(len(more), len(bad))
        rows[bad[:take]] = more[:take]
        bad = bad[take:]
    return rows
