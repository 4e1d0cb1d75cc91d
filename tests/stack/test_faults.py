"""Faults around real workers: the broker goes away and comes back, Redis restarts from its
AOF, a worker is SIGKILLed. Each test ends with exact counts: every step stored once, the
``step_index`` of every episode exactly 0..n-1, and the worker processes alive."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import kombu.exceptions
import msgpack
import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.cli.devstack import DevStack, worker_service
from orchestrator.delivery import shm, wire
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.wire import to_wire
from orchestrator.recipe.model import Recipe

AOF_ALWAYS = {"appendonly": "yes", "appendfsync": "always"}
DEAD_BROKER = "redis://127.0.0.1:1/0"  # nothing listens on port 1


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


def _pool_children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_broker_outage_with_unacked_messages_does_not_kill_the_worker(
    servers, namespace, start_worker
):
    """The broker dies while the worker holds an unacknowledged message and
    waits on BRPOP. Stock kombu then dies in ``restore_unacked`` ('NoneType' object has no
    attribute 'hostname'); the worker must ride the outage out and lose nothing."""
    data, broker = servers
    worker = start_worker(
        "ingest",
        2,
        CLAW_REDIS_URL=data.url,
        CLAW_BROKER_URL=broker.url,
        CLAW_VISIBILITY_TIMEOUT="3",
    )
    ing = Ingestor(namespace, data.url, broker_url=broker.url, flush_interval=None, flush_steps=10)
    _produce(ing, range(0, 3), 10)
    assert ing.flush(timeout=60).committed == 30
    b = broker.client()
    # Committed is not acked (acks_late): a child stopped before its ack would hold a
    # message too, and with both children's the worker would fetch nothing more.
    _wait(lambda: b.hlen("unacked") == 0, "the first messages are acked")
    children = _pool_children(worker.proc.pid)
    assert len(children) == 2
    for child in children:  # the next task waits in the pool, unacked
        os.kill(child, signal.SIGSTOP)
    try:
        _produce(ing, range(3, 4), 10)
        ing.flush(wait=False)
        _wait(lambda: b.hlen("unacked") == 1, "the worker holds the message unacked")
        _wait(lambda: any(c["cmd"] == "brpop" for c in b.client_list()), "it waits on BRPOP")
        b.close()
        broker.kill()
        _wait(lambda: b"Connection to broker lost" in worker.log.read_bytes(), "it notices")
        broker.start()
    finally:
        for child in children:
            os.kill(child, signal.SIGCONT)
    reconnected = lambda: worker.log.read_bytes().count(b"Connected to") >= 2  # noqa: E731
    _wait(lambda: reconnected() or worker.proc.poll() is not None, "the worker reconnects")
    assert worker.proc.poll() is None, worker.log.read_text()[-3000:]
    _produce(ing, range(4, 8), 10)
    res = ing.flush(timeout=120)
    assert res.committed == 50 and res.rejected == 0
    assert worker.proc.poll() is None
    assert b"Unrecoverable error" not in worker.log.read_bytes()
    _assert_exact(Store(data.url, namespace), range(0, 8), 10)


def _send(ing: Ingestor) -> None:
    """Hand what is buffered to the broker; while it is down the batch stays in the
    Ingestor (sent with the next flush that waits)."""
    with contextlib.suppress(Exception):  # the outage under test
        ing.flush(wait=False)


def test_redis_restarts_from_aof_and_a_worker_sigkill_lose_and_duplicate_nothing(
    namespace, start_worker
):
    """The default deployment (one Redis is store and broker, AOF with fsync on every
    write): Redis is shut down (SHUTDOWN) mid-stream while producers keep adding steps and
    comes back from its AOF, then the same after a SIGKILL; then a worker is SIGKILLed and
    replaced. Every step is stored exactly once, every episode's step_index is exactly
    0..n-1, and the worker that was not killed rides it all out."""
    n_steps, made = 25, 0

    def produce(episodes: int) -> None:
        nonlocal made
        for e in range(made, made + episodes):
            _produce(ing, range(e, e + 1), n_steps)
            _send(ing)
        made += episodes

    with RedisServer(options=AOF_ALWAYS) as server:
        env = {
            "CLAW_REDIS_URL": server.url,
            "CLAW_BROKER_URL": server.url,
            "CLAW_VISIBILITY_TIMEOUT": "3",
        }
        survivor = start_worker("ingest", 1, **env)
        victim = start_worker("ingest", 1, **env)
        ing = Ingestor(
            namespace,
            server.url,
            broker_url=server.url,
            flush_interval=None,
            flush_steps=10**9,
            resend_after=5,
        )
        store = Store(server.url, namespace)
        for stop in (server.stop, server.kill):  # SHUTDOWN (AOF flushed), then SIGKILL
            produce(6)
            before = store.count()
            _wait(lambda: store.count() > before, "steps are being stored")  # noqa: B023
            stop()
            produce(3)  # producers keep going while Redis is down
            server.start()  # same port and dir: reloads the AOF
        produce(3)
        victim.kill()
        start_worker("ingest", 1, **env)  # the replacement
        produce(3)
        res = ing.flush(timeout=180)
        assert res.rejected == 0 and res.pending == 0
        assert survivor.proc.poll() is None, survivor.log.read_text()[-3000:]
        assert b"Unrecoverable error" not in survivor.log.read_bytes()
        _assert_exact(store, range(made), n_steps)
        ing.close()
        store.r.close()


def test_the_stack_supervisor_replaces_a_dead_worker(redis_url, namespace, tmp_path):
    """`claw up`'s watch loop (DevStack.watch): a worker that dies (SIGKILL here, the OOM
    killer in life) is started again and serves; its previous log is kept."""
    stack = DevStack(tmp_path)
    stack.start_redis(redis_url)
    worker = worker_service(tmp_path, ["ingest"], 1, quick=True)
    stop, restarts = threading.Event(), []
    watch = {"interval": 0.1, "stop": stop, "on_restart": lambda _, code: restarts.append(code)}
    watcher = threading.Thread(target=stack.watch, kwargs=watch)
    try:
        stack.start([worker])
        watcher.start()
        ing = Ingestor(namespace, redis_url, flush_interval=None)
        _produce(ing, range(0, 2), 10)
        assert ing.flush(timeout=60).committed == 20
        first = worker.pid
        worker.signal_group(signal.SIGKILL)
        _wait(lambda: worker.pid != first and worker.ready(worker), "a new worker is ready")
        _produce(ing, range(2, 4), 10)
        assert ing.flush(timeout=60).committed == 20
        assert restarts == [-signal.SIGKILL]
        assert worker.log.with_name(f"{worker.log.name}.1").exists()
        _assert_exact(Store(redis_url, namespace), range(0, 4), 10)
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        stack.stop()


def _recipe(name: str) -> Recipe:
    return Recipe.model_validate(
        {"name": name, "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
    )


def test_pop_skips_garbage_queue_items_counts_them_and_logs_once(redis_url, namespace, r, caplog):
    client = BatchClient(namespace, redis_url)
    client.registry.put(_recipe("g"), shm.host_id())
    good = to_wire({"obs": np.ones((4, 2), np.float32)}, np.arange(4), recipe_version=1)
    ref = struct.pack("<4sI", shm.REF_MAGIC, wire.VERSION)
    garbage = [
        b"",
        b"junk",
        struct.pack("<4sIII", wire.MAGIC, wire.VERSION, 10**6, 0) + b"\x00" * 40,  # truncated
        shm.reference_message("claw-x", 10, shm.host_id())[:-3],  # truncated reference
        ref + msgpack.packb({"size": 1}),  # KeyError
        ref + msgpack.packb({"name": 7, "size": 1, "host": shm.host_id()}),  # TypeError
        ref + msgpack.packb([1, 2]),  # not a map
    ]
    r.rpush(client.registry.queue("g"), *garbage, good.tobytes(), *garbage, good.tobytes())
    with caplog.at_level(logging.WARNING, logger="orchestrator.delivery.client"):
        for _ in range(2):
            batch = client.pop("g", timeout=5)
            np.testing.assert_array_equal(batch["obs"], np.ones((4, 2), np.float32))
    assert client.stats("g")["g"]["skipped"] == 2 * len(garbage)
    skipped = [m for m in caplog.messages if "unreadable queue item" in m]
    assert len(skipped) == 1, caplog.messages
    client.close()


def test_refill_lock_released_when_the_request_cannot_be_sent(redis_url, namespace, r):
    """With the broker down, a refill request that cannot be sent gives its lock back:
    held for its 30 s, pops after the broker came back would wait for nothing."""
    offline = BatchClient(namespace, redis_url, broker_url=DEAD_BROKER)
    offline.registry.put(_recipe("l"), None)
    with pytest.raises(kombu.exceptions.OperationalError):
        offline.request_fill("l")
    assert not r.exists(offline.registry.refill_lock("l"))
    offline.close()
    online = BatchClient(namespace, redis_url)  # the broker is back: the next request goes
    assert online.request_fill("l")
    assert r.exists(online.registry.refill_lock("l"))
    online.unregister("l")
    online.close()
