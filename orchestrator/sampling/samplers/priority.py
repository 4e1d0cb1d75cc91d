"""``priority``: P(i) = p_i^alpha / sum_j p_j^alpha with replacement, where an unset (NaN)
priority counts as the current maximum priority of the namespace (1.0 if none is set);
importance weight w_i = (N * P(i))^-beta / max over the source's rows in the batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import NonNegativeFloat

from claw_tasks.where import Where
from orchestrator.recipe.model import SamplerSpec, Source
from orchestrator.sampling.candidates import Columns, InsufficientData
from orchestrator.sampling.samplers.base import Context, register
from orchestrator.sampling.samplers.rows import Distribution, WithReplacement
from orchestrator.sampling.sumtree import SumTree


class PrioritySpec(SamplerSpec):
    """``sampler: {kind: priority, alpha, beta}``."""

    kind: Literal["priority"] = "priority"
    alpha: NonNegativeFloat = 0.6
    beta: NonNegativeFloat = 0.4


@register
class PrioritySampler(WithReplacement):
    """Proportional to priority^alpha. Two trees: the mass of the candidates whose priority
    is set, and the count of those whose is not (their mass moves with the maximum)."""

    Spec = PrioritySpec
    needs_max_priority = True

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        super().__init__(source, where, tags)
        spec = source.sampler
        assert isinstance(spec, PrioritySpec)
        self.alpha, self.beta = spec.alpha, spec.beta
        self._mass: SumTree | None = None  # p^alpha of candidates with a priority
        self._count: SumTree | None = None  # 1 per candidate without one

    def built(self, columns: Columns) -> None:
        super().built(columns)
        if not self.trees:
            return
        p = columns["priority"]
        unset = np.isnan(p)
        mass = np.zeros(len(p))
        idx = np.flatnonzero(self.cand & ~unset)
        mass[idx] = p[idx].astype(np.float64) ** self.alpha
        self._mass = SumTree(mass)
        self._count = SumTree((self.cand & unset).astype(np.float64))

    def updated(self, columns: Columns, rows: np.ndarray, cand: np.ndarray) -> None:
        if not self.trees:
            return
        p = columns["priority"][rows].astype(np.float64)
        unset = np.isnan(p)
        self._mass.update(rows, np.where(cand & ~unset, p**self.alpha, 0.0))
        self._count.update(rows, (cand & unset).astype(np.float64))

    def dropped(self) -> None:
        super().dropped()
        self._mass = self._count = None

    def distribution(self, columns: Columns, pool: np.ndarray | None, ctx: Context) -> Distribution:
        rng, max_p = ctx.rng, ctx.max_priority
        if pool is None:
            mass, count = self._mass, self._count
            unset_mass = max_p**self.alpha
            set_total, unset_total = mass.total, count.total * unset_mass
            total = set_total + unset_total
            self._check_mass(total, self.n)

            def sample(m: int) -> np.ndarray:
                u = rng.random(m) * total
                hit = (u < set_total) | (unset_total == 0)
                out = np.empty(m, dtype=np.int64)
                if hit.any():
                    out[hit] = mass.find(u[hit])
                if not hit.all():
                    out[~hit] = count.find((u[~hit] - set_total) / unset_mass)
                return out

            return sample, total
        p = columns["priority"][pool].astype(np.float64)
        cs = np.cumsum(np.where(np.isnan(p), max_p, p) ** self.alpha)
        total = float(cs[-1]) if len(cs) else 0.0
        self._check_mass(total, len(pool))
        top = np.nextafter(total, 0.0)

        def sample_pool(m: int) -> np.ndarray:
            u = np.minimum(rng.random(m) * total, top)
            return pool[np.searchsorted(cs, u, side="right")]

        return sample_pool, total

    def weights(
        self, columns: Columns, rows: np.ndarray, n: int, total: float, ctx: Context
    ) -> np.ndarray:
        p = columns["priority"][rows].astype(np.float64)
        prob = np.where(np.isnan(p), ctx.max_priority, p) ** self.alpha / total
        w = (n * prob) ** -self.beta
        return (w / w.max()).astype(np.float32)

    def _check_mass(self, total: float, n: int) -> None:
        if not total > 0:
            raise InsufficientData(self.source.name, n, 1, "every candidate has priority 0")
