"""``uniform``: uniform over the candidates, with replacement; weight 1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np

from claw_tasks.where import Where
from orchestrator.recipe.model import SamplerSpec, Source
from orchestrator.sampling.candidates import Columns
from orchestrator.sampling.samplers.base import Context, register
from orchestrator.sampling.samplers.rows import Distribution, WithReplacement
from orchestrator.sampling.sumtree import SumTree


class UniformSpec(SamplerSpec):
    """``sampler: {kind: uniform}``: no keys."""

    kind: Literal["uniform"] = "uniform"


@register
class UniformSampler(WithReplacement):
    """Every candidate (in the window) equally likely; its tree counts the candidates."""

    Spec = UniformSpec

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str]) -> None:
        super().__init__(source, where, tags)
        self._count: SumTree | None = None  # 1 per candidate

    def built(self, columns: Columns) -> None:
        super().built(columns)
        if self.trees:
            self._count = SumTree(self.cand.astype(np.float64))

    def updated(self, columns: Columns, rows: np.ndarray, cand: np.ndarray) -> None:
        if self.trees:
            self._count.update(rows, cand.astype(np.float64))

    def dropped(self) -> None:
        super().dropped()
        self._count = None

    def distribution(self, columns: Columns, pool: np.ndarray | None, ctx: Context) -> Distribution:
        rng = ctx.rng
        if pool is None:
            count = self._count
            return lambda m: count.find(rng.random(m) * count.total), float(self.n)
        return lambda m: pool[rng.integers(len(pool), size=m)], float(len(pool))
