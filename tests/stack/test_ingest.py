"""Ingest end to end: Ingestor -> Celery task in a real worker -> Redis store, with the
broker on Redis and on RabbitMQ (``both_brokers``)."""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest

from claw_tasks.broker.app import client_app
from claw_tasks.client import Ingestor
from claw_tasks.format.message import IngestArgs
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceDropped, Store
from claw_tasks.store.commit import CommitResult
from claw_tasks.worker import ingest
from tests.support.hostile import outcomes
from tests.support.producer import outcome, send_unchecked
from tests.support.stepdata import batch, episode

# Every test here runs with the broker on Redis and on RabbitMQ.
pytestmark = pytest.mark.both_brokers


def _ingestor(redis_url: str, broker_url: str, namespace: str, **kw) -> Ingestor:
    kw.setdefault("flush_interval", None)
    return Ingestor(namespace, redis_url, broker_url=broker_url, **kw)


@pytest.mark.both_stores
def test_vector_round_trip_bit_exact(redis_url, broker_url, namespace, ingest_worker):
    rng = np.random.default_rng(0)
    ing = _ingestor(redis_url, broker_url, namespace, flush_steps=64)
    obs = rng.standard_normal((3, 50, 8)).astype(np.float32)
    for e in range(3):
        with ing.episode(episode_id=f"ep{e}", task_id="reach", agent_id="a1", level=e) as ep:
            for t in range(50):
                last = t == 49
                ep.add(
                    obs[e, t],
                    np.int64(t % 4),
                    float(t),
                    terminated=last,
                    next_obs=obs[e, t] + 1 if last else None,
                    skill_tag="s",
                )
    res = ing.close()
    assert res.committed == 150 and res.rejected == 0
    store = Store(redis_url, namespace)
    assert store.count() == 150
    got = store.episode("ep1")
    np.testing.assert_array_equal(got["obs"], obs[1])
    np.testing.assert_array_equal(got["next_obs"][:-1], obs[1, 1:])
    np.testing.assert_array_equal(got["next_obs"][-1], obs[1, -1] + 1)
    np.testing.assert_array_equal(got["action"], np.arange(50) % 4)
    np.testing.assert_array_equal(got["reward"], np.arange(50, dtype=np.float32))
    assert got["terminated"].tolist() == [False] * 49 + [True]
    assert set(got["task_id"]) == {"reach"} and set(got["skill_tag"]) == {"s"}
    assert set(got["tags.level"].tolist()) == {1.0}
    assert store.count({"task_id": "reach", "tags.level": 2}) == 50


@pytest.mark.both_brokers(brokers=["redis"])
def test_column_writer_steps_are_stored_as_episode_steps_are(
    redis_url, broker_url, namespace, ingest_worker
):
    """Ingestor.columns: steps copied into columns and sent by the Ingestor's thread (in
    batches of flush_steps, the rest at flush) are committed once each, with metadata,
    tags, priorities and explicit next_obs, as Episode.add stores them."""
    from claw_tasks.format.schema import FieldSpec, Schema

    rng = np.random.default_rng(1)
    schema = Schema(fields={"obs": FieldSpec("<f4", (8,)), "action": FieldSpec("<i8", ())})
    ing = _ingestor(redis_url, broker_url, namespace, flush_steps=64, schema=schema)
    cols = ing.columns(task_id="reach", level=3.0)
    obs = rng.standard_normal((2, 70, 8)).astype(np.float32)
    for e in range(2):
        for t in range(70):
            last = t == 69
            cols.append(
                f"ep{e}",
                t,
                obs[e, t],
                np.int64(t % 4),
                float(t),
                terminated=last,
                next_obs=obs[e, t] + 1 if last else None,
                priority=0.5 if t == 3 else None,
            )
    del cols  # the Ingestor keeps its writers: their last rows go out with close()
    gc.collect()
    res = ing.close()
    assert res.committed == 140 and res.rejected == 0
    store = Store(redis_url, namespace)
    assert store.count() == 140
    got = store.episode("ep1")
    np.testing.assert_array_equal(got["obs"], obs[1])
    np.testing.assert_array_equal(got["next_obs"][:-1], obs[1, 1:])
    np.testing.assert_array_equal(got["next_obs"][-1], obs[1, -1] + 1)
    np.testing.assert_array_equal(got["action"], np.arange(70) % 4)
    np.testing.assert_array_equal(got["reward"], np.arange(70, dtype=np.float32))
    assert np.flatnonzero(~np.isnan(got["priority"])).tolist() == [3]
    assert store.count({"task_id": "reach", "tags.level": 3}) == 140


