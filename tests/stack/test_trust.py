"""The ingest trust boundary, one test per kind of finding: hostile messages published
straight to the queue, and bad values through the public client."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.format.arrays import packb
from claw_tasks.format.columns import Placed
from claw_tasks.format.schema import SchemaError
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from claw_tasks.worker.deadletter import REJECTS
from tests.support.hostile import (
    MSGPACK,
    Publisher,
    body,
    dump_keys,
    headers,
    ingest_body,
    messages_done,
    outcomes,
    raw_batch,
    wait_for,
)


def _ingestor(redis_url: str, namespace: str, **kw) -> Ingestor:
    return Ingestor(namespace, redis_url, flush_interval=None, **kw)


def _fill(redis_url: str, namespace: str, n: int, **kw) -> Ingestor:
    ing = _ingestor(redis_url, namespace, **kw)
    with ing.episode(episode_id="live") as ep:
        for t in range(n):
            ep.add(np.full(8, t, np.float32), np.int64(t), 1.0)
    assert ing.flush().committed == n
    return ing


@pytest.fixture
def pub(redis_url):
    p = Publisher(redis_url)
    yield p
    p.close()


def _letters(r, key: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(key)]


# ---- 1: a message Celery cannot parse must not stop the worker ------------------------
def test_malformed_envelopes_are_dead_lettered_and_the_worker_serves_on(
    redis_url, namespace, r, ingest_worker, pub
):
    ing = _fill(redis_url, namespace, 3)
    ok = ingest_body(namespace, "x", b"")  # a well-formed body, for header mutations
    cases = [
        (body([1, 2]), headers(), MSGPACK, "args"),  # not [version, namespace, ...]
        (msgpack.packb([[], {}]), headers(), MSGPACK, "body"),
        (msgpack.packb([[], {}, None, 1]), headers(), MSGPACK, "body"),
        (msgpack.packb(7), headers(), MSGPACK, "body"),
        (msgpack.packb(None), headers(), MSGPACK, "body"),
        (msgpack.packb({"args": 1}), headers(), MSGPACK, "body"),
        (ok, headers(timelimit=["soon", None]), MSGPACK, "headers"),
        (ok, headers(timelimit="x"), MSGPACK, "headers"),
        (ok, headers(eta="not a time"), MSGPACK, "headers"),
        (b'{"a": 1}', headers(), "application/json", "content-type"),
        (b"\x80\x04K\x01.", headers(), "application/x-python-serialize", "content-type"),
        (b"hello", headers(), "text/plain", "content-type"),
        (ok, headers(task="celery.chain"), MSGPACK, "task"),
        (ok, "not a dict", MSGPACK, "envelope"),  # kombu itself cannot read it
        (
            body([1], embed={"callbacks": [{"task": "claw.maintenance.refill"}]}),
            headers(),
            MSGPACK,
            "body",
        ),
    ]
    before = messages_done(r, None, namespace)
    codes_before = outcomes(r, None, namespace)
    for data, hdrs, ctype, _ in cases:
        pub.publish(data, hdrs, content_type=ctype)
    assert wait_for(r, before + len(cases), None, namespace) == before + len(cases)
    assert ingest_worker.proc.poll() is None, "the worker must survive every message"
    codes = outcomes(r, None, namespace)
    for code in {c for *_, c in cases}:
        want = sum(c == code for *_, c in cases)
        assert codes.get(f"dead:{code}", 0) - codes_before.get(f"dead:{code}", 0) == want, code
    reasons = [f[b"reason"] for f in _letters(r, REJECTS)[-len(cases) :]]
    assert all(reasons), "every refusal says why"
    # ... and it still serves: a valid batch commits.
    with ing.episode(episode_id="after") as ep:
        ep.add(np.zeros(8, np.float32), np.int64(0), 1.0)
    assert ing.flush().committed == 1


# ---- 2: a claim check names only the sender's own staging key for its batch ----------
def test_claim_check_cannot_name_another_key(redis_url, namespace, r, ingest_worker, pub):
    victim = f"{namespace}-victim"
    _fill(redis_url, victim, 5)
    _fill(redis_url, namespace, 1)
    vk, own = Keys(victim), Keys(namespace)
    before = dump_keys(r, victim)
    secret = r.get(vk.config)
    r.set(own.stage("b-other"), raw_batch(2).encode(), ex=600)  # a real stage key, not its own
    names = [
        vk.config,
        vk.shard_key(0, "seq"),
        vk.stage("b1"),
        own.config,
        own.shard_key(0, "seq"),
        own.stage("b-other"),
        "ingest",
        "unacked",
    ]
    start = messages_done(r, None, namespace)
    for i, key in enumerate(names):
        pub.publish(ingest_body(namespace, f"b{i}", None, key))
    assert wait_for(r, start + len(names), None, namespace) == start + len(names)
    assert dump_keys(r, victim) == before, "another namespace was touched"
    assert r.exists(own.config, own.shard_key(0, "seq"), own.stage("b-other")) == 3
    letters = _letters(r, own.dead)[-len(names) :]
    assert [f[b"code"] for f in letters] == [b"claim-check"] * len(names)
    assert all(b"is not this batch's staging key" in f[b"reason"] for f in letters)
    assert not any(secret in b"".join(f.values()) for f in _letters(r, own.dead))


# ---- 3: nothing is allocated (or evicted) before the whole batch is known to fit -------
@pytest.mark.parametrize("n", [500, 1_000_000])
def test_small_message_cannot_allocate_or_evict(redis_url, namespace, r, ingest_worker, pub, n):
    ing = _fill(redis_url, namespace, 900, capacity=1000)
    store = Store(redis_url, namespace)
    before = store.episode("live")["obs"][:, 0].copy()
    batch = raw_batch(n, fields={"action": np.zeros(n, np.int64)})
    batch.step_index = np.zeros(n, np.int64)  # compresses to nothing
    batch.fields["obs"] = Placed(np.dtype(np.float32), (n, 8))  # "written in place": never
    data = batch.encode()
    assert len(data) < 128 * 1024  # a small message declaring n rows
    start = messages_done(r, namespace)
    pub.publish(ingest_body(namespace, batch.batch_id, data))
    assert wait_for(r, start + 1, namespace) == start + 1
    assert store.count() == 900
    np.testing.assert_array_equal(store.episode("live")["obs"][:, 0], before)
    assert r.get(store.layout_keys.shard_key(0, "seq")) == b"900"  # no slot was taken
    (letter,) = _letters(r, store.layout_keys.dead)
    assert letter[b"code"] in (b"placed", b"size")
    ing.close()


# ---- 6: every failure ends committed, dead-lettered or retried -------------------------
def _frame_mutation(key: str, value) -> bytes:
    enc = msgpack.unpackb(raw_batch(3).encode(), raw=False)
    enc[key] = value
    return packb(enc)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (packb([1, 2, 3]), "decode"),  # not a map
        (packb("text"), "decode"),
        (b"\xc1", "decode"),  # not msgpack at all
        (_frame_mutation("step_index", ["<i8", 5, b"\0" * 24, False]), "decode"),  # shape int
        (_frame_mutation("step_index", ["<i8", [3], b"garbage-lz4", True]), "decode"),
        (_frame_mutation("step_index", ["|O", [3], b"\0" * 24, False]), "decode"),  # objects
        (_frame_mutation("reward", ["<c8", [3], b"\0" * 24, False]), "decode"),  # complex
        (_frame_mutation("info", 7), "decode"),
        (_frame_mutation("v", 2), "decode"),  # a batch format this worker does not read
    ],
)
def test_malformed_batches_are_dead_lettered_never_lost(
    redis_url, namespace, r, ingest_worker, pub, payload, code
):
    _fill(redis_url, namespace, 1)
    start = messages_done(r, namespace)
    pub.publish(ingest_body(namespace, "bad", payload))
    assert wait_for(r, start + 1, namespace) == start + 1
    assert outcomes(r, namespace).get(f"dead:{code}") == 1
    done = r.get(Keys(namespace).done("bad"))
    assert done is not None, "the sender must learn the outcome"
    (letter,) = _letters(r, Keys(namespace).dead)
    assert letter[b"payload"] == payload[: len(letter[b"payload"])]
    assert letter[b"digest"] == b"sha256:" + hashlib.sha256(payload).hexdigest().encode()


def test_info_with_non_string_keys_is_dead_lettered_by_row(redis_url, namespace, r, ingest_worker):
    ing = _fill(redis_url, namespace, 1)
    batch = raw_batch(3, info_rows=np.array([1], np.int32), info=[{1: "x"}])
    store = Store(redis_url, namespace)
    from tests.support.producer import outcome, send_unchecked

    out = outcome(store, send_unchecked(redis_url, store, batch)[2])
    assert (out.committed, out.rejected) == (2, 1)
    assert "info key 1 is int; info keys must be strings" in out.errors[0]
    assert len(store.episode("raw")["step_index"]) == 2  # reads of the kept steps work
    ing.close()


def test_redis_data_error_is_dead_lettered_not_retried_forever(
    redis_url, namespace, r, ingest_worker
):
    ing = _fill(redis_url, namespace, 1)
    store = Store(redis_url, namespace)
    r.delete(store.layout_keys.shard_key(0, "links"))
    r.set(store.layout_keys.shard_key(0, "links"), "not a hash")  # the commit's HSET is refused
    from tests.support.producer import outcome, send_unchecked

    out = outcome(store, send_unchecked(redis_url, store, raw_batch(3))[2])
    assert out.committed == 0 and "Redis refused the batch" in out.errors[0]
    assert outcomes(r, namespace).get("dead:redis") == 1
    ing.close()


# ---- format version of the message ----------------------------------------------------
def test_unknown_message_version_is_dead_lettered_not_misread(
    redis_url, namespace, r, ingest_worker, pub
):
    _fill(redis_url, namespace, 1)
    args = [2, namespace, "v2", raw_batch(1).encode(), None]
    start = messages_done(r, None, namespace)
    pub.publish(body(args))
    pub.publish(body([namespace, "v0", raw_batch(1).encode(), None]))  # before versions
    assert wait_for(r, start + 2, None, namespace) == start + 2
    reasons = [f[b"reason"] for f in _letters(r, REJECTS)[-2:]]
    assert b"ingest message format version 2 is not one this worker reads (1)" in reasons[0]
    assert b"version" in reasons[1]
    assert Store(redis_url, namespace).count() == 1


# ---- 7: the client refuses what the store would misread ------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority": float("inf")}, r"priority is inf \(must be finite and >= 0 as float32\)"),
        ({"priority": -3.0}, r"priority is -3.0 \(must be finite and >= 0 as float32\)"),
        ({"priority": float("nan")}, "priority is nan"),
        ({"info": {1: "x"}}, "info key 1 is int; info keys must be strings"),
    ],
)
def test_client_refuses_bad_priorities_and_info_keys(redis_url, namespace, kwargs, message):
    ing = _ingestor(redis_url, namespace)
    with ing.episode(episode_id="e") as ep, pytest.raises(SchemaError, match=message):
        ep.add(np.zeros(8, np.float32), np.int64(0), 1.0, **kwargs)
    assert ep.step_index == 0


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("step_index", 2**31, "step_index 2147483648 is outside"),
        ("step_index", -1, "step_index -1 is outside"),
        ("policy_version", 2**31, "policy_version 2147483648 is outside"),
        ("priority", -3.0, "priority is -3.0"),
        ("priority", np.inf, "priority is inf"),
    ],
)
def test_add_batch_checks_ranges_instead_of_wrapping(redis_url, namespace, column, value, message):
    ing = _ingestor(redis_url, namespace)
    cols = {
        "obs": np.zeros((3, 8), np.float32),
        "action": np.zeros(3, np.int64),
        "reward": np.zeros(3),
        "episode_id": "e",
        "step_index": np.arange(3),
    }
    cols[column] = np.array([0, 1, value], np.float64 if column == "priority" else np.int64)
    with pytest.raises(SchemaError, match=message):
        ing.add_batch(cols)
    with pytest.raises(SchemaError, match="policy_version"):
        ing.episode(policy_version=2**31)


def test_worker_refuses_out_of_range_rows_the_client_would(redis_url, namespace, r, ingest_worker):
    ing = _fill(redis_url, namespace, 1)
    store = Store(redis_url, namespace)
    batch = raw_batch(4, priority=np.array([1, -3, np.inf, np.nan], np.float32))
    batch.step_index = np.array([0, 1, 2, 2**31], np.int64)
    from tests.support.producer import outcome, send_unchecked

    out = outcome(store, send_unchecked(redis_url, store, batch)[2])
    assert (out.committed, out.rejected) == (1, 3)
    assert store.count() == 2
    ing.close()


# ---- 8: the step counter advances once per accepted step, even when the send fails -----
def test_failed_send_does_not_shift_step_index(redis_url, namespace, ingest_worker):
    from kombu.exceptions import OperationalError

    from claw_tasks.broker.app import client_app

    ing = Ingestor(
        namespace, redis_url, broker_url="redis://127.0.0.1:1/0", flush_interval=None, flush_steps=3
    )
    ep = ing.episode(episode_id="e")
    for t in range(3):
        try:
            ep.add(np.full(8, t, np.float32), np.int64(0), 1.0)
        except OperationalError:
            assert t == 2  # the third step fills the buffer: its send fails, it is kept
    assert ep.step_index == 3
    ing.app = client_app(redis_url)  # the broker is back
    for t in range(3, 5):
        ep.add(np.full(8, t, np.float32), np.int64(0), 1.0)
    assert ing.close().committed == 5
    got = Store(redis_url, namespace).episode("e")
    np.testing.assert_array_equal(got["step_index"], np.arange(5))
    np.testing.assert_array_equal(got["obs"][:, 0], np.arange(5))
