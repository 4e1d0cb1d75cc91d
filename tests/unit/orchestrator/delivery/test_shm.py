"""Same-host shared-memory path: cross-process round trip, reclamation, orphan reaping
(never of a segment reused long after it was made)."""

import gc
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.delivery import shm
from orchestrator.delivery.wire import (
    VERSION,
    Pending,
    WireVersionError,
    decode_batch,
    is_batch,
    to_wire,
)
from orchestrator.sampling import shmfiles
from tests.support.paths import ROOT

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="needs /dev/shm")


MAKE_BATCH = """
import numpy as np
from orchestrator.delivery.wire import to_wire
rng = np.random.default_rng(5)
wire = to_wire(
    {"obs": rng.integers(0, 256, (64, 84, 84, 3), dtype=np.uint8),
     "reward": rng.normal(size=64).astype(np.float32)},
    ids=np.arange(64) + 1000, weights=rng.random(64), source_index=np.arange(64) % 2,
    sources=["hard", "easy"], recipe_version=3, meta={"worker": "w1"},
)
"""


def expected_batch():
    scope: dict = {}
    exec(MAKE_BATCH, scope)
    return scope["wire"]


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, **kwargs)


def ref_name(msg: bytes) -> str:
    return shm.reference_of(msg)["name"]


def test_round_trip_through_another_process_and_segment_reclaimed():
    writer = MAKE_BATCH + (
        "import sys\nfrom orchestrator.delivery import shm\n"
        "sys.stdout.buffer.write(shm.to_message(wire, reader_host=shm.host_id(), threshold=0))\n"
    )
    proc = run_python(writer, stdout=subprocess.PIPE)
    msg, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and not is_batch(msg)  # a reference, not the batch
    name = ref_name(msg)
    assert (shm.SHM_DIR / name).exists()  # survives its (exited) creator until read

    batch = shm.from_message(msg)
    assert not (shm.SHM_DIR / name).exists()  # unlinked as soon as it is mapped
    gc.collect()
    reference = decode_batch(expected_batch().tobytes())
    for field in ("obs", "reward"):
        np.testing.assert_array_equal(batch[field], reference[field])
    np.testing.assert_array_equal(batch.ids, reference.ids)
    np.testing.assert_array_equal(batch.weights, reference.weights)
    assert batch.sources == ("hard", "easy") and batch.recipe_version == 3
    assert batch.meta == {"worker": "w1"}
    batch["reward"][0] = 1.0  # writable private view of the (now anonymous) segment
    with pytest.raises(shm.SegmentMissing):
        shm.from_message(msg)


