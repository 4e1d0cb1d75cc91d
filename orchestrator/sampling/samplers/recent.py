"""``recent``: the newest candidates by step id, newest first, without replacement;
weight 1. Deterministic: the same data gives the same rows."""

from __future__ import annotations

from typing import Literal

import numpy as np

from orchestrator.recipe.model import SamplerSpec
from orchestrator.sampling.candidates import Columns, InsufficientData
from orchestrator.sampling.samplers.base import Accept, Context, Part, register
from orchestrator.sampling.samplers.rows import Windowed


class RecentSpec(SamplerSpec):
    """``sampler: {kind: recent}``: no keys."""

    kind: Literal["recent"] = "recent"


@register
class RecentSampler(Windowed):
    """Needs as many candidates (in its window) as it has rows."""

    Spec = RecentSpec

    def draw(self, columns: Columns, k: int, ctx: Context) -> Part:
        self.candidates(columns, ctx.params)
        pool, n = self.pool(columns, ctx.now)
        if n < k:
            raise InsufficientData(self.source.name, n, k)
        pool = self.candidate_rows(columns)[0] if pool is None else pool
        return Part(self._newest(columns, pool, k, ctx.accept), np.ones(k, dtype=np.float32))

    def _newest(
        self, columns: Columns, pool: np.ndarray, k: int, accept: Accept | None
    ) -> np.ndarray:
        """The ``k`` newest acceptable rows of ``pool`` by step id, newest first."""
        ids = columns["id"][pool]
        m = k
        while True:
            m = min(4 * m, len(pool))
            top = np.argpartition(-ids, m - 1)[:m] if m < len(pool) else np.arange(m)
            rows = pool[top[np.argsort(-ids[top], kind="stable")]]
            if accept is not None:
                rows = rows[accept(columns, rows)]
            if len(rows) >= k:
                return rows[:k]
            if m == len(pool):
                raise InsufficientData(
                    self.source.name, len(pool), k, f"only {len(rows)} are complete"
                )
