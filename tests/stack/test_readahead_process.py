"""ProcessReadAhead: a child process pops a recipe's batches and writes the trainer's
lineage (replayable: ``claw replay`` gives a declared batch back), over a real Redis and
prefetch worker; the child never outlives its trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.readahead_pipe import CREDIT_EVERY
from orchestrator.delivery.readahead_process import ProcessReadAhead, ReadAheadProcessError
from orchestrator.inspect.replay import replay
from tests.support.readahead import ingest_ramp, wait_until


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _recipe(name: str, batch_size: int) -> dict:
    return {
        "name": name,
        "batch_size": batch_size,
        "fields": ["obs", "reward"],
        "sources": [{"name": "all"}],
        "prefetch": {"depth": 8},
    }


@pytest.fixture
def client(redis_url, namespace, workers):
    ingest_ramp(namespace, redis_url)
    c = BatchClient(namespace, redis_url)
    c.register(_recipe("ra", 16))
    yield c
    c.close()


def test_the_child_holds_count_batches_and_the_trainer_decodes_them(client):
    ra = ProcessReadAhead(client, "ra", count=3, convert=lambda b: (len(b), b))
    # count, and the ones the trainer may have taken and not reported yet
    bound = 3 + CREDIT_EVERY - 1
    wait_until(lambda: len(ra) == bound, f"{bound} batches read ahead")
    queue = client.registry.queue("ra")
    wait_until(lambda: client.store.r.llen(queue) > 0, "the worker refilled the Redis queue")
    assert len(ra) == bound  # no credit left: the child stopped taking from Redis
    for _ in range(6):  # more than it holds: each pop gives the child a credit back
        rows, batch = ra.pop(timeout=60)
        assert rows == 16 and batch["obs"].shape == (16, 8)
        np.testing.assert_array_equal(batch["obs"][:, 0], batch["reward"])
    cmdline = Path(f"/proc/{ra.pid}/cmdline").read_bytes()
    assert b"redis" not in cmdline  # the servers' URLs travel in the pipe, not in argv
    ra.close()
    assert not _alive(ra.pid)
    assert int(client.store.r.hget(client.registry.counters("ra"), "popped") or 0) >= 6


def test_the_child_writes_the_lineage_the_trainer_declares(client):
    ra = ProcessReadAhead(client, "ra", count=2)
    popped = [ra.pop(timeout=60) for _ in range(3)]
    for k, batch in enumerate(popped):
        ra.trained(batch, f"v{k}")
    ra.flush_lineage()
    for k, batch in enumerate(popped):
        (entry,) = client.lineage.trained(f"v{k}")
        assert entry.recipe == "ra" and entry.rows == 16
        np.testing.assert_array_equal(entry.ids, np.sort(batch.ids))
        # What replays it came through the pipe too: the batch, again, in its order.
        assert entry.batch_ids.tolist() == batch.ids.tolist()
        assert (entry.seed, entry.recipe_digest) == (batch.seed, batch.recipe_digest)
        (again,) = replay(client.store, policy=f"v{k}")
        assert again.batch is not None, again.missing
        for name in ("obs", "reward"):
            assert again.batch[name].tobytes() == batch[name].tobytes()
        assert again.batch.weights.tobytes() == batch.weights.tobytes()
    ra.trained(popped[0], "at-close")
    ra.close()  # what is declared and not yet sent goes out before the child exits
    assert len(client.lineage.trained("at-close")) == 1


def test_a_take_not_reported_yet_loses_no_credit(client):
    ra = ProcessReadAhead(client, "ra", count=2)
    bound = 2 + CREDIT_EVERY - 1
    wait_until(lambda: len(ra) == bound, f"{bound} batches read ahead")
    for _ in range(CREDIT_EVERY + 1):  # one report, then one take not reported yet
        ra.pop(timeout=60)
    # the child refilled what was reported (the last take too, if the trainer reported
    # it), never more than its bound
    wait_until(lambda: len(ra) >= bound - 1, f"{bound - 1} batches read ahead")
    time.sleep(1.0)
    assert bound - 1 <= len(ra) <= bound
    ra.close()


def test_every_declared_batch_is_in_the_log_after_close(client):
    ra = ProcessReadAhead(client, "ra", count=2)
    declared = 2 * CREDIT_EVERY + 1  # not a whole number of reports: some go at close
    ids = []
    for k in range(declared):
        batch = ra.pop(timeout=60)
        ra.trained(batch, f"close-{k}")
        ids.append(batch.ids.tolist())
    ra.close()
    for k in range(declared):
        (entry,) = client.lineage.trained(f"close-{k}")
        assert entry.batch_ids.tolist() == ids[k]


def test_retarget_serves_the_new_recipe_and_drops_what_was_read_for_the_old(client):
    client.register(_recipe("big", 32))
    ra = ProcessReadAhead(client, "ra", count=3)
    wait_until(lambda: len(ra) >= 3, "three batches of the first recipe read ahead")
    pid = ra.pid
    ra.retarget("big", 2, None)
    for _ in range(4):
        assert len(ra.pop(timeout=60)) == 32  # never one of the old recipe's 16-row ones
    assert ra.pid == pid  # one child served both
    ra.resize(1)
    assert len(ra.pop(timeout=60)) == 32
    ra.close()


def test_what_the_child_meets_is_raised_by_the_next_pop(client):
    client.unregister("ra")
    ra = ProcessReadAhead(client, "ra", count=2)
    with pytest.raises(ReadAheadProcessError, match="not registered"):
        ra.pop(timeout=60)
    ra.close()


def test_an_empty_queue_times_out_with_the_explanation(client):
    recipe = _recipe("none", 16)
    recipe["sources"] = [{"name": "all", "where": {"task_id": "no-such-task"}}]
    client.register(recipe)
    ra = ProcessReadAhead(client, "none", count=2)
    with pytest.raises(TimeoutError, match="none"):
        ra.pop(timeout=3)
    ra.close()


def test_the_child_exits_when_its_trainer_is_killed(redis_url, namespace, client):
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from orchestrator.delivery.client import BatchClient\n"
            "from orchestrator.delivery.readahead_process import ProcessReadAhead\n"
            f"c = BatchClient({namespace!r}, {redis_url!r})\n"
            "ra = ProcessReadAhead(c, 'ra', count=2)\n"
            "ra.pop(timeout=60)\n"
            "print(ra.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert trainer.stdout is not None
    child = int(trainer.stdout.readline())
    assert _alive(child)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    wait_until(lambda: not _alive(child), "the orphaned read-ahead process exited", timeout=30)


def test_what_a_killed_trainer_declared_is_in_the_log(redis_url, namespace, client):
    declared = 2 * CREDIT_EVERY + 1  # not a whole number of reports
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from orchestrator.delivery.client import BatchClient\n"
            "from orchestrator.delivery.readahead_process import ProcessReadAhead\n"
            f"c = BatchClient({namespace!r}, {redis_url!r})\n"
            "ra = ProcessReadAhead(c, 'ra', count=2)\n"
            f"for k in range({declared}):\n"
            "    ra.trained(ra.pop(timeout=60), f'killed-{k}')\n"
            "print(ra.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert trainer.stdout is not None
    child = int(trainer.stdout.readline())
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    wait_until(lambda: not _alive(child), "the orphaned read-ahead process exited", timeout=30)
    for k in range(declared):
        assert len(client.lineage.trained(f"killed-{k}")) == 1


def test_a_byte_budget_holds_one_batch(client):
    ra = ProcessReadAhead(client, "ra", count=8, max_bytes=1)
    wait_until(lambda: len(ra) == 1, "one batch read ahead")
    wait_until(lambda: client.store.r.llen(client.registry.queue("ra")) > 0, "a refilled queue")
    assert len(ra) == 1  # over budget after one: never a second until it is taken
    assert len(ra.pop(timeout=60)) == 16
    wait_until(lambda: len(ra) == 1, "the next one read ahead")
    ra.close()


def test_park_writes_what_the_child_held_before_the_recipe_goes(client):
    ra = ProcessReadAhead(client, "ra", count=2)
    ra.trained(ra.pop(timeout=60), "before-park")
    ra.park()  # idle, its pops' counters and lineage written
    assert len(client.lineage.trained("before-park")) == 1
    client.unregister("ra")
    counters = client.registry.counters("ra")
    time.sleep(2 * 0.5 + 0.5)  # longer than the child's longest wait on a queue
    assert not client.store.r.exists(counters)  # nothing reported for it afterwards
    client.register(_recipe("next", 16))
    ra.retarget("next", 2, None)
    assert len(ra.pop(timeout=60)) == 16
    ra.close()


def test_a_failed_child_fails_every_later_call(client):
    client.unregister("ra")
    ra = ProcessReadAhead(client, "ra", count=2)
    for _ in range(2):
        with pytest.raises(ReadAheadProcessError, match="not registered"):
            ra.pop(timeout=60)
    assert not ra.alive
    ra.close()


def test_a_pop_that_times_out_names_the_wait_it_was_given(client):
    recipe = _recipe("never", 16)
    recipe["sources"] = [{"name": "all", "where": {"task_id": "no-such-task"}}]
    client.register(recipe)
    with pytest.raises(TimeoutError, match=r"within 1\.5s"):
        client.pop("never", timeout=1.5)  # not the time left after the last wait
