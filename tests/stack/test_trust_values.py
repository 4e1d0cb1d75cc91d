"""The ingest trust boundary, round two: values that overflow when
stored, refused messages that still changed the schema, concurrent deliveries that lost
their outcome, float or bool format versions (the decompression budget, which needs a
worker of its own, is in ``test_trust_limits``).
Hostile messages are published straight to the queue and run by a real worker, or (the
race) handed to the ingest entry point from two threads at once against a real Redis."""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from claw_tasks.client import Ingestor
from claw_tasks.format.arrays import packb
from claw_tasks.format.batch import Ragged
from claw_tasks.format.message import IngestArgs
from claw_tasks.format.schema import FieldSpec, Schema, SchemaError
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from claw_tasks.worker.ingest import run
from tests.stack.test_trust import _fill, _letters
from tests.support.hostile import (
    Publisher,
    headers,
    ingest_body,
    messages_done,
    outcomes,
    raw_batch,
)
from tests.support.hostile import wait_for as wait_outcomes


@pytest.fixture
def pub(redis_url):
    p = Publisher(redis_url)
    yield p
    p.close()


def _send(pub: Publisher, r, namespace: str, *payloads: tuple[str, bytes]) -> dict[str, int]:
    """Publish inline batches and wait for their outcomes; the outcome counters after."""
    start = messages_done(r, namespace)
    for batch_id, payload in payloads:
        pub.publish(ingest_body(namespace, batch_id, payload), headers())
    assert wait_outcomes(r, start + len(payloads), namespace) == start + len(payloads)
    return outcomes(r, namespace)


# ---- 1: values are checked as they are stored, not as they were sent ------------------
def test_values_that_overflow_their_stored_type_are_refused(
    redis_url, namespace, r, ingest_worker, pub
):
    _fill(redis_url, namespace, 1)
    b = raw_batch(6, episode="wide")
    b.reward = np.array([1e300, 0.5, 0.5, -1e39, 0.5, 0.5], "<f8")  # float32 in the store
    b.priority = np.array([0.5, 1e39, 0.5, 0.5, 0.25, 3e38], "<f8")
    score = np.array([1, 2, "1e400", 4, 5, 6], np.longdouble)  # float64 in the store
    b.nums = {"t:score": score}
    before = outcomes(r, namespace)
    stats = _send(pub, r, namespace, (b.batch_id, b.encode()))
    assert stats.get("partial", 0) == before.get("partial", 0) + 1
    got = Store(redis_url, namespace).episode("wide")
    assert got["step_index"].tolist() == [4, 5]  # rows 0-3 overflow
    assert got["reward"].tolist() == [0.5, 0.5]
    assert got["priority"].tolist() == [0.25, np.float32(3e38)]
    assert got["tags.score"].tolist() == [5.0, 6.0]
    reason = _letters(r, Keys(namespace).dead)[-1][b"reason"].decode()
    assert "reward is 1e+300" in reason and "priority is 1e+39" in reason
    assert "tag 'score'" in reason and "float32" in reason


# ---- 2: a refused message changes nothing but its dead letter -------------------------
def test_an_all_refused_message_leaves_the_schema_as_it_was(
    redis_url, namespace, r, ingest_worker, pub
):
    store = Store(redis_url, namespace)
    schema = Schema(
        fields={"obs": FieldSpec("<f4", (8,)), "action": FieldSpec("<i8", ())},
        tags={"a": "num", "b": "str"},
    )
    store.create(capacity=256, schema=schema)
    config = r.get(Keys(namespace).config)
    bad = raw_batch(3, episode="nan")
    bad.reward = np.full(3, np.nan, np.float32)
    bad.nums = {f"t:x{i}": np.zeros(3) for i in range(62)}  # the schema's 64-tag limit
    before = outcomes(r, namespace)
    stats = _send(pub, r, namespace, (bad.batch_id, bad.encode()))
    assert stats.get("rejected", 0) == before.get("rejected", 0) + 1, stats
    assert stats.get("partial", 0) == before.get("partial", 0)
    assert r.get(Keys(namespace).config) == config  # not a tag more
    assert store.count() == 0
    good = raw_batch(2, episode="new-tag", nums={"t:fresh": np.ones(2)})
    stats = _send(pub, r, namespace, (good.batch_id, good.encode()))
    assert store.count() == 2 and "fresh" in store.config(refresh=True).schema.tags


