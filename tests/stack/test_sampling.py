"""sample() and update_priorities() against a real Redis: distributions, curation, n-step
returns and sequence windows on hand-built episodes, cold workers, real ingest."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from claw_tasks.client import Ingestor
from claw_tasks.connection.client import is_cluster
from claw_tasks.format.columns import Ragged
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.slots import payload_read
from orchestrator import InsufficientData, Recipe, sample, update_priorities
from orchestrator.sampling.fetch import Fetcher
from orchestrator.sampling.index import SamplingIndex
from tests.support.stepdata import batch, episode, interleave, obs_of


def recipe(sources, fields=("obs", "action", "reward"), batch_size=256, **kw) -> Recipe:
    return Recipe.model_validate(
        {"name": "r", "batch_size": batch_size, "fields": list(fields), "sources": sources, **kw}
    )


def draw_ids(store: Store, r: Recipe, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([sample(store, r, rng=rng).ids for _ in range(n)])


def chi2_pvalue(drawn: np.ndarray, ids: np.ndarray, mass: np.ndarray) -> float:
    counts = np.array([np.count_nonzero(drawn == i) for i in ids])
    assert counts.sum() == len(drawn)
    expected = mass / mass.sum() * len(drawn)
    assert expected.min() > 5
    return chisquare(counts, expected).pvalue


@pytest.mark.both_stores
def test_priority_updates_land_and_change_the_distribution(store, redis_url):
    """Chi-square over 25,600 draws before and after an update; IS weights; a cold index
    (another worker) draws exactly the same rows from the same random stream."""
    steps = [s for e in range(8) for s in episode(e, 15, "terminated", task_id="ab"[e % 2])]
    store.commit(batch(steps))
    ids = np.sort(np.concatenate([store.episode(f"ep{e}", fields=[])["id"] for e in (0, 2, 4, 6)]))
    prios = np.random.default_rng(0).uniform(0.05, 1.0, len(ids)).astype(np.float32)
    prios[:6] = np.nan  # unset: counts as the namespace's max priority
    is_set = ~np.isnan(prios)
    assert update_priorities(store, ids[is_set], prios[is_set]) == is_set.sum()
    alpha, beta = 0.7, 0.5
    sampler = {"kind": "priority", "alpha": alpha, "beta": beta}
    r = recipe([{"name": "p", "where": {"task_id": "a"}, "sampler": sampler}])

    def mass(p: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(p), np.nanmax(p), p).astype(np.float64) ** alpha

    before = draw_ids(store, r, 100, 1)
    assert chi2_pvalue(before, ids, mass(prios)) > 1e-3

    b = sample(store, r, rng=np.random.default_rng(2))
    prob = mass(prios)[np.searchsorted(ids, b.ids)] / mass(prios).sum()
    w = (len(ids) * prob) ** -beta
    np.testing.assert_allclose(b.weights, w / w.max(), rtol=1e-5)
    assert b.weights.dtype == np.float32 and b.ids.dtype == np.int64

    prios[6:12] = 8.0  # a few steps become much more likely
    assert update_priorities(store.namespace, ids[6:12], prios[6:12], redis_url=redis_url) == 6
    drawn = draw_ids(store, r, 100, 3)
    assert chi2_pvalue(drawn, ids, mass(prios)) > 1e-3
    assert np.isin(drawn, ids[6:12]).mean() > 2 * np.isin(before, ids[6:12]).mean()

    warm = sample(store, r, rng=np.random.default_rng(4))
    cold = sample(store, r, rng=np.random.default_rng(4), index=SamplingIndex(store))
    np.testing.assert_array_equal(warm.ids, cold.ids)
    np.testing.assert_array_equal(warm.weights, cold.weights)
    rng = np.random.default_rng(5)  # fixed: a chi-square test fails 0.1 % of random streams
    drawn = np.concatenate(
        [sample(store, r, rng=rng, index=SamplingIndex(store)).ids for _ in range(100)]
    )
    assert chi2_pvalue(drawn, ids, mass(prios)) > 1e-3


_COLD_PROCESS = """
import json, sys
import numpy as np
from orchestrator import Recipe, sample
ns, url, recipe = sys.argv[1], sys.argv[2], Recipe.model_validate_json(sys.argv[3])
b = sample(ns, recipe, redis_url=url, rng=np.random.default_rng(4))
print(json.dumps({"ids": b.ids.tolist(), "weights": b.weights.tolist()}))
"""


def test_a_new_worker_process_samples_the_same(store, redis_url):
    """A fresh process rebuilds its index from Redis alone and draws exactly what a warm
    one draws from the same random stream."""
    import json
    import subprocess
    import sys

    store.commit(batch([s for e in range(6) for s in episode(e, 20, "terminated")]))
    ids = store.episode("ep3", fields=[])["id"]
    update_priorities(store, ids, np.linspace(0.1, 5.0, len(ids)))
    r = recipe([{"name": "p", "sampler": {"kind": "priority", "alpha": 0.8, "beta": 0.4}}])
    warm = sample(store, r, rng=np.random.default_rng(4))
    out = subprocess.run(
        [sys.executable, "-c", _COLD_PROCESS, store.namespace, redis_url, r.model_dump_json()],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    cold = json.loads(out.stdout)
    np.testing.assert_array_equal(warm.ids, cold["ids"])
    np.testing.assert_allclose(warm.weights, cold["weights"], rtol=1e-6)


def test_updates_for_overwritten_steps_are_ignored(redis_url, namespace):
    st_ = Store(redis_url, namespace)
    st_.create(capacity=40)
    st_.commit(batch(episode(1, 40, "terminated")))
    old = st_.episode("ep1", fields=[])["id"]
    r = recipe([{"name": "p", "sampler": {"kind": "priority"}}], ["obs", "priority"], 64)
    sample(st_, r)  # the index knows the old steps
    st_.commit(batch(episode(2, 15, "terminated")))  # reuses the slots of old[:15]
    new = st_.episode("ep2", fields=[])["id"]
    assert update_priorities(st_, old, np.full(40, 3.0)) == 25
    assert update_priorities(st_, old, np.full(40, 3.0)) == 25  # idempotent
    assert np.isnan(st_.get(new, fields=[])["priority"]).all()
    for _ in range(20):
        b = sample(st_, r)
        assert not np.isin(b.ids, old[:15]).any()
        is_new = np.isin(b.ids, new)
        assert np.isnan(b["priority"][is_new]).all() and (b["priority"][~is_new] == 3.0).all()


@pytest.mark.both_stores
def test_mixture_counts_are_exact_and_rows_match_their_source(store):
    eps = [
        episode(e, 20, "terminated", task_id="abc"[e % 3], tags={"color": "rb"[e % 2], "level": e})
        for e in range(6)
    ]
    store.commit(batch(interleave(*eps)))
    fields = ["obs", "task_id", "tags.level", "tags.color", "episode_id", "step_index"]
    hard = {"task_id": {"in": ["b", "c"]}, "tags.level": {"ge": "$min_level"}}
    r = recipe(
        [
            {"name": "a", "weight": 3, "where": {"task_id": "a"}},
            {"name": "rest", "weight": 1, "where": hard, "sampler": {"kind": "priority"}},
        ],
        fields,
        batch_size=10,
        params={"min_level": 2},
    )
    for i in range(50):
        b = sample(store, r, params={"min_level": 4} if i % 2 else None)
        assert b.sources == ("a", "rest") and b.recipe_version == 1 and len(b) == 10
        assert b.source_index.tolist() == [0] * 8 + [1] * 2
        assert b.meta["task_id"][:8] == ["a"] * 8
        assert set(b.meta["task_id"][8:]) <= {"b", "c"}
        assert (b["tags.level"][8:] >= (4 if i % 2 else 2)).all()
        obs = b["obs"]
        assert b.meta["episode_id"] == [f"ep{int(e)}" for e in obs[:, 0]]
        assert b["step_index"].tolist() == obs[:, 1].astype(int).tolist()
        assert b.meta["tags.color"] == ["rb"[int(e) % 2] for e in obs[:, 0]]


@pytest.mark.both_stores
def test_curation_trainable_and_quality(store):
    store.commit(batch(interleave(*(episode(e, 20, "terminated") for e in range(4)))))
    store.curate(episode_id="ep0", trainable=False)
    store.curate(episode_id="ep1", quality="good")
    everything = recipe([{"name": "all"}], batch_size=64)
    for _ in range(30):
        assert 0 not in sample(store, everything)["obs"][:, 0]
    good = recipe([{"name": "q", "where": {"quality": "good"}}], batch_size=64)
    assert set(sample(store, good)["obs"][:, 0]) == {1}
    great = recipe([{"name": "q", "where": {"quality": {"in": ["great"]}}}], batch_size=64)
    with pytest.raises(InsufficientData, match="'q': 0 candidates"):
        sample(store, great)
    store.curate(episode_id="ep2", quality="great")  # a string new to the dictionary
    assert set(sample(store, great)["obs"][:, 0]) == {2}
    store.curate(episode_id="ep0", trainable=True)
    seen = np.concatenate([sample(store, everything)["obs"][:, 0] for _ in range(10)])
    assert set(seen) == {0, 1, 2, 3}


LENGTH = {1: 6, 2: 5, 3: 7, 4: 4}
END = {1: "terminated", 2: "truncated", 3: "", 4: "terminated"}  # 3 is still running


def commit_episodes(store: Store) -> None:
    """Four episodes interleaved, in three commits that split them across batches."""
    steps = interleave(*(episode(e, LENGTH[e], END[e]) for e in LENGTH))
    for part in (steps[:7], steps[7:15], steps[15:]):
        store.commit(batch(part))


def reward_of(ep: int, t: int) -> float:
    return float(np.float32(ep + t / 100))


def transition(ep: int, t: int, n: int, gamma: float):
    """(return, discount, done, next_obs or None if not stored) of the n-step transition."""
    ret, k, done, last = 0.0, 0, False, LENGTH[ep] - 1
    while k < n:
        ret += gamma**k * reward_of(ep, t + k)
        k += 1
        if t + k - 1 == last:
            done = END[ep] == "terminated"
            break
    boot = t + k - 1
    if boot < last:
        nxt = obs_of(ep, boot + 1)
    elif END[ep] == "truncated":
        nxt = obs_of(ep, boot + 1, explicit=True)
    else:
        nxt = np.zeros(4, np.float32) if done else None
    return ret, gamma**k, done, nxt


@pytest.mark.both_stores
def test_n_step_returns_on_interleaved_episodes(store):
    commit_episodes(store)
    fields = ["obs", "reward", "next_obs", "terminated", "truncated"]
    r = recipe([{"name": "u"}], fields, batch_size=64, n_step=3, gamma=0.5)
    valid = {
        (e, t) for e in LENGTH for t in range(LENGTH[e]) if transition(e, t, 3, 0.5)[3] is not None
    }
    seen = set()
    for _ in range(30):
        b = sample(store, r)
        assert b["discount"].dtype == np.float32 and b["done"].dtype == bool
        for i, (ep, t) in enumerate(b["obs"][:, :2].astype(int).tolist()):
            ret, discount, done, nxt = transition(ep, t, 3, 0.5)
            assert (ep, t) in valid
            assert b["reward"][i] == pytest.approx(ret, rel=1e-6)
            assert b["discount"][i] == discount and b["done"][i] == done
            np.testing.assert_array_equal(b["next_obs"][i], nxt)
            last = t == LENGTH[ep] - 1
            assert b["terminated"][i] == (last and END[ep] == "terminated")
            assert b["truncated"][i] == (last and END[ep] == "truncated")
            seen.add((ep, t))
    assert seen == valid


def test_sequences_stay_inside_one_episode(store):
    commit_episodes(store)
    fields = ["obs", "reward", "next_obs", "episode_id"]
    r = recipe([{"name": "u"}], fields, batch_size=32, sequence_length=3)
    # Every step of a window needs its next_obs (or to terminate the episode).
    ok = {
        (e, t) for e in LENGTH for t in range(LENGTH[e]) if transition(e, t, 1, 1.0)[3] is not None
    }
    valid = {(e, t) for e, t in ok if {(e, t + 1), (e, t + 2)} <= ok}
    assert (1, 3) in valid and (2, 2) in valid  # windows ending on an episode's last step
    seen = set()
    for _ in range(20):
        b = sample(store, r)
        obs = b["obs"]
        assert obs.shape == (32, 3, 4) and b["reward"].shape == (32, 3) and b.ids.shape == (32,)
        assert b["next_obs"].shape == (32, 3, 4) and len(b) == len(b.meta["episode_id"]) == 32
        for w in range(32):
            ep, t = int(obs[w, 0, 0]), int(obs[w, 0, 1])
            assert (ep, t) in valid
            np.testing.assert_array_equal(obs[w], [obs_of(ep, t + j) for j in range(3)])
            assert b.meta["episode_id"][w] == [f"ep{ep}"] * 3
            assert b["reward"][w].tolist() == [reward_of(ep, t + j) for j in range(3)]
            for j in range(3):
                np.testing.assert_array_equal(b["next_obs"][w, j], transition(ep, t + j, 1, 1.0)[3])
            seen.add((ep, t))
    assert seen == valid


def test_fetch_rejects_rows_overwritten_since_the_sync(redis_url, namespace):
    st_ = Store(redis_url, namespace)
    st_.create(capacity=20)
    st_.commit(batch(episode(1, 20, "terminated")))
    ix = SamplingIndex(st_)
    ix.sync()
    rows = np.arange(5)
    ids = ix.columns["id"][rows]
    fetch = Fetcher(st_, ix.cap)
    read = payload_read("obs", st_.config().schema.fields["obs"], rows)
    (got,), _ = fetch(rows, ids, [read])
    np.testing.assert_array_equal(got.view(np.float32), [obs_of(1, t) for t in range(5)])
    st_.commit(batch(episode(2, 3)))  # slots 0-2 now hold other steps
    assert fetch(rows, ids, [read]) is None
    r = recipe([{"name": "u"}], ["obs"], batch_size=64)
    sample(st_, r, index=ix)
    st_.commit(batch(episode(3, 3)))
    assert not np.isin(sample(st_, r, index=ix).ids, ids).any()


def _calls(store: Store) -> dict[str, int]:
    """Commands run since the last reset, summed over every node (and then reset)."""
    if is_cluster(store.r):
        per_node = store.r.info("commandstats", target_nodes=store.r.PRIMARIES).values()
        store.r.config_resetstat(target_nodes=store.r.PRIMARIES)
    else:
        per_node = [store.r.info("commandstats")]
        store.r.config_resetstat()
    calls: dict[str, int] = {}
    for stats in per_node:
        for k, v in stats.items():
            name = k.removeprefix("cmdstat_")
            calls[name] = calls.get(name, 0) + v["calls"]
    calls.pop("config|resetstat", None)
    calls.pop("info", None)
    return calls


@pytest.mark.both_stores
@pytest.mark.store(capacity=100, n_shards=2)
def test_a_quiet_store_is_sampled_in_one_round_trip_and_changes_are_seen(store):
    """Nothing committed since the last batch: the next one is drawn from the index as it
    is and proved current by the change logs' newest entries, read after it, with no sync
    of its own and no payload read (obs and action are mirrored). A commit or a priority
    update made before a call is in the batch that call returns."""
    store.commit(batch(interleave(*(episode(e, 10, "terminated", task_id="a") for e in range(4)))))
    r = recipe([{"name": "u", "where": {"task_id": "a"}}], ["obs", "action", "next_obs"], 64)
    sample(store, r)
    sample(store, r)  # the logs were quiet at the last fetch
    _calls(store)
    b = sample(store, r)
    calls = _calls(store)
    assert calls == {"xrange": 2}  # each log from the index's last entry: the one round trip
    want = store.get(b.ids, ["obs", "action", "next_obs"])
    for field in ("obs", "action", "next_obs"):
        np.testing.assert_array_equal(b[field], want[field])

    store.commit(batch(episode(9, 5, task_id="b")))  # seen by the very next call
    assert set(sample(store, recipe([{"name": "b", "where": {"task_id": "b"}}]))["obs"][:, 0]) == {
        9
    }
    old = np.sort(b.ids)
    for e in range(10, 14):  # the ring comes round
        store.commit(batch(episode(e, 25, "terminated", task_id="a")))
    after = sample(store, r, rng=np.random.default_rng(1))
    cold = SamplingIndex(store)
    cold.sync()
    live = cold.columns["id"][cold.columns["alive"]]
    assert np.isin(after.ids, live).all()
    gone = np.setdiff1d(old, live)
    assert len(gone) and not np.isin(after.ids, gone).any()
    want = store.get(after.ids, ["obs", "next_obs"])
    np.testing.assert_array_equal(after["obs"], want["obs"])
    np.testing.assert_array_equal(after["next_obs"], want["next_obs"])
    ids = store.episode("ep13", fields=[])["id"][:1]
    p = recipe([{"name": "p", "where": {"task_id": "a"}, "sampler": {"kind": "priority"}}])
    update_priorities(store, live, np.full(len(live), 1e-6))
    sample(store, p)
    sample(store, p)
    update_priorities(store, ids, [1e6])  # all the mass on one step, just before the call
    assert (sample(store, p).ids == ids[0]).mean() > 0.9


def _cold_equal(ix: SamplingIndex) -> None:
    cold = SamplingIndex(ix.store)
    cold.sync()
    assert ix.columns.keys() == cold.columns.keys()
    for name, col in cold.columns.items():
        np.testing.assert_array_equal(ix.columns[name], col, err_msg=name)


@pytest.mark.both_stores
@pytest.mark.store(capacity=100, n_shards=2)
def test_a_changing_store_reads_each_log_page_once(store):
    """A commit before a call after a quiet batch: the fetch from the index as it is reads
    the entries after its positions, refuses the batch, and the sync applies those entries
    instead of reading them again (per shard: that XRANGE, then the checked fetch's, from
    the index's last entry on: no loss check of its own). A commit before the call after
    that: the store is changing, so the call syncs first (no draw to throw away), its
    page's round trip re-reading the committed slots (``reread.lua``, which runs the loss
    check and an XRANGE inside: per shard the page's XRANGE and that EVALSHA). The
    batches hold the
    committed steps as stored; the index stays what a cold rebuild gives."""
    store.commit(batch(interleave(*(episode(e, 10, "terminated", task_id="a") for e in range(4)))))
    store.commit(batch(episode(4, 10, "terminated", task_id="b")))
    r = recipe([{"name": "u"}], ["obs", "action", "next_obs"], 64)
    rb = recipe([{"name": "b", "where": {"task_id": "b"}}], ["obs"])
    ix = SamplingIndex(store)
    sample(store, rb, index=ix)
    sample(store, r, index=ix)  # quiet from here
    for e, (xrange, evalsha) in [(5, (4, None)), (6, (6, 2))]:
        store.commit(batch(episode(e, 10, "terminated", task_id="b")))
        _calls(store)
        b = sample(store, rb, index=ix)
        calls = _calls(store)
        assert (calls.get("xrange"), calls.get("evalsha"), calls.get("xrevrange")) == (
            xrange,
            evalsha,
            None,
        )
        assert set(b["obs"][:, 0]) <= {4, 5, 6} and e in set(b["obs"][:, 0])
        _cold_equal(ix)
    sample(store, r, index=ix)  # found nothing new at its start: quiet again
    _calls(store)
    b = sample(store, r, index=ix)
    assert _calls(store) == {"xrange": 2}
    np.testing.assert_array_equal(b["obs"], store.get(b.ids, ["obs"])["obs"])


@pytest.mark.both_stores
@pytest.mark.store(capacity=40, n_shards=2)
def test_rows_overwritten_between_sync_and_fetch_are_never_served(store):
    """Commits that overwrite every slot land after the sync and before the checked fetch
    (from inside the sync's listener): that fetch refuses the batch, and the next
    draw's sync applies the entries it read (no second read of that page) and serves only
    the new steps, as stored."""
    store.commit(batch(interleave(*(episode(e, 10, "terminated") for e in range(4)))))
    r = recipe([{"name": "u"}], ["obs", "action", "next_obs"], 32)
    ix = SamplingIndex(store)
    sample(store, r, index=ix)
    old = ix.columns["id"][ix.columns["alive"]].copy()
    store.commit(batch(episode(7, 2, "terminated")))  # the next call syncs first
    pending = [episode(e, 10, "terminated") for e in range(10, 22)]  # 3 rings' worth

    def overwrite(rows: object) -> None:
        while pending:
            store.commit(batch(pending.pop()))

    sample(store, r, index=ix)  # quiet at its fetch
    store.commit(batch(episode(8, 2, "terminated")))
    ix.subscribe(overwrite)
    _calls(store)
    b = sample(store, r, index=ix)
    calls = _calls(store)
    assert not pending
    # the call's two syncs: one page read, with reread.lua's XRANGE per shard (the second
    # applies the refused fetch's); two checked fetches; the commit's own commands read no log
    assert calls["xrange"] == 8
    assert not np.isin(b.ids, old).any()
    want = store.get(b.ids, ["obs", "action", "next_obs"])
    for field in ("obs", "action", "next_obs"):
        np.testing.assert_array_equal(b[field], want[field])
    _cold_equal(ix)


@pytest.mark.store(capacity=120, n_shards=2)
def test_mirrored_fields_are_the_stored_payloads(store):
    """Batches with obs and action mirrored in the index equal those read from Redis
    (``payload_bytes=0``), from the same random stream, across n-step returns, windows and
    frame stacks, and again after the ring overwrote slots."""
    store.commit(
        batch(
            interleave(*(episode(e, 20, ("terminated", "truncated", "")[e % 3]) for e in range(5)))
        )
    )
    recipes = [
        recipe([{"name": "u"}], ["obs", "action", "next_obs"], 64, n_step=3),
        recipe([{"name": "u"}], ["obs", "next_obs"], 16, sequence_length=3),
        recipe([{"name": "u"}], ["obs", "next_obs"], 32, frame_stack=3),
    ]
    mirrored, plain = SamplingIndex(store), SamplingIndex(store, payload_bytes=0)
    mirrored.sync()
    plain.sync()
    assert "f:obs" in mirrored.columns and "f:action" in mirrored.columns
    assert not any(c.startswith("f:") for c in plain.columns)
    for _ in range(2):
        for i, r in enumerate(recipes):
            a = sample(store, r, rng=np.random.default_rng(i), index=mirrored)
            b = sample(store, r, rng=np.random.default_rng(i), index=plain)
            np.testing.assert_array_equal(a.ids, b.ids)
            for field in r.fields:
                np.testing.assert_array_equal(a[field], b[field])
        store.commit(batch(interleave(*(episode(e, 30, "terminated") for e in (7, 8)))))
    assert_cold = SamplingIndex(store)
    assert_cold.sync()
    mirrored.sync()
    for col in ("f:obs", "f:action"):
        np.testing.assert_array_equal(mirrored.columns[col], assert_cold.columns[col])


def test_clear_errors(redis_url, namespace, store):
    r = recipe([{"name": "u"}], batch_size=4)
    with pytest.raises(NamespaceError):
        sample(f"{namespace}-missing", r, redis_url=redis_url)
    with pytest.raises(InsufficientData, match="no steps"):
        sample(store, r)
    store.commit(batch(episode(1, 3, "terminated", task_id="a")))
    with pytest.raises(InsufficientData, match="'u': 0 candidates, needs 1"):
        sample(store, recipe([{"name": "u", "where": {"task_id": "b"}}]))
    with pytest.raises(ValueError, match="'prompt_ids' is not a field"):
        sample(store, recipe([{"name": "u"}], ["obs", "prompt_ids"]))


@pytest.mark.both_stores
def test_through_the_real_ingest_worker(redis_url, namespace, ingest_worker):
    ing = Ingestor(namespace, redis_url, flush_steps=64, flush_interval=None, n_shards=2)
    eps, t = np.repeat(np.arange(4), 50), np.tile(np.arange(50), 4)
    obs = np.stack([eps, t, np.zeros(200), np.zeros(200)], axis=1).astype(np.float32)
    ing.add_batch(
        {
            "obs": obs,
            "action": t % 3,
            "reward": (eps + t / 100).astype(np.float32),
            "episode_id": [f"ep{e}" for e in eps],
            "step_index": t,
            "terminated": t == 49,
            "task_id": "grasp",
        }
    )
    assert ing.close().committed == 200
    fields = ["obs", "action", "reward", "next_obs", "episode_id"]
    r = recipe([{"name": "g", "where": {"task_id": "grasp"}}], fields, 128, n_step=2, gamma=0.9)
    b = sample(namespace, r, redis_url=redis_url)
    ep, step = b["obs"][:, 0].astype(int), b["obs"][:, 1].astype(int)
    assert (b["action"] == step % 3).all()
    assert b.meta["episode_id"] == [f"ep{e}" for e in ep]
    last = step == 49
    r0 = (ep + step / 100).astype(np.float32).astype(np.float64)
    r1 = (ep + (step + 1) / 100).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(b["reward"], np.where(last, r0, r0 + 0.9 * r1), rtol=1e-6)
    assert (b["done"] == (step >= 48)).all()
    np.testing.assert_array_equal(b["next_obs"][step < 48, 1], step[step < 48] + 2)
    assert (b["next_obs"][step >= 48] == 0).all()


TASKS = ["a", "b", "c"]
CONDITIONS = {
    "task_id": st.one_of(
        st.sampled_from([*TASKS, "zzz"]),
        st.fixed_dictionaries({"in": st.lists(st.sampled_from(TASKS))}),
    ),
    "reward": st.one_of(
        st.fixed_dictionaries({"gt": st.sampled_from([-1.0, 0.0, 0.25, 0.5])}),
        st.fixed_dictionaries({"le": st.sampled_from([-1.0, 0.0, 0.5])}),
        st.fixed_dictionaries({"between": st.sampled_from([[0.0, 0.5], [-1.0, 0.0]])}),
    ),
    "tags.color": st.sampled_from(["red", "blue"]),
    "tags.level": st.fixed_dictionaries({"ge": st.sampled_from([0, 1, 2.5])}),
    "step_index": st.fixed_dictionaries({"lt": st.integers(0, 5)}),
}
ROW = st.fixed_dictionaries(
    {
        "task_id": st.sampled_from([*TASKS, None]),
        "reward": st.sampled_from([-1.0, 0.0, 0.25, 0.5, 1.0]),
        "color": st.sampled_from(["red", "blue", None]),
        "level": st.sampled_from([None, 0.0, 1.0, 2.5]),
        "trainable": st.booleans(),
    }
)


OPS = {
    "eq": lambda x, v: x == v,
    "in": lambda x, v: x in v,
    "gt": lambda x, v: x > v,
    "ge": lambda x, v: x >= v,
    "le": lambda x, v: x <= v,
    "lt": lambda x, v: x < v,
    "between": lambda x, v: v[0] <= x <= v[1],
}


def holds(row: dict, where: dict) -> bool:
    """Reference evaluation of a ``where`` on one row's values (None: missing)."""
    for key, cond in where.items():
        x = row[key.removeprefix("tags.")]
        op, v = next(iter(cond.items())) if isinstance(cond, dict) else ("eq", cond)
        if x is None or not OPS[op](x, v):
            return False
    return True


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(ROW, min_size=1, max_size=30),
    where=st.fixed_dictionaries({}, optional=CONDITIONS),
    kind=st.sampled_from(["uniform", "priority"]),
)
def test_sampled_rows_satisfy_their_where(redis_url, rows, where, kind):
    st_ = Store(redis_url, f"h-{uuid.uuid4().hex[:10]}")
    st_.create(capacity=64)
    rows = [{**rows[0], "color": "red", "level": 1.0}, *rows[1:]]  # fixes the tags' kinds
    steps = []
    for i, row in enumerate(rows):
        row["step_index"] = i % 5
        tags = {k: row[k] for k in ("color", "level") if row[k] is not None}
        steps.append(
            {"ep": i // 5, "step": i % 5, "reward": row["reward"], "tags": tags}
            | ({"task_id": row["task_id"]} if row["task_id"] else {})
        )
    st_.commit(batch(steps))
    ids = np.arange(1, len(rows) + 1)  # one shard, one commit: ids are the seqs in order
    assert (st_.get(ids, fields=[])["step_index"] == np.arange(len(rows)) % 5).all()
    untrainable = [i for i, row in zip(ids.tolist(), rows, strict=True) if not row["trainable"]]
    if untrainable:
        st_.curate(untrainable, trainable=False)
    fields = ["obs", "task_id", "reward", "tags.color", "tags.level", "step_index"]
    r = recipe([{"name": "s", "where": where, "sampler": {"kind": kind}}], fields, 16)
    matching = [row["trainable"] and holds(row, where) for row in rows]
    try:
        b = sample(st_, r, rng=np.random.default_rng(0))
    except InsufficientData:
        assert not any(matching)
        return
    by_id = dict(zip(ids.tolist(), rows, strict=True))
    for i, step_id in enumerate(b.ids.tolist()):
        row = by_id[step_id]
        assert row["trainable"] and holds(row, where)
        assert b.meta["task_id"][i] == row["task_id"] and b["reward"][i] == row["reward"]
        level = b["tags.level"][i]
        assert (math.isnan(level) and row["level"] is None) or level == row["level"]


def test_ragged_fields_info_and_sequences_of_them(store):
    steps = episode(1, 6, "terminated") + episode(2, 4, "truncated")
    b = batch(steps)
    b.fields["prompt_ids"] = Ragged.of(
        [np.arange(s["step"] + s["ep"], dtype=np.int32) for s in steps]
    )
    b.info_rows = np.array([0, 7], np.int32)
    b.info = [{"note": "first"}, {"note": "late", "k": 2}]
    store.commit(b)
    fields = ["prompt_ids", "info", "next_obs", "obs"]
    out = sample(store, recipe([{"name": "u"}], fields, batch_size=64))
    for ids, info, (ep, t) in zip(
        out["prompt_ids"], out.meta["info"], out["obs"][:, :2].astype(int).tolist(), strict=True
    ):
        np.testing.assert_array_equal(ids, np.arange(t + ep))
        assert ids.dtype == np.int32
        assert info == {(1, 0): {"note": "first"}, (2, 1): {"note": "late", "k": 2}}.get(
            (ep, t), {}
        )
    seq = sample(store, recipe([{"name": "u"}], fields, batch_size=8, sequence_length=2))
    assert len(seq["prompt_ids"]) == 8 and all(len(w) == 2 for w in seq["prompt_ids"])
    for w, obs in zip(seq["prompt_ids"], seq["obs"], strict=True):
        for ids, (ep, t) in zip(w, obs[:, :2].astype(int).tolist(), strict=True):
            np.testing.assert_array_equal(ids, np.arange(t + ep))


def image(ep: int, t: int, explicit: bool = False) -> np.ndarray:
    """A 48x48x3 uint8 frame (6,912 bytes: read by plain commands) that names its step."""
    return np.full((48, 48, 3), ep * 20 + t + 128 * explicit, np.uint8)


def test_big_rows_through_plain_commands(store):
    steps = interleave(*(episode(e, LENGTH[e], END[e]) for e in LENGTH))
    for part in (steps[:9], steps[9:]):
        b = batch(part)
        b.fields["obs"] = np.stack([image(s["ep"], s["step"]) for s in part])
        if b.next_obs is not None:
            b.next_obs = np.stack(
                [image(part[i]["ep"], part[i]["step"] + 1, True) for i in b.next_rows]
            )
        store.commit(b)
    r = recipe([{"name": "u"}], ["obs", "next_obs"], batch_size=64, n_step=2, gamma=0.5)
    for i in range(5):
        if i == 2:
            store.r.script_flush()  # the scripts are loaded again on NOSCRIPT
        out = sample(store, r)
        assert out["obs"].shape == (64, 48, 48, 3) and out["obs"].dtype == np.uint8
        for obs, nxt in zip(out["obs"], out["next_obs"], strict=True):
            ep, t = divmod(int(obs[0, 0, 0]), 20)
            np.testing.assert_array_equal(obs, image(ep, t))
            want = transition(ep, t, 2, 0.5)[3]
            expected = (
                np.zeros_like(obs) if not want.any() else image(ep, int(want[1]), bool(want[2]))
            )
            np.testing.assert_array_equal(nxt, expected)
    seq = sample(store, recipe([{"name": "u"}], ["obs"], batch_size=16, sequence_length=3))
    first = seq["obs"][:, :, 0, 0, 0].astype(int)
    assert (np.diff(first, axis=1) == 1).all()  # consecutive steps of one episode

    fetch = Fetcher(store, 500)
    ix = SamplingIndex(store)
    ix.sync()
    rows = np.flatnonzero(ix.columns["alive"])[:4]
    read = payload_read("obs", store.config().schema.fields["obs"], rows)
    assert read.plain
    (got,), _ = fetch(rows, ix.columns["id"][rows], [read])
    assert got.shape == (4, 6912) and (got == got[:, :1]).all()
    assert (got[:, 0] % 20 == ix.columns["step_index"][rows]).all()
    earlier = ix.columns["id"][rows] - ix.cap * ix.n_shards  # the slots' previous occupants
    assert fetch(rows, earlier, [read]) is None


def test_new_version_or_params_keep_the_sampler(store):
    from orchestrator.sampling.sample import _session

    store.commit(batch(episode(1, 20, "terminated")))
    where = {"step_index": {"lt": "$cut"}}
    v1 = recipe([{"name": "u", "where": where}], batch_size=8, params={"cut": 5})
    assert (sample(store, v1)["obs"][:, 1] < 5).all()
    bound = _session(store, None, None).bound["r"]
    sampler = bound.sampler
    v2 = v1.model_copy(update={"version": 2, "params": {"cut": 2}})  # as set_params makes it
    out = sample(store, v2)
    assert (out["obs"][:, 1] < 2).all() and out.recipe_version == 2
    assert _session(store, None, None).bound["r"].sampler is sampler  # trees kept
    v3 = v2.model_copy(update={"version": 3, "n_step": 2})
    sample(store, v3)
    assert _session(store, None, None).bound["r"].sampler is not sampler  # content changed
