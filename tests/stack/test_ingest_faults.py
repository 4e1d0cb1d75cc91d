"""Ingest under faults: a worker SIGKILLed mid-stream, and bad input of every kind."""

from __future__ import annotations

import time

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import SchemaError
from claw_tasks.store import Store
from tests.support.producer import outcome, send_unchecked


def _obs(e: int, t: int) -> np.ndarray:
    return np.full(16, e * 10_000 + t, np.float32)


def test_worker_sigkill_mid_stream_stores_every_step_once(redis_url, namespace, start_worker, r):
    # A short visibility timeout so the unacked messages of the dead worker come back soon.
    env = {"CLAW_VISIBILITY_TIMEOUT": "3"}
    w1 = start_worker("ingest", 1, **env)
    ing = Ingestor(
        namespace,
        redis_url,
        flush_steps=50,
        flush_interval=None,
        claim_check_bytes=2048,
        resend_after=5,
    )
    n_eps, n_steps = 40, 100
    total = n_eps * n_steps

    def produce(episodes: range) -> None:  # flush_steps=50: batches go out as steps arrive
        for e in episodes:
            with ing.episode(episode_id=f"e{e}") as ep:
                for t in range(n_steps):
                    ep.add(
                        _obs(e, t),
                        np.int64(t),
                        float(t),
                        terminated=t == n_steps - 1,
                        next_obs=_obs(e, t + 1) if t == n_steps - 1 else None,
                    )

    # Three quarters go out before the kill, the rest after it: the kill lands mid-stream
    # however fast or slow the worker is (no race between this loop and the worker).
    produce(range(n_eps * 3 // 4))
    store = Store(redis_url, namespace)
    deadline = time.monotonic() + 60
    while store.count() < total // 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    w1.kill()
    killed_at = store.count()
    assert 0 < killed_at <= total * 3 // 4
    produce(range(n_eps * 3 // 4, n_eps))
    start_worker("ingest", 2, **env)
    res = ing.flush(wait=True, timeout=120)
    assert res.committed == total and res.rejected == 0
    assert store.count() == total
    ids = np.concatenate([store.episode(f"e{e}", fields=[])["id"] for e in range(n_eps)])
    assert len(np.unique(ids)) == total  # no step twice
    for e in range(n_eps):
        got = store.episode(f"e{e}")
        np.testing.assert_array_equal(got["step_index"], np.arange(n_steps))
        np.testing.assert_array_equal(got["obs"][:, 0], e * 10_000 + np.arange(n_steps))
        np.testing.assert_array_equal(got["next_obs"][:, 0], e * 10_000 + np.arange(1, n_steps + 1))


@pytest.fixture
def ing(redis_url, namespace, ingest_worker):
    ing = Ingestor(namespace, redis_url, flush_interval=None, max_step_bytes=4096)
    with ing.episode(episode_id="good") as ep:
        for _ in range(5):
            ep.add(np.zeros(8, np.float32), np.int64(0), 1.0)
    assert ing.flush().committed == 5
    return ing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"obs": np.zeros(8, np.float64)}, "field 'obs' has dtype float64, schema says float32"),
        ({"obs": np.zeros(9, np.float32)}, "field 'obs' has shape (9,), schema says float32[8]"),
        ({"reward": float("nan")}, "reward is nan"),
        ({"reward": float("inf")}, "reward is inf"),
        ({"obs": np.array(["a"] * 8)}, "field 'obs' of step 1 of episode 'bad': unsupported type"),
        ({"action": {"x": 1}}, "field 'action' of step 1 of episode 'bad'"),
        ({"extra": np.zeros(3)}, "field(s) extra not in the schema"),
        ({"info": {"arr": np.zeros(3)}}, "info['arr'] is ndarray"),
    ],
)
def test_client_rejects_bad_steps_and_keeps_the_rest(ing, redis_url, namespace, kwargs, message):
    step = {"obs": np.zeros(8, np.float32), "action": np.int64(0), "reward": 0.0, **kwargs}
    with ing.episode(episode_id="bad") as ep:
        ep.add(np.ones(8, np.float32), np.int64(1), 2.0)
        with pytest.raises(SchemaError) as exc:
            ep.add(**step)
        assert message in str(exc.value)
        ep.add(np.ones(8, np.float32), np.int64(1), 3.0)
    assert ing.flush().committed == 2
    store = Store(redis_url, namespace)
    assert store.count() == 7
    assert store.episode("bad")["reward"].tolist() == [2.0, 3.0]


