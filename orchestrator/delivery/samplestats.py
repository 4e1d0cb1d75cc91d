"""Sampling performance per recipe, as the prefetch fill measures it and ``claw metrics``
exports it: the time to make a batch (sample, read, augment, collate, frame) and its rows
as histograms, and each source's hit rate (its candidates over the namespace's live
steps). Kept in the recipe's counters hash (``pstats:<recipe>``): ``lat:<i>`` and
``rows:<i>`` count the observations in bucket ``i`` (not cumulative), ``lat_sum``,
``rows_sum`` and ``n`` their sums and count, ``hit:<source>`` the last fill's rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the time-per-batch buckets (seconds; the last bucket is +Inf)."""
ROWS = (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
"""Upper bounds of the batch-size buckets."""


class Observed:
    """What one fill measured, to add to the counters in one write."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}
        self.hits: dict[str, str] = {}

    def batch(self, seconds: float, rows: int) -> None:
        for name, bounds, value in (("lat", SECONDS, seconds), ("rows", ROWS, rows)):
            i = int(np.searchsorted(bounds, value))  # bucket i: value <= bounds[i]
            key = f"{name}:{i}"
            self.counts[key] = self.counts.get(key, 0) + 1
            self.counts[f"{name}_sum"] = self.counts.get(f"{name}_sum", 0.0) + value
        self.counts["n"] = self.counts.get("n", 0) + 1

    def hit_rates(self, sources: Sequence[str], candidates: Sequence[int], live: int) -> None:
        for src, n in zip(sources, candidates, strict=False):
            self.hits[f"hit:{src}"] = f"{n / live if live else 0.0:.6g}"

    def fields(self) -> dict[str, Any]:
        """The counters to add (numbers) and set (strings), for ``Registry.bump``."""
        return {**self.counts, **self.hits}


def histogram(counts: Mapping[str, Any], name: str) -> tuple[list[tuple[str, float]], float]:
    """``name`` (``lat`` or ``rows``) as Prometheus buckets (cumulative, ``+Inf`` last) and
    the sum, from a recipe's counters."""
    bounds = SECONDS if name == "lat" else ROWS
    out, total = [], 0.0
    for i in range(len(bounds) + 1):
        total += float(counts.get(f"{name}:{i}", 0))
        le = "+Inf" if i == len(bounds) else f"{bounds[i]:g}"
        out.append((le, total))
    return out, float(counts.get(f"{name}_sum", 0.0))


def hit_rates(counts: Mapping[str, Any]) -> dict[str, float]:
    """Source -> its last hit rate."""
    return {k[4:]: float(v) for k, v in counts.items() if k.startswith("hit:")}
