"""The data store on a real 3-master Redis Cluster (claw_tasks/connection/client.py): a
namespace with more shards than masters gives the same results as on one Redis, step for
step; a master SIGKILLed mid-ingest and restarted from its AOF loses no acknowledged step,
nor does a replica failover when a commit counts only once a replica has it
(``CLAW_INGEST_REPLICAS``; ``-m slow``).
(Most of the store's tests also run on the cluster: the ``both_stores`` marker,
tests/conftest.py.)"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from redis.exceptions import RedisClusterException, RedisError

from claw_tasks.client import IngestError, Ingestor
from claw_tasks.connection.client import is_cluster, redis_client
from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import Settings
from claw_tasks.store import Store
from claw_tasks.store.check import check_namespace
from claw_tasks.store.retention import Retention
from claw_tasks.worker.deadletter import REJECTS, REJECTS_OUTCOMES
from orchestrator import Recipe, sample, update_priorities
from orchestrator.delivery.registry import ACTIVE, Registry
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.evict import evict_namespace
from orchestrator.maintenance.priorities import Recompute, Rules
from tests.support.stepdata import batch, episode, interleave

SHARDS = 5  # more shards than the cluster's 3 masters
T0 = 1_000_000.0


def _wait(cond: Callable[[], object], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _masters_of(store: Store) -> set[str]:
    return {
        store.r.get_node_from_key(store.layout_keys.shard_key(s, "seq")).name for s in range(SHARDS)
    }


def _run_everything(url: str, namespace: str, archive_dir: Path) -> dict[str, object]:
    """One script of store work; returns everything it observed, to compare across stores."""
    store = Store(url, namespace)
    store.create(capacity=1000, n_shards=SHARDS)
    steps = interleave(
        *(
            episode(e, 30, "terminated", task_id="ab"[e % 2], skill_tag=f"s{e % 3}")
            for e in range(12)
        )
    )
    store.commit(batch(steps), now=T0)
    out: dict[str, object] = {"count": store.count()}
    ids = np.sort(np.concatenate([store.episode(f"ep{e}", fields=[])["id"] for e in range(12)]))
    prios = np.random.default_rng(0).uniform(0.1, 2.0, len(ids)).astype(np.float32)
    out["updated"] = update_priorities(store, ids, prios)
    sampler = {"kind": "priority", "alpha": 0.7, "beta": 0.5}
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 64,
            "fields": ["obs", "action", "reward"],
            "sources": [
                {"name": "a", "where": "task_id == 'a' and reward > 2", "sampler": sampler},
                {"name": "b", "where": {"skill_tag": "s1"}, "weight": 1.0},
            ],
        }
    )
    drawn = sample(store, recipe, rng=np.random.default_rng(1))
    out["sample"] = (drawn.ids.tolist(), drawn.weights.tolist(), drawn["obs"].tobytes())
    store.curate(episode_id="ep3", quality="good")
    store.curate(episode_id="ep4", trainable=False)
    good = Recipe.model_validate(
        {
            "name": "g",
            "batch_size": 32,
            "fields": ["obs"],
            "sources": [{"name": "q", "where": {"quality": "good"}}],
        }
    )
    out["good"] = sorted(set(sample(store, good, rng=np.random.default_rng(2))["obs"][:, 0]))
    rules = {"half_life": "1h", "unsampled_boost": 2.0}
    out["recomputed"] = Recompute(store, Rules.of(rules)).run(now=T0 + 3600)["finished"]
    out["prio_after"] = store.get(ids, fields=[])["priority"].tobytes()
    out["archived"] = archive_namespace(store, archive_dir, chunk_bytes=4096).rows
    out["marks"] = store.watermarks()
    store.set_retention(Retention(max_steps=200, protect=({"quality": "good"},)))
    out["evicted"] = evict_namespace(store, now=T0 + 7200)
    out["left"] = store.count()
    out["live_ids"] = sorted(
        i
        for s in range(SHARDS)
        for i in (lambda c: c["id"][c["alive"]].tolist())(store.meta_columns(s, ["id"]))
    )
    tables = [pq.read_table(f) for f in sorted(archive_dir.rglob("*.parquet"))]
    table = pa.concat_tables(tables, promote_options="permissive")
    out["archive"] = sorted(zip(table["id"].to_pylist(), table["reward"].to_pylist(), strict=True))
    reg = Registry(store)
    reg.put(recipe, None)
    out["inserted"] = reg.inserted()
    out["active"] = bool(store.r.sismember(ACTIVE, namespace))
    store.set_retention(None)
    return out


def test_a_namespace_with_more_shards_than_masters_gives_the_same_results(
    redis_cluster, redis_server, namespace, tmp_path
):
    """Commit, priorities, sampling with filters and priorities, curation, the priority
    recomputation, archival, eviction and the registry: identical on a standalone Redis and
    on the 3-master cluster, where the 5 shards spread over every master."""
    single = _run_everything(redis_server.url, namespace, tmp_path / "single")
    clustered = _run_everything(redis_cluster.url, namespace, tmp_path / "cluster")
    store = Store(redis_cluster.url, namespace)
    assert is_cluster(store.r) and len(_masters_of(store)) == 3
    assert single["count"] == 360 and single["archived"] == 360
    assert single["evicted"]["cap"] > 0 and single["good"] == [3.0]
    for key, value in single.items():
        assert clustered[key] == value, key


def test_dead_letters_of_unknown_namespaces_stay_in_one_slot(redis_cluster):
    """``claw:rejects`` and its counters are updated by one script: one slot."""
    r = redis_cluster.client()
    assert r.keyslot(REJECTS) == r.keyslot(REJECTS_OUTCOMES)


def test_a_cluster_store_needs_a_broker_of_its_own(redis_cluster, monkeypatch):
    """kombu and RedBeat cannot use a cluster: no broker named is a clear error."""
    monkeypatch.delenv("CLAW_BROKER_URL", raising=False)
    settings = Settings.from_env()
    with pytest.raises(ValueError, match="cannot be the Celery broker: set CLAW_BROKER_URL"):
        settings.broker_for(redis_cluster.url)
    monkeypatch.setenv("CLAW_REDIS_URL", redis_cluster.url)
    with pytest.raises(ValueError, match="cannot be the Celery broker: set CLAW_BROKER_URL"):
        Settings.from_env()
    monkeypatch.setenv("CLAW_BROKER_URL", "amqp://guest:guest@127.0.0.1//")
    with pytest.raises(ValueError, match="set CLAW_BEAT_REDIS_URL"):
        Settings.from_env()
    monkeypatch.setenv("CLAW_BROKER_URL", "redis://127.0.0.1:1/0")
    assert Settings.from_env().beat_url == "redis://127.0.0.1:1/0"


def _produce(ing: Ingestor, episodes: range, n_steps: int) -> None:
    for e in episodes:
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(n_steps):
                ep.add(
                    np.full(4, e * 10_000 + t, np.float32),
                    np.int64(t),
                    float(t),
                    terminated=t == n_steps - 1,
                )
    ing.flush(wait=False)


def _stored(store: Store, e: int) -> np.ndarray:
    """The ids stored of episode ``e`` (none yet: empty)."""
    try:
        return store.episode(f"e{e}", fields=[])["id"]
    except KeyError:
        return np.zeros(0, np.int64)


def test_a_master_sigkilled_mid_ingest_restarts_from_its_aof_losing_nothing(
    namespace, broker_url, start_worker
):
    """Ingest through a real worker into a 5-shard namespace; the master holding shard 0
    is SIGKILLed while batches flow, and restarted from its AOF (fsync on every write).
    Every step acknowledged before the kill is there after it, and in the end every step
    is stored exactly once, in order."""
    n_steps, made = 20, 0
    aof = {"appendonly": "yes", "appendfsync": "always"}
    with LocalCluster(3, options=aof) as cluster:
        start_worker(
            "ingest",
            1,
            CLAW_REDIS_URL=cluster.url,
            CLAW_BROKER_URL=broker_url,
            CLAW_VISIBILITY_TIMEOUT="5",
        )
        ing = Ingestor(
            namespace,
            cluster.url,
            broker_url=broker_url,
            n_shards=SHARDS,
            flush_interval=None,
            flush_steps=10**9,
            resend_after=10,
        )
        store = Store(cluster.url, namespace)
        victim = cluster.node_of(store.layout_keys.shard_key(0, "seq"))
        _produce(ing, range(0, 8), n_steps)
        made = 8
        _wait(lambda: store.count() >= 4 * n_steps, "steps are being stored")
        acknowledged = {e: _stored(store, e) for e in range(made)}
        acknowledged = {e: ids for e, ids in acknowledged.items() if len(ids) == n_steps}
        assert acknowledged
        _produce(ing, range(8, 12), n_steps)  # in flight as the master dies
        victim.kill()
        _produce(ing, range(12, 16), n_steps)  # producers keep going while it is down
        victim.start()  # same port and dir: reloads the AOF and rejoins
        cluster.wait_ok()
        made = 16
        res = ing.flush(timeout=180)
        assert (res.committed, res.rejected, res.pending) == (made * n_steps, 0, 0), res
        store = Store(redis_client(cluster.url), namespace)
        for e, ids in acknowledged.items():
            np.testing.assert_array_equal(store.episode(f"e{e}", fields=[])["id"], ids)
        counts = {e: len(_stored(store, e)) for e in range(made)}
        assert store.count() == made * n_steps, (
            counts,
            res,
            store.r.xrange(store.layout_keys.dead),
        )
        for e in range(made):
            got = store.episode(f"e{e}")
            np.testing.assert_array_equal(got["step_index"], np.arange(n_steps))
            np.testing.assert_array_equal(got["obs"][:, 0], e * 10_000 + np.arange(n_steps))
        ing.close()


def test_a_redis_server_is_not_a_cluster(redis_server: RedisServer):
    assert not is_cluster(redis_client(redis_server.url))


class _Producer(threading.Thread):
    """Records episodes of ``n_steps`` steps one after another, each flushed until the store
    confirms it (as an actor does); ``confirmed`` lists the episodes it saw confirmed."""

    def __init__(self, ing: Ingestor, n_steps: int, obs_floats: int) -> None:
        super().__init__(daemon=True)
        self.ing, self.n_steps, self.obs_floats = ing, n_steps, obs_floats
        self.made: list[int] = []
        self.confirmed: list[int] = []
        self.halt = threading.Event()

    def run(self) -> None:
        for e in itertools.count():
            if self.halt.is_set():
                return
            with self.ing.episode(episode_id=f"e{e}") as ep:
                for t in range(self.n_steps):
                    obs = np.full(self.obs_floats, e * 10_000 + t, np.float32)
                    ep.add(obs, np.int64(t), float(t), terminated=t == self.n_steps - 1)
            self.made.append(e)
            while True:  # until confirmed: the batch stays in flight and is re-sent
                try:
                    self.ing.flush(timeout=30)
                    break
                except (IngestError, RedisError, RedisClusterException):
                    time.sleep(0.1)  # the cluster is failing over
            self.confirmed.append(e)

    def stop(self) -> None:
        self.halt.set()
        self.join(120)
        assert not self.is_alive()


def _unsent_to_replicas(master: RedisServer) -> int:
    """Bytes of the replication stream ``master`` holds, not yet sent to its replicas."""
    return sum(int(c["omem"]) for c in master.client().client_list(_type="replica"))


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [0, 1], ids=["replicas=0", "replicas=1"])
def test_replica_failover_mid_ingest_keeps_the_store_consistent(
    namespace, broker_url, start_worker, replicas
):
    """Opt-in (``-m slow``). 3 masters with a replica each; a producer records episodes
    one at a time, each flushed until confirmed, through a real worker. The replica of the
    shard's master is stopped (SIGSTOP), the master SIGKILLed while commits go on, then the
    replica resumed: it takes over, and the old master rejoins as its replica. Every
    episode the producer saw confirmed is stored whole, ingest goes on after the failover,
    no step is stored twice, and the namespace passes ``claw doctor``'s checks.

    With ``CLAW_INGEST_REPLICAS=1`` nothing is confirmed while the replica is stopped.
    With 0 (the control) the master confirms what its replica has not received: the kill
    comes once the master holds several episodes of replication stream it could not send
    (the replica's socket buffers are full), so the failover loses confirmed episodes,
    every time: that run asserts the loss."""
    n_steps, obs_floats = 20, 1024  # 80 KiB of obs per episode: one message, inline
    options = {
        "cluster-node-timeout": "1000",
        "appendonly": "yes",
        "appendfsync": "always",
        "repl-diskless-sync-delay": "0",
    }
    with LocalCluster(3, options=options, replicas=1) as cluster:
        start_worker(
            "ingest",
            1,
            CLAW_REDIS_URL=cluster.url,
            CLAW_BROKER_URL=broker_url,
            CLAW_VISIBILITY_TIMEOUT="5",
            CLAW_INGEST_REPLICAS=str(replicas),
            CLAW_INGEST_REPLICA_TIMEOUT_MS="1000",
        )
        ing = Ingestor(
            namespace,
            cluster.url,
            broker_url=broker_url,
            n_shards=1,
            flush_interval=None,
            flush_steps=10**9,
            resend_after=10,
        )
        store = Store(cluster.url, namespace)
        seq = store.layout_keys.shard_key(0, "seq")
        victim = cluster.node_of(seq)
        replica = cluster.replica_of(victim)
        producer = _Producer(ing, n_steps, obs_floats)
        producer.start()
        _wait(lambda: len(producer.confirmed) >= 4, "episodes are confirmed")
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            if replicas:
                r = redis_client(cluster.url)
                _wait(
                    lambda: int(r.hget(store.layout_keys.outcomes, "unreplicated") or 0) >= 1,
                    "a commit is refused for want of a replica",
                )
                r.close()
            else:
                episode_bytes = n_steps * obs_floats * 4
                _wait(
                    lambda: _unsent_to_replicas(victim) > 3 * episode_bytes,
                    "the master holds episodes its replica has not received",
                )
            confirmed = list(producer.confirmed)
            victim.kill()
        finally:
            os.kill(replica.pid, signal.SIGCONT)

        def promoted() -> bool:
            client = redis_client(cluster.url)
            try:
                port = client.get_node_from_key(seq).port
                return port != victim.port and client.get(seq) is not None
            except Exception:  # topology still moving
                return False
            finally:
                client.close()

        _wait(promoted, "the replica serves the shard")
        victim.start()  # same port and dir: rejoins as the new master's replica
        _wait(
            lambda: victim.client().info("replication").get("master_link_status") == "up",
            "the old master replicates the new one",
        )
        after = len(producer.confirmed)
        _wait(lambda: len(producer.confirmed) >= after + 4, "ingest goes on after the failover")
        producer.stop()
        store = Store(redis_client(cluster.url), namespace)
        lost = [
            e for e in confirmed if not np.array_equal(_stored_steps(store, e), np.arange(n_steps))
        ]
        if not replicas:  # the control: acknowledged, and lost
            assert lost, f"none of {len(confirmed)} confirmed episodes lost without WAIT"
            return
        assert not lost, f"{len(lost)} of {len(confirmed)} confirmed episode(s) lost: {lost}"
        for e in producer.confirmed:
            np.testing.assert_array_equal(_stored_steps(store, e), np.arange(n_steps))
        for e in producer.made:
            idx = _stored(store, e)
            assert len(idx) <= n_steps and len(np.unique(idx)) == len(idx)
        assert check_namespace(store.r, namespace).ok
        ing.close()


def _stored_steps(store: Store, e: int) -> np.ndarray:
    """The step indexes stored of episode ``e``, in order (none: empty)."""
    try:
        return store.episode(f"e{e}", fields=[])["step_index"]
    except KeyError:
        return np.zeros(0, np.int64)