def test_client_rejects_oversize_step(redis_url, namespace, ingest_worker):
    ing = Ingestor(
        namespace, redis_url, flush_interval=None, ragged=("tokens",), max_step_bytes=1000
    )
    with ing.episode(episode_id="long") as ep:
        ep.add(np.zeros(2, np.float32), np.int64(0), 0.0, tokens=np.arange(10, dtype=np.int32))
        with pytest.raises(
            SchemaError, match="step 1 of episode 'long': 4016 payload bytes > limit 1000"
        ):
            ep.add(
                np.zeros(2, np.float32), np.int64(0), 0.0, tokens=np.arange(1000, dtype=np.int32)
            )
        ep.add(np.zeros(2, np.float32), np.int64(0), 0.0, tokens=np.arange(5, dtype=np.int32))
    assert ing.close().committed == 2
    assert [len(t) for t in Store(redis_url, namespace).episode("long")["tokens"]] == [10, 5]


def _raw_batch(n: int, obs: np.ndarray, reward: np.ndarray) -> StepBatch:
    return StepBatch(
        episode=StrColumn.constant("raw", n),
        step_index=np.arange(n),
        reward=reward,
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": obs, "action": np.zeros(n, np.int64)},
    )


@pytest.mark.parametrize("n", [10, 5000])  # inline message, and payload written in place
def test_worker_dead_letters_bad_rows_and_commits_the_rest(ing, redis_url, namespace, r, n):
    reward = np.arange(n, dtype=np.float32)
    reward[[2, 7]] = [np.nan, np.inf]
    obs = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    batch = _raw_batch(n, obs, reward)
    store = Store(redis_url, namespace)
    send_unchecked(redis_url, store, batch, in_place=n > 1000)  # the worker must catch it
    res = outcome(store, batch.batch_id)
    assert res.committed == n - 2 and res.rejected == 2
    got = store.episode("raw")
    np.testing.assert_array_equal(got["obs"], np.delete(obs, [2, 7], axis=0))
    assert "step 2 (episode 'raw', step_index 2): reward is nan" in res.errors[0]
    assert store.count() == 5 + n - 2
    dead = r.xrange(store.layout_keys.dead)
    assert len(dead) == 1
    entry = dead[0][1]
    assert unpackb(entry[b"rows"]) == [2, 7]
    bad = StepBatch.decode(entry[b"payload"])  # the rejected steps are kept, not lost
    assert bad.n == 2 and np.isnan(bad.reward[0])
    np.testing.assert_array_equal(bad.fields["obs"], obs[[2, 7]])


def test_worker_dead_letters_schema_mismatch_whole_batch(ing, redis_url, namespace, r):
    store = Store(redis_url, namespace)
    sent = [
        _raw_batch(4, np.zeros((4, 3), np.float32), np.zeros(4, np.float32)),
        _raw_batch(4, np.zeros((4, 8), np.float64), np.zeros(4, np.float32)),
    ]
    res = [outcome(store, send_unchecked(redis_url, store, b)[2]) for b in sent]
    assert [(o.committed, o.rejected) for o in res] == [(0, 4), (0, 4)]
    assert "field 'obs' is float32[3], schema says float32[8]" in res[0].errors[0]
    assert "field 'obs' is float64[8], schema says float32[8]" in res[1].errors[0]
    assert store.count() == 5
    assert r.xlen(store.layout_keys.dead) == 2


def test_worker_dead_letters_undecodable_payload(ing, redis_url, namespace, r):
    from claw_tasks.format.message import IngestArgs

    args = IngestArgs(namespace, "junk1", b"\x93garbage", None).to_args()
    ing.app.send_task("claw_tasks.ingest", args=args, queue="ingest")
    store = Store(redis_url, namespace)
    res = outcome(store, "junk1")
    assert res.committed == 0 and "undecodable batch" in res.errors[0]
    assert store.count() == 5


def test_broker_down_keeps_batches_until_it_answers(redis_url, namespace, ingest_worker):
    from kombu.exceptions import OperationalError

    from claw_tasks.broker.app import client_app

    ing = Ingestor(namespace, redis_url, broker_url="redis://127.0.0.1:1/0", flush_interval=None)
    with ing.episode(episode_id="offline") as ep:
        for t in range(5):
            ep.add(np.full(4, t, np.float32), np.int64(0), 1.0)
    with pytest.raises(OperationalError, match="Connection refused"):
        ing.flush(wait=False)
    ing.app = client_app(redis_url)  # the broker is back
    assert ing.flush().committed == 5
    np.testing.assert_array_equal(
        Store(redis_url, namespace).episode("offline")["obs"][:, 0], np.arange(5)
    )
