"""A full ring through the real ingest path: old steps go, new ones are whole, and every
reader (get, episode, sample, priorities, doctor) agrees."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.store import Store
from orchestrator import Recipe, sample
from orchestrator.cli.doctor import check_namespace


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
