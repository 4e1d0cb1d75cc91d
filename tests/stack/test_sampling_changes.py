"""A changing store's sync and checked fetch: what the session keeps from each sync (the
live-step count), what a fetch does when a log lost the index's position, and a read
from the columns of the last sync (``read_steps(held=True)``) after commits."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator import Recipe, sample
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.sample import read_steps
from tests.support.stepdata import batch, episode, interleave


def recipe(sources: list, fields: list, batch_size: int) -> Recipe:
    return Recipe.model_validate(
        {"name": "r", "batch_size": batch_size, "fields": fields, "sources": sources}
    )


def cold_equal(ix: SamplingIndex) -> None:
    cold = SamplingIndex(ix.store)
    cold.sync()
    assert ix.columns.keys() == cold.columns.keys()
    for name, col in cold.columns.items():
        np.testing.assert_array_equal(ix.columns[name], col, err_msg=name)


@pytest.mark.store(capacity=60, n_shards=2)
def test_the_live_count_follows_each_sync_without_a_recount(store):
    """The session keeps the live steps it reports (``hit_rates``) from each sync's exact
    change of the alive flags (ring overwrites, evictions by id, both in one sync), not a
    count of the whole column; it equals that count after every batch."""
    r = recipe([{"name": "u"}], ["obs"], 8)
    ix = SamplingIndex(store)
    store.commit(batch(interleave(*(episode(e, 10, "terminated") for e in range(3)))))

    def live(ix: SamplingIndex, name: str) -> int:  # what hit_rates reports of its session
        return ix.attached["session"].bound[name].hits[1]

    sample(store, r, index=ix)
    for e in range(3, 15):
        store.commit(batch(episode(e, 10 + e % 4, "terminated")))  # the ring wraps
        if e % 3 == 0:  # evicted by id, some of them overwritten in the same sync after
            ids = ix.columns["id"][ix.columns["alive"]]
            store.evict(ids[::7].tolist())
            store.commit(batch(episode(e + 100, 9, "terminated")))
        sample(store, r, index=ix)
        assert live(ix, r.name) == int(ix.columns["alive"].sum())
    cold = SamplingIndex(store)
    cold.sync()
    assert live(ix, r.name) == int(cold.columns["alive"].sum())


@pytest.mark.store(capacity=100, n_shards=2)
def test_a_fetch_whose_logs_lost_the_index_position_leaves_it_to_the_sync(store):
    """The checked fetch reads each log from the index's last entry on (no loss check of
    its own): when that entry was trimmed away it refuses the batch and the sync decides
    (here nothing after it is lost: applied, not rebuilt); the batch holds the steps as
    stored and the index is what a cold rebuild gives."""
    store.commit(batch(interleave(*(episode(e, 10, "terminated", task_id="a") for e in range(4)))))
    r = recipe([{"name": "u"}], ["obs", "action", "next_obs"], 32)
    ix = SamplingIndex(store)
    sample(store, r, index=ix)
    sample(store, r, index=ix)  # quiet from here
    rebuilds, rebuild = [], ix.rebuild
    ix.rebuild = lambda: rebuilds.append(1) or rebuild()  # type: ignore[method-assign]
    for e in range(4, 7):
        store.commit(batch(episode(e, 10, "terminated", task_id="b")))
        for s in range(ix.n_shards):  # only the newest entry stays: the index's is gone
            log = store.layout_keys.shard_key(s, "log")
            store.r.xtrim(log, maxlen=1, approximate=False)
            assert store.r.xlen(log) == 1
        b = sample(store, r, index=ix)
        np.testing.assert_array_equal(b["obs"], store.get(b.ids, ["obs"])["obs"])
        cold_equal(ix)
    assert not rebuilds  # applied, never rebuilt: nothing after the positions was lost


@pytest.mark.store(capacity=60, n_shards=1)
def test_a_held_read_after_commits_reads_the_steps_as_stored(store):
    """``read_steps(held=True)`` reads from the columns of the last sync and lets the
    fetch's log check prove them current (nothing logged since: the log read is its only
    command, obs mirrored in the index); after a commit since (logged after the index's
    position) it syncs and reads again, so the steps come back as stored, and a step the
    ring overwrote meanwhile gives None, as an unheld read does."""
    r = recipe([{"name": "u"}], ["obs", "reward"], 10)
    ids = store.commit(batch(episode(0, 30, "terminated"))).ids
    want = read_steps(store, r, ids[:10])  # syncs, then reads
    assert want is not None
    store.r.config_resetstat()
    again = read_steps(store, r, ids[:10], held=True)  # nothing logged since
    assert again is not None
    calls = {k.removeprefix("cmdstat_") for k in store.r.info("commandstats")}
    assert calls - {"config|resetstat", "info"} == {"xrange"}  # the log check: no sync
    np.testing.assert_array_equal(again["obs"], want["obs"])
    store.commit(batch(episode(1, 20, "terminated")))  # 50 of 60 slots: nothing overwritten
    got = read_steps(store, r, ids[:10], held=True)
    assert got is not None
    np.testing.assert_array_equal(got["obs"], want["obs"])
    np.testing.assert_array_equal(got["reward"], want["reward"])
    store.commit(batch(episode(2, 20, "terminated")))  # the ring overwrites ids[:10]
    assert read_steps(store, r, ids[:10], held=True) is None
    assert read_steps(store, r, ids[:10]) is None
    tail = read_steps(store, r, ids[20:30], held=True)
    assert tail is not None
    np.testing.assert_allclose(tail["reward"], 0 + np.arange(20, 30) / 100, rtol=1e-6)
