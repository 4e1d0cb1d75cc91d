"""Run tables (``layout.expand_runs``, ``runs_of``, ``run_blocks``): what commit.lua writes
reads back per slot, zeros before a block's first record and in a block with no key; the
metadata chunks a pass walks (``meta_spans``) cover a shard."""

from __future__ import annotations

import itertools

import numpy as np

from claw_tasks.store.layout import (
    RUN_CHUNK_SLOTS,
    RUN_ENTRY,
    expand_runs,
    meta_chunk_of,
    meta_spans,
    run_blocks,
    runs_of,
)

R = RUN_CHUNK_SLOTS


def table(*records: tuple[int, float]) -> bytes:
    return np.array(list(records), RUN_ENTRY).tobytes()


def test_runs_of_starts_each_run_of_equal_values():
    first, values = runs_of(np.array([5.0, 5.0, 6.0, 6.0, 6.0, 5.0]))
    assert first.tolist() == [0, 2, 5] and values.tolist() == [5.0, 6.0, 5.0]
    first, values = runs_of(np.zeros(0))
    assert len(first) == len(values) == 0


def test_run_blocks_cover_a_slot_range():
    assert list(run_blocks(0, 1)) == [0]
    assert list(run_blocks(R - 1, R + 1)) == [0, 1]
    assert list(run_blocks(R, 3 * R)) == [1, 2]
    assert list(run_blocks(5, 5)) == []


def test_expand_runs_over_consecutive_blocks():
    tables = [table((3, 1.5), (10, 2.5)), None, table((0, 7.0)), b""]
    at = np.array([0, 2, 3, 9, 10, R - 1, R, 2 * R - 1, 2 * R, 3 * R - 1, 3 * R, 4 * R - 1])
    got = expand_runs(tables, at, np.dtype("<f8"))
    assert got.tolist() == [0, 0, 1.5, 1.5, 2.5, 2.5, 0, 0, 7.0, 7.0, 0, 0]
    assert expand_runs([], np.zeros(0, np.int64), np.dtype("<f8")).tolist() == []


def test_a_slice_of_positions_reads_as_the_same_positions_listed():
    tables = [table((3, 1.5), (10, 2.5)), None, table((0, 7.0), (R - 1, 8.0)), b""]
    for lo, hi in [(0, 4 * R), (2, 11), (R - 2, 2 * R + 3), (3 * R - 1, 3 * R + 1), (5, 5)]:
        want = expand_runs(tables, np.arange(lo, hi), np.dtype("<f8"))
        got = expand_runs(tables, slice(lo, hi), np.dtype("<f8"))
        assert got.tolist() == want.tolist()
    assert expand_runs([None, None], slice(0, 2 * R), np.dtype("<f8")).tolist() == [0] * 2 * R


def test_one_block_at_a_slice_reads_as_its_positions_listed():
    """The one-table slice (a sync's span) gives what the general case gives."""
    rng = np.random.default_rng(0)
    for n in [0, 1, 3, 40]:
        slots = np.sort(rng.choice(R, n, replace=False))
        tables = [table(*zip(slots.tolist(), rng.uniform(1, 9, n).tolist(), strict=True))]
        for lo, hi in [
            (0, R),
            (0, 1),
            (R - 1, R),
            (5, 300),
            (7, 7),
            (int(slots[0]) if n else 0, R),
        ]:
            want = expand_runs([*tables, None], np.arange(lo, hi), np.dtype("<f8"))
            got = expand_runs(tables, slice(lo, hi), np.dtype("<f8"))
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert expand_runs([None], slice(2, 9), np.dtype("<f8")).tolist() == [0] * 7


def test_meta_spans_cover_a_shard() -> None:
    for cap in (1, 600, 16376, 16377, 50000):
        spans = meta_spans(cap)
        assert spans[0][0] == 0 and spans[-1][1] == cap
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        starts = np.array([s for s, _ in spans])
        assert (meta_chunk_of(starts) == np.arange(len(spans))).all()
        assert (meta_chunk_of(np.array([e - 1 for _, e in spans])) == np.arange(len(spans))).all()