def test_host_id_is_stable_across_processes():
    code = "from orchestrator.delivery import shm; print(shm.host_id())"
    proc = run_python(code, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert out.decode().strip() == shm.host_id()


def test_inline_when_small_or_other_host():
    wire = to_wire({"x": np.arange(10)}, ids=range(10))
    for msg in (
        shm.to_message(wire, reader_host=shm.host_id()),  # below the threshold
        shm.to_message(wire, reader_host="elsewhere", threshold=0),
        shm.to_message(wire, reader_host=None, threshold=0),
    ):
        assert is_batch(msg)
        np.testing.assert_array_equal(shm.from_message(msg)["x"], np.arange(10))


def test_reference_from_another_host_is_rejected():
    wire = to_wire({"x": np.arange(10)}, ids=range(10))
    msg = shm.to_message(wire, reader_host=shm.host_id(), threshold=0)
    ref = shm.reference_of(msg)
    forged = shm.reference_message(ref["name"], ref["size"], "other")
    try:
        with pytest.raises(ValueError, match="from host other"):
            shm.from_message(forged)
    finally:
        shm.from_message(msg)
    with pytest.raises(ValueError, match="not a Claw"):
        shm.from_message(b"garbage")


def test_reference_of_an_unknown_version_is_refused_and_left_to_the_reaper():
    wire = to_wire({"x": np.arange(10)}, ids=range(10))
    msg = shm.to_message(wire, reader_host=shm.host_id(), threshold=0)
    name = ref_name(msg)
    newer = msg[:4] + struct.pack("<I", VERSION + 1) + msg[8:]
    try:
        with pytest.raises(WireVersionError, match=f"version {VERSION + 1}, .* version {VERSION}"):
            shm.from_message(newer)
        shm.discard(newer)  # cannot be read: not touched, the reaper gets it
        assert (shm.SHM_DIR / name).exists()
    finally:
        shm.discard(msg)
    assert not (shm.SHM_DIR / name).exists()


def test_reaper_removes_segment_of_sigkilled_creator():
    writer = MAKE_BATCH + (
        "import sys, time\nfrom orchestrator.delivery import shm\n"
        "print(shm.write_segment(wire), flush=True)\ntime.sleep(60)\n"
    )
    proc = run_python(writer, stdout=subprocess.PIPE)
    name = proc.stdout.readline().decode().strip()
    assert (shm.SHM_DIR / name).exists()
    assert name not in shmfiles.reap_orphans(max_age_s=3600, dead_grace_s=0)  # creator alive
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    assert name in shmfiles.reap_orphans(max_age_s=3600, dead_grace_s=0)
    assert not (shm.SHM_DIR / name).exists()


def test_reaper_ttl_and_grace():
    wire = to_wire({"x": np.arange(10)}, ids=range(10))
    name = shm.write_segment(wire)
    path = shm.SHM_DIR / name
    try:
        assert name not in shmfiles.reap_orphans(max_age_s=60)  # our own, fresh
        old = time.time() - 120
        os.utime(path, (old, old))
        assert name in shmfiles.reap_orphans(max_age_s=60)
    finally:
        path.unlink(missing_ok=True)


def test_failed_write_leaves_nothing(monkeypatch):
    def full(fd, chunks):  # /dev/shm fills up halfway through the batch
        os.write(fd, b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm, "_write_all", full)
    mine = f"{shmfiles.SEGMENT_PREFIX}*-{os.getpid()}-*"
    before = set(shm.SHM_DIR.glob(mine))
    wire = to_wire({"x": np.arange(10)}, ids=range(10))
    msg = shm.to_message(wire, reader_host=shm.host_id(), threshold=0)
    assert is_batch(msg)  # fell back to inline
    assert set(shm.SHM_DIR.glob(mine)) == before


def _frame(value: int):
    return to_wire({"x": np.full((64, 4096), value, np.uint8)}, ids=range(64))


def _write(value: int) -> bytes:
    return shm.to_message(_frame(value), reader_host=shm.host_id(), threshold=0)


def _inode(msg: bytes) -> int:
    return (shm.SHM_DIR / ref_name(msg)).stat().st_ino


def _taken(msg: bytes) -> Path:
    return shm.SHM_DIR / f"{ref_name(msg)}{shm.TAKEN}"


def test_a_segment_is_reused_only_once_its_reader_dropped_the_batch():
    shm.release_pool()
    first = _write(1)
    ino = _inode(first)
    held = shm.from_message(first)
    later = [_write(2), _write(3)]
    inodes = {ino, *(_inode(m) for m in later)}
    assert len(inodes) == 3  # held by a reader: not reused
    for value, m in zip((2, 3), later, strict=True):
        assert (shm.from_message(m)["x"] == value).all()  # read and dropped at once
    assert (held["x"] == 1).all()  # never written over while held
    del held
    gc.collect()
    again = [_write(v) for v in (4, 5, 6)]
    assert {_inode(m) for m in again} == inodes  # all three reused, no new segment
    assert not {ref_name(m) for m in again} & {ref_name(m) for m in [first, *later]}
    with pytest.raises(shm.SegmentMissing):  # fresh names: an old reference stays dead
        shm.from_message(first)
    for value, m in zip((4, 5, 6), again, strict=True):
        assert (shm.from_message(m)["x"] == value).all()


def test_a_segment_whose_reader_was_killed_is_reused():
    shm.release_pool()
    msg = _write(7)
    ino = _inode(msg)
    reader = (
        "import sys, time\nfrom orchestrator.delivery import shm\n"
        "batch = shm.from_message(bytes.fromhex(sys.argv[1]))\n"
        "print(int(batch['x'].sum()), flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", reader, msg.hex()], env=env, cwd=ROOT, stdout=subprocess.PIPE
    )
    assert int(proc.stdout.readline()) == 7 * 64 * 4096  # it holds the batch
    busy = _write(8)
    assert _inode(busy) != ino
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    shm.discard(busy)  # gone from /dev/shm, and so from the pool
    assert not (shm.SHM_DIR / ref_name(busy)).exists()
    again = _write(9)
    assert _inode(again) == ino  # the killed reader's lock went with it
    assert (shm.from_message(again)["x"] == 9).all()


