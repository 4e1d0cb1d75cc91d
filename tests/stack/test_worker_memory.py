"""A prefetch worker's memory is bounded by ``CLAW_WORKER_CACHE_BYTES``, not by the number
of namespaces it serves: each namespace context of capacity 1M holds ~93 MiB of index
columns, and a worker that fills batches for 20 of them keeps only as many as fit the
budget (least recently used let go) plus the one in use."""

from __future__ import annotations

from pathlib import Path

from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from orchestrator.maintenance.lifecycle import drop_namespace
from tests.support.stepdata import batch, episode

MIB = 1 << 20
BUDGET = 256 * MIB
NAMESPACES = 20
CAPACITY = 1_000_000


def rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (VmRSS: anonymous, file and shared pages touched,
    the host's shared index in /dev/shm included)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def pool_child(pid: int) -> int:
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


def test_a_worker_serving_20_namespaces_of_1m_steps_stays_in_its_byte_budget(
    redis_url, namespace, start_worker
):
    worker = start_worker("prefetch", 1, CLAW_WORKER_CACHE_BYTES=str(BUDGET))
    child = pool_child(worker.proc.pid)
    recipe = {"name": "u", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    seen = []
    for i in range(NAMESPACES):
        ns = f"{namespace}-{i}"
        store = Store(redis_url, ns)
        store.create(capacity=CAPACITY)
        store.commit(batch(episode(0, 10, "terminated")))
        client = BatchClient(ns, redis_url)
        try:
            client.register(recipe)
            client.pop("u", timeout=120)  # the worker built this namespace's context
        finally:
            client.close()
        seen.append(rss(child))
    for i in range(NAMESPACES):
        drop_namespace(store.r, f"{namespace}-{i}")
    print("worker RSS MiB per namespace touched:", [s // MIB for s in seen])
    one = seen[0]  # the worker with one namespace's context: its base and what it holds
    # Unbounded, 20 contexts of ~100 MiB each: ~2 GiB more than one. Bounded: the budget
    # (weighed ~10% under RSS: allocator overheads) beyond the one in use.
    assert max(seen) < one + int(BUDGET * 1.2), [s // MIB for s in seen]
    assert seen[-1] - one < NAMESPACES * 90 * MIB / 4  # far below what 20 contexts hold
