"""A pass that recomputes a namespace's priorities, as the store sees it: the pass walks
the namespace one metadata chunk at a time (``layout.meta_spans``); when it starts it
snapshots every chunk of the priority column (COPY in Redis), and a write lands only where
the priority still equals the snapshot and the value it was computed from
(``lua/reprioritize.lua``), so a trainer's update after the pass started wins over it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import meta_spans, nan_xor
from claw_tasks.store.scripts import Lua

WRITE_BATCH = 1024
"""Steps per script call (a BITFIELD, three short GETRANGEs, a few SETRANGEs)."""
_SCRIPT = Lua("reprioritize")
Queue = Callable[[Any], None]


def _snapshots(store: StoreCore) -> list[tuple[int, int]]:
    cfg = store.config()
    return [(s, c) for s in range(cfg.n_shards) for c in range(len(meta_spans(cfg.cap)))]


def snapshot_priorities(store: StoreCore, also: Queue | None = None) -> None:
    """Snapshot every priority chunk for a new pass (and run what ``also`` queues in the
    same round trip)."""
    k = store.layout_keys
    with store.r.pipeline(transaction=False) as pipe:
        for shard, c in _snapshots(store):
            pipe.copy(k.meta(shard, "priority", c), k.shard_key(shard, f"psnap:{c}"), replace=True)
        if also is not None:
            also(pipe)
        pipe.execute()


def drop_priority_snapshots(store: StoreCore, also: Queue | None = None) -> None:
    """Delete a finished pass's snapshots (and run what ``also`` queues, same round trip)."""
    with store.r.pipeline(transaction=False) as pipe:
        for shard, c in _snapshots(store):  # one DEL per key: a cluster routes each
            pipe.delete(store.layout_keys.shard_key(shard, f"psnap:{c}"))
        if also is not None:
            also(pipe)
        pipe.execute()


def write_priorities(
    store: StoreCore,
    shard: int,
    chunk: int,
    slots: np.ndarray,
    ids: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> int:
    """Write priorities ``new`` (float32, NaN: unset) at ascending ``slots`` of metadata
    chunk ``chunk`` of ``shard``, each only where the step is still ``ids``' and its
    priority still ``old`` and the pass's snapshot. Returns the priorities written."""
    k = store.layout_keys
    first, stop = meta_spans(store.config().cap)[chunk]
    keys = [
        k.shard_key(shard, "alive"),
        k.meta(shard, "id", chunk),
        k.meta(shard, "priority", chunk),
        k.shard_key(shard, f"psnap:{chunk}"),
        k.shard_key(shard, "log"),
    ]
    before = nan_xor(np.asarray(old, np.float32))
    after = nan_xor(np.asarray(new, np.float32))
    written = 0
    for s in range(0, len(slots), WRITE_BATCH):
        part = slice(s, s + WRITE_BATCH)
        args = [
            first,
            np.asarray(slots[part], "<i4").tobytes(),
            np.asarray(ids[part], "<i8").tobytes(),
            before[part].tobytes(),
            after[part].tobytes(),
            LOG_MAXLEN,
            (stop - first) * 4,  # the chunk's bytes: a missing one is sized first
        ]
        written += int(_SCRIPT(store.r, keys, args))
    return written
