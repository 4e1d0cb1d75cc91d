"""What every page of the inspector reads through: a namespace's store, its query engine
(index synced; least recently used dropped) under its lock, its ``BatchClient``, and the
episode names and decoded strings of index rows, and a step's row as pages show it."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED, UNTRAINABLE
from claw_tasks.store import NamespaceError, Store
from claw_tasks.worker.lru import LRU
from orchestrator.delivery.client import BatchClient
from orchestrator.inspect.query import Query

THUMB_BYTES = 32 << 20
"""PNG thumbnails the inspector keeps (2,048 at most), least recently shown let go."""


def step_row(cols: Mapping[str, np.ndarray], row: int) -> dict[str, Any]:
    """Row ``row`` of metadata columns ``cols`` as every page shows a step: its id,
    step_index, reward, priority and flags."""
    flags = int(cols["flags"][row])
    return {
        "id": int(cols["id"][row]),
        "step_index": int(cols["step_index"][row]),
        "reward": float(cols["reward"][row]),
        "priority": float(cols["priority"][row]),
        "terminated": bool(flags & TERMINATED),
        "truncated": bool(flags & TRUNCATED),
        "trainable": not flags & UNTRAINABLE,
    }


class Access:
    """Per-namespace indexes (least recently used dropped), thumbnails, and the clients
    that change recipes. Thread-safe: one lock per namespace around its index."""

    def __init__(self, redis_url: str, broker_url: str, max_namespaces: int = 8) -> None:
        self.redis_url, self.broker_url = redis_url, broker_url
        self.r = redis_client(redis_url)
        self._queries: LRU[str, Query] = LRU(max_namespaces)
        # Keyed by the namespace a request names: bounded like the indexes. A lock let go
        # while a request holds it only lets a later request of that namespace run beside
        # it on a fresh index (its Query was let go before: the locks outlive them 4:1).
        # A client let go is closed (its connections; a request using it reconnects).
        self._locks: LRU[str, threading.Lock] = LRU(4 * max_namespaces)
        self._clients: LRU[str, BatchClient] = LRU(4 * max_namespaces, on_evict=BatchClient.close)
        self._guard = threading.Lock()
        self.thumbs: LRU[tuple[str, int, str], bytes] = LRU(2048, weigh=len, max_bytes=THUMB_BYTES)

    # ---- plumbing --------------------------------------------------------------------
    def store(self, ns: str) -> Store:
        store = Store(self.redis_url, ns)
        if not store.exists():
            raise NamespaceError(f"namespace {ns!r} does not exist")
        return store

    def lock(self, ns: str) -> threading.Lock:
        with self._guard:
            return self._locks.get(ns, threading.Lock)

    def query(self, ns: str) -> Query:
        """The namespace's query engine, its index synced now (call under ``lock(ns)``)."""
        q = self._queries.get(ns, lambda: Query(self.store(ns)))
        q.index.sync()
        return q

    def client(self, ns: str) -> BatchClient:
        with self._guard:
            return self._clients.get(
                ns, lambda: BatchClient(ns, self.redis_url, broker_url=self.broker_url)
            )

    def close(self) -> None:
        for c in self._clients.pop_where(lambda ns: True):
            c.close()

    def episode_names(self, q: Query, rows: np.ndarray) -> list[str]:
        cols, cap = q.index.columns, q.index.cap
        names = q.store.episode_names(rows // cap, cols["episode"][rows])
        return ["?" if v is None else v for v in names]

    def decode(self, q: Query, column: str, rows: np.ndarray) -> list[Any]:
        return q.store.decode_codes(column, q.index.columns[column][rows].tolist())
