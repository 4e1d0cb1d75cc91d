"""Namespaces found in a Redis: discovery, their keys, memory use and payload sizes (what
:mod:`orchestrator.inspect.stats` reports of them)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from claw_tasks.codecs import engine_for
from claw_tasks.codecs.delta import key_body
from claw_tasks.store import Store
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS
from orchestrator.maintenance.lifecycle import key_bytes

# claw:{<ns>}:<rest> (namespace level) or claw:{<ns>:<shard>}:<rest> (shard level)
_KEY = re.compile(rb"^claw:\{([^{}:]+)(?::(\d+))?\}:(.*)$", re.S)
_SCAN_COUNT = 1000


@dataclass(frozen=True)
class NamespaceKey:
    namespace: str
    shard: int | None  # None: a namespace-level key
    name: str  # the part after the hash tag, e.g. "m:id:0" or "config"
    key: bytes


def parse_key(key: bytes) -> NamespaceKey | None:
    """The namespace, shard and name of a Claw key; None for other keys."""
    m = _KEY.match(key)
    if m is None:
        return None
    shard = None if m.group(2) is None else int(m.group(2))
    return NamespaceKey(m.group(1).decode(), shard, m.group(3).decode(errors="replace"), key)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def scan_keys(r: redis.Redis, namespace: str | None = None) -> Iterator[NamespaceKey]:
    """Keys of `namespace` (all shards), or of every namespace when it is None."""
    match = "claw:{*" if namespace is None else f"claw:{{{_glob_escape(namespace)}*"
    for key in r.scan_iter(match=match, count=_SCAN_COUNT):
        parsed = parse_key(key)
        if parsed and (namespace is None or parsed.namespace == namespace):
            yield parsed


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
        if len(batch) >= _SCAN_COUNT:
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
            stored, raw = _sparse_sizes(store, name, spec, shards, slots)
        ratio = raw / stored if stored else None
        out[name] = {"codec": codec, "stored": stored, "raw": raw, "ratio": ratio}
    return out


def _sparse_sizes(
    store: Store, name: str, spec: Any, shards: np.ndarray, slots: np.ndarray
) -> tuple[float, float]:
    """Mean stored and decoded bytes of a hash-stored field at (shard, slot) pairs."""
    keys = store.keys
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
