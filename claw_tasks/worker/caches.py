"""A worker process's long-lived clients: its data store connection and its ``Store`` per
namespace (an LRU bounded by ``namespace_cache_size``), shared by the ingest task and the
orchestrator's tasks that run in the same process."""

from __future__ import annotations

from functools import cache

from claw_tasks.connection import client as connect
from claw_tasks.connection.client import Client
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.worker.lru import LRU


@cache
def redis_client() -> Client:
    """This worker process's client of the data store (made lazily, so each prefork child
    gets its own connection pool)."""
    return connect.redis_client(get_settings().redis_url)


stores: LRU[str, Store] = LRU(get_settings().namespace_cache_size)


def store_for(namespace: str) -> Store:
    """This process's ``Store`` of ``namespace`` (kept for the most recently used
    ``namespace_cache_size`` namespaces)."""
    return stores.get(namespace, lambda: Store(redis_client(), namespace))


def forget_namespace(namespace: str) -> None:
    """Drop this process's cached ``Store`` of ``namespace`` (call when it is deleted)."""
    stores.drop(lambda ns: ns == namespace)