def test_image_round_trip_and_next_obs_stored_once(
    redis_url, broker_url, namespace, ingest_worker, r
):
    n = 400
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (n + 1, 84, 84, 3), dtype=np.uint8)
    ing = _ingestor(redis_url, broker_url, namespace, flush_steps=100)
    with ing.episode(episode_id="img") as ep:
        for t in range(n):
            last = t == n - 1
            ep.add(
                frames[t],
                np.int64(1),
                0.5,
                next_obs=frames[t + 1] if last else None,
                truncated=last,
            )
    assert ing.close().committed == n
    used = sum(r.memory_usage(k) for k in r.scan_iter(f"claw:{{{namespace}*"))
    # Stored once: ~21,168 bytes a step (plus part-filled chunks), not twice that.
    assert n * 84 * 84 * 3 < used < 1.5 * n * 84 * 84 * 3
    got = Store(redis_url, namespace).episode("img")
    np.testing.assert_array_equal(got["obs"], frames[:n])
    np.testing.assert_array_equal(got["next_obs"], frames[1:])
    assert got["obs"].dtype == np.uint8 and got["obs"].shape == (n, 84, 84, 3)


def test_ragged_token_steps_round_trip(redis_url, broker_url, namespace, ingest_worker):
    rng = np.random.default_rng(2)
    ing = _ingestor(redis_url, broker_url, namespace, ragged=("prompt_ids", "logprobs"))
    lens = rng.integers(0, 40, 30)
    prompts = [rng.integers(0, 50_000, k, dtype=np.int32) for k in lens]
    logps = [rng.standard_normal(k).astype(np.float32) for k in lens[::-1]]
    with ing.episode(episode_id="chat", task_id="math", reward_source="verifier") as ep:
        for t in range(30):
            ep.add(
                np.zeros(4, np.float32),
                np.int64(0),
                float(t % 2),
                prompt_ids=prompts[t],
                logprobs=logps[t],
                terminated=t == 29,
                next_obs=np.zeros(4, np.float32) if t == 29 else None,
            )
    assert ing.close().committed == 30
    store = Store(redis_url, namespace)
    assert store.schema().fields["prompt_ids"].ragged
    got = store.episode("chat")
    for t in range(30):
        np.testing.assert_array_equal(got["prompt_ids"][t], prompts[t])
        np.testing.assert_array_equal(got["logprobs"][t], logps[t])
    assert got["reward_source"] == ["verifier"] * 30


