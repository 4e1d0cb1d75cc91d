"""Batched reads (``claw_tasks.connection.resp``): GETRANGEs straight into a buffer, the
same bytes as redis-py reads, on every kind of connection the client may have; each
command's decoder given its replies; and the same batches when the fetch falls back."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
import redis

from claw_tasks.connection.resp import Commands, Reply, RoundTrips, plain_connection
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.sample import sample


def getranges(trips: RoundTrips, commands: list[tuple[str, int, int]], out: np.ndarray) -> None:
    batch = Commands()
    batch.into(commands, out.nbytes, out=out)
    trips.run(batch)


def read(client: redis.Redis, commands: list[tuple[str, int, int]]) -> bytes:
    trips = RoundTrips(client)
    assert trips.reader() is not None
    out = np.zeros(sum(end - start + 1 for _, start, end in commands), np.uint8)
    try:
        getranges(trips, commands, out)
    finally:
        trips.close()
    return out.tobytes()


def test_replies_fill_the_buffer_in_order_on_the_clients_database(redis_url):
    base = redis_url.rsplit("/", 1)[0]
    client = redis.Redis.from_url(f"{base}/3")
    assert client.connection_pool.connection_kwargs["db"] == 3
    key, blob = f"bulk-{uuid.uuid4().hex}", bytes(range(256)) * 1000  # 256,000 bytes
    client.set(key, blob)
    commands = [
        (key, 0, 9),
        (key, 250_000, 255_999),
        (key, 7, 7),
        (f"{key}-none", 0, 4),
        (key, 255_990, 256_009),
    ]
    got = read(client, commands)
    expected = blob[:10] + blob[250_000:] + blob[7:8] + bytes(5) + blob[255_990:] + bytes(10)
    assert got == expected  # a missing key or a range past the end: zeros
    assert read(redis.Redis.from_url(f"{base}/4"), [(key, 0, 3)]) == bytes(4)  # not in db 4


def test_an_error_reply_raises_and_the_next_call_reconnects(redis_url):
    client = redis.Redis.from_url(redis_url)
    key = f"bulk-{uuid.uuid4().hex}"
    client.hset(f"{key}-h", "a", "b")
    client.set(key, b"abcdef")
    trips = RoundTrips(client)
    out = np.zeros(6, np.uint8)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        getranges(trips, [(f"{key}-h", 0, 5)], out)
    getranges(trips, [(key, 0, 5)], out)
    assert out.tobytes() == b"abcdef"
    trips.close()


def test_password_user_and_unix_socket(tmp_path):
    sock = tmp_path / "r.sock"
    with RedisServer(options={"unixsocket": str(sock), "unixsocketperm": "700"}) as srv:
        admin = srv.client()
        admin.set("k", b"0123456789")
        admin.acl_setuser("claw", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
        user = redis.Redis(host=srv.host, port=srv.port, username="claw", password="pw")
        assert read(user, [("k", 2, 4)]) == b"234"
        over_unix = redis.Redis(unix_socket_path=str(sock))
        assert read(over_unix, [("k", 8, 9)]) == b"89"
        trips = RoundTrips(user)
        out = np.zeros(2, np.uint8)
        getranges(trips, [("k", 0, 1)], out)
        srv.restart()  # the reader's connection breaks: replaced on the next call
        admin.set("k", b"ab")
        admin.acl_setuser("claw", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
        getranges(trips, [("k", 0, 1)], out)
        assert out.tobytes() == b"ab"
        trips.close()
        wrong = redis.Redis(host=srv.host, port=srv.port, username="claw", password="no")
        with pytest.raises(redis.ResponseError, match="WRONGPASS"):
            read(wrong, [("k", 0, 1)])


class _OtherConnection(redis.Connection):
    """A connection class the bulk reader does not know (as TLS or a proxy would be)."""


def _fallback_client(url: str) -> redis.Redis:
    kw = redis.Redis.from_url(url).connection_pool.connection_kwargs
    pool = redis.ConnectionPool(
        connection_class=_OtherConnection, host=kw["host"], port=kw["port"], db=kw["db"]
    )
    return redis.Redis(connection_pool=pool)


def test_unknown_connections_fall_back_to_redis_py_with_the_same_batches(redis_url, namespace):
    assert plain_connection(_fallback_client(redis_url)) is None
    assert plain_connection(redis.Redis.from_url(redis_url, protocol=3)) is None
    store = Store(redis_url, namespace)
    store.create(capacity=400)
    rng = np.random.default_rng(0)
    n, length = 300, 30
    idx = np.arange(n)
    last = idx % length == length - 1
    store.commit(
        StepBatch(
            episode=StrColumn.of([f"e{i // length}" for i in idx]),
            step_index=idx % length,
            reward=np.ones(n, np.float32),
            terminated=last,
            truncated=np.zeros(n, bool),
            fields={"obs": rng.integers(0, 256, (n, 84, 84, 3), dtype=np.uint8)},  # plain rows
            next_rows=np.flatnonzero(last).astype(np.int32),
            next_obs=rng.integers(0, 256, (int(last.sum()), 84, 84, 3), dtype=np.uint8),
        )
    )
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 64,
            "fields": ["obs", "next_obs"],
            "n_step": 3,
            "sources": [{"name": "all"}],
        }
    )
    other = Store(_fallback_client(redis_url), namespace)
    for seed in range(3):
        bulk = sample(store, recipe, rng=np.random.default_rng(seed))
        plain = sample(other, recipe, rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(bulk.ids, plain.ids)
        np.testing.assert_array_equal(bulk["obs"], plain["obs"])
        np.testing.assert_array_equal(bulk["next_obs"], plain["next_obs"])
    np.testing.assert_array_equal(bulk["obs"], store.get(bulk.ids, ["obs"])["obs"])


class _Script:
    """A script as a transport loads it on NOSCRIPT (its ``source``)."""

    source = "return {KEYS[1], ARGV[1]}"
    sha = hashlib.sha1(source.encode()).hexdigest()


def _batch(key: str) -> tuple[Commands, list[Reply]]:
    batch = Commands()
    replies = [
        batch.add(["GET", key]),
        batch.into([(key, 0, 2), (f"{key}-none", 0, 1), (key, 4, 9)], 11, lambda buf: bytes(buf)),
        batch.add_all([["HMGET", f"{key}-h", "a", "b"], ["HMGET", f"{key}-h", "c"]], list),
        batch.add(["EVALSHA", _Script.sha, 1, key, "x"], lambda r: [v.upper() for v in r]),
        batch.into([], 0, len),
    ]
    return batch, replies


@pytest.mark.parametrize("path", ["own connection", "redis-py", "own connection busy"])
def test_a_transport_gives_each_decoder_its_replies_on_either_path(redis_url, path):
    """Commands queued with their decoders, GETRANGEs into one buffer (zeros past the end
    and for a missing key) and the rest after them: the same values on the transport's own
    connection, through redis-py, and when another thread holds the own connection; a
    script the server does not know is loaded and the batch sent again."""
    client = redis.Redis.from_url(redis_url)
    key = f"bulk-{uuid.uuid4().hex}"
    client.set(key, b"abcdef")
    client.hset(f"{key}-h", mapping={"a": "1", "c": "3"})
    client.script_flush()
    transport = RoundTrips(_fallback_client(redis_url) if path == "redis-py" else client, [_Script])
    batch, replies = _batch(key)
    if path == "own connection busy":
        with transport.lock:
            transport.run(batch)
    else:
        transport.run(batch)
    assert (transport.reader() is None) == (path == "redis-py")
    got = [r.value for r in replies]
    assert got == [
        b"abcdef",
        b"abc" + bytes(2) + b"ef" + bytes(4),
        [[b"1", None], [b"3"]],
        [key.encode().upper(), b"X"],
        0,
    ]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        bad = Commands()
        bad.add(["GET", f"{key}-h"])
        transport.run(bad)
    again, replies = _batch(key)
    transport.run(again)  # the connection survived the error
    assert [r.value for r in replies] == got
