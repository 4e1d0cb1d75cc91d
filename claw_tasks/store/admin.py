"""Namespace admin: create a namespace, and change its config record (schema, retention,
episode index, priority rules, spaces), each change one optimistic WATCH transaction."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import redis

from claw_tasks.format.schema import Schema
from claw_tasks.store.config import (
    DEFAULT_CAPACITY,
    NamespaceConfig,
    NamespaceError,
    dropped_key,
)
from claw_tasks.store.core import StoreCore
from claw_tasks.store.retention import Retention


class Admin:
    """A namespace's lifecycle over a :class:`StoreCore`: create, schema, config changes.
    Every record it writes is handed to the core's cache (``core.remember``)."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    def clear_tombstone(self) -> None:
        """Delete the dropped tombstone a drop left (a scratch namespace no writer knows:
        nobody to stop, so nothing to keep for ``DROPPED_TTL``)."""
        self.core.r.delete(dropped_key(self.core.namespace))

    def exists(self) -> bool:
        return bool(self.core.r.exists(self.core.layout_keys.config))

    def create(
        self,
        capacity: int = DEFAULT_CAPACITY,
        n_shards: int = 1,
        schema: Schema | None = None,
        retention: Retention | None = None,
        *,
        new: bool = False,
    ) -> NamespaceConfig:
        """Create the namespace, or return it when it exists with the same capacity/shards
        (a ``retention`` given then replaces the stored one). ``new``: only a namespace
        that does not exist and was not just dropped (NamespaceError otherwise), for a
        namespace its creator alone writes and later drops (``claw replay``'s scratch)."""
        if capacity < 1 or n_shards < 1:
            raise ValueError("capacity and n_shards must be >= 1")
        core = self.core
        cfg = NamespaceConfig(capacity, n_shards, schema, time.time(), retention)
        if new and core.r.exists(dropped_key(core.namespace)):
            raise NamespaceError(f"namespace {core.namespace!r} was just dropped")
        if not new:
            core.r.delete(dropped_key(core.namespace))  # created again on purpose
        if not core.r.set(core.layout_keys.config, cfg.to_bytes(), nx=True):
            if new:
                raise NamespaceError(f"namespace {core.namespace!r} exists")
            cfg = core.config(refresh=True)
            if (cfg.capacity, cfg.n_shards) != (capacity, n_shards):
                raise NamespaceError(
                    f"namespace {core.namespace!r} exists with capacity {cfg.capacity} and "
                    f"{cfg.n_shards} shard(s), not {capacity} and {n_shards}"
                )
            if schema is not None:
                self.ensure_schema(schema)
            if retention is not None:
                self.set_retention(retention)
            cfg = core.config()
        core.remember(cfg)
        return core.config()

    def ensure_schema(self, schema: Schema) -> Schema:
        """Set the schema if there is none; otherwise check ``schema`` against it (new tags
        are added). A field mismatch raises SchemaError naming the field."""
        core = self.core
        cached = core.cached_config.schema if core.cached_config else None
        if cached is not None and cached.merged(schema).tags == cached.tags:
            return cached
        with core.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(core.layout_keys.config)
                    raw = pipe.get(core.layout_keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {core.namespace!r} does not exist")
                    cfg = NamespaceConfig.from_bytes(raw, core.namespace)
                    new = schema if cfg.schema is None else cfg.schema.merged(schema)
                    if cfg.schema is None or new.tags != cfg.schema.tags:
                        cfg = replace(cfg, schema=new)
                        pipe.multi()
                        pipe.set(core.layout_keys.config, cfg.to_bytes())
                        pipe.execute()
                    else:
                        pipe.unwatch()
                    core.remember(cfg)
                    return new
                except redis.WatchError:
                    continue

    def set_retention(self, retention: Retention | None) -> NamespaceConfig:
        """Store the retention policy (None: keep everything the ring keeps)."""
        return self._set_config(retention=retention)

    def set_episode_index(self, on: bool = True) -> NamespaceConfig:
        """Index each episode's step ids at commit from now on (``Store.trajectory_ids``).
        Steps committed before (or by a worker whose cached config predates this) are not
        in the index: readers fall back to the episode column (``Store.episode``)."""
        cfg = self.core.config(refresh=True)
        return cfg if cfg.episode_index == on else self._set_config(episode_index=on)

    def set_priority_rules(self, rules: dict[str, Any] | None) -> NamespaceConfig:
        """Store the priority recomputation rules (checked by the orchestrator's
        ``maintenance.priorities.Rules``; None: no recomputation)."""
        return self._set_config(priorities=rules)

    def set_spaces(self, observation: str, action: str) -> NamespaceConfig:
        """Record the observation and action spaces (serialized): offline formats
        (Minari) need them to export the namespace."""
        return self._set_config(spaces={"observation": observation, "action": action})

    def schema(self) -> Schema | None:
        return self.core.config(refresh=True).schema

    def _set_config(self, **changes: Any) -> NamespaceConfig:
        core = self.core
        with core.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(core.layout_keys.config)
                    raw = pipe.get(core.layout_keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {core.namespace!r} does not exist")
                    cfg = replace(NamespaceConfig.from_bytes(raw, core.namespace), **changes)
                    pipe.multi()
                    pipe.set(core.layout_keys.config, cfg.to_bytes())
                    pipe.execute()
                    core.remember(cfg)
                    return cfg
                except redis.WatchError:
                    continue
