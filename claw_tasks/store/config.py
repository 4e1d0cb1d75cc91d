"""Namespace admin: the config record in Redis (capacity, shards, schema), and the base
every part of a ``Store`` builds on (client, keys, scripts, the cached config)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import redis

from claw_tasks.connection.client import redis_client
from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.schema import Schema
from claw_tasks.store.layout import Keys
from claw_tasks.store.retention import Retention
from claw_tasks.store.scripts import Scripts

MARKER_TTL = 7 * 86400
LOG_MAXLEN = 100_000
DEFAULT_CAPACITY = 1_000_000


DROPPED_TTL = 86400

FORMAT = 2
"""Version of a namespace's stored layout (this record, its keys and columns). A Claw
reads the formats it knows (:data:`READS`) and refuses any other instead of misreading
it; bump this with any change to the layout an older Claw would misread. 2: compressed
fields (a field with a codec, its frames in ``z:`` hashes). A namespace without one is
still written as 1, so a Claw that reads only 1 reads it."""
READS = (1, 2)


def format_of(schema: Schema | None) -> int:
    """The format a namespace with ``schema`` is written in: the oldest that holds it."""
    return 2 if schema is not None and schema.codecs else 1


class NamespaceError(LookupError):
    """The namespace does not exist or is configured differently."""


class NamespaceDropped(NamespaceError):
    """The namespace was dropped (``claw drop``): nothing is written to it until it is
    created again explicitly (``Store.create``, a new ``Ingestor``)."""


def dropped_key(namespace: str) -> str:
    """The tombstone ``claw drop`` leaves for a day; outside the namespace's keys."""
    return f"claw:dropped:{namespace}"


@dataclass(frozen=True)
class NamespaceConfig:
    capacity: int
    n_shards: int
    schema: Schema | None
    created: float
    retention: Retention | None = None
    priorities: dict[str, Any] | None = None  # recomputation rules (orchestrator.maintenance)
    # Observation and action spaces (Minari's JSON serialization), when a recorder knew them.
    spaces: dict[str, str] | None = None
    # Index each episode's step ids at commit (``Store.trajectory_ids``): the capture
    # gateway turns it on, so a reward post finds its turns without a column scan.
    episode_index: bool = False

    @property
    def format(self) -> int:
        return format_of(self.schema)

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
                "priorities": self.priorities,
                "spaces": self.spaces,
                "format": self.format,
                "episode_index": self.episode_index,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, namespace: str = "") -> NamespaceConfig:
        """Parse a stored config; a format this Claw does not know is a NamespaceError."""
        d = unpackb(data)
        _check_format(d.get("format"), namespace)
        schema = None if d["schema"] is None else Schema.from_dict(d["schema"])
        if schema is not None and format_of(schema) > d["format"]:
            raise NamespaceError(
                f"namespace {namespace!r}: format {d['format']} cannot hold compressed fields "
                f"({', '.join(schema.codecs)}): recreate it (claw drop, then ingest)"
            )
        retention = Retention.of(d.get("retention"))
        priorities = d.get("priorities")
        return cls(
            d["capacity"],
            d["n_shards"],
            schema,
            d["created"],
            retention,
            priorities,
            d.get("spaces"),
            episode_index=bool(d.get("episode_index", False)),
        )


def _check_format(found: Any, namespace: str) -> None:
    if type(found) is int and found in READS:
        return
    ns = f"namespace {namespace!r}" if namespace else "the namespace"
    if isinstance(found, int) and found > FORMAT:
        fix = "it was written by a newer Claw: upgrade Claw (pip install -U claw) to read it"
    else:
        fix = "it was not written by a released Claw: recreate it (claw drop, then ingest)"
    raise NamespaceError(
        f"{ns} has store format {found!r}; this Claw reads format "
        f"{' and '.join(map(str, READS))} only: {fix}"
    )


class NamespaceAdmin:
    """The state a ``Store`` shares (client, keys, scripts, cached config), and the
    namespace's lifecycle: create, config, schema."""

    def __init__(self, client: redis.Redis | str, namespace: str) -> None:
        self.r = redis_client(client) if isinstance(client, str) else client
        self.keys = Keys(namespace)
        self.namespace = namespace
        self.scripts = Scripts(self.r)
        self._config: NamespaceConfig | None = None

    def config(self, refresh: bool = False) -> NamespaceConfig:
        if self._config is None or refresh:
            raw = self.r.get(self.keys.config)
            if raw is None:
                raise NamespaceError(f"namespace {self.namespace!r} does not exist")
            self._config = NamespaceConfig.from_bytes(raw, self.namespace)
        return self._config

    def revalidate(self) -> None:
        """One round trip before writing with a cached config: raise NamespaceDropped if
        the namespace was dropped; re-read the config if it changed (recreated, new tags
        or retention), so a long-lived worker never writes with a stale one."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.exists(dropped_key(self.namespace))
            pipe.get(self.keys.config)
            dropped, raw = pipe.execute()
        if dropped:
            raise NamespaceDropped(
                f"namespace {self.namespace!r} was dropped; create it again (a new Ingestor "
                "or Store.create) to write to it"
            )
        if raw is not None and (self._config is None or raw != self._config.to_bytes()):
            self._config = NamespaceConfig.from_bytes(raw, self.namespace)

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
        self.r.delete(dropped_key(self.namespace))  # created again on purpose
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
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    raw = pipe.get(self.keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {self.namespace!r} does not exist")
                    cfg = NamespaceConfig.from_bytes(raw, self.namespace)
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
        return self._set_config(retention=retention)

    def set_episode_index(self, on: bool = True) -> NamespaceConfig:
        """Index each episode's step ids at commit from now on (``Store.trajectory_ids``).
        Steps committed before (or by a worker whose cached config predates this) are not
        in the index: readers fall back to the episode column (``Store.episode``)."""
        cfg = self.config(refresh=True)
        return cfg if cfg.episode_index == on else self._set_config(episode_index=on)

    def set_priority_rules(self, rules: dict[str, Any] | None) -> NamespaceConfig:
        """Store the priority recomputation rules (checked by the orchestrator's
        ``maintenance.priorities.Rules``; None: no recomputation)."""
        return self._set_config(priorities=rules)

    def set_spaces(self, observation: str, action: str) -> NamespaceConfig:
        """Record the observation and action spaces (serialized): offline formats
        (Minari) need them to export the namespace."""
        return self._set_config(spaces={"observation": observation, "action": action})

    def _set_config(self, **changes: Any) -> NamespaceConfig:
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    raw = pipe.get(self.keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {self.namespace!r} does not exist")
                    cfg = replace(NamespaceConfig.from_bytes(raw, self.namespace), **changes)
                    pipe.multi()
                    pipe.set(self.keys.config, cfg.to_bytes())
                    pipe.execute()
                    self._config = cfg
                    return cfg
                except redis.WatchError:
                    continue

    def schema(self) -> Schema | None:
        return self.config(refresh=True).schema
