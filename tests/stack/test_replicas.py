"""Acknowledged means replicated (``CLAW_INGEST_REPLICAS``, claw_tasks/store/replication.py):
a commit counts only once a replica of its master has it, on a standalone Redis and on a
Redis Cluster, where the ``WAIT`` must reach the master of the shard's slot. A replica is
held back with SIGSTOP: its master keeps answering writes, and ``WAIT`` cannot be met."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from claw_tasks.client import IngestError, Ingestor
from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from claw_tasks.store.replication import (
    NotReplicated,
    Replication,
    replica_counts,
    replicas_advice,
)
from claw_tasks.store.writer import Writer
from orchestrator.cli.exporter import registry_for
from tests.support.hostile import outcomes
from tests.support.stepdata import batch, episode

WAIT = Replication(1, 30_000)  # met: WAIT returns once the replica acknowledges
SHORT = Replication(1, 100)  # for a replica that is stopped: WAIT gives up
FAST_SYNC = {"repl-diskless-sync-delay": "0"}  # a replica's first sync starts at once


def _wait(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """``server`` SIGSTOPped: it reads nothing and acknowledges nothing until resumed."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


@contextmanager
def master_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer(options=FAST_SYNC) as master, RedisServer() as replica:
        client = replica.client()
        client.replicaof("127.0.0.1", master.port)
        _wait(
            lambda: client.info("replication").get("master_link_status") == "up",
            "the replica is in sync",
        )
        client.close()
        yield master, replica


def test_a_commit_counts_once_a_replica_has_it():
    """``Store.commit`` with a replication requirement: met while the replica runs; while
    it is stopped, the commit (and the string codes it adds) raise NotReplicated, and so
    does its replay until the replica has it. With no requirement nothing waits."""
    with master_and_replica() as (master, replica):
        r = master.client()
        assert replica_counts(r) == {f"127.0.0.1:{master.port}": 1}
        assert "set CLAW_INGEST_REPLICAS=1" in (replicas_advice(r, 0) or "")
        assert replicas_advice(r, 1) is None
        assert "fewer replicas connected" in (replicas_advice(r, 2) or "")
        store = Store(master.url, "ns")
        store.create(capacity=1000, n_shards=2)
        first = batch(episode(0, 10, "terminated", task_id="a"))
        assert store.commit(first, replication=WAIT).committed == 10
        assert Store(replica.url, "ns").count() == 10  # WAIT returned: the replica has it
        held = batch(episode(1, 10, "terminated", task_id="b"))
        with stopped(replica):
            with pytest.raises(NotReplicated, match="string codes"):
                store.commit(held, replication=SHORT)  # its new task_id: the dictionary
            held.strs.pop("task_id")
            with pytest.raises(NotReplicated, match=r"reached 0 of the 1 replica"):
                store.commit(held, replication=SHORT)
            with pytest.raises(NotReplicated):  # a redelivery: committed, not replicated
                store.commit(held, replication=SHORT)
            assert store.commit(held).replayed == 10  # nothing asked: nothing waited for
        res = store.commit(held, replication=WAIT)
        assert (res.committed, res.replayed) == (0, 10)
        assert Store(replica.url, "ns").count() == 20


def test_a_commit_another_delivery_made_meanwhile_is_waited_for(monkeypatch):
    """Two deliveries of a batch: one commits it between the other's allocation (which
    found it not committed) and its commit, whose script then writes nothing. That
    commit is not on the replica (its delivery saw too few); the second delivery, on a
    connection of its own, must not confirm it either. (On Redis before 7.2 ``WAIT``
    counts from a connection's last command, read or write, and this holds anyway; from
    7.2 on it counts from its last write only.)"""
    with master_and_replica() as (master, replica):
        Store(master.url, "ns").create(capacity=1000, n_shards=1)
        held = batch(episode(0, 10))
        allocate = Writer.allocate

        def before_the_other_commit(self: Writer, *args: object, **kw: object) -> tuple:
            seq0, state = allocate(self, *args, **kw)
            return seq0, "alloc" if state == "done" else state

        with stopped(replica):
            with pytest.raises(NotReplicated):
                Store(master.url, "ns").commit(held, replication=SHORT)
            monkeypatch.setattr(Writer, "allocate", before_the_other_commit)
            with pytest.raises(NotReplicated, match=r"shard 0's commit .* reached 0 of the 1"):
                Store(master.url, "ns").commit(held, replication=SHORT)
        monkeypatch.undo()
        assert Store(master.url, "ns").commit(held, replication=WAIT).replayed == 10
        assert Store(replica.url, "ns").count() == 10


