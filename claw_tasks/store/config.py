"""Namespace admin: the config record in Redis (capacity, shards, schema), and the base
every part of a ``Store`` builds on (client, keys, scripts, the cached config)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import redis

from claw_tasks.codec import packb, unpackb
from claw_tasks.schema import Schema
from claw_tasks.store.layout import Keys
from claw_tasks.store.retention import Retention
from claw_tasks.store.scripts import Scripts

MARKER_TTL = 7 * 86400
LOG_MAXLEN = 100_000
DEFAULT_CAPACITY = 1_000_000


class NamespaceError(LookupError):
    """The namespace does not exist or is configured differently."""


@dataclass(frozen=True)
class NamespaceConfig:
    capacity: int
    n_shards: int
    schema: Schema | None
    created: float
    retention: Retention | None = None

    @property
    def cap(self) -> int:
        """Slots per shard."""
        return math.ceil(self.capacity / self.n_shards)

    def to_bytes(self) -> bytes:
        return packb(
            {
                "capacity": self.capacity,
                "n_shards": self.n_shards,
                "schema": None if self.schema is None else self.schema.to_dict(),
                "created": self.created,
                "retention": None if self.retention is None else self.retention.to_dict(),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> NamespaceConfig:
        d = unpackb(data)
        schema = None if d["schema"] is None else Schema.from_dict(d["schema"])
        retention = Retention.of(d.get("retention"))
        return cls(d["capacity"], d["n_shards"], schema, d["created"], retention)


class NamespaceAdmin:
    """The state a ``Store`` shares (client, keys, scripts, cached config), and the
    namespace's lifecycle: create, config, schema."""

    def __init__(self, client: redis.Redis | str, namespace: str) -> None:
        self.r = redis.Redis.from_url(client) if isinstance(client, str) else client
        self.keys = Keys(namespace)
        self.namespace = namespace
        self.scripts = Scripts(self.r)
        self._config: NamespaceConfig | None = None

    def config(self, refresh: bool = False) -> NamespaceConfig:
        if self._config is None or refresh:
            raw = self.r.get(self.keys.config)
            if raw is None:
                raise NamespaceError(f"namespace {self.namespace!r} does not exist")
            self._config = NamespaceConfig.from_bytes(raw)
        return self._config

    def exists(self) -> bool:
        return bool(self.r.exists(self.keys.config))

    def create(
        self,
        capacity: int = DEFAULT_CAPACITY,
        n_shards: int = 1,
        schema: Schema | None = None,
        retention: Retention | None = None,
    ) -> NamespaceConfig:
        """Create the namespace, or return it when it exists with the same capacity/shards
        (a ``retention`` given then replaces the stored one)."""
        if capacity < 1 or n_shards < 1:
            raise ValueError("capacity and n_shards must be >= 1")
        cfg = NamespaceConfig(capacity, n_shards, schema, time.time(), retention)
        if not self.r.set(self.keys.config, cfg.to_bytes(), nx=True):
            cfg = self.config(refresh=True)
            if (cfg.capacity, cfg.n_shards) != (capacity, n_shards):
                raise NamespaceError(
                    f"namespace {self.namespace!r} exists with capacity {cfg.capacity} and "
                    f"{cfg.n_shards} shard(s), not {capacity} and {n_shards}"
                )
            if schema is not None:
                self.ensure_schema(schema)
            if retention is not None:
                self.set_retention(retention)
            cfg = self.config()
        self._config = cfg
        return self.config()

    def ensure_schema(self, schema: Schema) -> Schema:
        """Set the schema if there is none; otherwise check ``schema`` against it (new tags
        are added). A field mismatch raises SchemaError naming the field."""
        cached = self._config.schema if self._config else None
        if cached is not None and cached.merged(schema).tags == cached.tags:
            return cached
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    raw = pipe.get(self.keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {self.namespace!r} does not exist")
                    cfg = NamespaceConfig.from_bytes(raw)
                    new = schema if cfg.schema is None else cfg.schema.merged(schema)
                    if cfg.schema is None or new.tags != cfg.schema.tags:
                        cfg = replace(cfg, schema=new)
                        pipe.multi()
                        pipe.set(self.keys.config, cfg.to_bytes())
                        pipe.execute()
                    else:
                        pipe.unwatch()
                    self._config = cfg
                    return new
                except redis.WatchError:
                    continue

    def set_retention(self, retention: Retention | None) -> NamespaceConfig:
        """Store the retention policy (None: keep everything the ring keeps)."""
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    raw = pipe.get(self.keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {self.namespace!r} does not exist")
                    cfg = replace(NamespaceConfig.from_bytes(raw), retention=retention)
                    pipe.multi()
                    pipe.set(self.keys.config, cfg.to_bytes())
                    pipe.execute()
                    self._config = cfg
                    return cfg
                except redis.WatchError:
                    continue

    def schema(self) -> Schema | None:
        return self.config(refresh=True).schema
