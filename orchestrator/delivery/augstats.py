"""Running statistics of a recipe's augmentation (``running_normalize``) in Redis, shared
by every prefetch worker of the recipe and kept across worker restarts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import redis

from claw_tasks.format.arrays import packb, unpackb
from orchestrator.transforms.running import RunningStats

_DIGEST = "digest"
NAMESPACE_DIGEST = "namespace"


def namespace_stats(r: redis.Redis, base: str) -> RedisStats:
    """A namespace's global normalisation statistics (``claw:{ns}:nstats``, one field per
    payload field), kept by the cleaning pass and read by ``scope: namespace`` ops."""
    return RedisStats(r, base + "nstats", NAMESPACE_DIGEST)


class RedisStats:
    """A :class:`~orchestrator.transforms.running.StatsStore` in the hash ``key``
    (``claw:{ns}:astats:<recipe>``): field ``digest`` names the ``augment`` section the
    statistics belong to (another section starts afresh), and each op's statistics are a
    field (msgpack: count, shape, float64 mean and m2).

    ``merge`` is a read-merge-write in one transaction that watches the hash and runs again
    when another worker merged in between: the Chan et al. formula stays in one place
    (:meth:`RunningStats.merge`), and a merge happens once per batch, so retries are rare.
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

    def _update(
        self, op: str, change: Callable[[RunningStats], None], fresh: bool = False
    ) -> RunningStats:
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    digest, raw = pipe.hmget(self.key, [_DIGEST, op])
                    stale = digest is None or digest.decode() != self.digest
                    st = RunningStats() if fresh else self._decode(digest, raw)
                    change(st)
                    pipe.multi()
                    if stale:  # another augment section's statistics: drop them
                        pipe.delete(self.key)
                    pipe.hset(self.key, mapping={_DIGEST: self.digest, op: _encode(st)})
                    pipe.execute()
                    return st
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