def test_without_a_replica_a_commit_that_needs_one_never_counts(redis_server):
    """A Redis with no replica: CLAW_INGEST_REPLICAS=1 refuses every commit (WAIT answers
    0 after its timeout); 0 commits as before."""
    assert replicas_advice(redis_server.client(), 0) is None
    assert "fewer replicas connected" in (replicas_advice(redis_server.client(), 1) or "")
    store = Store(redis_server.url, f"t-{os.getpid()}-{time.monotonic_ns()}")
    store.create(capacity=100, n_shards=1)
    steps = batch(episode(0, 5))
    with pytest.raises(NotReplicated):
        store.commit(steps, replication=SHORT)
    assert store.commit(steps, replication=Replication(0, 100)).replayed == 5


def test_on_a_cluster_the_wait_reaches_the_master_of_the_shard():
    """2 masters with a replica each. The replica of one shard's master is stopped: a
    commit to that shard is not replicated, a commit to a shard of the other master is (a
    WAIT sent elsewhere, or to every node, would count the other master's replica)."""
    with LocalCluster(2, options=FAST_SYNC, replicas=1) as cluster:
        store = Store(cluster.url, "ns")
        store.create(capacity=1000, n_shards=12)
        shard_key = store.layout_keys.shard_key
        victim = cluster.node_of(shard_key(0, "seq"))
        others = [s for s in range(12) if cluster.node_of(shard_key(s, "seq")) is not victim]
        replica = cluster.replica_of(victim)
        eps = {int(store.shards_of(batch(episode(e, 1)))[0]): e for e in range(200)}
        on_victim, elsewhere = eps[0], eps[others[0]]
        held = batch(episode(on_victim, 5))
        assert sorted(replica_counts(store.r).values()) == [1, 1]
        with stopped(replica):
            with pytest.raises(NotReplicated, match=f"shard 0's commit.*:{victim.port}"):
                store.commit(held, replication=SHORT)
            assert store.commit(batch(episode(elsewhere, 5)), replication=WAIT).committed == 5
        assert store.commit(held, replication=WAIT).replayed == 5


def test_the_ingest_worker_confirms_a_batch_only_once_a_replica_has_it(
    namespace, broker_url, start_worker
):
    """A real worker with CLAW_INGEST_REPLICAS=1 on a master whose replica is stopped: the
    batches are committed on the master but not confirmed (no done record; the deliveries
    are counted ``unreplicated`` and retried); once the replica runs again they are
    confirmed, every step stored once, and the replica holds them all."""
    n_steps, episodes = 10, range(4)
    with master_and_replica() as (master, replica):
        worker = start_worker(
            "ingest",
            1,
            CLAW_REDIS_URL=master.url,
            CLAW_BROKER_URL=broker_url,
            CLAW_INGEST_REPLICAS="1",
            CLAW_INGEST_REPLICA_TIMEOUT_MS="1000",
        )
        ing = Ingestor(
            namespace, master.url, broker_url=broker_url, n_shards=2, flush_interval=None
        )
        r = master.client()
        with stopped(replica):
            for e in episodes:
                with ing.episode(episode_id=f"e{e}", task_id=f"task{e}") as ep:
                    for t in range(n_steps):
                        ep.add(np.full(4, t, np.float32), np.int64(t), 1.0, terminated=t == 9)
            ing.flush(wait=False)
            _wait(
                lambda: outcomes(r, namespace).get("unreplicated", 0) >= 2,
                "deliveries are refused for want of a replica",
            )
            metrics = generate_latest(registry_for(master.url, broker_url)).decode()
            counted = [
                s.value
                for f in text_string_to_metric_families(metrics)
                for s in f.samples
                if s.name == "claw_ingest_unreplicated_total"
                and s.labels.get("namespace") == namespace
            ]
            assert counted and counted[0] >= 2, counted  # claw metrics
            with pytest.raises(IngestError) as e:
                ing.flush(timeout=0.5)
            assert e.value.result.committed == 0
            assert not list(r.scan_iter(Keys(namespace).done("*")))
        res = ing.flush(timeout=120)
        assert (res.committed, res.rejected) == (len(episodes) * n_steps, 0), res
        assert "fewer replicas connected" not in worker.log.read_text()  # it has one
        for url in (master.url, replica.url):
            store = Store(url, namespace)
            assert store.count() == len(episodes) * n_steps
            for e in episodes:
                got = store.episode(f"e{e}", fields=[])
                np.testing.assert_array_equal(got["step_index"], np.arange(n_steps))
        ing.close()


def test_an_ingest_worker_says_at_start_when_no_replica_can_meet_the_setting(start_worker):
    """CLAW_INGEST_REPLICAS=1 on a Redis without a replica: an ingest worker's log says so
    at start (every batch would be retried); a worker on another queue says nothing."""
    ingest = start_worker("ingest", 1, CLAW_INGEST_REPLICAS="1")
    assert "fewer replicas connected" in ingest.log.read_text()
    other = start_worker("maintenance", 1, CLAW_INGEST_REPLICAS="1")
    assert "CLAW_INGEST_REPLICAS" not in other.log.read_text()
