"""The sampling index follows the change log and always equals a cold rebuild from Redis,
a process's own and the host's shared one (``orchestrator.sampling.shared``) alike."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.connection import resp
from claw_tasks.connection.resp import RoundTrips
from claw_tasks.store import Store, column_dtype
from claw_tasks.store.changes import LOG_SINCE, REREAD, page_commands, page_replies
from claw_tasks.store.slots import reread_columns
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.shared import SharedIndex
from tests.support.stepdata import batch, episode, interleave

pytestmark = pytest.mark.store(capacity=300)


@pytest.fixture(params=["own", "shared"])
def make(request):
    made: list[SamplingIndex] = []

    def new(store: Store) -> SamplingIndex:
        made.append(SamplingIndex(store) if request.param == "own" else SharedIndex(store))
        return made[-1]

    yield new
    for ix in made:
        if isinstance(ix, SharedIndex):
            ix.close()


def assert_cold_equal(ix: SamplingIndex) -> None:
    cold = SamplingIndex(ix.store)
    assert cold.sync() is None
    assert ix.columns.keys() == cold.columns.keys()
    for name, col in cold.columns.items():
        np.testing.assert_array_equal(ix.columns[name], col, err_msg=name)


def rows_of(ix: SamplingIndex, ids: np.ndarray) -> np.ndarray:
    seq = ids // ix.n_shards
    return np.sort(ids % ix.n_shards * ix.cap + (seq - 1) % ix.cap)


def live_ids(ix: SamplingIndex) -> np.ndarray:
    return ix.columns["id"][ix.columns["alive"]]


def test_follows_inserts_updates_curation_tags_and_ring(store, make):
    store.commit(batch(interleave(episode(1, 40, "terminated", task_id="a"), episode(2, 30))))
    ix = make(store)
    assert ix.sync() is None
    assert ix.columns["alive"].sum() == 70
    assert_cold_equal(ix)

    # Episode 2 goes on in a later commit; episode 3 commits its second half first.
    store.commit(batch(episode(2, 50, "truncated", first=30) + episode(3, 20, first=10)))
    before = set(live_ids(ix).tolist())
    changed = ix.sync()
    new = np.array(sorted(set(live_ids(ix).tolist()) - before))
    assert len(new) == 30
    assert set(rows_of(ix, new)) <= set(changed.tolist())
    store.commit(batch(episode(3, 10, task_id="b")))
    ix.sync()
    assert_cold_equal(ix)

    ids = live_ids(ix)[:60]
    prios = np.linspace(0.1, 6.0, 60).astype(np.float32)
    assert store.update_priorities(ids, prios) == 60
    changed = ix.sync()
    np.testing.assert_array_equal(changed, rows_of(ix, ids))
    by_id = dict(zip(ids.tolist(), prios.tolist(), strict=True))
    got = ix.columns["priority"][changed]
    assert got.tolist() == [by_id[i] for i in ix.columns["id"][changed].tolist()]
    assert_cold_equal(ix)

    store.curate(episode_id="ep1", quality="good")
    store.curate(ids[:5], trainable=False)
    ix.sync()
    assert_cold_equal(ix)

    store.commit(batch(episode(4, 25, "terminated", tags={"color": "red", "level": 2.0})))
    ix.sync()
    assert {"t:color", "t:level"} <= ix.columns.keys()
    assert_cold_equal(ix)

    # Past capacity: the ring overwrites the oldest slots of both shards.
    steps = interleave(*(episode(e, 60, "terminated") for e in range(5, 15)))
    for i in range(0, len(steps), 100):  # a commit bigger than a shard's ring expires
        assert store.commit(batch(steps[i : i + 100])).committed == 100
    changed = ix.sync()
    assert len(changed) == 2 * ix.cap
    assert_cold_equal(ix)
    assert not np.isin(ids, live_ids(ix)).any()


def test_trimmed_log_rebuilds_cold(store, r, make):
    store.commit(batch(episode(1, 30, "terminated")))
    ix = make(store)
    ix.sync()
    logs = [store.layout_keys.shard_key(s, "log") for s in range(ix.n_shards)]
    ids = live_ids(ix)
    store.update_priorities(ids, np.full(len(ids), 2.0))
    for key in logs:  # the priority events go before the index read them
        r.xtrim(key, maxlen=0)
    assert ix.sync() is None
    assert (ix.columns["priority"][ix.columns["alive"]] == 2.0).all()
    assert_cold_equal(ix)

    for key in logs:  # only entries already applied go: nothing to rebuild
        r.xtrim(key, maxlen=0)
    assert len(ix.sync()) == 0
    store.update_priorities(ids[:3], np.full(3, 5.0))
    np.testing.assert_array_equal(ix.sync(), rows_of(ix, ids[:3]))
    assert_cold_equal(ix)


def test_a_page_and_its_check_need_no_transaction(store, r):
    """A page is an XRANGE and then the check: a loss another client makes before the
    read, or between the two, shows as lost (after it: a rebuild that was not needed)."""
    store.commit(batch(episode(1, 30, "terminated")))
    key = store.layout_keys.shard_key(0, "log")
    r.script_load(LOG_SINCE.source)
    first = r.xrange(key, count=1)[0][0].decode()

    def page(last: str, seen: int, between: list | None = None) -> tuple[bool, list]:
        read, check = page_commands(key, last, seen, 1000)
        with r.pipeline(transaction=False) as pipe:
            pipe.execute_command(*read)
            if between:
                pipe.execute_command(*between)
            pipe.execute_command(*check)
            got = pipe.execute()
        ((lost, entries),) = page_replies([got[0], got[-1]])
        return lost, entries

    assert page("0-0", 0) == (False, [(e, f) for e, f in r.xrange(key)])
    assert page(first, 1) == (False, [(e, f) for e, f in r.xrange(key)][1:])
    assert page(first, 1, ["XADD", key, "*", "op", "x"])[0] is False  # growth is no loss
    added = r.xadd(key, {"op": "y"})
    assert page(first, 1, ["XDEL", key, added])[0] is True  # read, then deleted
    r.xtrim(key, maxlen=0)
    assert page(first, 1) == (True, [])
    r.xadd(key, {"op": "z"})
    assert page(first, 1, ["DEL", key])[0] is True  # the log gone
    assert page("0-0", 0) == (False, [])  # a reader that applied nothing lost nothing


def test_reread_tells_a_loss_as_the_pages_check_does(store, r):
    """``reread.lua``, which a sync's round trip queues after its XRANGE instead of
    ``log_since.lua``, reports the same losses: none for growth, one for an entry deleted
    or trimmed after the read, or the log gone; and re-reads nothing then."""
    store.commit(batch(episode(1, 30, "terminated")))
    ix = SamplingIndex(store)
    ix.sync()
    key, alive = store.layout_keys.shard_key(0, "log"), store.layout_keys.shard_key(0, "alive")
    r.script_load(REREAD.source)

    def lost(between: list | None = None) -> bool:
        cols = {c: column_dtype(c, ix.schema) for c in ix.columns if c != "alive"}
        args = [store.layout_keys.shard(0), ix.cap, ix.log_last[0], ix.log_seen[0], 64, 16_384]
        args += reread_columns(cols)
        with r.pipeline(transaction=False) as pipe:
            pipe.execute_command("XRANGE", key, f"({ix.log_last[0]}", "+", "COUNT", 1000)
            if between:
                pipe.execute_command(*between)
            REREAD.queue(pipe, [key, alive], args)
            reply = pipe.execute()[-1]
        assert reply[0] in (0, 1) and (reply[0] == 0 or len(reply) == 1)
        return bool(reply[0])

    store.commit(batch(episode(2, 5, "terminated")))
    assert not lost()
    assert not lost(["XADD", key, "*", "op", "x"])  # growth is no loss
    assert lost(["XDEL", key, r.xrange(key, count=1000)[-1][0]])  # read, then deleted
    assert lost(["XTRIM", key, "MAXLEN", 0])
    assert lost(["DEL", key])


def test_evict_event_and_unknown_events(store, r, make):
    store.commit(batch(episode(1, 30, "terminated")))
    ix = make(store)
    ix.sync()
    victim = int(live_ids(ix)[0])
    shard, seq = victim % ix.n_shards, victim // ix.n_shards
    slot = (seq - 1) % ix.cap
    log = store.layout_keys.shard_key(shard, "log")
    # What an allocation that takes back ring slots does: clear alive bits, log the range.
    r.setbit(store.layout_keys.shard_key(shard, "alive"), slot, 0)
    r.xadd(log, {"op": "evict", "seq": seq, "n": 1})
    np.testing.assert_array_equal(ix.sync(), [shard * ix.cap + slot])
    assert not ix.columns["alive"][shard * ix.cap + slot]
    assert_cold_equal(ix)

    r.xadd(log, {"op": "something-new"})
    assert ix.sync() is None
    assert_cold_equal(ix)


def test_error_half_way_leaves_the_index_cold(store, monkeypatch, make):
    store.commit(batch(episode(1, 10)))
    ix = make(store)
    ix.sync()
    store.commit(batch(episode(1, 20, first=10)))

    def fail(*_):
        raise ConnectionError("gone")

    monkeypatch.setattr(ix, "_reread", fail)
    with pytest.raises(ConnectionError):
        ix.sync()
    monkeypatch.undo()
    assert ix.sync() is None
    assert_cold_equal(ix)


@pytest.mark.parametrize("wire", ["own connection", "redis-py", "scripts flushed"])
def test_a_sync_reads_its_page_on_its_own_connection_or_through_redis_py(store, wire, monkeypatch):
    """A sync's round trip goes packed on the index's own connection; through a redis-py
    pipeline where that cannot speak to the server (no own connection) or is busy; and loads
    its scripts again after a SCRIPT FLUSH. The index equals a cold rebuild either way."""
    if wire == "redis-py":
        monkeypatch.setattr(resp, "plain_connection", lambda client: None)
    store.commit(batch(interleave(episode(1, 40, "terminated"), episode(2, 30))))
    ix = SamplingIndex(store)
    ix.sync()
    for e in range(3, 12):  # past the ring of 300: evictions, wrapping slots
        store.commit(batch(episode(e, 35, "terminated", task_id="a") + episode(e + 20, 20)))
        if wire == "scripts flushed":
            store.r.script_flush()
        assert len(ix.sync())
        assert_cold_equal(ix)
    assert (ix.round_trips.reader() is None) == (wire == "redis-py")
    if wire != "redis-py":
        with ix.round_trips.lock:  # another thread syncing: a redis-py pipeline
            store.commit(batch(episode(40, 10)))
            assert len(ix.sync())
        assert_cold_equal(ix)
    assert store.r.script_exists(REREAD.sha) == [True]


@pytest.mark.parametrize("limits", [(64, 16_384), (1, 16_384), (64, 10)])
def test_a_sync_rereads_committed_slots_in_its_page_round_trip(store, make, monkeypatch, limits):
    """The slots a page's entries name are read by ``reread.lua`` in the page's own round
    trip (one pipeline per sync), wrapping ring included; past its entry or slot limits in
    a second one. Either way the index equals a cold rebuild."""
    import claw_tasks.store.changes as changes

    monkeypatch.setattr(changes, "REREAD_ENTRIES", limits[0])
    monkeypatch.setattr(changes, "REREAD_SLOTS", limits[1])
    store.commit(batch(interleave(episode(1, 40, "terminated"), episode(2, 30))))
    ix = make(store)
    ix.sync()
    pipelines = []
    real = store.r.pipeline
    monkeypatch.setattr(store.r, "pipeline", lambda *a, **k: pipelines.append(1) or real(*a, **k))
    run = RoundTrips.run  # the sync's own connection: a round trip as well
    monkeypatch.setattr(RoundTrips, "run", lambda *a, **k: pipelines.append(1) or run(*a, **k))
    for e in range(3, 12):  # past the ring of 300: evict and ins entries, wrapping slots
        store.commit(batch(episode(e, 35, "terminated", task_id="a") + episode(e + 20, 20)))
        store.commit(batch(episode(e + 40, 5)))
        pipelines.clear()
        assert len(ix.sync())
        if isinstance(ix, SharedIndex):
            continue
        if e > 3:  # (the first loads the script)
            assert len(pipelines) == (1 if limits == (64, 16_384) else 2)
    monkeypatch.setattr(store.r, "pipeline", real)
    assert_cold_equal(ix)