def test_an_all_refused_message_does_not_fix_a_fresh_namespaces_schema(
    redis_url, namespace, r, ingest_worker, pub
):
    store = Store(redis_url, namespace)
    store.create(capacity=256)  # no schema yet: the first committed batch sets it
    bad = raw_batch(
        2, fields={"obs": np.zeros((2, 1000)), "action": np.zeros(2, np.int64)}, episode="x"
    )
    bad.reward = np.full(2, np.inf, np.float32)
    stats = _send(pub, r, namespace, (bad.batch_id, bad.encode()))
    assert stats.get("rejected") == 1 and not stats.get("partial")
    assert store.config(refresh=True).schema is None
    good = raw_batch(
        3, fields={"obs": np.zeros((3, 4), np.float32), "action": np.zeros(3, np.int64)}
    )
    stats = _send(pub, r, namespace, (good.batch_id, good.encode()))
    assert stats.get("committed") == 1 and store.count() == 3
    assert store.config().schema.fields["obs"] == FieldSpec("<f4", (4,))


# ---- 3: two deliveries of one batch at once: each counted exactly once ---------------
@pytest.mark.parametrize("valid", [True, False], ids=["valid", "refused"])
def test_concurrent_deliveries_each_get_one_outcome(redis_url, namespace, r, valid):
    _fill(redis_url, namespace, 1, capacity=4096)
    limits = get_settings().limits
    pairs = 12
    messages = []
    for i in range(pairs):
        b = raw_batch(4, episode=f"race{i}")
        if not valid:
            b.reward[:] = np.nan
        messages.append(IngestArgs(namespace, b.batch_id, b.encode(), None).to_args())
    before = outcomes(r, namespace)
    for args in messages:
        gate = threading.Barrier(2)
        errors: list[BaseException] = []

        def deliver(args=args, gate=gate, errors=errors) -> None:
            gate.wait()
            try:
                run(r, list(args), {}, limits)
            except BaseException as e:  # surfaced below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=deliver) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    got = outcomes(r, namespace)
    delta = {k: got.get(k, 0) - before.get(k, 0) for k in ("committed", "rejected", "duplicate")}
    first = "committed" if valid else "rejected"
    assert delta == {"committed": 0, "rejected": 0, "duplicate": pairs, first: pairs}, delta
    assert got.get("dead", 0) - before.get("dead", 0) == (0 if valid else pairs)
    assert Store(redis_url, namespace).count() == 1 + (4 * pairs if valid else 0)


# ---- 5: format versions are ints ------------------------------------------------------
@pytest.mark.parametrize("version", [True, 1.0])
def test_a_float_or_bool_batch_version_is_refused(
    redis_url, namespace, r, ingest_worker, pub, version
):
    _fill(redis_url, namespace, 1)
    d = msgpack.unpackb(raw_batch(2, episode="v").encode(), raw=False)
    d["v"] = version
    stats = _send(pub, r, namespace, (d["id"], packb(d)))
    assert stats.get("dead:decode") == 1 and Store(redis_url, namespace).count() == 1
    assert b"format version" in _letters(r, Keys(namespace).dead)[-1][b"reason"]


# ---- found by the widened fuzz: a ragged field whose every row is empty ---------------
def test_a_ragged_field_of_empty_rows_commits(redis_url, namespace, r, ingest_worker, pub):
    """Its values are a (0, 4) array: the commit failed as an internal error."""
    Store(redis_url, namespace).create(
        capacity=64,
        schema=Schema(fields={"obs": FieldSpec("<f4", (None, 4)), "action": FieldSpec("<i8", ())}),
    )
    b = raw_batch(2, episode="empty", fields={"obs": Ragged.of([np.zeros((0, 4), np.float32)] * 2)})
    b.fields["action"] = np.zeros(2, np.int64)
    stats = _send(pub, r, namespace, (b.batch_id, b.encode()))
    assert stats.get("committed") == 1 and not stats.get("dead"), stats
    got = Store(redis_url, namespace).episode("empty")
    assert [row.shape for row in got["obs"]] == [(0, 4), (0, 4)]


