"""``running_normalize`` statistics shared in Redis: real prefetch worker processes, one after
another and side by side, a restarted one among them, normalise one recipe's batches with
one stream of statistics."""

from __future__ import annotations

import re
import time

import numpy as np

from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from tests.support.stepdata import one_episode

DEPTH = 2


def _store(url: str, ns: str, n: int = 400) -> Store:
    store = Store(url, ns)
    store.create(capacity=1000)
    obs = np.random.default_rng(0).normal([5, -2, 0, 100], [3, 1, 0.1, 20], (n, 4))
    store.commit(one_episode(obs.astype(np.float32)))
    return store


def _quiet(client: BatchClient, name: str) -> None:
    """Top the queue up and wait until no fill is on its way (nothing merged unpopped)."""
    reg, deadline = client.registry, time.monotonic() + 60
    while reg.r.llen(reg.queue(name)) < DEPTH or reg.r.exists(reg.refill_lock(name)):
        assert time.monotonic() < deadline, "the queue did not fill"
        client.request_fill(name)  # as the beat would (nothing sent while a fill runs)
        time.sleep(0.05)


def _made_batches(log) -> bool:
    made = r"claw\.prefetch\.fill\[.*succeeded.*'made': [1-9]"
    return re.search(made, log.read_text()) is not None


def test_workers_share_running_normalize_statistics(redis_url, namespace, start_worker):
    store = _store(redis_url, namespace)
    client = BatchClient(namespace, redis_url)
    client.register(
        {
            "name": "norm",
            "batch_size": 16,
            "fields": ["obs"],
            "sources": [{"name": "all"}],
            "augment": {"obs": [{"running_normalize": {}}]},
            "prefetch": {"depth": DEPTH, "low_water": 1},
        }
    )
    popped = []
    first = start_worker("prefetch", 1)
    popped += [client.pop("norm", timeout=60) for _ in range(3)]
    _quiet(client, "norm")
    first.stop()
    second = start_worker("prefetch", 1)  # another process: continues the statistics
    popped += [client.pop("norm", timeout=60) for _ in range(4)]
    _quiet(client, "norm")
    start_worker("prefetch", 1)  # the first one again, beside the second
    popped += [client.pop("norm", timeout=60) for _ in range(6)]
    _quiet(client, "norm")
    popped += [client.pop("norm", timeout=60) for _ in range(DEPTH)]
    client.close()
    assert _made_batches(first.log) and _made_batches(second.log)

    # One fill at a time per recipe: batches were merged in the order they are popped, so
    # batch k is normalised with the statistics of batches 0..k together.
    seen = []
    for k, batch in enumerate(popped):
        raw = store.get(batch.ids)["obs"]
        seen.append(raw.astype(np.float64))
        data = np.concatenate(seen)
        mean, var = data.mean(axis=0), data.var(axis=0)
        expected = (raw - mean.astype(np.float32)) * (1 / np.sqrt(var + 1e-8)).astype(np.float32)
        np.testing.assert_allclose(
            batch["obs"], expected, rtol=1e-4, atol=1e-4, err_msg=f"batch {k}"
        )
