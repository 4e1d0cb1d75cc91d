"""``claw.maintenance.evict``: apply every namespace's retention policy (beat, 30 s).

Per namespace the worker keeps a sampling index (synced from the change log each tick) to
choose the steps (:mod:`orchestrator.maintenance.eviction_choice`); the store evicts them in
bounded script calls. A namespace that fails does not stop the others; the task then
raises, so Flower shows it FAILED with the error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.evict import PLAN_COLUMNS
from claw_tasks.worker.app import app
from claw_tasks.worker.context import context_for
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.dictprune import prune_dictionaries
from orchestrator.maintenance.eviction_choice import Choice, choose
from orchestrator.maintenance.lifecycle import namespace_bytes, synced_index
from orchestrator.sampling.index import SamplingIndex

PRUNE_EVERY_S = 60.0
PRUNED = "dictionaries pruned"
"""When this process last pruned the namespace's dictionaries: a part of its context."""


@dataclass
class Pruned:
    at: float = -math.inf


def evict_namespace(store: Store, now: float | None = None) -> dict[str, Any]:
    """Apply the namespace's retention policy once; returns steps evicted by reason."""
    retention = store.config(refresh=True).retention
    if retention is None:
        return {}
    if retention.max_snapshots is not None or retention.snapshot_max_age is not None:
        store.prune_snapshots(retention.max_snapshots, retention.snapshot_max_age)
    index, strings = synced_index(store)
    now = time.time() if now is None else now
    if retention.empty:
        return {"pruned": _prune(store, index, now)}
    marks = store.watermarks() if retention.archive_before_evict else None
    per_step = None
    if retention.max_bytes is not None:
        live = int(index.columns["alive"].sum())
        per_step = namespace_bytes(store.r, store.namespace) / live if live else None
    choice = choose(index, strings, retention, now, watermarks=marks, bytes_per_step=per_step)
    done = evict_rows(store, index, choice)
    return {**done, "protected": choice.protected, "pruned": _prune(store, index, now)}


def _prune(store: Store, index: SamplingIndex, now: float) -> int:
    """Dictionary pruning, at most every PRUNE_EVERY_S per namespace and process (it scans
    whole dictionaries; its sweep waits GRACE_S anyway)."""
    pruned = context_for(store).part(PRUNED, Pruned)
    if now - pruned.at < PRUNE_EVERY_S:
        return 0
    pruned.at = now
    return sum(prune_dictionaries(store, index, now).values())


def evict_rows(store: Store, index: SamplingIndex, choice: Choice) -> dict[str, int]:
    """Evict the chosen rows reason by reason (the index synced in between, so each plan
    sees the steps the previous one removed as gone)."""
    cap, done = index.cap, {}
    for reason, rows in choice.rows.items():
        done[reason] = 0
        for shard in np.unique(rows // cap).tolist():
            view = {c: index.columns[c][shard * cap : (shard + 1) * cap] for c in PLAN_COLUMNS}
            view["alive"] = index.columns["alive"][shard * cap : (shard + 1) * cap]
            slots = rows[rows // cap == shard] % cap
            done[reason] += store.evict_slots(shard, view, slots, reason)
        index.sync()
    return done


@app.task(name="claw.maintenance.evict", acks_late=False, ignore_result=True)
def evict() -> dict[str, Any]:
    """Apply every namespace's retention policy (:func:`~orchestrator.maintenance.beat.
    each_namespace`); returns the steps evicted where any were."""

    def work(store: Store) -> dict[str, Any] | None:
        counts = evict_namespace(store)
        evicted = any(v for k, v in counts.items() if k not in ("protected", "pruned"))
        return counts if evicted else None

    return each_namespace("eviction", work)