def test_add_batch_vectorized_and_claim_check(redis_url, broker_url, namespace, ingest_worker, r):
    n = 5000
    rng = np.random.default_rng(3)
    obs = rng.standard_normal((n, 8)).astype(np.float32)
    ing = _ingestor(redis_url, broker_url, namespace, flush_steps=2048, claim_check_bytes=16 * 1024)
    ing.add_batch(
        {
            "obs": obs,
            "action": rng.integers(0, 4, n),
            "reward": rng.standard_normal(n),
            "episode_id": np.repeat(np.arange(10).astype(str), n // 10),
            "step_index": np.tile(np.arange(n // 10), 10),
            "task_id": "t",
            "terminated": np.tile(np.arange(n // 10) == n // 10 - 1, 10),
            "tags": {"difficulty": 0.5},
        }
    )
    assert ing.close().committed == n
    # Claim checks cleaned up: a worker deletes one after writing the batch's done record
    # (the other way round, a redelivery after a crash between the two would find the
    # claim check gone and reject a committed batch), so after the confirmation.
    deadline = time.monotonic() + 30
    while stages := list(r.scan_iter(f"claw:{{{namespace}:0}}:stage:*")):
        assert time.monotonic() < deadline, f"claim checks left: {stages}"
        time.sleep(0.02)
    store = Store(redis_url, namespace)
    got = store.episode("3")
    np.testing.assert_array_equal(got["obs"], obs[1500:2000])
    np.testing.assert_array_equal(got["next_obs"][:-1], obs[1501:2000])


def test_add_batch_deliver_commits_in_the_caller_or_publishes(
    redis_url, broker_url, namespace, ingest_worker
):
    """``deliver`` gets each message's task args: one it commits itself (here with the
    ingest task's own code) is stored before ``add_batch`` returns and never published;
    one it declines (False) is published and a worker commits it. ``close`` confirms both
    by their done records."""
    store = Store(redis_url, namespace)
    ing = _ingestor(redis_url, broker_url, namespace)
    committed, declined = [], []

    def commit(args):
        limits = get_settings().limits
        committed.append(ingest.run(store.r, args, {}, limits, lambda _ns: store))
        return True

    def decline(args):
        declined.append(args)
        return False

    def columns(episode: str) -> dict:
        n = 10
        return {
            "obs": np.full((n, 4), float(len(committed)), np.float32),
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n),
            "episode_id": episode,
            "step_index": np.arange(n),
        }

    ing.add_batch(columns("a"), deliver=commit)
    assert [o.committed for o in committed] == [10]
    assert len(store.episode("a")["reward"]) == 10  # stored already: no worker involved
    ing.add_batch(columns("b"), deliver=decline)
    assert len(declined) == 1 and len(committed) == 1
    assert ing.close().committed == 20


@pytest.mark.both_stores
def test_same_message_twice_stores_once(redis_url, broker_url, namespace, ingest_worker, r):
    ing = _ingestor(redis_url, broker_url, namespace)
    with ing.episode(episode_id="dup") as ep:
        for t in range(10):
            ep.add(np.full(8, t, np.float32), np.int64(0), 1.0)
    ing.flush()
    from claw_tasks.format.batch import StepBatch
    from claw_tasks.format.columns import StrColumn

    batch = StepBatch(
        episode=StrColumn.constant("x", 20),
        step_index=np.arange(20),
        reward=np.ones(20, np.float32),
        terminated=np.zeros(20, bool),
        truncated=np.zeros(20, bool),
        fields={"obs": np.ones((20, 8), np.float32), "action": np.zeros(20, np.int64)},
    )
    store = Store(redis_url, namespace)
    args = send_unchecked(redis_url, store, batch, broker_url=broker_url)
    assert outcome(store, batch.batch_id).committed == 20
    dups = outcomes(r, namespace).get("duplicate", 0)
    client_app(broker_url).send_task("claw_tasks.ingest", args=args, queue="ingest")
    deadline = time.monotonic() + 60
    while outcomes(r, namespace).get("duplicate", 0) == dups:  # the redelivery has run
        assert time.monotonic() < deadline, outcomes(r, namespace)
        time.sleep(0.02)
    store = Store(redis_url, namespace)
    assert store.count() == 30
    assert store.count({"episode_id": "x"}) == 20


@pytest.mark.both_stores
@pytest.mark.parametrize("n_shards", [3])
def test_sharded_namespace(redis_url, broker_url, namespace, ingest_worker, n_shards):
    ing = _ingestor(redis_url, broker_url, namespace, n_shards=n_shards, capacity=3000)
    for e in range(12):
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(20):
                last = t == 19
                nx = np.zeros(2, np.float32) if last else None
                ep.add(
                    np.full(2, e * 100 + t, np.float32),
                    np.int64(e),
                    0.0,
                    terminated=last,
                    next_obs=nx,
                )
    assert ing.close().committed == 240
    store = Store(redis_url, namespace)
    assert store.count() == 240
    for e in (0, 7, 11):
        got = store.episode(f"e{e}")
        np.testing.assert_array_equal(got["obs"][:, 0], e * 100 + np.arange(20))
        np.testing.assert_array_equal(got["next_obs"][:-1, 0], e * 100 + np.arange(1, 20))


def test_leaving_the_episode_block_ends_it(redis_url, broker_url, namespace, ingest_worker):
    ing = _ingestor(redis_url, broker_url, namespace)
    with ing.episode(episode_id="closed") as ep:
        ep.add(np.zeros(8, np.float32), np.int64(0), 1.0)
    with pytest.raises(RuntimeError, match=r"episode .closed. has ended.*ingestor\.episode"):
        ep.add(np.zeros(8, np.float32), np.int64(0), 2.0)
    assert ing.close().committed == 1  # the step before the end is kept
    got = Store(redis_url, namespace).episode("closed")
    assert got["reward"].tolist() == [1.0] and not got["truncated"].any()


@pytest.mark.parametrize(
    ("obs_shape", "n_shards"),
    [((8,), 1), ((64, 64, 3), 1), ((8,), 2)],
    ids=["inline", "in-place", "two-shards"],
)
def test_a_batch_over_capacity_is_sent_in_parts(
    redis_url, broker_url, namespace, ingest_worker, r, obs_shape, n_shards
):
    """250 steps into 100 slots: the Ingestor sends messages of at most a shard's slots
    (one message of 250 would be refused whole), so the ring fills with the batch's steps.
    Messages commit in any order on two worker processes: a part whose slots a later one
    took first is counted expired, as with any batches past capacity."""
    n, capacity = 250, 100
    ing = _ingestor(redis_url, broker_url, namespace, capacity=capacity, n_shards=n_shards)
    image = len(obs_shape) == 3
    obs = np.arange(n, dtype=np.uint8 if image else np.float32)
    names = {episode_code(f"e{i}") % n_shards: f"e{i}" for i in range(16)}  # one per shard
    episodes = [names[i % n_shards] for i in range(n)]
    ing.add_batch(
        {
            "obs": np.broadcast_to(obs.reshape(-1, *[1] * len(obs_shape)), (n, *obs_shape)).copy(),
            "action": np.zeros(n, np.int64),
            "reward": np.arange(n, dtype=np.float32),
            "episode_id": episodes,
            "step_index": np.arange(n),
        }
    )
    res = ing.close()
    assert (res.committed + res.expired, res.rejected, res.errors) == (n, 0, [])
    store = Store(redis_url, namespace)
    assert r.xlen(store.layout_keys.dead) == 0
    assert store.count() == capacity
    kept = []
    for e in sorted(set(episodes)):
        got = store.episode(e)
        rows = got["obs"].reshape(len(got["obs"]), -1)
        assert (rows == rows[:, :1]).all()  # every element of a step's obs is its index
        np.testing.assert_array_equal(rows[:, 0], obs[got["step_index"]])
        np.testing.assert_array_equal(got["reward"], got["step_index"].astype(np.float32))
        kept += got["step_index"].tolist()
    assert len(set(kept)) == capacity
    if image:  # written in place: slots are taken in the client's order, newest kept
        assert sorted(kept) == list(range(n - capacity, n))


def test_the_worker_refuses_a_batch_over_capacity_with_a_dead_letter(
    redis_url, broker_url, namespace, ingest_worker, r
):
    """A producer that does not split (not the Ingestor) gets its over-capacity message
    refused whole, with a dead letter that names the cause; the stored steps stay."""
    from claw_tasks.format.batch import StepBatch
    from claw_tasks.format.columns import StrColumn

    ing = _ingestor(redis_url, broker_url, namespace, capacity=100)
    with ing.episode(episode_id="kept") as ep:
        for t in range(10):
            ep.add(np.full(8, t, np.float32), np.int64(0), 1.0)
    assert ing.close().committed == 10
    n = 250
    batch = StepBatch(
        episode=StrColumn.constant("big", n),
        step_index=np.arange(n),
        reward=np.ones(n, np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": np.ones((n, 8), np.float32), "action": np.zeros(n, np.int64)},
    )
    store = Store(redis_url, namespace)
    send_unchecked(redis_url, store, batch, broker_url=broker_url)
    got = outcome(store, batch.batch_id)
    assert (got.committed, got.rejected) == (0, n)
    assert "250 steps > the 100 a shard" in got.errors[0]
    ((_, letter),) = r.xrevrange(store.layout_keys.dead, count=1)
    assert letter[b"batch_id"].decode() == batch.batch_id
    reason = letter[b"reason"].decode()
    assert "overwrite each other in the ring" in reason and "at most 100 steps" in reason
    assert store.count() == 10 and store.count({"episode_id": "kept"}) == 10
    with pytest.raises(ValueError, match="250 slots > the 100 a shard"):  # nor in place
        store.allocate(0, "too-big", n, {"obs": 32})


@pytest.mark.both_stores
def test_a_namespace_dropped_while_a_batch_is_checked_gets_none_of_it(store):
    """The ingest task checks the tombstone as it starts (with the batch's done record)
    and the commit checks it again just before its scripts: a namespace dropped between
    the two (while the task reads, decodes and checks the batch: a window that grows with
    the batch) gets none of it, no slot taken nor logged; the task discards the batch."""

    class DroppedMeanwhile(Store):
        def commit(self, *args: Any, **kwargs: Any) -> CommitResult:
            self.mark_dropped()  # a drop's first step, after the task's first check
            return super().commit(*args, **kwargs)

    b = batch(episode(0, 10, "terminated"))
    args = IngestArgs(store.namespace, b.batch_id, b.encode(), None)
    with pytest.raises(NamespaceDropped):
        ingest.process(DroppedMeanwhile(store.r, store.namespace), args, get_settings().limits)
    keys = store.layout_keys
    for shard in range(store.config().n_shards):
        assert not store.r.exists(keys.shard_key(shard, "seq"), keys.shard_key(shard, "log"))
