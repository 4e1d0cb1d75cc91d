"""Faults around real workers: the broker goes away and comes back, Redis restarts from its
AOF, a worker is SIGKILLed. Each test ends with exact counts: every step stored once, the
``step_index`` of every episode exactly 0..n-1, and the worker processes alive."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.redis_server import RedisServer
from claw_tasks.store import Store

AOF_ALWAYS = {"appendonly": "yes", "appendfsync": "always"}


def _wait(cond: Callable[[], object], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _obs(e: int, t: int) -> np.ndarray:
    return np.full(4, e * 10_000 + t, np.float32)


def _produce(ing: Ingestor, episodes: range, n_steps: int) -> None:
    for e in episodes:
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(n_steps):
                ep.add(_obs(e, t), np.int64(t), float(t), terminated=t == n_steps - 1)


def _assert_exact(store: Store, episodes: range, n_steps: int) -> None:
    """Every step of ``episodes`` stored exactly once, in order, with its own payload."""
    assert store.count() == len(episodes) * n_steps
    ids = []
    for e in episodes:
        got = store.episode(f"e{e}")
        np.testing.assert_array_equal(got["step_index"], np.arange(n_steps))
        np.testing.assert_array_equal(got["obs"][:, 0], e * 10_000 + np.arange(n_steps))
        ids.append(got["id"])
    assert len(np.unique(np.concatenate(ids))) == len(episodes) * n_steps


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A data-store Redis and a separate broker Redis (AOF, fsync on every write)."""
    with RedisServer() as data, RedisServer(options=AOF_ALWAYS) as broker:
        yield data, broker
        for server in (data, broker):  # never leave a stopped server behind
            if server.pid is not None:
                os.kill(server.pid, signal.SIGCONT)


def test_broker_outage_with_unacked_messages_does_not_kill_the_worker(
    servers, namespace, start_worker
):
    """Finding 4: the broker dies while the worker holds an unacknowledged message and
    waits on BRPOP. Stock kombu then dies in ``restore_unacked`` ('NoneType' object has no
    attribute 'hostname'); the worker must ride the outage out and lose nothing."""
    data, broker = servers
    worker = start_worker("ingest", 2, CLAW_REDIS_URL=data.url, CLAW_BROKER_URL=broker.url,
                          CLAW_VISIBILITY_TIMEOUT="3")  # fmt: skip
    ing = Ingestor(namespace, data.url, broker_url=broker.url, flush_interval=None,
                   flush_steps=10)  # fmt: skip
    _produce(ing, range(0, 3), 10)
    assert ing.flush(timeout=60).committed == 30
    b = broker.client()
    os.kill(data.pid, signal.SIGSTOP)  # the next task hangs in the pool, unacked
    _produce(ing, range(3, 4), 10)
    ing.flush(wait=False)
    _wait(lambda: b.hlen("unacked") == 1, "the worker holds the message unacked")
    _wait(lambda: any(c["cmd"] == "brpop" for c in b.client_list()), "the worker waits on BRPOP")
    b.close()
    broker.kill()
    _wait(lambda: b"Connection to broker lost" in worker.log.read_bytes(), "the worker notices")
    broker.start()
    os.kill(data.pid, signal.SIGCONT)
    reconnected = lambda: worker.log.read_bytes().count(b"Connected to") >= 2  # noqa: E731
    _wait(lambda: reconnected() or worker.proc.poll() is not None, "the worker reconnects")
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
    _produce(ing, range(4, 8), 10)
    res = ing.flush(timeout=120)
    assert res.committed == 50 and res.rejected == 0
    assert worker.proc.poll() is None
    assert b"Unrecoverable error" not in worker.log.read_bytes()
    _assert_exact(Store(data.url, namespace), range(0, 8), 10)
