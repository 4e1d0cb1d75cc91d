"""``timestamp`` as run tables (store format 3): commit.lua splices each commit's runs into
the blocks' tables, across commits, block ends, the ring's end and skipped rows, and every
reader (get, whole columns, range scans, the sampling index, doctor) expands the same
per-slot times; eviction leaves the tables alone (the alive bits decide liveness)."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.store import Store
from claw_tasks.store.check import check_namespace
from claw_tasks.store.layout import RUN_CHUNK_SLOTS, RUN_ENTRY, runs_of
from claw_tasks.store.scan import read_meta_run
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.maintenance.restore import restore
from orchestrator.sampling.index import SamplingIndex
from tests.support.stepdata import batch, episode

CAP = 2500  # not a multiple of RUN_CHUNK_SLOTS: the last block is short

pytestmark = pytest.mark.store(capacity=CAP, n_shards=1)


def tables(store: Store) -> dict[int, np.ndarray]:
    """The shard's run tables by block."""
    out = {}
    for block in range(-(-CAP // RUN_CHUNK_SLOTS)):
        raw = store.r.get(store.layout_keys.runs(0, "timestamp", block))
        if raw is not None:
            out[block] = np.frombuffer(raw, RUN_ENTRY)
    return out


def assert_matches(store: Store, model: np.ndarray) -> None:
    """Every reader sees the model's per-slot times, and each block's table is exactly the
    runs of its slots' times (equal neighbours merged, no record for leading zeros)."""
    cols = store.meta_columns(0, ["id", "timestamp"])
    np.testing.assert_array_equal(cols["timestamp"], model)
    got = tables(store)
    for block in range(-(-CAP // RUN_CHUNK_SLOTS)):
        part = model[block * RUN_CHUNK_SLOTS : (block + 1) * RUN_CHUNK_SLOTS]
        first, values = runs_of(part)
        keep = slice(1, None) if values[0] == 0 else slice(None)
        table = got.get(block, np.zeros(0, RUN_ENTRY))
        assert table["slot"].tolist() == first[keep].tolist(), block
        assert table["value"].tolist() == values[keep].tolist(), block
    seq = int(store.r.get(store.layout_keys.shard_key(0, "seq")))
    lo = max(1, seq - CAP + 1)
    slot0 = (lo - 1) % CAP
    n = min(CAP - slot0, seq - lo + 1)  # the run up to the ring's end
    run = read_meta_run(store, 0, lo, n, ["timestamp"])
    np.testing.assert_array_equal(run["timestamp"], model[slot0 : slot0 + n])
    alive = np.flatnonzero(cols["alive"])
    some = cols["id"][alive[:: max(1, len(alive) // 50)]]
    np.testing.assert_array_equal(store.get(some, fields=[])["timestamp"], model[(some - 1) % CAP])
    report = check_namespace(store.r, store.namespace)
    assert report.ok, report.problems


@pytest.mark.both_stores
def test_runs_splice_across_commits_block_ends_and_the_ring(store):
    rng = np.random.default_rng(7)
    model = np.zeros(CAP)
    seq, t = 0, 1000.0
    # Sizes that end inside blocks, on block ends, span several blocks, and wrap the ring;
    # some commits share a time (their runs merge).
    sizes = [1, 1, 300, 724, 1, 1023, 1, 1500, 7, 2048, 3, 999, 1, 1, 2500, 450, 1]
    for ep, size in enumerate(sizes):
        t = t if rng.random() < 0.25 else t + 1.0
        res = store.commit(batch(episode(ep, size)), now=t)
        kept = res.ids[res.ids > 0]
        assert res.committed == len(kept) == min(size, CAP)
        model[(kept - 1) % CAP] = t
        seq += size
        assert_matches(store, model)
    assert seq > 3 * CAP


def test_per_row_times_of_a_restore(store):
    """A restore commits each row's own time: runs of one, equal neighbours merged."""
    times = np.repeat(np.arange(2000.0, 2400.0), np.tile([1, 3, 2, 1], 100))[:700]
    times[::50] = np.nan  # any float64 round-trips, NaN too
    res = store.commit(batch(episode(1, 700)), now=times)
    model = np.zeros(CAP)
    model[(res.ids - 1) % CAP] = times
    cols = store.meta_columns(0, ["timestamp"])
    np.testing.assert_array_equal(cols["timestamp"][:700], times)
    n_runs = len(runs_of(model[:RUN_CHUNK_SLOTS])[0])  # and the zeros after them
    assert len(tables(store)[0]) == n_runs < 700
    # Later commits of one time go over part of those runs and keep the rest.
    res = store.commit(batch(episode(2, 100)), now=3000.0)
    model[(res.ids - 1) % CAP] = 3000.0
    got = store.meta_columns(0, ["timestamp"])["timestamp"]
    np.testing.assert_array_equal(got, model)


def test_eviction_keeps_the_tables_and_later_commits_splice_over(store):
    model = np.zeros(CAP)
    for k, size in enumerate([600, 900, 700]):
        res = store.commit(batch(episode(k, size)), now=100.0 + k)
        model[(res.ids - 1) % CAP] = 100.0 + k
    before = tables(store)
    cols = store.meta_columns(0, ["id"])
    victims = cols["id"][cols["alive"]][550:1700:3]
    assert store.evict(victims) == len(victims)
    after = tables(store)
    assert before.keys() == after.keys()
    assert all(before[b].tobytes() == after[b].tobytes() for b in before)
    cols = store.meta_columns(0, ["id", "timestamp"])
    alive = cols["alive"]
    assert alive.sum() == 2200 - len(victims)
    np.testing.assert_array_equal(cols["timestamp"][alive], model[alive])
    # Past the ring: the new commits take the evicted slots' places as any others.
    for k, size in enumerate([800, 1200], start=3):
        res = store.commit(batch(episode(k, size)), now=100.0 + k)
        model[(res.ids - 1) % CAP] = 100.0 + k
    cols = store.meta_columns(0, ["timestamp"])
    alive = cols["alive"]
    np.testing.assert_array_equal(cols["timestamp"][alive], model[alive])
    report = check_namespace(store.r, store.namespace)
    assert report.ok, report.problems


def test_sampling_index_rereads_times_as_a_cold_build(store):
    store.commit(batch(episode(1, 1500)), now=10.0)
    ix = SamplingIndex(store)
    ix.sync()
    for k, size in enumerate([30, 1100, 2000]):
        store.commit(batch(episode(2 + k, size)), now=20.0 + k)
        ix.sync()
        cold = SamplingIndex(store)
        cold.sync()
        np.testing.assert_array_equal(ix.columns["timestamp"], cold.columns["timestamp"])
        want = store.meta_columns(0, ["timestamp"])["timestamp"]
        np.testing.assert_array_equal(ix.columns["timestamp"], want)


def test_doctor_names_a_broken_run_table(store):
    store.commit(batch(episode(1, 100)), now=5.0)
    key = store.layout_keys.runs(0, "timestamp", 0)
    good = store.r.get(key)
    bad = np.array([(10, 1.0), (3, 2.0)], RUN_ENTRY).tobytes()
    for raw, says in ((good + b"x", "not whole run records"), (bad, "not increasing")):
        store.r.set(key, raw)
        (problem,) = check_namespace(store.r, store.namespace).problems
        assert problem.check == "chunks" and says in problem.detail
    store.r.set(key, good)
    store.r.set(store.layout_keys.meta(0, "timestamp", 0), b"\0" * 8)  # a format 2 column
    (problem,) = check_namespace(store.r, store.namespace).problems
    assert problem.check == "keys" and "run tables" in problem.detail
    store.r.delete(store.layout_keys.meta(0, "timestamp", 0))


@pytest.mark.parametrize("every", [0, 7, 10], ids=["one-time", "runs-of-7", "runs-of-10"])
def test_rows_newer_steps_took_keep_the_newer_times(store, every):
    """A commit landing after newer seqs took the slots of its first rows (they expire)
    splices only the rows it commits: its runs from the first committed row on (one that
    starts there, or one that began among the skipped rows)."""
    late = batch(episode(1, 1000))
    assert store.allocate(0, late.batch_id, 1000) == (1, "new")
    model = np.zeros(CAP)
    res = store.commit(batch(episode(2, 2000)), now=50.0)  # seqs 1001..3000: wraps over 1..500
    model[(res.ids - 1) % CAP] = 50.0
    times = 40.0 + (np.arange(1000) // every if every else np.zeros(1000))
    res = store.commit(late, now=times)
    assert res.expired == 500 and res.committed == 500
    model[(res.ids[500:] - 1) % CAP] = times[500:]
    assert_matches(store, model)


def test_archive_and_restore_keep_every_steps_own_time(store, tmp_path):
    """The archive keeps each step's time; the restore commits them per row (runs where
    neighbours share one), so every step reads its own time back."""
    for k, size in enumerate([700, 1, 1300, 40]):
        store.commit(batch(episode(k, size)), now=500.0 + k)
    archive_namespace(store, tmp_path)
    back = Store(store.r, store.namespace + "-back")
    assert restore(tmp_path, back).rows == 2041

    def times(s: Store) -> dict[tuple[int, int], float]:
        cols = s.meta_columns(0, ["episode", "step_index", "timestamp"])
        alive = cols["alive"]
        ep, idx, ts = (cols[c][alive].tolist() for c in ("episode", "step_index", "timestamp"))
        return dict(zip(zip(ep, idx, strict=True), ts, strict=True))

    assert times(back) == times(store)
    assert {len(t) for t in tables(back).values()} <= {1, 2, 3}  # runs, not one per step
    drop_namespace(back.r, back.namespace)
