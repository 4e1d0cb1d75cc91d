"""Celery tasks of claw_tasks: ``claw_tasks.ingest``."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import redis

from claw_tasks.app import app, settings
from claw_tasks.ingest import process
from claw_tasks.lru import LRU
from claw_tasks.store import NamespaceDropped, Store


@cache
def redis_client() -> redis.Redis:
    """This worker process's client of the data store (made lazily, so each prefork child
    gets its own connection pool)."""
    return redis.Redis.from_url(settings.redis_url)


log = logging.getLogger(__name__)
stores: LRU[str, Store] = LRU(settings.namespace_cache_size)


def store_for(namespace: str) -> Store:
    """This process's ``Store`` of ``namespace`` (kept for the most recently used
    ``namespace_cache_size`` namespaces)."""
    return stores.get(namespace, lambda: Store(redis_client(), namespace))


def forget_namespace(namespace: str) -> None:
    """Drop this process's cached ``Store`` of ``namespace`` (call when it is deleted)."""
    stores.drop(lambda ns: ns == namespace)


@app.task(
    name="claw_tasks.ingest",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError),
    retry_backoff=True,
    retry_backoff_max=30,
    max_retries=None,
)
def ingest(
    namespace: str, batch_id: str, payload: bytes | None = None, stage_key: str | None = None
) -> dict[str, Any]:
    """Commit one batch of steps (inline ``payload`` or a claim-check ``stage_key``); a batch
    for a dropped namespace is discarded (nothing written) and the cached Store forgotten."""
    try:
        outcome = process(store_for(namespace), batch_id, payload, stage_key)
    except NamespaceDropped:
        forget_namespace(namespace)
        log.warning("batch %s: namespace %r was dropped; discarded", batch_id, namespace)
        return {"committed": 0, "rejected": 0, "dropped": True}
    return {"committed": outcome.committed, "rejected": outcome.rejected}
