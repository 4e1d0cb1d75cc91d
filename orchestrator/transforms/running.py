"""Running statistics and the op that normalises by them: ``RunningStats`` (merged batch by
batch), where a plan keeps them (``StatsStore``, ``LocalStats``) and ``RunningNormalize``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from orchestrator.transforms.base import Op, as_rows, check_number


class RunningStats:
    """Count, mean and variance of feature vectors, merged batch by batch (Chan et al.)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = np.zeros(())
        self.m2 = np.zeros(())

    @classmethod
    def of(cls, rows: np.ndarray) -> RunningStats:
        """The statistics of a batch of rows (first axis: samples)."""
        st = cls()
        st.update(rows)
        return st

    @property
    def var(self) -> np.ndarray:
        """Population variance (1 before any data)."""
        return self.m2 / self.count if self.count else np.ones_like(self.m2)

    def merge(self, count: int, mean: np.ndarray, m2: np.ndarray) -> None:
        """Fold in the stats of another set of rows (sum of squared deviations ``m2``)."""
        if not count:
            return
        if self.count and self.mean.shape != np.shape(mean):
            raise ValueError(f"feature shape {np.shape(mean)} != running shape {self.mean.shape}")
        total = self.count + count
        delta = mean - self.mean if self.count else np.asarray(mean, dtype=np.float64)
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.count = total

    def update(self, rows: np.ndarray) -> None:
        """Fold in a batch of rows (first axis: samples)."""
        if not len(rows):
            return
        x = rows.astype(np.float64)
        mean = x.mean(axis=0)
        self.merge(len(x), mean, ((x - mean) ** 2).sum(axis=0))

    def state_dict(self) -> dict[str, Any]:
        """Plain dict of numbers and lists (JSON/msgpack-able)."""
        return {
            "count": self.count,
            "shape": list(self.mean.shape),
            "mean": self.mean.ravel().tolist(),
            "var": np.broadcast_to(self.var, self.mean.shape).ravel().tolist(),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RunningStats:
        """Restore from :meth:`state_dict` output."""
        st, shape = cls(), tuple(state["shape"])
        st.count = int(state["count"])
        st.mean = np.asarray(state["mean"], dtype=np.float64).reshape(shape)
        st.m2 = np.asarray(state["var"], dtype=np.float64).reshape(shape) * st.count
        return st


class StatsStore(Protocol):
    """Where the running statistics of a plan live, by key (``<field>/<op index>``).

    ``merge`` folds a batch's statistics into the stored ones and returns the result as one
    atomic step, so processes sharing a store (prefetch workers of one recipe, a restarted
    worker) normalise with the same statistics. The prefetch workers keep them in Redis
    (:mod:`orchestrator.delivery.augstats`); :class:`LocalStats` keeps them in this process.
    """

    def merge(self, key: str, batch: RunningStats) -> RunningStats: ...

    def get(self, key: str) -> RunningStats: ...

    def put(self, key: str, stats: RunningStats) -> None: ...


class LocalStats:
    """A :class:`StatsStore` in this process's memory."""

    def __init__(self) -> None:
        self._stats: dict[str, RunningStats] = {}

    def merge(self, key: str, batch: RunningStats) -> RunningStats:
        st = self._stats.setdefault(key, RunningStats())
        st.merge(batch.count, batch.mean, batch.m2)
        return st

    def get(self, key: str) -> RunningStats:
        return self._stats.get(key) or RunningStats()

    def put(self, key: str, stats: RunningStats) -> None:
        self._stats[key] = stats


class RunningNormalize(Op):
    """Normalize by running mean/variance of the data seen so far (per last-axis feature);
    float32 out, optionally clipped to ``[-clip, clip]``. ``update: false`` freezes the stats.

    The statistics live in the plan's :class:`StatsStore` under ``key`` (set by
    :func:`build_pipelines`); ``stats`` is the snapshot the last batch was normalised with.
    ``scope: namespace`` reads the namespace's global statistics of the field instead
    (kept by the cleaning pass, never updated here; ``stats.count`` is their version).
    """

    name = "running_normalize"

    def __init__(
        self,
        clip: float | None = None,
        eps: float = 1e-8,
        update: bool = True,
        scope: str = "recipe",
    ) -> None:
        self.clip = None if clip is None else check_number("clip", clip, 0.0)
        self.eps = check_number("eps", eps, 0.0)
        if not isinstance(update, bool):
            raise ValueError(f"update must be true or false, got {update!r}")
        if scope not in ("recipe", "namespace"):
            raise ValueError(f"scope must be 'recipe' or 'namespace', got {scope!r}")
        self.scope = scope
        self.update = update and scope == "recipe"
        self.store: StatsStore = LocalStats()
        self.key = self.name
        self.stats = RunningStats()

    def observe(self, x: np.ndarray) -> None:
        if self.update:
            self.stats = self.store.merge(self.key, RunningStats.of(as_rows(x)))
        else:
            self.stats = self.store.get(self.key)

    def out_spec(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype(np.float32), shape

    def __call__(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        st = self.stats
        if st.count and st.mean.shape != as_rows(x).shape[1:]:
            raise ValueError(f"feature shape {as_rows(x).shape[1:]} != running {st.mean.shape}")
        out = x.astype(np.float32)
        out -= st.mean.astype(np.float32)
        out *= (1.0 / np.sqrt(st.var + self.eps)).astype(np.float32)
        if self.clip is not None:
            np.clip(out, -self.clip, self.clip, out=out)
        return out
