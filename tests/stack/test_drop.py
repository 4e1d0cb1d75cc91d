"""`claw drop` while a worker runs: every key goes, the worker keeps serving the other
namespaces and writes nothing to the dropped one again; creating it again is explicit."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.store import NamespaceDropped, Store
from claw_tasks.store.check import check_namespace
from claw_tasks.store.keyscan import namespace_keys
from tests.support.paths import ROOT


def columns(n: int, episode: str) -> dict:
    return {
        "obs": np.ones((n, 4), np.float32),
        "action": np.zeros(n, np.int64),
        "reward": np.ones(n, np.float32),
        "episode_id": episode,
        "step_index": np.arange(n),
    }


def test_drop_while_a_worker_runs(redis_url, start_worker, r):
    start_worker("ingest", concurrency=1)  # one process: messages are handled in order
    a, b = (f"drop-{x}-{os.getpid()}" for x in "ab")
    ing_a = Ingestor(a, redis_url, flush_interval=None, claim_check_bytes=2048)
    ing_b = Ingestor(b, redis_url, flush_interval=None)
    ing_a.add_batch(columns(200, "ea"))
    ing_b.add_batch(columns(200, "eb"))
    assert ing_a.flush().committed == 200 and ing_b.flush().committed == 200
    assert any(True for _ in namespace_keys(r, a))

    env = {**os.environ, "CLAW_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "drop", a, "--yes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"dropped {a!r}" in out.stdout
    assert not list(namespace_keys(r, a))

    # The old producer goes on: small batches reach the worker, which refuses them;
    # large ones would be written in place by the client, which refuses first.
    ing_a.add_batch(columns(10, "ea2"))
    ing_a.flush(wait=False)
    with pytest.raises(NamespaceDropped, match="was dropped"):
        ing_a.add_batch(columns(200, "ea3"))
        ing_a.flush(wait=False)
    ing_b.add_batch(columns(300, "eb2"))
    assert ing_b.flush().committed == 300  # handled after ing_a's batch (FIFO)
    assert not list(namespace_keys(r, a))
    assert Store(redis_url, b).count() == 500
    assert check_namespace(r, b).ok
    ing_b.close()

    # A new Ingestor creates it again on purpose.
    again = Ingestor(a, redis_url, flush_interval=None)
    again.add_batch(columns(5, "new"))
    assert again.close().committed == 5
    assert Store(redis_url, a).count() == 5


def test_drop_forgets_this_process_caches(redis_url, namespace, r):
    from claw_tasks.worker import context
    from orchestrator import Recipe, sample
    from orchestrator.maintenance.lifecycle import drop_namespace
    from tests.support.stepdata import batch, episode

    st = Store(redis_url, namespace)
    st.create(capacity=100)
    st.commit(batch(episode(1, 10)))
    recipe = Recipe.model_validate(
        {"name": "r", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    )
    sample(namespace, recipe, redis_url=redis_url)
    assert any(key[-2] == namespace for key in context.contexts)
    assert drop_namespace(r, namespace) > 0
    assert not any(key[-2] == namespace for key in context.contexts)
    assert not list(namespace_keys(r, namespace))
    with pytest.raises(NamespaceDropped):
        st.commit(batch(episode(2, 5)))  # the old Store's cached config is not reused
    assert not list(namespace_keys(r, namespace))
