"""The gateway's spool on a real directory: what a process left is found by the next one,
settled calls and their segments go, a full spool refuses a call, a record cut short by a
kill ends its segment's reading, and one process holds a spool at a time."""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable

import pytest

from orchestrator.gateway.calls import Call, call_of_record, call_record
from orchestrator.gateway.spool import Spool, SpoolLocked


def meta(call_id: str) -> bytes:
    return json.dumps({"call_id": call_id}).encode()


def died(work: Callable[[], object]) -> None:
    """Run ``work`` in a child process that then dies without closing anything."""
    pid = os.fork()
    if pid == 0:
        try:
            work()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_unsettled_calls_and_their_batch_are_found_by_the_next_process(tmp_path):

    def work() -> None:
        s = Spool(tmp_path, 1 << 20)
        for c in ("a", "b", "c", "d"):
            assert s.append_call(c, meta(c), c.encode() * 3)
        s.group("batch-1", ["a", "b"])
        s.group("batch-2", ["c"])
        s.settle(["c"])  # committed; d never grouped

    died(work)
    again = Spool(tmp_path, 1 << 20)
    found = {f.call_id: f for f in again.found}
    assert list(found) == ["a", "b", "d"]
    assert [found[c].batch_id for c in found] == ["batch-1", "batch-1", ""]
    assert found["d"].body == b"ddd"
    again.settle(["a", "b", "d"])
    again.close()
    assert not tmp_path.exists()  # nothing unsettled: removed


def test_settled_segments_are_deleted_oldest_first(tmp_path):
    s = Spool(tmp_path, 1 << 20, segment_bytes=200)
    for i in range(10):
        assert s.append_call(f"c{i}", meta(f"c{i}"), b"x" * 100)
    assert len(list(tmp_path.glob("*.spool"))) >= 5
    s.settle([f"c{i}" for i in range(1, 10)])  # c0 holds the oldest segment
    assert len(list(tmp_path.glob("*.spool"))) >= 5
    s.settle(["c0"])
    assert len(list(tmp_path.glob("*.spool"))) == 1  # the active one
    assert s.size < 200


def test_a_full_spool_refuses_a_call_until_space_is_settled(tmp_path):
    s = Spool(tmp_path, 1000, segment_bytes=300)
    kept = [s.append_call(f"c{i}", meta(f"c{i}"), b"x" * 200) for i in range(6)]
    assert kept == [True, True, True, True, False, False]
    s.settle(["c0", "c1"])
    assert s.append_call("c9", meta("c9"), b"x" * 200)


def test_a_record_cut_short_ends_its_segment(tmp_path):

    def work() -> None:
        s = Spool(tmp_path, 1 << 20)
        s.append_call("a", meta("a"), b"whole")
        s.append_call("b", meta("b"), b"cut short")

    died(work)
    seg = next(tmp_path.glob("*.spool"))
    seg.write_bytes(seg.read_bytes()[:-4])  # killed in the middle of b's write
    assert [f.call_id for f in Spool(tmp_path, 1 << 20).found] == ["a"]


def test_one_process_holds_a_spool_of_one_namespace(tmp_path):
    held = Spool(tmp_path, 1 << 20, owner="ns")
    with pytest.raises(SpoolLocked, match="held by another gateway process"):
        Spool(tmp_path, 1 << 20, owner="ns")
    held.append_call("a", meta("a"), b"")
    held.close()  # "a" is left in it
    with pytest.raises(SpoolLocked, match="holds calls of 'ns', not 'other'"):
        Spool(tmp_path, 1 << 20, owner="other")
    again = Spool(tmp_path, 1 << 20, owner="ns")
    again.settle(["a"])
    again.close()
    Spool(tmp_path, 1 << 20, owner="other").close()  # empty: anyone's


def test_a_call_comes_back_from_its_record_as_it_was():
    call = Call(
        "t1",
        "g",
        "chat",
        {"messages": [{"role": "user", "content": "hé"}], "n": 2},
        b'{"id": "x"}\xff',
        True,
        {"task": "add"},
        "7",
        "c0ffee",
        ("t1~0", "t1~1"),
    )
    assert call_of_record(call_record(call), call.reply) == call


def test_a_whole_record_that_is_not_ours_is_skipped(tmp_path):
    """A record whose crc holds but whose JSON is not a spool's (a foreign or damaged
    file) is skipped with a warning; the records around it are read."""

    def work() -> None:
        s = Spool(tmp_path, 1 << 20)
        s.append_call("a", meta("a"), b"one")
        s.append_call("bad", b"[1, 2", b"")
        s.append_call("nameless", b"{}", b"")
        s.append_call("c", meta("c"), b"two")
        s.group("batch-1", ["a"])

    died(work)
    seg = max(tmp_path.glob("*.spool"))
    ack = b'{"c": 5}'  # an ack naming no list of calls, in the documented framing
    seg.write_bytes(seg.read_bytes() + struct.pack("<BIII", 3, len(ack), 0, zlib.crc32(ack)) + ack)
    found = Spool(tmp_path, 1 << 20).found
    assert [(f.call_id, f.batch_id) for f in found] == [("a", "batch-1"), ("c", "")]


def test_a_spool_others_may_write_to_is_refused(tmp_path):
    """Its records become stored turns: a directory open to other users is refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        Spool(shared, 1 << 20)
    Spool(tmp_path / "own", 1 << 20).close()  # made by the spool: this user's, 0700
