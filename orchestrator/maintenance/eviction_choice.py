"""Which steps a namespace's retention policy evicts now (the choice only; the store's
``evict_slots`` does the eviction). Works on the sampling index's columns, so a beat tick
costs one incremental sync, not a read of the whole namespace."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.retention import Retention
from claw_tasks.where import Where
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings


@dataclass
class Choice:
    """Global rows (``shard * cap + slot``) to evict, by reason, and what was weighed."""

    rows: dict[str, np.ndarray] = field(default_factory=dict)
    live: int = 0
    protected: int = 0
    limit: int | None = None  # the step cap in force (max_steps, max_bytes), if any

    @property
    def total(self) -> int:
        return sum(len(r) for r in self.rows.values())


def protected_mask(
    columns: Mapping[str, np.ndarray], retention: Retention, strings: Strings, tags: Mapping
) -> np.ndarray:
    """Live rows that match any of the policy's ``protect`` filters."""
    out = np.zeros(len(columns["alive"]), bool)
    for where in retention.protect:
        out |= Where(where, tags, strings.encode).mask(columns, {})
    return out & columns["alive"]


def choose(
    index: SamplingIndex,
    strings: Strings,
    retention: Retention,
    now: float,
    *,
    watermarks: list[int | None] | None = None,
    bytes_per_step: float | None = None,
) -> Choice:
    """The rows ``retention`` evicts now: older than ``max_age`` (``ttl``), then the excess
    over the step cap (``cap``: ``max_steps``, or ``max_bytes / bytes_per_step``), lowest
    priority first (unset = the current maximum) or oldest first; protected rows and, with
    ``archive_before_evict``, rows above their shard's archive watermark never."""
    cols = index.columns
    alive = cols["alive"]
    tags = index.schema.tags if index.schema else {}
    protected = protected_mask(cols, retention, strings, tags)
    evictable = alive & ~protected
    if retention.archive_before_evict:
        seq = cols["id"] // index.n_shards
        marks = np.array([-1 if w is None else w for w in watermarks or []], np.int64)
        if len(marks) != index.n_shards:
            raise ValueError("archive_before_evict needs one watermark per shard")
        evictable &= seq <= np.repeat(marks, index.cap)
    out = Choice(live=int(alive.sum()), protected=int(protected.sum()))
    if retention.max_age is not None:
        ttl = evictable & (cols["timestamp"] < now - retention.max_age)
        out.rows["ttl"] = np.flatnonzero(ttl)
        evictable &= ~ttl
    limits = [retention.max_steps]
    if retention.max_bytes is not None and bytes_per_step:
        limits.append(int(retention.max_bytes // bytes_per_step))
    known = [v for v in limits if v is not None]
    if known:
        out.limit = min(known)
        excess = out.live - out.total - out.limit
        if excess > 0:
            rows = np.flatnonzero(evictable)
            if retention.evict == "oldest":
                order = np.lexsort((cols["id"][rows], cols["timestamp"][rows]))
            else:
                pr = cols["priority"][rows].astype(np.float64)
                top = np.nanmax(pr) if np.isfinite(pr).any() else 1.0
                pr = np.where(np.isnan(pr), top, pr)
                order = np.lexsort((cols["timestamp"][rows], pr))
            out.rows["cap"] = np.sort(rows[order[:excess]])
    return out


def protected_steps(store: Store) -> int | None:
    """Live steps the namespace's policy protects (None: no protect filters)."""
    retention = store.config(refresh=True).retention
    if retention is None or not retention.protect:
        return None
    index = SamplingIndex(store, payload_bytes=0)
    index.sync()
    tags = index.schema.tags if index.schema else {}
    return int(protected_mask(index.columns, retention, Strings(store, index), tags).sum())
