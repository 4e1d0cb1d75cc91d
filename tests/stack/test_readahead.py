"""ReadAhead: decoded batches held in the trainer's process, bounded by count and bytes,
over a real Redis and prefetch worker."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.readahead import ReadAhead, batch_bytes
from tests.support.readahead import ingest_ramp, wait_until


@pytest.fixture
def client(redis_url, namespace, workers):
    ingest_ramp(namespace, redis_url)
    c = BatchClient(namespace, redis_url)
    c.register(
        {
            "name": "ra",
            "batch_size": 16,
            "fields": ["obs", "reward"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 8},
        }
    )
    yield c
    c.close()


def test_readahead_holds_count_batches_and_pops_locally(client, workers):
    ra = ReadAhead(client, "ra", count=3)
    wait_until(lambda: len(ra) == 3, "three batches read ahead")
    queue = client.registry.queue("ra")
    wait_until(lambda: client.store.r.llen(queue) > 0, "the worker refilled the Redis queue")
    assert len(ra) == 3  # full: it stopped taking from Redis
    for _ in range(5):  # more than it holds: the thread keeps up
        batch = ra.pop(timeout=60)
        assert batch["obs"].shape == (16, 8) and batch["obs"].dtype == np.float32
        np.testing.assert_array_equal(batch["obs"][:, 0], batch["reward"])
    ra.close()


def test_readahead_byte_budget_holds_one_batch(client, workers):
    ra = ReadAhead(client, "ra", count=8, max_bytes=1)
    wait_until(lambda: len(ra) == 1, "one batch read ahead")
    wait_until(lambda: client.store.r.llen(client.registry.queue("ra")) > 0, "a refilled queue")
    assert len(ra) == 1  # over budget after one batch: never a second
    assert batch_bytes(ra.pop(timeout=60)) >= 16 * 8 * 4
    ra.close()


def test_readahead_raises_what_its_thread_met(client, workers):
    client.unregister("ra")
    ra = ReadAhead(client, "ra", count=2, poll=0.2)
    with pytest.raises(KeyError, match="not registered"):
        ra.pop(timeout=60)
    ra.close()


def test_a_client_with_readahead_pops_locally_and_drops_what_a_new_version_makes_stale(
    client, redis_url, namespace, workers
):
    """BatchClient(readahead=3): pops come from a thread's local queue; the policy a
    batch trains reaches the lineage log without a pop of its own going out; after
    set_params no batch of the old version is returned."""
    ahead = BatchClient(namespace, redis_url, readahead=3)
    try:
        first = ahead.pop("ra", timeout=60, policy_version="p1")
        assert first["obs"].shape == (16, 8)
        wait_until(lambda: ahead.held("ra") == 3, "three batches read ahead")
        for _ in range(4):
            b = ahead.pop("ra", timeout=60, policy_version="p1")
            np.testing.assert_array_equal(b["obs"][:, 0], b["reward"])
        wait_until(lambda: len(ahead.lineage.trained("p1")) == 5, "five lineage entries sent")
        assert [e.rows for e in ahead.lineage.trained("p1")] == [16] * 5
        v = ahead.set_params("ra", unused=1).version
        assert all(ahead.pop("ra", timeout=60).recipe_version == v for _ in range(4))
    finally:
        ahead.close()
