"""Namespaces as a whole: the memory they use, dropping one, and the sampling index the
maintenance tasks keep in each namespace's context (which namespaces exist, and their keys,
the store lists: ``claw_tasks.store.keyscan``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from claw_tasks.store import Store
from claw_tasks.store.keyscan import SCAN_COUNT, namespace_keys
from claw_tasks.store.usage import key_bytes
from claw_tasks.worker.context import context_for, forget
from orchestrator.delivery.registry import ACTIVE
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings

DROP_BATCH = 500
"""Keys per UNLINK: the values are freed in the background, so each call stays short."""
DROP_SWEEPS = 3
MAINTENANCE_INDEX = "maintenance index"
"""The maintenance tasks' sampling index (and its strings) in a namespace context: their
own, without payload bytes, apart from the sampling session's."""


def namespace_bytes(r: redis.Redis, namespace: str) -> int:
    """Redis memory of a namespace's keys (:func:`key_bytes`)."""
    total, batch = 0, []
    for key in namespace_keys(r, namespace):
        batch.append(key)
        if len(batch) >= SCAN_COUNT:
            total += sum(key_bytes(r, batch))
            batch.clear()
    return total + sum(key_bytes(r, batch))


def synced_index(store: Store) -> tuple[SamplingIndex, Strings]:
    """This process's maintenance index of the namespace, synced; rebuilt (with every part
    of the namespace's context) if the namespace was made again since it was built."""
    created = store.config(refresh=True).created
    while not (ctx := context_for(store)).check_created(created):
        pass  # made again since: the old context is forgotten, the next one starts cold

    def make() -> tuple[SamplingIndex, Strings]:
        index = SamplingIndex(ctx.store, payload_bytes=0)
        strings = Strings(ctx.store, index)
        index.subscribe(strings.observe)
        return index, strings

    index, strings = ctx.part(MAINTENANCE_INDEX, make)
    index.sync()
    return index, strings


def drop_namespace(
    r: redis.Redis, namespace: str, progress: Callable[[int], None] | None = None
) -> int:
    """Delete every key of ``namespace`` in bounded UNLINK batches; returns how many.

    The tombstone and the config go first, together (``Store.mark_dropped``): workers
    check the tombstone before every commit (``Store.revalidate``), so none writes to the
    namespace again (nor recreates it implicitly) and their cached configs are not
    reused. Then the rest, swept again until a sweep finds nothing (a commit that passed its check
    just before the tombstone may land during the first sweep)."""
    deleted = Store(r, namespace).mark_dropped()
    r.srem(ACTIVE, namespace)
    for sweep in range(DROP_SWEEPS):
        found = 0
        batch: list[bytes] = []
        for key in namespace_keys(r, namespace):
            batch.append(key)
            if len(batch) >= DROP_BATCH:
                found += _unlink(r, batch, progress)
        found += _unlink(r, batch, progress) if batch else 0
        deleted += found
        if not found and sweep:
            break
        time.sleep(0.2 * (sweep + 1))
    forget(namespace, dropped=True)
    return deleted


def _unlink(r: redis.Redis, batch: list[bytes], progress: Callable[[int], None] | None) -> int:
    n = int(r.unlink(*batch))
    if progress is not None:
        progress(len(batch))
    batch.clear()
    return n
