"""The one collector of Claw's statistics: ``claw stats``, the Prometheus exporter (``claw
metrics``), the web inspector's namespaces page and the gateway's admission gauges all read
a namespace's figures from :class:`Statistics`, so no two of them can disagree.

It sits in ``inspect``, the lowest layer that sees everything it reads: the store's info
and columns, the memory of a namespace's keys (:mod:`~orchestrator.inspect.namespaces`),
the protected steps and the last quality pass (``maintenance``), and the recipes
(:func:`~orchestrator.delivery.recipestats.recipe_stats`). :meth:`BatchClient.stats
<orchestrator.delivery.client.BatchClient.stats>` lives below it, in ``delivery``, and
returns that same ``recipe_stats``: the recipe figures are read by one function, whichever
door they leave by. Recipes (with the admission budget, read once for all of them), quality
and protected steps, the costly or rarely shown parts, are read only when asked; every
:meth:`Statistics.collect` reads the rest of a namespace's figures, payload sizes and
cleaning counts among them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from claw_tasks.connection import client as connect
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.keyscan import list_namespaces
from claw_tasks.store.retention import Retention
from orchestrator.delivery import admission
from orchestrator.delivery.quarantine import quarantined
from orchestrator.delivery.recipestats import RecipeStats, recipe_stats
from orchestrator.delivery.registry import Registry
from orchestrator.inspect.namespaces import memory_by_namespace, payload_bytes
from orchestrator.maintenance.eviction_choice import protected_steps
from orchestrator.maintenance.quality import read_quality


class UnreadableNamespace(ValueError):
    """A namespace's keys do not decode (`claw doctor` says why)."""


@dataclass
class NamespaceStats:
    """One namespace's figures; :meth:`to_json` is what ``claw stats --json`` prints."""

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
    # Read only when asked (Statistics.collect's ``recipes`` and ``quality``).
    recipes: dict[str, RecipeStats] = field(default_factory=dict)
    admission: dict[str, Any] | None = None  # the declared budget (admission.state)
    quality: dict[str, Any] | None = None  # the last quality pass (read_quality)

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


@dataclass
class Census:
    """What one :meth:`Statistics.collect` read."""

    nodes: list[tuple[int, int]]  # (used_memory, maxmemory) of each master
    namespaces: list[NamespaceStats]  # the readable ones, in the order asked
    unreadable: dict[str, str]  # namespace -> why

    @property
    def used_memory(self) -> int:
        return sum(used for used, _ in self.nodes)


class Statistics:
    """Reads the figures of the namespaces of one Redis (or Cluster) ``r``."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def collect(
        self,
        names: Sequence[str] | None = None,
        *,
        protected: bool = False,
        recipes: bool = False,
        quality: bool = False,
    ) -> Census:
        """The namespaces ``names`` (default: all), one SCAN for their memory; with
        ``protected`` the steps the retention policy protects (it builds the sampling
        index), with ``recipes`` each recipe's figures and the admission budget, with
        ``quality`` the last quality pass."""
        names = list_namespaces(self.r) if names is None else list(names)
        one = names[0] if len(names) == 1 else None  # a SCAN matching its keys only
        memory = memory_by_namespace(self.r, one, among=set(names)) if names else {}
        found, unreadable = [], {}
        for name in names:
            try:
                st = self.namespace(name, memory.get(name, 0), protected=protected)
            except UnreadableNamespace as e:
                unreadable[name] = str(e)
                continue
            if recipes:
                st.admission = self.admission(name)
                st.recipes = self.recipes(name, budget=st.admission or {})
            if quality:
                st.quality = self.quality(name)
            found.append(st)
        return Census(connect.memory(self.r), found, unreadable)

    def namespace(self, name: str, memory_bytes: int, protected: bool = False) -> NamespaceStats:
        """Counts per task and agent, episodes and reward moments over the live steps, the
        store's info, payload sizes and cleaning counts; :class:`UnreadableNamespace` when
        its keys do not decode."""
        store = Store(self.r, name)
        try:
            return _namespace_stats(store, memory_bytes, protected)
        except (NamespaceError, ValueError, KeyError, TypeError) as e:  # e.g. an unknown format
            raise UnreadableNamespace(
                f"namespace {name!r} cannot be read ({type(e).__name__}: {e}); "
                f"run `claw doctor {name}`"
            ) from e

    def recipes(self, name: str, budget: dict[str, Any] | None = None) -> dict[str, RecipeStats]:
        """Every registered recipe's figures (what ``BatchClient.stats`` returns);
        ``budget``: :meth:`admission`'s, when the caller read it already."""
        store = Store(self.r, name)
        return recipe_stats(store, Registry(store), budget=budget)

    def quality(self, name: str) -> dict[str, Any] | None:
        """The last quality pass's summary (None before the first)."""
        return read_quality(Store(self.r, name))

    def admission(self, name: str) -> dict[str, Any] | None:
        """The declared admission budget and its counters (None: none declared)."""
        return admission.state(Store(self.r, name))


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
