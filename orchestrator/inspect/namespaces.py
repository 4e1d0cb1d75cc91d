"""Namespaces found in a Redis: discovery, their keys, memory use and payload sizes (what
:mod:`orchestrator.inspect.stats` reports of them)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from typing import Any

import numpy as np
import redis

from claw_tasks.store import Store
from claw_tasks.store.keyscan import SCAN_COUNT, NamespaceKey, scan_keys
from claw_tasks.store.usage import field_sizes, key_bytes


def memory_by_namespace(
    r: redis.Redis, namespace: str | None = None, among: Collection[str] | None = None
) -> dict[str, int]:
    """Bytes Redis uses for the keys of each namespace (``key_bytes``); with
    ``among``, of those namespaces only (one SCAN, MEMORY USAGE of their keys)."""
    totals: dict[str, int] = defaultdict(int)
    batch: list[NamespaceKey] = []

    def flush() -> None:
        used = key_bytes(r, [k.key for k in batch])
        for k, n in zip(batch, used, strict=True):
            totals[k.namespace] += n
        batch.clear()

    for k in scan_keys(r, namespace):
        if among is not None and k.namespace not in among:
            continue
        batch.append(k)
        if len(batch) >= SCAN_COUNT:
            flush()
    if batch:
        flush()
    return dict(totals)


PAYLOAD_SAMPLE = 512


def payload_bytes(store: Store, live: list[np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per field: ``codec``, mean ``stored`` and ``raw`` bytes per step and their
    ``ratio``, from up to :data:`PAYLOAD_SAMPLE` live steps (evenly spaced): a fixed
    uncompressed field takes its row size; a compressed one its frames' lengths
    (``HSTRLEN``), decoded sizes from the frames' headers for a ragged one."""
    schema = store.config().schema
    total = sum(len(x) for x in live)
    if schema is None or not total:
        return {}
    pick = np.linspace(0, total - 1, min(total, PAYLOAD_SAMPLE)).astype(np.int64)
    shards = np.concatenate([np.full(len(x), s) for s, x in enumerate(live)])[pick]
    slots = np.concatenate(live)[pick]
    out: dict[str, dict[str, Any]] = {}
    for name, spec in schema.fields.items():
        codec = None if spec.codec is None else str(spec.codec)
        if spec.codec is None and not spec.ragged:
            stored = raw = float(spec.row_bytes)
        else:
            stored, raw = field_sizes(store, name, spec, shards, slots)
        ratio = raw / stored if stored else None
        out[name] = {"codec": codec, "stored": stored, "raw": raw, "ratio": ratio}
    return out
