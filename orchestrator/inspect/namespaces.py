"""Namespaces found in a Redis: discovery, their keys, memory use and summary statistics."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.keyscan import SCAN_COUNT, NamespaceKey, scan_keys
from claw_tasks.store.retention import Retention
from claw_tasks.store.usage import field_sizes, key_bytes
from orchestrator.maintenance.cleaning import quarantined
from orchestrator.maintenance.eviction_choice import protected_steps


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


@dataclass
class NamespaceStats:
    """What `claw stats` and the metrics endpoint report for one namespace."""

    info: dict[str, Any]  # Store.info()
    memory_bytes: int
    episodes: int
    reward_mean: float | None
    reward_std: float | None
    by_task_id: dict[str | None, int]
    by_agent_id: dict[str | None, int]
    evictions: dict[str, int]  # by reason
    retention: Retention | None
    protected: int | None  # live steps the policy protects (None: no protect filters)
    # Per payload field, measured on up to PAYLOAD_SAMPLE live steps: mean bytes a step's
    # value takes in Redis (its frame, for a compressed field) and decoded ("raw").
    payload: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Cleaning: steps brought in from each declared source and quarantined by each rule
    # (``<source>:steps``, ``<source>:<rule>``; orchestrator/maintenance/cleaning.py).
    cleaning: dict[str, int] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return self.info["namespace"]

    @property
    def bytes_per_step(self) -> float | None:
        steps = self.info["steps"]
        return self.memory_bytes / steps if steps else None

    def to_json(self) -> dict[str, Any]:
        def counts(column: str, d: dict[str | None, int]) -> list[dict[str, Any]]:
            return [{column: k, "steps": v} for k, v in d.items()]

        return {
            **self.info,
            "memory_bytes": self.memory_bytes,
            "bytes_per_step": self.bytes_per_step,
            "episodes": self.episodes,
            "reward": {"mean": self.reward_mean, "std": self.reward_std},
            "by_task_id": counts("task_id", self.by_task_id),
            "by_agent_id": counts("agent_id", self.by_agent_id),
            "retention": None if self.retention is None else self.retention.to_dict(),
            "protected": self.protected,
            "payload": self.payload,
            "cleaning": self.cleaning,
        }


class UnreadableNamespace(ValueError):
    """A namespace's keys do not decode (`claw doctor` says why)."""


def namespace_stats(store: Store, memory_bytes: int, protected: bool = False) -> NamespaceStats:
    """Counts per task and agent, episodes and reward moments over the live steps; with
    ``protected``, the steps the retention policy protects (it builds the sampling index)."""
    try:
        return _namespace_stats(store, memory_bytes, protected)
    except (NamespaceError, ValueError, KeyError, TypeError) as e:  # e.g. an unknown format
        raise UnreadableNamespace(
            f"namespace {store.namespace!r} cannot be read ({type(e).__name__}: {e}); "
            f"run `claw doctor {store.namespace}`"
        ) from e


def _namespace_stats(store: Store, memory_bytes: int, protected: bool) -> NamespaceStats:
    info = store.info()
    codes: dict[str, list[np.ndarray]] = {"task_id": [], "agent_id": []}
    rewards, episodes = [], 0
    live = []
    for shard in range(info["n_shards"]):
        cols = store.meta_columns(shard, ["task_id", "agent_id", "reward", "episode"])
        alive = cols["alive"]
        live.append(np.flatnonzero(alive))
        for column, parts in codes.items():
            parts.append(cols[column][alive])
        rewards.append(cols["reward"][alive].astype(np.float64))
        episodes += len(np.unique(cols["episode"][alive]))  # an episode lives on one shard
    reward = np.concatenate(rewards) if rewards else np.zeros(0)
    by: dict[str, dict[str | None, int]] = {}
    for column, parts in codes.items():
        values, counts = np.unique(np.concatenate(parts), return_counts=True)
        names = store.decode_codes(column, values)
        order = np.argsort(-counts, kind="stable")
        by[column] = {names[i]: int(counts[i]) for i in order.tolist()}
    return NamespaceStats(
        info=info,
        memory_bytes=memory_bytes,
        episodes=episodes,
        reward_mean=float(reward.mean()) if len(reward) else None,
        reward_std=float(reward.std()) if len(reward) else None,
        by_task_id=by["task_id"],
        by_agent_id=by["agent_id"],
        evictions=info["evictions"],
        retention=store.config().retention,
        protected=protected_steps(store) if protected else None,
        payload=payload_bytes(store, live),
        cleaning=quarantined(store),
    )


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
