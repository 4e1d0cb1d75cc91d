"""One sampling index per host and namespace, shared by real processes: the same batches
as a process's own index, no torn rows while a writer works, a writer SIGKILLed half-way
replaced by the next process to sync, one mirror for a prefetch worker's pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from orchestrator.sampling.index import LogRead, SamplingIndex
from orchestrator.sampling.shared import H_DIRTY, H_WROTE, SharedIndex, index_key
from orchestrator.sampling.shmfiles import SHM_DIR, reap_orphans
from tests.support.paths import ROOT
from tests.support.stepdata import batch, episode, interleave

PROC = ROOT / "tests" / "support" / "indexproc.py"


def run(url: str, ns: str, mode: str, n: int = 1, **env: str) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(
        [sys.executable, str(PROC), url, ns, mode, str(n)],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def output(proc: subprocess.Popen) -> object:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def files_of(store: Store) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"clawidx-{index_key(store)}.*"))


def assert_cold_equal(ix: SamplingIndex) -> None:
    cold = SamplingIndex(ix.store)
    cold.sync()
    assert ix.columns.keys() == cold.columns.keys()
    for name, col in cold.columns.items():
        np.testing.assert_array_equal(ix.columns[name], col, err_msg=name)


pytestmark = pytest.mark.store(capacity=400)


def test_processes_sharing_one_index_draw_what_an_own_index_draws(store, redis_url, namespace):
    store.commit(batch(interleave(*(episode(e, 30 + e, "terminated") for e in range(8)))))
    shared = [run(redis_url, namespace, "sample", 5) for _ in range(2)]
    own = run(redis_url, namespace, "sample", 5, CLAW_SHARED_INDEX="0")
    a, b, c = (output(p) for p in (*shared, own))
    assert a == b == c
    assert len({tuple(ids) for ids in a}) == 5  # five different batches
    assert files_of(store) == []  # the last process to close removed the files


def test_readers_never_see_a_row_half_written(store, redis_url, namespace):
    """Two processes sync and check every live row while this one overwrites the ring
    (each commit rewrites slots whose old step had another step_index)."""
    store.commit(batch(episode(0, 150)))
    readers = [run(redis_url, namespace, "check", 300) for _ in range(2)]
    lengths = [7, 13, 29, 41, 3]
    for i in range(60):
        store.commit(batch(episode(i + 1, lengths[i % 5] + i % 11, "terminated")))
    for p in readers:
        assert output(p) == []
    ix = SharedIndex(store)
    ix.sync()
    assert_cold_equal(ix)
    ix.close()


def test_writer_killed_half_way_is_replaced_and_never_read(store, redis_url, namespace):
    store.commit(batch(episode(1, 60, "terminated")))
    ix = SharedIndex(store)
    ix.sync()
    ix.release()
    store.commit(batch(interleave(episode(2, 40), episode(3, 50, "terminated"))))
    writer = run(redis_url, namespace, "pause")
    while _state(writer.pid) != "T":  # stopped half-way through the new rows' columns
        assert writer.poll() is None, writer.communicate()[1][-3000:]
        threading.Event().wait(0.02)
    ctl = np.fromfile(SHM_DIR / f"clawidx-{index_key(store)}.ctl", np.int64, 16)
    assert ctl[H_DIRTY] == 1

    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(ix.sync()))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # waits for the writer: it never reads a half-written row
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    reader.join(60)
    assert got == [None]  # rebuilt cold (its samplers refresh whole)
    assert ix.columns["alive"].sum() == 150
    assert_cold_equal(ix)
    ix.release()
    store.update_priorities(ix.columns["id"][ix.columns["alive"]][:4], np.full(4, 3.0))
    assert len(ix.sync()) == 4  # and goes on incrementally
    ix.close()
    assert files_of(store) == []


def test_unused_files_are_reaped_and_symlinks_refused(store, tmp_path):
    ix = SharedIndex(store)
    ix.sync()
    names = files_of(store)
    assert len(names) == 4  # lock, users, ctl, data
    assert not set(reap_orphans()) & set(names)  # in use: kept
    ix._f.pid = -1  # as if the process had been killed: its files stay
    ix._f.close()
    assert files_of(store) == names
    assert set(names) <= set(reap_orphans())  # nobody uses them any more
    assert files_of(store) == []

    other = SharedIndex(store)
    link = SHM_DIR / f"clawidx-{index_key(store)}.lock"
    link.symlink_to(tmp_path / "victim")
    try:
        with pytest.raises(ValueError, match="cannot open it safely"):
            other.sync()
    finally:
        link.unlink()
    assert not (tmp_path / "victim").exists()


def test_prefetch_pool_of_two_maps_one_index(redis_url, namespace, start_worker):
    worker = start_worker("ingest,prefetch", concurrency=2)
    with Ingestor(namespace, redis_url, flush_steps=200) as ing:
        for e in range(6):
            with ing.episode(episode_id=f"e{e}") as ep:
                for t in range(100):
                    ep.add(np.full(4, t, np.float32), np.int64(t % 2), float(t))
    client = BatchClient(namespace, redis_url)
    for name in ("a", "b"):
        client.register(
            {
                "name": name,
                "batch_size": 32,
                "fields": ["obs", "reward"],
                "sources": [{"name": "all", "where": {}}],
                "prefetch": {"depth": 4},
            }
        )
    for _ in range(12):
        for name in ("a", "b"):
            got = client.pop(name, timeout=60)
            np.testing.assert_array_equal(got["obs"][:, 0], got["reward"])
    client.close()
    store = Store(redis_url, namespace)
    data = [n for n in files_of(store) if ".d" in n]
    assert len(data) == 1  # one mirror on this host
    mapped = {pid: _maps(pid, data[0]) for pid in _children(worker.proc.pid)}
    assert len(mapped) == 2 and any(mapped.values())
    inodes = {ino for found in mapped.values() for ino in found}
    assert len(inodes) == 1  # every process that samples maps the same file
    worker.stop()  # SIGTERM: the pool processes detach, the last removes the files
    deadline = time.monotonic() + 30  # (a pool process may still be exiting)
    while files_of(store) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files_of(store) == []


def test_a_pool_process_killed_mid_exit_leaves_no_files_after_the_worker_stops(
    redis_url, namespace, start_worker
):
    """A pool process that could not detach (SIGKILLed: as a second SIGTERM cuts its exit
    short) leaves the index's files held by nobody; the worker's main process removes them
    once its pool has stopped (alone on the host, nothing else would)."""
    worker = start_worker("ingest,prefetch", concurrency=1)
    with Ingestor(namespace, redis_url, flush_steps=100) as ing, ing.episode("e") as ep:
        for t in range(100):
            ep.add(np.full(4, t, np.float32), np.int64(0), float(t))
    client = BatchClient(namespace, redis_url)
    client.register({"name": "a", "batch_size": 8, "fields": ["obs"], "sources": [{"name": "all"}]})
    client.pop("a", timeout=60)
    reg = client.registry
    deadline = time.monotonic() + 60  # the fill that pop asked for ends; no other comes
    while reg.r.exists(reg.refill_lock("a")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not reg.r.exists(reg.refill_lock("a")) and reg.r.llen(reg.queue("a"))
    client.close()
    store = Store(redis_url, namespace)
    assert files_of(store)
    (child,) = _children(worker.proc.pid)
    os.kill(child, signal.SIGKILL)
    # The pool replaces it. Its files stay until a process reaps them: the main process at
    # its shutdown, or any process on this host opening a shared index (another test's
    # here), so only the end state is asserted.
    deadline = time.monotonic() + 60
    while _children(worker.proc.pid) in ([], [child]) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.stop()
    assert worker.proc.returncode is not None
    assert files_of(store) == []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _maps(pid: int, name: str) -> set[int]:
    """Inodes of ``name`` mapped by ``pid``."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith("/" + name):
            found.add(int(parts[4]))
    return found


