"""Running statistics of a recipe's augmentation (``running_normalize``) in Redis, shared
by every prefetch worker of the recipe and kept across worker restarts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import redis

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.store import Store
from orchestrator.transforms.quantiles import QuantileSample
from orchestrator.transforms.running import RunningStats

_DIGEST = "digest"
_SAMPLE = "q:"
T = TypeVar("T")
NAMESPACE_DIGEST = "namespace"


def namespace_stats(store: Store) -> RedisStats:
    """A namespace's global normalisation statistics (``claw:{ns}:nstats``, one field per
    payload field), kept by the cleaning pass and read by ``scope: namespace`` ops."""
    return RedisStats(store.r, store.owned_key("nstats"), NAMESPACE_DIGEST)


class RedisStats:
    """A :class:`~orchestrator.transforms.running.StatsStore` in the hash ``key``
    (``claw:{ns}:astats:<recipe>``): field ``digest`` names the ``augment`` section the
    statistics belong to (another section starts afresh), and each op's statistics are a
    field (msgpack: count, shape, float64 mean and m2).

    ``merge`` is a read-merge-write in one transaction that watches the hash and runs again
    when another worker merged in between: the Chan et al. formula stays in one place
    (:meth:`RunningStats.merge`), and a merge happens once per batch, so retries are rare.
    Quartile samples (IQR outlier rules) are fields ``q:<name>`` of the same hash, merged
    the same way (:meth:`merge_sample`).
    """

    def __init__(self, r: redis.Redis, key: str, digest: str) -> None:
        self.r, self.key, self.digest = r, key, digest

    def get(self, op: str) -> RunningStats:
        digest, raw = self.r.hmget(self.key, [_DIGEST, op])
        return self._decode(digest, raw)

    def merge(self, op: str, batch: RunningStats) -> RunningStats:
        return self._update(op, lambda st: st.merge(batch.count, batch.mean, batch.m2))

    def put(self, op: str, stats: RunningStats) -> None:
        self._update(op, lambda st: st.merge(stats.count, stats.mean, stats.m2), fresh=True)

    def get_sample(self, name: str) -> QuantileSample:
        """The quartile sample of field ``name`` (empty before any merge)."""
        digest, raw = self.r.hmget(self.key, [_DIGEST, _SAMPLE + name])
        fresh = raw is None or digest is None or digest.decode() != self.digest
        return QuantileSample() if fresh else _decode_sample(raw)

    def merge_sample(self, name: str, batch: QuantileSample) -> QuantileSample:
        def change(digest: bytes | None, raw: bytes | None) -> tuple[QuantileSample, bytes]:
            fresh = raw is None or digest is None or digest.decode() != self.digest
            st = QuantileSample(batch.size) if fresh else _decode_sample(raw)
            st.merge(batch)
            return st, _encode_sample(st)

        return self._transact(_SAMPLE + name, change)

    def _update(
        self, op: str, change: Callable[[RunningStats], None], fresh: bool = False
    ) -> RunningStats:
        def merged(digest: bytes | None, raw: bytes | None) -> tuple[RunningStats, bytes]:
            st = RunningStats() if fresh else self._decode(digest, raw)
            change(st)
            return st, _encode(st)

        return self._transact(op, merged)

    def _transact(self, field: str, change: Callable[[Any, Any], tuple[T, bytes]]) -> T:
        """Read ``field``, change it and write it back in one watched transaction."""
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    digest, raw = pipe.hmget(self.key, [_DIGEST, field])
                    stale = digest is None or digest.decode() != self.digest
                    value, encoded = change(digest, raw)
                    pipe.multi()
                    if stale:  # another augment section's statistics: drop them
                        pipe.delete(self.key)
                    pipe.hset(self.key, mapping={_DIGEST: self.digest, field: encoded})
                    pipe.execute()
                    return value
                except redis.WatchError:
                    continue

    def _decode(self, digest: bytes | None, raw: bytes | None) -> RunningStats:
        st = RunningStats()
        if raw is None or digest is None or digest.decode() != self.digest:
            return st
        d = unpackb(raw)
        shape = tuple(d["shape"])
        st.count = int(d["count"])
        st.mean = np.frombuffer(d["mean"], "<f8").reshape(shape).copy()
        st.m2 = np.frombuffer(d["m2"], "<f8").reshape(shape).copy()
        return st


def _encode(st: RunningStats) -> bytes:
    mean, m2 = np.asarray(st.mean, "<f8"), np.asarray(st.m2, "<f8")
    return packb(
        {"count": st.count, "shape": list(mean.shape), "mean": mean.tobytes(), "m2": m2.tobytes()}
    )


def _encode_sample(st: QuantileSample) -> bytes:
    rows = np.ascontiguousarray(st.rows, "<f4")
    return packb(
        {
            "count": st.count,
            "size": st.size,
            "features": rows.shape[1] if rows.ndim == 2 else 0,
            "keys": np.ascontiguousarray(st.keys, "<f8").tobytes(),
            "rows": rows.tobytes(),
        }
    )


def _decode_sample(raw: bytes) -> QuantileSample:
    d = unpackb(raw)
    st = QuantileSample(int(d["size"]))
    st.count = int(d["count"])
    st.keys = np.frombuffer(d["keys"], "<f8").copy()
    st.rows = np.frombuffer(d["rows"], "<f4").reshape(len(st.keys), int(d["features"])).copy()
    return st
