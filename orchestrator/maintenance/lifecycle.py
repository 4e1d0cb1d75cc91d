"""Namespaces as a whole: which exist, the memory they use, dropping one, and the
sampling index the maintenance tasks keep in each namespace's context."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import redis

from claw_tasks.store import Store
from claw_tasks.store.config import DROPPED_TTL, dropped_key
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS
from claw_tasks.worker.context import context_for, forget
from orchestrator.delivery.registry import ACTIVE
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings

SCAN_COUNT = 1000
SAMPLED_ENTRIES = SPARSE_CHUNK_SLOTS
"""Entries of a hash ``MEMORY USAGE`` reads (:func:`key_bytes`): all of a payload hash."""
DROP_BATCH = 500
"""Keys per UNLINK: the values are freed in the background, so each call stays short."""
DROP_SWEEPS = 3
MAINTENANCE_INDEX = "maintenance index"
"""The maintenance tasks' sampling index (and its strings) in a namespace context: their
own, without payload bytes, apart from the sampling session's."""


def list_namespaces(r: redis.Redis) -> list[str]:
    """Every namespace with a config key, sorted."""
    found = set()
    for key in r.scan_iter(match="claw:{*}:config", count=SCAN_COUNT):
        name = key.decode(errors="replace")[len("claw:{") : -len("}:config")]
        if name and not any(c in name for c in "{}:"):
            found.add(name)
    return sorted(found)


def namespace_keys(r: redis.Redis, namespace: str) -> Iterator[bytes]:
    """Every key of ``namespace`` (namespace level and all shards)."""
    prefixes = (f"claw:{{{namespace}}}:".encode(), f"claw:{{{namespace}:".encode())
    pattern = "claw:{" + "".join(f"\\{c}" if c in "*?[]\\" else c for c in namespace) + "*"
    for key in r.scan_iter(match=pattern, count=SCAN_COUNT):
        if key.startswith(prefixes):
            yield key


def key_bytes(r: redis.Redis, keys: Sequence[bytes]) -> list[int]:
    """Bytes Redis allocates for each key (0: gone meanwhile), one pipelined round trip.

    ``MEMORY USAGE key SAMPLES 4096`` (:data:`SAMPLED_ENTRIES`) reads up to 4,096 entries of
    a hash and scales up: exact for every hash of at most that many, which holds every
    payload hash (a frame a step, 4,096 a key). Redis's default samples 5, and a compressed
    field's frames differ 100-fold in size (a ``delta`` key frame every 16 steps), so it
    came out 0.25-3x off. Only the episode hashes (name, newest seq, index: an entry per
    episode of a shard, alike in size) outgrow it: read whole (``SAMPLES 0``), 10,000
    cost Redis 1.8 ms, so a shard of 100k one-step episodes would hold it ~18 ms. What it
    leaves out is Redis's own bookkeeping per key and entry: the total stays within 2% of
    the growth of ``used_memory`` (test_compress_store). Cost: at most ~1.3 ms a call
    (docs/benchmarks.md)."""
    with r.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.memory_usage(k, samples=SAMPLED_ENTRIES)
        return [int(u or 0) for u in pipe.execute()]


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

    A tombstone (``claw:dropped:<ns>``, a day) goes first: workers check it before every
    commit (``Store.revalidate``), so none writes to the namespace again (nor recreates
    it implicitly) and their cached configs are not reused. The config goes next, then
    the rest, swept again until a sweep finds nothing (a commit that passed its check
    just before the tombstone may land during the first sweep)."""
    r.set(dropped_key(namespace), repr(time.time()), ex=DROPPED_TTL)
    r.srem(ACTIVE, namespace)
    deleted = r.unlink(Store(r, namespace).keys.config)
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
    forget(namespace)
    return deleted


def _unlink(r: redis.Redis, batch: list[bytes], progress: Callable[[int], None] | None) -> int:
    n = int(r.unlink(*batch))
    if progress is not None:
        progress(len(batch))
    batch.clear()
    return n
