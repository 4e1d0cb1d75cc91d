"""Lua scripts survive a server that forgot them (restart, SCRIPT FLUSH)."""

from __future__ import annotations

import numpy as np

from claw_tasks.store import Store
from orchestrator import Recipe, sample
from tests.support.stepdata import batch, episode


def test_scripts_reload_after_script_flush(redis_url, namespace, r):
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    store.commit(batch(episode(1, 10, "terminated", task_id="a")))
    recipe = Recipe.model_validate(
        {"name": "x", "batch_size": 8, "fields": ["obs", "next_obs"], "sources": [{"name": "a"}]}
    )
    sample(store, recipe, rng=np.random.default_rng(0))
    r.script_flush()
    store.commit(batch(episode(2, 10, "terminated", task_id="b")))  # alloc, dict, commit
    ids = store.episode("ep2", fields=[])["id"]
    assert store.update_priorities(ids, np.ones(len(ids))) == 10
    r.script_flush()
    got = sample(store, recipe, rng=np.random.default_rng(1))  # log_since, fetch
    assert len(got.ids) == 8 and store.count() == 20