def test_the_pool_is_bounded_and_released_at_exit(monkeypatch):
    shm.release_pool()
    monkeypatch.setattr(shm, "POOL_SIZE", 2)
    msgs = [_write(i) for i in range(4)]
    inodes = [_inode(m) for m in msgs]
    held = [shm.from_message(m) for m in msgs]  # all taken: four segments
    del held
    gc.collect()
    reused = _write(5)
    assert _inode(reused) in inodes[2:]  # only the two newest are still tracked
    try:
        shm.release_pool()  # what exit does: the free one is unlinked ...
        assert [_taken(m).exists() for m in msgs[2:]].count(True) == 0
        assert (shm.SHM_DIR / ref_name(reused)).exists()  # ... a queued one stays
        assert all(_taken(m).exists() for m in msgs[:2])  # forgotten: left to the reaper
    finally:
        shm.discard(reused)
        for m in msgs[:2]:
            _taken(m).unlink(missing_ok=True)


def test_symlinked_segment_is_refused_and_its_target_untouched(tmp_path):
    """A `claw-*` symlink planted in /dev/shm must not be followed (the reader
    would map the target read-write)."""
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 64)
    name = f"{shmfiles.SEGMENT_PREFIX}planted-{os.getpid()}"
    link = shm.SHM_DIR / name
    link.symlink_to(target)
    try:
        with pytest.raises(ValueError, match="cannot open it safely"):
            shm.from_message(shm.reference_message(name, 64, shm.host_id()))
    finally:
        link.unlink(missing_ok=True)
    assert target.read_bytes() == b"x" * 64


def test_segment_that_is_not_a_regular_file_is_refused():
    name = f"{shmfiles.SEGMENT_PREFIX}fifo-{os.getpid()}"
    os.mkfifo(shm.SHM_DIR / name)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            shm.from_message(shm.reference_message(name, 0, shm.host_id()))
    finally:
        (shm.SHM_DIR / name).unlink(missing_ok=True)


def _pending_frame():
    """A batch whose ``x`` is laid out but not yet written (``Pending``)."""
    return to_wire({"x": Pending(np.uint8, (64, 4096)), "y": np.arange(64)}, ids=range(64))


def _fill(value: int):
    def fill(out):
        out["x"][:] = value

    return fill


def _deliver(value: int) -> bytes:
    return shm.deliver(_pending_frame(), _fill(value), reader_host=shm.host_id(), threshold=0)


def test_pending_fields_are_written_straight_into_a_reused_segment():
    shm.release_pool()
    first = _deliver(1)  # no free segment yet: filled into arrays, written as before
    ino = _inode(first)
    batch = shm.from_message(first)
    assert (batch["x"] == 1).all() and (batch["y"] == np.arange(64)).all()
    del batch
    gc.collect()
    seen = []
    again = shm.deliver(
        _pending_frame(),
        lambda out: (seen.append(out["x"].base is not None), _fill(2)(out)),
        reader_host=shm.host_id(),
        threshold=0,
    )
    assert _inode(again) == ino and seen == [True]  # filled in the segment's mapping
    got = shm.from_message(again)
    want = _pending_frame()
    want.place({"x": np.full((64, 4096), 2, np.uint8)})
    assert decode_batch(want.tobytes()).fields.keys() == got.fields.keys()
    assert (got["x"] == 2).all() and (got["y"] == np.arange(64)).all()
    assert bytes((shm.SHM_DIR / f"{ref_name(again)}{shm.TAKEN}").read_bytes()) == want.tobytes()


def test_a_fill_that_fails_leaves_its_segment_free():
    shm.release_pool()
    msg = _deliver(1)
    ino = _inode(msg)
    shm.from_message(msg)  # read and dropped
    gc.collect()

    def broken(out):
        raise ValueError("augmentation failed")

    with pytest.raises(ValueError, match="augmentation failed"):
        shm.deliver(_pending_frame(), broken, reader_host=shm.host_id(), threshold=0)
    again = _deliver(3)
    assert _inode(again) == ino  # free again, reused
    assert (shm.from_message(again)["x"] == 3).all()


def test_pending_fields_go_inline_to_another_host():
    msg = shm.deliver(_pending_frame(), _fill(4), reader_host="elsewhere", threshold=0)
    assert is_batch(msg) and (decode_batch(msg)["x"] == 4).all()


@pytest.mark.parametrize("send", [_write, _deliver], ids=["written", "filled in place"])
def test_a_segment_reused_long_after_it_was_made_is_not_reaped(send):
    shm.release_pool()
    first = send(1)
    ino = _inode(first)
    shm.from_message(first)  # read and dropped: free
    gc.collect()
    old = time.time() - 3600
    os.utime(_taken(first), (old, old))  # made an hour ago
    again = send(2)
    assert _inode(again) == ino  # the same segment
    assert ref_name(again) not in shmfiles.reap_orphans(max_age_s=600)  # queued just now
    assert (shm.from_message(again)["x"] == 2).all()