def test_rollout_tags_are_checked_in_float32_where_they_are_used(
    redis_url, namespace, r, ingest_worker, pub
):
    """The attack: ``value=1e300`` is finite in float64 (numeric tags' stored type), but
    a rollout's GAE runs in float32: the served minibatch would carry returns/value inf,
    log_prob -inf and every advantage 0. Rollout tags are refused unless NaN or finite in float32,
    other numeric tags as float64."""
    _fill(redis_url, namespace, 1)
    b = raw_batch(5, episode="ro")
    b.nums = {
        "t:value": np.array([1e300, 0.5, 0.5, 0.5, 0.5]),
        "t:log_prob": np.array([-0.5, -1e39, -0.5, -0.5, -0.5]),
        "t:bootstrap_value": np.array([np.nan, np.nan, np.inf, np.nan, 1.0]),
        "t:score": np.array([1e300, 1e300, 1e300, 1e300, 1e300]),  # float64: fine
    }
    before = outcomes(r, namespace)
    stats = _send(pub, r, namespace, (b.batch_id, b.encode()))
    assert stats.get("partial", 0) == before.get("partial", 0) + 1
    got = Store(redis_url, namespace).episode("ro")
    assert got["step_index"].tolist() == [3, 4]
    assert got["tags.value"].tolist() == [0.5, 0.5] and got["tags.score"][0] == 1e300
    reason = _letters(r, Keys(namespace).dead)[-1][b"reason"].decode()
    for tag in ("value", "log_prob", "bootstrap_value"):
        assert f"tag '{tag}'" in reason, reason
    assert "float32" in reason


FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-4e38, 4e38),
    st.sampled_from([3.4028235e38, 3.4028236e38, -3.5e38, 1e300, -1e39, 0.0, -0.0]),
)
TAG_VALUE = st.one_of(FLOATS, st.integers(-(10**400), 10**400), st.booleans())


def _ok32(v) -> bool:
    try:
        x = float(v)
    except OverflowError:
        return False
    with np.errstate(over="ignore"):
        return bool(np.isnan(x) or np.isfinite(np.float32(x)))


def _fuzz_rollout_tags(redis_url, namespace, r, pub, n: int) -> dict[str, int]:
    """Hostile rollout tags through ``Episode.add`` (refused at once iff not NaN or finite
    in float32, nothing buffered) and straight to the queue (each bad row dead-lettered);
    whatever was stored is NaN or finite in float32."""
    _fill(redis_url, namespace, 1)
    ing = Ingestor(namespace, redis_url, flush_interval=None)
    ep = ing.episode(episode_id="fz-client")
    counts = {"added": 0, "refused": 0, "rows": 0}
    sent: list[tuple[str, bytes]] = []
    expect: list[int] = []  # rows of each raw batch that must be stored

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        tags=st.fixed_dictionaries(
            {}, optional={"log_prob": TAG_VALUE, "value": TAG_VALUE, "bootstrap_value": TAG_VALUE}
        ),
        reward=FLOATS,
        rows=st.lists(st.tuples(FLOATS, FLOATS, FLOATS), min_size=1, max_size=6),
    )
    def storm(tags: dict, reward: float, rows: list[tuple]) -> None:
        good = all(_ok32(v) for v in tags.values()) and _ok32(reward) and not np.isnan(reward)
        try:
            ep.add(np.zeros(8, np.float32), np.int64(0), reward, **tags)
        except SchemaError as e:
            assert not good, (tags, reward, e)
            assert "\n" not in str(e)
            counts["refused"] += 1
        else:
            assert good, (tags, reward)
            counts["added"] += 1
        b = raw_batch(len(rows), episode=f"fz-raw-{len(sent)}")
        cols = np.array(rows, np.float64).T
        b.nums = {"t:log_prob": cols[0], "t:value": cols[1], "t:bootstrap_value": cols[2]}
        sent.append((b.batch_id, b.encode()))
        expect.append(sum(all(_ok32(v) for v in row) for row in rows))
        counts["rows"] += len(rows)

    storm()
    assert ing.close().committed == counts["added"]
    for i in range(0, len(sent), 50):
        _send(pub, r, namespace, *sent[i : i + 50])
    store = Store(redis_url, namespace)
    stored = 0
    for e, want in [*((f"fz-raw-{i}", k) for i, k in enumerate(expect)), ("fz-client", None)]:
        try:
            got = store.episode(e, fields=[])
        except KeyError:
            assert want == 0, e  # every row refused: nothing stored
            continue
        assert want is None or len(got["id"]) == want, (e, want, len(got["id"]))
        for tag in ("log_prob", "value", "bootstrap_value"):
            col = got.get(f"tags.{tag}")
            if col is not None:
                assert all(_ok32(v) for v in col.tolist()), (e, tag, col)
        stored += len(got["id"])
    counts["stored"] = stored
    return counts


def test_fuzz_rollout_tags(redis_url, namespace, r, ingest_worker, pub):
    counts = _fuzz_rollout_tags(redis_url, namespace, r, pub, 60)
    assert counts["added"] > 0 and counts["refused"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_rollout_tags_long(redis_url, namespace, r, ingest_worker, pub):
    counts = _fuzz_rollout_tags(redis_url, namespace, r, pub, 1000)
    print(f"rollout tag fuzz: {counts}")
    assert counts["added"] > 0 and counts["refused"] > 0