def test_a_sync_reads_recent_columns_others_read_and_waits_for_old_ones(store):
    """While another holder reads, a sync draws from columns written within MAX_LAG_S
    instead of waiting to write (the pool keeps sampling in parallel); older ones it
    brings up to date once the reader is done."""
    store.commit(batch(episode(1, 40, "terminated")))
    a, b = SharedIndex(store), SharedIndex(store)
    for ix in (a, b):
        ix.sync()
        ix.release()
    a.sync()  # a reads (holds the columns shared)
    store.commit(batch(episode(2, 30, "terminated")))
    hdr = a._hdr
    hdr[H_WROTE] = time.monotonic_ns() + 60 * 10**9  # as if written just now, for a minute
    assert len(b.sync()) == 0  # did not wait for a: the columns as they were
    assert b.columns["alive"].sum() == 40
    b.release()

    hdr[H_WROTE] = 0  # written long ago: b waits for a, then writes
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(b.sync()))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()
    a.release()
    waiter.join(60)
    assert len(got[0]) == 30 and b.columns["alive"].sum() == 70
    assert_cold_equal(b)
    b.close()
    a.close()


def test_a_quiet_draw_from_shared_columns_sees_what_another_process_synced(store):
    """A process that draws without a sync (the store was quiet at its last fetch) holds
    the shared columns at the positions their writer left them: after another index of the
    host synced a commit, the draw has the new steps, checked against those positions."""
    from orchestrator import Recipe, sample

    store.commit(batch(episode(1, 20, "terminated", task_id="a")))
    mine, other = SharedIndex(store), SharedIndex(store)
    try:
        r = Recipe.model_validate(
            {
                "name": "q",
                "batch_size": 32,
                "fields": ["obs"],
                "sources": [{"name": "b", "where": {"task_id": "b"}}],
            }
        )
        a = Recipe.model_validate(
            {
                "name": "a",
                "batch_size": 32,
                "fields": ["obs", "next_obs"],
                "sources": [{"name": "all"}],
            }
        )
        sample(store, a, index=mine)
        sample(store, a, index=mine)  # quiet: the next call draws without a sync
        store.commit(batch(episode(2, 10, "terminated", task_id="b")))
        other.sync()  # writes the shared columns and their positions
        other.release()
        got = sample(store, r, index=mine)
        assert set(got["obs"][:, 0]) == {2}
        got = sample(store, a, index=mine)
        want = store.get(got.ids, ["obs", "next_obs"])
        np.testing.assert_array_equal(got["obs"], want["obs"])
        np.testing.assert_array_equal(got["next_obs"], want["next_obs"])
        assert_cold_equal(mine)
    finally:
        mine.close()
        other.close()


