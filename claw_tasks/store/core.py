"""``StoreCore``: what every part of a ``Store`` shares, and the only API the parts use of
each other's state — the client, the namespace's keys and scripts, its string
dictionaries, and the cached config record.

A part (``Admin``, ``Reader``, ``Writer``, ...) is made over a core and keeps no state of
its own; ``Store`` is a core whose methods are its parts' (``claw_tasks.store``). Functions
that read the store directly (``scan``, ``compressed.decode_stored``, ``turns``) take a
core too, so a ``Store`` passes as one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from claw_tasks.connection.client import Client, redis_client
from claw_tasks.store.config import (
    DROPPED_TTL,
    NamespaceConfig,
    NamespaceDropped,
    NamespaceError,
    dropped_key,
)
from claw_tasks.store.dicts import Dictionaries
from claw_tasks.store.layout import Keys, check_owned_name
from claw_tasks.store.scripts import Scripts


def owned_key(namespace: str, name: str) -> str:
    """:meth:`StoreCore.owned_key` of ``namespace``, for code that holds no ``Store``."""
    return Keys(namespace).base + check_owned_name(name)


class StoreCore:
    """A namespace's client, keys, scripts and dictionaries, and its config, cached.

    ``r``: the Redis client (a URL is connected); ``layout_keys``: the namespace's key names;
    ``scripts``: the store's Lua scripts bound to ``r``; ``dicts``: its string
    dictionaries. ``config()`` reads the config record once and then answers from the
    cache; a part that writes the record hands the new one to :meth:`remember`.
    """

    def __init__(self, client: Client | str, namespace: str) -> None:
        self.r = redis_client(client) if isinstance(client, str) else client
        self.layout_keys = Keys(namespace)
        self.namespace = namespace
        self.scripts = Scripts(self.r)
        self.dicts = Dictionaries(self.r, self.layout_keys, self.scripts)
        self._config: NamespaceConfig | None = None
        self._config_raw: bytes | None = None  # the record ``_config`` is, as stored

    def owned_key(self, name: str) -> str:
        """The namespace-scoped key of ``name``, a key the orchestrator owns (queues,
        recipes, admission, lineage, statistics, index definitions): in the namespace's
        hash slot beside its config, never one of the store's step-data keys, so the
        orchestrator names its keys without knowing the store's. ValueError for a name
        of the store's own (``config``, ``dict:...``) or an empty one: a family of keys
        is named by a prefix of ``name`` (``owned_key(f"q:{recipe}")``)."""
        return self.layout_keys.base + check_owned_name(name)

    def queue_config(self, pipe: Any) -> None:
        """Queue a read of the config record on ``pipe``, for a reader's own round trip:
        its reply is the record as stored (``NamespaceConfig.from_bytes`` reads it; None:
        the namespace does not exist)."""
        pipe.get(self.layout_keys.config)

    def mark_dropped(self) -> int:
        """Leave the dropped tombstone (for ``DROPPED_TTL``, read by :meth:`revalidate`)
        and delete the config record, one round trip (1: there was a record): writers
        stop and readers find no namespace from here on; the first step of dropping
        one, before its other keys."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.set(dropped_key(self.namespace), repr(time.time()), ex=DROPPED_TTL)
            pipe.unlink(self.layout_keys.config)
            return int(pipe.execute()[1])

    @property
    def cached_config(self) -> NamespaceConfig | None:
        """The config as last read or written (None: not yet), without a round trip."""
        return self._config

    def remember(self, cfg: NamespaceConfig) -> None:
        """Cache ``cfg``: the config record as just read or written."""
        self._config, self._config_raw = cfg, cfg.to_bytes()

    def config(self, refresh: bool = False, raw: bytes | None = None) -> NamespaceConfig:
        """The namespace's config: cached after the first read (``refresh``: read again;
        ``raw``: the record as stored, read by the caller with its other reads). Raises
        NamespaceError when the namespace does not exist."""
        if raw is not None:
            self._config = NamespaceConfig.from_bytes(raw, self.namespace)
            self._config_raw = raw
        elif self._config is None or refresh:
            raw = self.r.get(self.layout_keys.config)
            if raw is None:
                raise NamespaceError(f"namespace {self.namespace!r} does not exist")
            self._config = NamespaceConfig.from_bytes(raw, self.namespace)
            self._config_raw = raw
        return self._config

    def revalidate(self, also: Sequence[str] = ()) -> list[bytes | None]:
        """One round trip before writing with a cached config: raise NamespaceDropped if
        the namespace was dropped; re-read the config if it changed (recreated, new tags
        or retention), so a long-lived worker never writes with a stale one. ``also``:
        keys the caller reads before its write (GET), in the same round trip; returns
        their values."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.exists(dropped_key(self.namespace))
            pipe.get(self.layout_keys.config)
            for key in also:
                pipe.get(key)
            dropped, raw, *values = pipe.execute()
        if dropped:
            raise NamespaceDropped(
                f"namespace {self.namespace!r} was dropped; create it again (a new Ingestor "
                "or Store.create) to write to it"
            )
        if raw is not None and raw != self._config_raw:  # changed (or not read yet)
            self._config = NamespaceConfig.from_bytes(raw, self.namespace)
            self._config_raw = raw
        return values
