"""Change-log entries decoded as readers see them (``claw_tasks.store.changes.event``)."""

from __future__ import annotations

import numpy as np

from claw_tasks.store.changes import event


def test_a_slot_range_parses_its_links_only_when_asked():
    fields = {b"seq": b"5", b"n": b"3", b"links": b"2:3,4:1"}
    e = event(fields)
    assert (e.kind, e.seq, e.n) == ("slots", 5, 3)
    np.testing.assert_array_equal(e.links[0], [2, 4])
    np.testing.assert_array_equal(e.links[1], [3, 1])
    bare = event(fields, links=False)
    assert (bare.kind, bare.seq, bare.n, bare.links) == ("slots", 5, 3, None)


def test_a_forget_entry_without_codes_or_column_prunes_nothing():
    codes = np.array([7, 9], "<i4").tobytes()
    e = event({b"op": b"forget", b"col": b"task_id", b"codes": codes})
    assert (e.kind, e.col, e.codes.tolist()) == ("forgotten", "task_id", [7, 9])
    for fields in ({b"op": b"forget", b"col": b"task_id"}, {b"op": b"forget"}):
        e = event(fields)
        assert e.kind == "forgotten" and not len(e.codes)
    assert event({b"op": b"other"}).kind == "unknown"