def test_a_current_sync_sees_every_commit_while_another_reads_recent_columns(store):
    """A sync asked ``current`` (a rollout's sweep after its commit) writes the columns
    even while another holder reads columns written a moment ago: the commit it follows
    is in them (without it, the commit completing a rollout saw it short)."""
    store.commit(batch(episode(1, 40, "terminated")))
    a, b = SharedIndex(store), SharedIndex(store)
    b.sync()
    b.release()
    a.sync()  # a reads (holds the columns shared)
    store.commit(batch(episode(2, 30, "terminated")))
    a._hdr[H_WROTE] = time.monotonic_ns() + 60 * 10**9  # as if written just now
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(b.sync(current=True)))
    waiter.start()
    waiter.join(0.5)
    a.release()  # b waited for the reader to write, not read the columns as they were
    waiter.join(60)
    assert len(got[0]) == 30 and b.columns["alive"].sum() == 70
    assert_cold_equal(b)
    b.close()
    a.close()


def test_a_current_sync_does_not_take_a_write_of_pages_read_before_for_its_own(store):
    """A sync asked ``current`` skips its own write when another process's write started
    after it asked, unless that write applied log pages its caller had read before (a
    fetch's tail): the commit the current sync follows may be after those pages. Here
    b asks after the second commit; a, synced from pages read before it, writes in
    between; b must still see the commit."""
    store.commit(batch(episode(1, 40, "terminated")))
    a, b = SharedIndex(store), SharedIndex(store)
    b.sync()
    b.release()
    a.sync()
    a.release()
    earlier = LogRead(list(a.log_last), list(a.log_seen), [(False, [])] * a.n_shards)
    store.commit(batch(episode(2, 30, "terminated")))

    seen_by_a: list[int] = []

    def then_lock(wait: bool) -> bool:  # b has asked: a writes before b takes the lock
        a.sync(earlier)
        seen_by_a.append(int(a.columns["alive"].sum()))
        a.release()
        return SharedIndex._exclusive(b, wait)

    b._exclusive = then_lock  # type: ignore[method-assign]  # the interleaving under test
    try:
        b.sync(current=True)
        assert seen_by_a == [40]  # a wrote, from the earlier pages alone
        assert b.columns["alive"].sum() == 70
        assert_cold_equal(b)
    finally:
        b.close()
        a.close()
