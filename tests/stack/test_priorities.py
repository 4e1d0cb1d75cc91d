"""Priority recomputation: built-in rules exactly, a trainer's writes win over a pass, and
a custom scorer run by a real worker changes the sampling distribution as predicted."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis

from claw_tasks.store import Store
from claw_tasks.store.check import check_namespace
from orchestrator import Recipe, sample
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.priorities import PriorityWriteError
from orchestrator.maintenance.priorities import Recompute, Rules, RulesError
from tests.support.paths import ROOT
from tests.support.producer import sender
from tests.support.stepdata import batch, episode, interleave

T0 = 1_000_000.0


pytestmark = pytest.mark.store(capacity=40_000)  # two metadata chunks per shard


def prio(store: Store, ids: np.ndarray) -> np.ndarray:
    return store.get(ids, fields=[])["priority"]


@pytest.mark.both_stores
def test_builtin_rules(store):
    store.commit(batch(episode(1, 10)), now=T0)
    store.commit(batch(episode(2, 10)), now=T0 + 3600)
    a = store.episode("ep1", fields=[])["id"]
    b = store.episode("ep2", fields=[])["id"]
    store.update_priorities(a, np.full(10, 8.0))  # ep2 stays unset (never sampled)
    rules = Rules.of({"half_life": "1h", "unsampled_boost": 2.0, "clamp": [0.5, 3.0]})
    assert Recompute(store, rules).run(now=T0 + 7200)["finished"]
    np.testing.assert_allclose(prio(store, a), 2.0)  # 8 decayed over two half-lives
    np.testing.assert_allclose(prio(store, b), 3.0)  # 2 * 8 boosted, then clamped
    # The next pass decays from the previous one only (no compounding): one half-life.
    Recompute(store, rules).run(now=T0 + 7200 + 3600)
    np.testing.assert_allclose(prio(store, a), 1.0)
    np.testing.assert_allclose(prio(store, b), 1.5)
    Recompute(store, Rules.of({"normalize": True})).run(now=T0 + 10_800)
    np.testing.assert_allclose(prio(store, np.concatenate([a, b])).mean(), 1.0, rtol=1e-6)
    assert check_namespace(store.r, store.namespace).ok
    with pytest.raises(RulesError, match="not allowed on this worker"):
        Recompute(store, Rules.of({"scorer": "os:system"}), allowed=())


def test_a_trainer_write_after_the_pass_started_wins(store):
    steps = interleave(*(episode(e, 30) for e in range(8)))
    store.commit(batch(steps), now=T0)
    ids = np.concatenate([store.episode(f"ep{e}", fields=[])["id"] for e in range(8)])
    store.update_priorities(ids, np.full(len(ids), 4.0))
    rules = Rules.of({"half_life": 10.0})
    job = Recompute(store, rules)
    assert not job.run(max_chunks=1, now=T0 + 10)["finished"]  # shard 0, chunk 0 only
    shard1 = ids[ids % 2 == 1]
    trainer = shard1[: len(shard1) // 2]
    store.update_priorities(trainer, np.full(len(trainer), 7.0))
    assert Recompute(store, rules).run(now=T0 + 10)["finished"]  # resumed from the cursor
    np.testing.assert_allclose(prio(store, trainer), 7.0)
    others = np.setdiff1d(ids, trainer)
    np.testing.assert_allclose(prio(store, others), 2.0)
    assert check_namespace(store.r, store.namespace).ok  # snapshots gone


def test_a_custom_scorer_changes_the_sampling_distribution(store, start_worker, redis_url):
    n_eps = 40
    store.commit(batch(interleave(*(episode(e, 25) for e in range(n_eps)))))
    store.set_priority_rules(
        {"scorer": "tests.support.scorers:by_obs", "fields": ["obs"], "params": {"high": 9.0}}
    )
    start_worker("maintenance", CLAW_SCORERS="tests.support.scorers:by_obs", PYTHONPATH=str(ROOT))
    sender(redis_url).send_task("claw.maintenance.priorities", queue="maintenance")
    deadline = time.monotonic() + 60
    while not store.r.hexists(store.owned_key("prio"), "last"):
        assert time.monotonic() < deadline, "the pass did not finish"
        time.sleep(0.1)
    recipe = Recipe.model_validate(
        {
            "name": "p",
            "batch_size": 500,
            "fields": ["obs"],
            "sources": [{"name": "all", "sampler": {"kind": "priority", "alpha": 1.0}}],
        }
    )
    rng = np.random.default_rng(7)
    odd = draws = 0
    for _ in range(20):
        obs = sample(store, recipe, rng=rng)["obs"]
        odd += int((obs[:, 0] % 2 == 1).sum())
        draws += len(obs)
    p = 9.0 / (9.0 + 1.0)  # half the steps score 9, half 1; alpha 1: proportional
    sd = np.sqrt(p * (1 - p) / draws)
    assert abs(odd / draws - p) < 5 * sd  # uniform would give 0.5


def test_priorities_written_behind_in_order_later_ones_winning(store, redis_url, namespace):
    """``update_priorities`` returns before the store has them (None); after
    ``flush_priorities`` each id holds its last submitted priority (over two shards, ids
    repeated across and within calls), evicted ids are skipped, and bad input is refused
    at the call. ``wait=True`` writes the earlier ones, then its own, and counts its own; a
    new recipe version is made after every update submitted before it."""
    store.commit(batch(episode(1, 30)), now=T0)
    store.commit(batch(episode(2, 30)), now=T0)
    ids = np.concatenate([store.episode(f"ep{e}", fields=[])["id"] for e in (1, 2)])
    rng = np.random.default_rng(0)
    want = dict.fromkeys(ids.tolist(), None)
    client = BatchClient(namespace, redis_url)
    for _ in range(40):
        some = rng.choice(ids, 25)  # repeats within a call: its last one wins
        pr = rng.uniform(0, 10, 25).astype(np.float32)
        assert client.update_priorities(some, pr) is None
        want.update(zip(some.tolist(), pr.tolist(), strict=True))
    with pytest.raises(ValueError, match="finite"):
        client.update_priorities(ids[:2], [1.0, np.nan])
    with pytest.raises(ValueError, match="ids but"):
        client.update_priorities(ids[:2], [1.0])
    gone = int(ids.max()) + 1000 * 2  # never stored: skipped, not an error
    client.update_priorities([gone], [5.0])
    assert client.flush_priorities() > 0
    set_ids = np.array([i for i, p in want.items() if p is not None])
    np.testing.assert_allclose(prio(store, set_ids), [want[i] for i in set_ids.tolist()])
    client.update_priorities(ids[:4], np.full(4, 0.5))  # behind ...
    assert client.update_priorities(ids[2:4], [7.0, 8.0], wait=True) == 2  # ... then this
    np.testing.assert_allclose(prio(store, ids[:4]), [0.5, 0.5, 7.0, 8.0])
    assert client.priority_errors == 0
    client.register({"name": "p", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "a"}]})
    client.update_priorities(ids, np.full(len(ids), 9.0))
    client.set_params("p", cutoff=1)  # a new version's batches are drawn after them
    np.testing.assert_allclose(prio(store, ids), 9.0)
    client.close()


def test_priorities_submitted_before_close_are_all_written(store, redis_url, namespace):
    """``close()`` writes every update submitted before it: nothing flushed by hand, the
    store read by a fresh connection afterwards."""
    store.commit(batch(interleave(*(episode(e, 50) for e in range(8)))), now=T0)
    ids = np.concatenate([store.episode(f"ep{e}", fields=[])["id"] for e in range(8)])
    rng = np.random.default_rng(1)
    want: dict[int, float] = {}
    client = BatchClient(namespace, redis_url)
    for _ in range(300):
        some = rng.choice(ids, 32, replace=False)
        pr = rng.uniform(0, 10, 32).astype(np.float32)
        client.update_priorities(some, pr)
        want.update(zip(some.tolist(), pr.tolist(), strict=True))
    client.close()
    fresh = Store(redis_url, namespace)
    keys = np.array(sorted(want))
    np.testing.assert_allclose(prio(fresh, keys), [want[i] for i in keys.tolist()])
    fresh.r.close()


def test_a_failed_priority_write_surfaces_and_is_counted(store, r, redis_url, namespace):
    """A write behind the call that fails (the writer's Redis user loses the right to run
    scripts meanwhile) is counted and raised by the next call, then by
    ``flush_priorities`` and by ``close()``, each failure once; writes after it go on. A
    recipe change waits for the writes but leaves their error to the priority calls."""
    store.commit(batch(episode(1, 20)), now=T0)
    ids = store.episode("ep1", fields=[])["id"]
    user = f"prio-{namespace}"
    r.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all")
    url = urlsplit(redis_url)
    client = BatchClient(namespace, url._replace(netloc=f"{user}:pw@{url.netloc}").geturl())
    try:
        client.register(
            {"name": "p", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "a"}]}
        )
        client.update_priorities(ids, np.ones(len(ids)))
        assert client.flush_priorities() == len(ids)
        r.execute_command("ACL", "SETUSER", user, "-@scripting")
        client.update_priorities(ids[:3], [1.0, 2.0, 3.0])
        writer = client._priorities
        assert writer is not None
        with writer._cond:  # the failed write is in
            assert writer._cond.wait_for(lambda: writer.errors == 1, 30)
        assert client.set_params("p", cutoff=1).version == 2  # not raised here ...
        with pytest.raises(PriorityWriteError, match=r"1 priority write.*3 id update") as e:
            client.update_priorities(ids[:1], [4.0])  # ... but by the next call (not queued)
        assert isinstance(e.value.__cause__, redis.exceptions.NoPermissionError)
        assert client.priority_errors == 1
        client.update_priorities(ids[:1], [4.0])
        with pytest.raises(PriorityWriteError):
            client.flush_priorities()
        assert client.priority_errors == 2
        assert client.flush_priorities() == 0  # raised once: nothing new
        client.update_priorities(ids[:1], [5.0])
        with pytest.raises(PriorityWriteError):
            client.close()
        assert client.priority_errors == 3
        np.testing.assert_allclose(prio(store, ids[:3]), 1.0)  # none of them written
    finally:
        r.execute_command("ACL", "DELUSER", user)
