"""A full ring through the real ingest path: old steps go, new ones are whole, and every
reader (get, episode, sample, priorities, doctor) agrees."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from claw_tasks.store.check import check_namespace
from orchestrator import Recipe, sample


def test_ring_overwrite_through_ingest(redis_url, namespace, ingest_worker, r):
    cap = 1000
    # Payloads over 1 KiB per batch are written in place by the client.
    ing = Ingestor(
        namespace,
        redis_url,
        capacity=cap,
        flush_steps=300,
        flush_interval=None,
        claim_check_bytes=1024,
    )
    n = 2600
    obs = np.arange(n, dtype=np.float32)[:, None].repeat(16, 1)
    ing.add_batch(
        {
            "obs": obs,
            "action": np.arange(n),
            "reward": np.ones(n, np.float32),
            "episode_id": np.repeat(np.arange(n // 100).astype(str), 100),
            "step_index": np.tile(np.arange(100), n // 100),
            "terminated": np.tile(np.arange(100) == 99, n // 100),
        }
    )
    res = ing.close()
    # Steps whose slots newer steps took before their commit landed are "expired" (past
    # capacity already); how many depends on how far the client ran ahead of the worker.
    assert res.committed + res.expired == n and res.committed >= cap
    store = Store(redis_url, namespace)
    assert store.count() == cap
    assert store.info()["committed_total"] == n

    with pytest.raises(KeyError, match="evicted or never written"):
        store.get([1])  # the first step is long gone
    assert store.update_priorities([1, 2, 3], [1.0, 1.0, 1.0]) == 0
    newest = store.episode(str(n // 100 - 1))
    np.testing.assert_array_equal(newest["obs"][:, 0], np.arange(n - 100, n))
    np.testing.assert_array_equal(newest["next_obs"][:-1, 0], np.arange(n - 99, n))

    recipe = Recipe.model_validate(
        {
            "name": "ring",
            "batch_size": 200,
            "fields": ["obs", "action", "next_obs"],
            "sources": [{"name": "all"}],
        }
    )
    batch = sample(store, recipe, rng=np.random.default_rng(0))
    assert batch["obs"][:, 0].min() >= n - cap  # only live steps
    np.testing.assert_array_equal(batch["obs"][:, 0], batch["action"])
    live = batch["action"] % 100 != 99  # next_obs is the next step's obs within episodes
    np.testing.assert_array_equal(batch["next_obs"][live, 0], batch["obs"][live, 0] + 1)

    report = check_namespace(r, namespace)
    assert report.ok, report.problems


def test_late_commit_across_a_chunk_keeps_its_rows_in_the_ring(redis_url, namespace):
    """A commit that lands after newer allocations took its first slots writes only its
    rows still in the ring, whole, where those rows cross a metadata chunk's end (the
    script writes a column's chunk runs as sent, cutting only a run that starts among
    skipped rows) and the payload written in the commit too."""
    cap, n = 40_000, 20_000  # rows 0..19,999 straddle the first 16,376-slot chunk's end
    store = Store(redis_url, namespace)
    store.create(capacity=cap, n_shards=1)
    rows = np.arange(n)
    late = StepBatch(
        episode=StrColumn(["late"], np.zeros(n, np.int32)),
        step_index=rows,
        reward=rows.astype(np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": rows[:, None].astype(np.float32), "action": rows},
        batch_id="late",
    )
    store.allocate(0, "late", n)  # seqs 1..20,000
    store.allocate(0, "newer", 30_000)  # seqs 20,001..50,000: they retake slots 0..9,999
    res = store.commit(late)
    assert (res.committed, res.expired) == (n - 10_000, 10_000)
    kept = res.ids[res.ids >= 0]
    np.testing.assert_array_equal(kept, np.arange(10_001, n + 1))
    got = store.get(kept)
    np.testing.assert_array_equal(got["reward"], np.arange(10_000, n, dtype=np.float32))
    np.testing.assert_array_equal(got["step_index"], np.arange(10_000, n))
    np.testing.assert_array_equal(got["obs"][:, 0], np.arange(10_000, n, dtype=np.float32))
