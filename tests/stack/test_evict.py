"""Retention and eviction on a real Redis: TTL and cap choose exactly the steps they should,
protected steps stay, transitions stay whole, every reader agrees, counters are exact."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from claw_tasks.durations import DurationError, parse_duration
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.store import Store
from claw_tasks.store.check import check_namespace
from claw_tasks.store.retention import Retention, RetentionError, parse_bytes
from orchestrator import Recipe, sample
from orchestrator.maintenance.evict import evict_namespace
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.sample import StoreChangingError
from tests.support.producer import sender
from tests.support.stepdata import batch, episode, interleave

T0 = 1_000_000.0


pytestmark = pytest.mark.store(capacity=2000)


def live(store: Store) -> dict[int, dict]:
    """Live steps by id: timestamp, priority, episode code (every shard)."""
    out = {}
    for shard in range(store.config().n_shards):
        cols = store.meta_columns(shard, ["id", "timestamp", "priority", "episode"])
        for slot in np.flatnonzero(cols["alive"]).tolist():
            out[int(cols["id"][slot])] = {k: cols[k][slot] for k in cols if k != "alive"}
    return out


def assert_clean(store: Store) -> None:
    report = check_namespace(store.r, store.namespace)
    assert report.ok, report.problems


def test_policy_round_trips_and_names_bad_settings(store):
    ret = Retention.of(
        {
            "max_age": "7d",
            "max_steps": 10,
            "max_bytes": "2GiB",
            "protect": {"quality": "golden"},
            "archive_before_evict": True,
        }
    )
    assert ret.max_age == 7 * 86400 and ret.max_bytes == 2 * 2**30
    store.set_retention(ret)
    assert Store(store.r, store.namespace).config().retention == ret
    assert parse_duration("1d12h") == 36 * 3600 and parse_bytes("500MB") == 500_000_000
    with pytest.raises(RetentionError, match="evict must be one of"):
        Retention(evict="random")
    with pytest.raises(DurationError, match="duration '7 days'"):
        parse_duration("7 days")
    with pytest.raises(RetentionError, match="max_age: duration '7 days'"):
        Retention.of({"max_age": "7 days"})
    with pytest.raises(RetentionError, match="unknown retention setting"):
        Retention.of({"ttl": 5})


@pytest.mark.both_stores
def test_ttl_evicts_exactly_the_steps_older_than_the_limit(store):
    # Three commits an hour apart; ep 1 spans the first two (links across the boundary).
    store.commit(batch(interleave(episode(1, 30), episode(2, 20, "terminated"))), now=T0)
    store.commit(batch(episode(1, 50, "terminated", first=30) + episode(3, 10)), now=T0 + 3600)
    store.commit(batch(episode(4, 25, "truncated")), now=T0 + 7200)
    before = live(store)
    store.set_retention(Retention(max_age=5400))  # 1.5 h at T0 + 2 h: the first commit goes
    counts = evict_namespace(store, now=T0 + 7200)
    after = live(store)
    old = {i for i, s in before.items() if s["timestamp"] < T0 + 1800}
    assert len(old) == 50 and counts["ttl"] == 50
    assert set(after) == set(before) - old
    assert store.evictions()["ttl"] == 50
    with pytest.raises(KeyError, match="evicted"):
        store.get(sorted(old)[:1])
    # Episode 2 is gone entirely: its name goes too; episode 1 keeps its name.
    assert store.episode("ep1")["step_index"].tolist() == list(range(30, 50))
    with pytest.raises(KeyError):
        store.episode("ep2")
    assert evict_namespace(store, now=T0 + 7200)["ttl"] == 0  # nothing left to do
    assert_clean(store)


def test_archive_before_evict_keeps_steps_above_the_watermark(store):
    store.commit(batch(interleave(episode(1, 30), episode(2, 30))), now=T0)
    store.set_retention(Retention(max_age=60, archive_before_evict=True))
    assert evict_namespace(store, now=T0 + 3600)["ttl"] == 0  # nothing archived yet
    marks = {}
    for shard in range(2):
        ids = sorted(i for i in live(store) if i % 2 == shard)
        marks[shard] = ids[len(ids) // 2] // 2 if ids else 0  # half of each shard archived
        store.r.set(store.layout_keys.archived(shard), marks[shard])
    before = set(live(store))
    evicted = evict_namespace(store, now=T0 + 3600)["ttl"]
    gone = before - set(live(store))
    assert gone == {i for i in before if i // 2 <= marks[i % 2]} and evicted == len(gone) > 0
    assert_clean(store)


@pytest.mark.both_stores
def test_cap_evicts_lowest_priority_unprotected_first(store):
    steps = interleave(*(episode(e, 20) for e in range(10)))
    store.commit(batch(steps), now=T0)
    ids = np.array(sorted(live(store)))
    rng = np.random.default_rng(3)
    prios = rng.permutation(len(ids)).astype(np.float32) + 1
    store.update_priorities(ids, prios)
    golden = ids[np.argsort(prios)[:15]]  # the 15 lowest are protected
    store.curate(golden, quality="golden")
    store.set_retention(Retention(max_steps=120, protect=({"quality": "golden"},)))
    counts = evict_namespace(store, now=T0)
    assert counts["cap"] == 80
    kept = set(live(store))
    by_prio = ids[np.argsort(prios)]
    unprotected = [i for i in by_prio.tolist() if i not in set(golden.tolist())]
    assert kept == set(golden.tolist()) | set(unprotected[80:])
    assert store.evictions() == {"ttl": 0, "cap": 80, "manual": 0, "ring": 0}
    # Protected steps alone over the cap: they stay, everything else goes.
    store.set_retention(Retention(max_steps=5, protect=("quality == 'golden'",)))
    counts = evict_namespace(store, now=T0)
    assert counts == {"cap": 105, "protected": 15, "pruned": 0}
    assert set(live(store)) == set(golden.tolist())
    assert_clean(store)


def test_oldest_first_and_evicted_successor_keeps_the_transition_whole(store):
    store.commit(batch(episode(1, 10)), now=T0)
    store.commit(batch(episode(1, 20, "terminated", first=10)), now=T0 + 10)
    whole = store.episode("ep1")
    ix = SamplingIndex(store)
    ix.sync()
    # Manual eviction of a middle step: its predecessor keeps next_obs (copied explicit).
    mid = whole["id"][whole["step_index"] == 10]
    assert store.evict(mid) == 1 and store.evict(mid) == 0
    got = store.get(whole["id"][whole["step_index"] == 9])
    np.testing.assert_array_equal(got["next_obs"][0], whole["obs"][whole["step_index"] == 10][0])
    assert got["has_next_obs"][0]
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 64,
            "fields": ["obs", "next_obs"],
            "sources": [{"name": "all", "where": {"step_index": 9}}],
        }
    )
    drawn = sample(store, recipe, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(drawn["next_obs"][:, 1], np.full(64, 10))
    store.set_retention(Retention(max_steps=12, evict="oldest"))
    assert evict_namespace(store, now=T0 + 10)["cap"] == 7
    left = store.episode("ep1")["step_index"].tolist()
    assert left == [7, 8, 9, *range(11, 20)]  # the 7 oldest went; step 10 went before
    assert store.evictions()["manual"] == 1 and store.evictions()["cap"] == 7
    ix.sync()  # the index followed the evictions and the re-linked predecessor
    cold = SamplingIndex(store)
    cold.sync()
    for name, col in cold.columns.items():
        np.testing.assert_array_equal(ix.columns[name], col, err_msg=name)
    assert_clean(store)


def test_ring_overwrites_are_counted(redis_url, namespace):
    st = Store(redis_url, namespace)
    st.create(capacity=100)
    st.commit(batch(episode(1, 60)))
    st.evict(sorted(live(st))[:5])
    st.commit(batch(episode(2, 60)))  # 20 slots come round; 5 of them were evicted already
    assert st.evictions() == {"ttl": 0, "cap": 0, "manual": 5, "ring": 15}
    assert_clean(st)


@pytest.mark.both_stores
def test_a_sampler_never_gets_an_evicted_step(store):
    """One thread evicts (random victims, ring wraps from fresh commits) while another
    samples; every batch is checked against the steps evicted before it was drawn."""
    store.commit(batch(interleave(*(episode(e, 40) for e in range(20)))), now=T0)
    recipe = Recipe.model_validate(
        {
            "name": "race",
            "batch_size": 128,
            "fields": ["obs", "next_obs"],
            "sources": [{"name": "all"}],
        }
    )
    evicted: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def evictor() -> None:
        rng = np.random.default_rng(1)
        try:
            for rnd in range(60):
                ids = np.array(sorted(live(store)))
                victims = rng.choice(ids, size=min(len(ids), 15), replace=False)
                store.evict(victims)
                with lock:
                    evicted.extend(victims.tolist())
                if rnd % 10 == 9:  # fresh steps keep the sampler supplied
                    store.commit(batch(episode(100 + rnd, 120)), now=T0)
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    thread = threading.Thread(target=evictor)
    thread.start()
    rng, rounds, refused = np.random.default_rng(2), 0, 0
    while not stop.is_set() or rounds < 5:
        with lock:
            gone = set(evicted)
        try:
            drawn = sample(store, recipe, rng=rng)
        except StoreChangingError:
            # This evictor never pauses: 15 of ~1,000 steps go every few ms, so a draw of
            # 128 rows and their successors often loses one before it is read, and on a
            # loaded machine 8 draws in a row can (the sampler then refuses the batch, as
            # documented). What this test checks is that no batch holds an evicted step;
            # the deterministic race is test_a_step_evicted_after_the_index_sync_....
            refused += 1
            continue
        assert not gone & set(drawn.ids.tolist())
        rounds += 1
    thread.join()
    assert not errors, errors
    assert rounds >= 5
    assert store.evictions()["manual"] == len(set(evicted))
    assert_clean(store)


def test_a_step_evicted_after_the_index_sync_is_never_sampled(store):
    """The race of the test above, made certain: an index listener (called in sync, after
    the change log is applied, before the draw) evicts steps the index still shows alive.
    The draw includes some; the read finds them gone (alive bits, checked in the read's
    script), and the sampler draws again from a new sync."""
    store.commit(batch(interleave(*(episode(e, 10) for e in range(4)))), now=T0)
    index = SamplingIndex(store)
    syncs: list[np.ndarray | None] = []
    ep0 = episode_code("ep0")
    victims = np.array(sorted(i for i, s in live(store).items() if s["episode"] != ep0))

    def evict_on_first_sync(rows: np.ndarray | None) -> None:
        syncs.append(rows)
        if len(syncs) == 1:
            assert index.columns["alive"].sum() == 40  # the index: every step alive
            assert store.evict(victims) == 30  # all but ep0, now

    index.subscribe(evict_on_first_sync)
    recipe = Recipe.model_validate(
        {
            "name": "race",
            "batch_size": 32,
            "fields": ["obs", "next_obs"],
            "sources": [{"name": "all"}],
        }
    )
    drawn = sample(store, recipe, rng=np.random.default_rng(0), index=index)
    assert len(syncs) >= 2  # the first draw was read, found stale, and drawn again
    assert not set(drawn.ids.tolist()) & set(victims.tolist())
    obs, nxt = drawn.fields["obs"], drawn.fields["next_obs"]
    assert (obs[:, 0] == obs[0, 0]).all()  # one episode left: its steps only
    np.testing.assert_array_equal(nxt[:, 1], obs[:, 1] + 1)  # transitions whole


def test_cli_sets_policy_stats_metrics_and_manual_eviction(store, redis_url):
    from prometheus_client import generate_latest
    from typer.testing import CliRunner

    from orchestrator.cli.exporter import registry_for
    from orchestrator.cli.main import app

    store.commit(batch(episode(1, 30, task_id="a")), now=T0)
    ns, env = store.namespace, {"CLAW_REDIS_URL": redis_url, "COLUMNS": "250"}

    def claw(*args: str, code: int = 0) -> str:
        result = CliRunner().invoke(app, list(args), env=env)
        assert result.exit_code == code, result.output
        return result.output

    out = claw(
        "retention",
        ns,
        "--max-age",
        "7d",
        "--max-steps",
        "5",
        "--evict",
        "oldest",
        "--protect",
        "task_id == 'a'",
        "--archive-before-evict",
    )
    assert "max age 7d" in out and "max 5 steps (oldest first)" in out and "archive" in out
    ret = Store(redis_url, ns).config().retention
    assert ret.max_age == 7 * 86400 and ret.protect == ("task_id == 'a'",)
    assert "nope" in claw("retention", ns, "--protect", "{nope: 1}", code=1)
    assert "reward >" in claw("retention", ns, "--protect", "reward > ", code=1)
    out = claw("stats", "--namespace", ns)
    assert "retention: max age 7d" in out and "30 protected steps alone exceed" in out
    ids = sorted(live(store))[:3]
    assert "evicted 3 of 3" in claw("evict", ns, "--ids", ",".join(map(str, ids)), "--yes")
    stats = __import__("json").loads(claw("stats", "--namespace", ns, "--json"))
    (s,) = stats["namespaces"]
    assert s["evictions"]["manual"] == 3 and s["steps"] == 27 and s["protected"] == 27
    metrics = generate_latest(registry_for(redis_url, redis_url)).decode()
    assert f'claw_evictions_total{{namespace="{ns}",reason="manual"}} 3.0' in metrics
    out = claw("retention", ns, "--max-steps", "7", "--no-archive-before-evict")
    assert "max age 7d" in out and "max 7 steps (oldest first)" in out  # the rest kept
    assert "archive" not in out
    assert "retention of" in claw("retention", ns, "--clear")
    assert Store(redis_url, ns).config().retention is None


def test_the_evict_task_on_a_real_worker(store, start_worker, redis_url):

    store.commit(batch(episode(1, 40)), now=T0)
    store.commit(batch(episode(2, 40)))  # now
    store.set_retention(Retention(max_age=3600))
    start_worker("maintenance")
    sender(redis_url).send_task("claw.maintenance.evict", queue="maintenance")
    deadline = time.monotonic() + 60
    while store.evictions()["ttl"] < 40:
        assert time.monotonic() < deadline, "the worker did not evict"
        time.sleep(0.1)
    assert store.evictions()["ttl"] == 40
    assert sorted(store.get(sorted(live(store)), fields=[])["step_index"]) == list(range(40))
    assert_clean(store)


def test_dictionaries_shed_strings_no_live_step_uses(store):
    from claw_tasks.store.dictprune import GRACE_S

    def traj(e: int, n: int, first: int = 0) -> list[dict]:
        return episode(e, n, first=first, task_id=f"traj-{e}", tags={"prompt": f"p{e}"})

    store.commit(batch([s for e in range(20) for s in traj(e, 5)]), now=T0)
    store.commit(batch(traj(99, 5)), now=T0 + 3600)
    recipe = Recipe.model_validate(
        {
            "name": "one",
            "batch_size": 8,
            "fields": ["obs"],
            "sources": [{"name": "t", "where": {"task_id": "traj-3"}}],
        }
    )
    assert (sample(store, recipe, rng=np.random.default_rng(0))["obs"][:, 0] == 3).all()
    size = store.r.hlen(store.layout_keys.rdict("task_id"))
    store.set_retention(Retention(max_age=1800))
    first = evict_namespace(store, now=T0 + 3600)  # evicts 100 steps, marks 20 strings
    assert first["ttl"] == 100 and first["pruned"] == 0
    assert store.r.hlen(store.layout_keys.dpend("task_id")) == 20
    assert check_namespace(store.r, store.namespace).ok
    # traj-4 comes back before the sweep: revived with its old code, never swept.
    code4 = int(store.r.hget(store.layout_keys.dpend("task_id"), "traj-4").split(b":")[0])
    store.commit(batch(traj(4, 8, first=5)), now=T0 + 3600)
    assert int(store.r.hget(store.layout_keys.dict("task_id"), "traj-4")) == code4
    swept = evict_namespace(store, now=T0 + 3600 + GRACE_S + 1)["pruned"]
    assert swept == 2 * 19  # task_id and tags.prompt of the 19 gone trajectories
    assert store.r.hlen(store.layout_keys.rdict("task_id")) == size - 19
    assert store.r.hlen(store.layout_keys.dpend("task_id")) == 0
    assert check_namespace(store.r, store.namespace).ok
    # traj-3 comes back: a new code, and the sampler's cached code for it is forgotten.
    store.commit(batch(traj(3, 14, first=10)), now=T0 + 3600)
    assert int(store.r.hget(store.layout_keys.dict("task_id"), "traj-3")) > size - 1  # (+ counter)
    drawn = sample(store, recipe, rng=np.random.default_rng(1))
    assert (drawn["obs"][:, 0] == 3).all() and (drawn["obs"][:, 1] >= 10).all()
    assert check_namespace(store.r, store.namespace).ok
