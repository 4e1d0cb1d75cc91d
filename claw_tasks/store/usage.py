"""What a namespace's keys cost in Redis memory, and what a hash-stored field's steps
take stored against decoded: figures for ``claw stats``, the eviction pass's
``max_bytes`` and the web page, read without the reader knowing the keys."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import redis

from claw_tasks.codecs import engine_for
from claw_tasks.codecs.delta import key_body
from claw_tasks.format.schema import FieldSpec
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS

SAMPLED_ENTRIES = SPARSE_CHUNK_SLOTS
"""Entries of a hash ``MEMORY USAGE`` reads (:func:`key_bytes`): all of a payload hash."""


def key_bytes(r: redis.Redis, keys: Sequence[bytes]) -> list[int]:
    """Bytes Redis allocates for each key (0: gone meanwhile), one pipelined round trip.

    ``MEMORY USAGE key SAMPLES 4096`` (:data:`SAMPLED_ENTRIES`) reads up to 4,096 entries of
    a hash and scales up: exact for every hash of at most that many, which holds every
    payload hash (a frame a step, 4,096 a key). Redis's default samples 5, and a compressed
    field's frames differ 100-fold in size (a ``delta`` key frame every 16 steps), so it
    came out 0.25-3x off. Only the episode hashes (name, newest seq, index: an entry per
    episode of a shard, alike in size) outgrow it: read whole (``SAMPLES 0``), 10,000
    cost Redis 1.8 ms, so a shard of 100k one-step episodes would hold it ~18 ms. What it
    leaves out is Redis's own bookkeeping per key and entry: the total stays within 2% of
    the growth of ``used_memory`` (test_compress_store). Cost: at most ~1.3 ms a call
    (docs/benchmarks.md)."""
    with r.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.memory_usage(k, samples=SAMPLED_ENTRIES)
        return [int(u or 0) for u in pipe.execute()]


def field_sizes(
    store: StoreCore, name: str, spec: FieldSpec, shards: np.ndarray, slots: np.ndarray
) -> tuple[float, float]:
    """Mean stored and decoded bytes of hash-stored (ragged or compressed) field ``name``
    at (shard, slot) pairs, one round trip."""
    keys = store.layout_keys
    base = keys.compressed if spec.codec is not None else keys.ragged
    with store.r.pipeline(transaction=False) as pipe:
        for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
            key = base(sh, name, sl // SPARSE_CHUNK_SLOTS)
            if spec.codec is not None and spec.ragged:
                pipe.hget(key, sl)
            else:
                pipe.hstrlen(key, sl)
        replies = pipe.execute()
    if spec.codec is None:  # ragged, raw
        return float(np.mean(replies)), float(np.mean(replies))
    if not spec.ragged:
        return float(np.mean(replies)), float(spec.row_bytes)
    eng = engine_for(spec.codec)
    frames = [f or b"" for f in replies]
    raw = [
        eng.declared(key_body(f) if spec.codec.name == "delta" else f) if f else 0 for f in frames
    ]
    return float(np.mean([len(f) for f in frames])), float(np.mean(raw))
