"""Compressed fields in the store: every codec round-trips through Store.commit, get,
episode and sample (fixed and ragged fields, one and two shards), next_obs at episode
ends, delta frames across ring wrap-around and eviction (a step whose key frame was
evicted still decodes), eviction freeing frames, and the config's format version."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from claw_tasks.codecs import Codec, CodecFrames, encode
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from claw_tasks.store.config import FORMAT
from orchestrator import Recipe, sample

SHAPE = (12, 10, 3)
EP_LEN = 10


def _obs(n: int, seed: int) -> np.ndarray:
    """Game-like frames: a fixed background with a moving block, so deltas are small."""
    rng = np.random.default_rng(seed)
    bg = (rng.integers(0, 4, SHAPE) * 60).astype(np.uint8)
    out = np.repeat(bg[None], n, 0)
    for i in range(n):
        out[i, i % 10 : i % 10 + 2, (3 * i) % 8 : (3 * i) % 8 + 2] = 255 - i % 7
    return out


def _batch(
    first_ep: int,
    n_eps: int,
    obs: np.ndarray,
    tokens: list[np.ndarray] | None = None,
    batch_id: str | None = None,
    shuffle: int | None = None,
    action0: int = 0,
) -> StepBatch:
    """Episodes of EP_LEN steps (truncated, with an explicit next_obs = obs of step 0
    plus 1), rows optionally shuffled (a batch's rows need not be in step order)."""
    n = n_eps * EP_LEN
    step = np.arange(n) % EP_LEN
    b = StepBatch(
        episode=StrColumn.of([f"e{first_ep + i // EP_LEN}" for i in range(n)]),
        step_index=step,
        reward=np.arange(n, dtype=np.float32),
        terminated=np.zeros(n, bool),
        truncated=step == EP_LEN - 1,
        fields={"obs": obs, "action": action0 + np.arange(n, dtype=np.int64)},
        next_rows=np.flatnonzero(step == EP_LEN - 1).astype(np.int32),
        next_obs=obs[step == 0] + 1,
    )
    if tokens is not None:
        b.fields["tokens"] = Ragged.of(tokens, "<i4")
    if batch_id:
        b.batch_id = batch_id
    if shuffle is not None:
        b = b.take(np.random.default_rng(shuffle).permutation(n))
    return b


def _want_next(obs: np.ndarray, action: np.ndarray) -> np.ndarray:
    """The next_obs of each action (row of the unshuffled batch)."""
    last = action % EP_LEN == EP_LEN - 1
    nxt = np.where(last, action - (EP_LEN - 1), action + 1)
    return np.where(last[:, None, None, None], obs[nxt] + 1, obs[nxt])


def _schema(codec: str, ragged: str | None = None) -> Schema:
    fields = {"obs": FieldSpec("|u1", SHAPE, codec), "action": FieldSpec("<i8", ())}
    if ragged is not None:
        fields["tokens"] = FieldSpec("<i4", (None, 2), ragged)
    return Schema(fields=fields)


CODECS = ["zstd", "zstd:1", "lz4", "png", "delta:4", "delta"]


@pytest.mark.both_stores
@pytest.mark.parametrize("n_shards", [1, 2])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_through_the_store(redis_url, namespace, codec, n_shards):
    store = Store(redis_url, namespace)
    store.create(capacity=400, n_shards=n_shards, schema=_schema(codec, "zstd"))
    n = 6 * EP_LEN
    obs = _obs(n, 1)
    tokens = [np.full((i % 4, 2), i, np.int32) for i in range(n)]
    res = store.commit(_batch(0, 6, obs, tokens, shuffle=3))
    assert res.committed == n
    got = store.get(res.ids)
    order = got["action"]
    np.testing.assert_array_equal(got["obs"], obs[order])
    np.testing.assert_array_equal(got["next_obs"], _want_next(obs, order))
    for i, a in enumerate(order.tolist()):
        np.testing.assert_array_equal(got["tokens"][i], tokens[a])
    ep = store.episode("e2")
    np.testing.assert_array_equal(ep["obs"], obs[2 * EP_LEN : 3 * EP_LEN])
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 48,
            "fields": ["obs", "next_obs", "action", "tokens"],
            "sources": [{"name": "all"}],
        }
    )
    sb = sample(store, recipe, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(sb["obs"], obs[sb["action"]])
    np.testing.assert_array_equal(sb["next_obs"], _want_next(obs, sb["action"]))
    for i, a in enumerate(sb["action"].tolist()):
        np.testing.assert_array_equal(sb["tokens"][i], tokens[a])  # collated by delivery
    assert unpackb(store.r.get(store.layout_keys.config))["format"] == FORMAT
    assert not any(store.r.exists(store.layout_keys.field(s, "obs", 0)) for s in range(n_shards))


@pytest.mark.parametrize("codec", ["zstd", "png", "delta:4"])
def test_producer_frames_are_stored_as_sent(redis_url, namespace, codec):
    """A batch carrying frames (a compressing producer, an archive) stores them as they
    are (delta frames are made again at commit: they name step ids)."""
    store = Store(redis_url, namespace)
    store.create(capacity=100, schema=_schema(codec))
    obs = _obs(2 * EP_LEN, 2)
    c = Codec.of(codec)
    b = _batch(0, 2, obs)
    b.fields["obs"] = Encoded(c, np.dtype("|u1"), (len(obs), *SHAPE), encode(c, obs))
    b.next_obs = Encoded(c, np.dtype("|u1"), (2, *SHAPE), encode(c, b.next_obs))
    res = store.commit(b)
    got = store.get(res.ids)
    np.testing.assert_array_equal(got["obs"], obs)
    np.testing.assert_array_equal(got["next_obs"], _want_next(obs, got["action"]))
    stored = store.read_frames(*store.locate(res.ids), "obs")
    explicit = store.read_frames(*store.locate(res.ids[b.next_rows]), "obs", explicit=True)
    if c.name != "delta":
        assert [bytes(f) for f in stored] == [bytes(f) for f in b.fields["obs"].frames]
        assert [bytes(f) for f in explicit] == [bytes(f) for f in b.next_obs.frames]


@pytest.mark.both_stores
def test_delta_chains_across_ring_wraparound_and_eviction(redis_url, namespace):
    """Keys are the newest step of their group, so the ring (oldest first) never takes a
    key before its deltas; eviction keeps delta frames until the ring reuses their slots,
    so a step whose key frame was evicted still decodes, and so does the explicit
    next_obs a predecessor gets from an evicted step."""
    cap = 75  # not a multiple of the episode length: the ring cuts groups in the middle
    store = Store(redis_url, namespace)
    store.create(capacity=cap, schema=_schema("delta:4"))
    obs = _obs(400, 4)
    ids = []
    for k in range(8):  # 8 batches of 5 episodes: the ring wraps 5 times
        part = obs[k * 50 : (k + 1) * 50]
        b = _batch(5 * k, 5, part, batch_id=f"b{k}", shuffle=k, action0=50 * k)
        ids.append(store.commit(b).ids)
    live = np.concatenate(ids)[-cap:]
    got = store.get(live)
    np.testing.assert_array_equal(got["obs"], obs[got["action"]])  # action: the obs row
    has = got["has_next_obs"]  # not where the ring took a successor (rows were shuffled)
    want = _want_next(obs[: 8 * 50], got["action"] % 50 + 50 * (got["action"] // 50))
    assert has.sum() > cap // 2
    np.testing.assert_array_equal(got["next_obs"][has], want[has])
    # Evict the key frames of the newest batch's first two episodes (groups of 4: steps 3,
    # 7 and 9 are keys) and step 5, a delta whose predecessor gets its frame as next_obs.
    newest = store.get(ids[-1])
    keys = ids[-1][np.isin(newest["step_index"], [3, 5, 7, 9]) & (newest["action"] < 370)]
    assert store.evict(keys) == len(keys) == 8
    rest = np.setdiff1d(ids[-1], keys)
    got = store.get(rest)
    rows = got["action"]
    np.testing.assert_array_equal(got["obs"], obs[rows])
    nxt_rows = np.where(got["step_index"] == EP_LEN - 1, rows - (EP_LEN - 1), rows + 1)
    want = obs[nxt_rows] + (got["step_index"] == EP_LEN - 1)[:, None, None, None]
    np.testing.assert_array_equal(got["next_obs"], want)  # step 2's next_obs: evicted step 3
    recipe = Recipe.model_validate(
        {"name": "r", "batch_size": 64, "fields": ["obs", "next_obs"], "sources": [{"name": "all"}]}
    )
    sb = sample(store, recipe, rng=np.random.default_rng(1))
    assert sb["obs"].shape == (64, *SHAPE)
    # More batches: the ring passes the evicted keys and the deltas that needed them.
    for k in range(8, 10):
        ids.append(store.commit(_batch(5 * k, 5, obs[:50], batch_id=f"b{k}")).ids)
    got = store.get(np.concatenate(ids)[-50:])
    np.testing.assert_array_equal(got["obs"], obs[:50])


@pytest.mark.parametrize("codec", ["zstd", "delta:4"])
def test_eviction_frees_frames_except_deltas_until_the_ring(redis_url, namespace, codec):
    store = Store(redis_url, namespace)
    store.create(capacity=40, schema=_schema(codec))
    res = store.commit(_batch(0, 2, _obs(20, 5)))
    r = redis.Redis.from_url(redis_url)
    key = store.layout_keys.compressed(0, "obs", 0)
    assert r.hlen(key) == 20
    store.evict(res.ids[:5])
    assert r.hlen(key) == (20 if codec.startswith("delta") else 15)
    store.commit(_batch(2, 4, _obs(40, 6), batch_id="wrap"))  # the ring reuses every slot
    assert r.hlen(key) == 40


def test_every_namespace_records_the_current_format(redis_url, namespace):
    store = Store(redis_url, namespace)
    store.create(capacity=10, schema=_schema("zstd"))
    r = redis.Redis.from_url(redis_url)
    assert unpackb(r.get(store.layout_keys.config))["format"] == FORMAT
    plain = Store(redis_url, namespace + "p")
    plain.create(capacity=10, schema=Schema(fields={"obs": FieldSpec("|u1", SHAPE)}))
    assert unpackb(r.get(plain.layout_keys.config))["format"] == FORMAT
    assert store.config(refresh=True).schema.codecs == {"obs": Codec("zstd")}


def test_stats_show_each_fields_codec_and_stored_vs_raw_bytes(redis_url, namespace):
    from orchestrator.inspect.stats import Statistics

    store = Store(redis_url, namespace)
    store.create(capacity=200, schema=_schema("zstd", "lz4"))
    n = 6 * EP_LEN
    tokens = [np.full((i % 4, 2), i, np.int32) for i in range(n)]
    store.commit(_batch(0, 6, _obs(n, 1), tokens))
    (found,) = Statistics(store.r).collect([namespace]).namespaces
    payload = found.to_json()["payload"]
    obs, action, tok = payload["obs"], payload["action"], payload["tokens"]
    assert obs["codec"] == "zstd" and obs["raw"] == np.prod(SHAPE)
    r = redis.Redis.from_url(redis_url)
    frames = r.hgetall(store.layout_keys.compressed(0, "obs", 0))
    assert obs["stored"] == pytest.approx(np.mean([len(v) for v in frames.values()]))
    assert obs["ratio"] == pytest.approx(obs["raw"] / obs["stored"]) and obs["ratio"] > 1.5
    assert action == {"codec": None, "stored": 8.0, "raw": 8.0, "ratio": 1.0}
    assert tok["codec"] == "lz4" and tok["raw"] == pytest.approx(
        np.mean([len(t) * 8 for t in tokens])
    )


@pytest.mark.parametrize("codec", ["zstd", "png", "delta:4"])
def test_an_episode_that_ends_without_next_obs_reads_zeros(redis_url, namespace, codec):
    store = Store(redis_url, namespace)
    store.create(capacity=100, schema=_schema(codec))
    obs = _obs(EP_LEN, 7)
    b = _batch(0, 1, obs)
    b.terminated = b.truncated.copy()  # terminated, not truncated: no explicit next_obs
    b.truncated = np.zeros(EP_LEN, bool)
    b.next_rows, b.next_obs = np.zeros(0, np.int32), None
    res = store.commit(b)
    got = store.get(res.ids)
    assert got["has_next_obs"].tolist() == [True] * (EP_LEN - 1) + [False]
    np.testing.assert_array_equal(got["next_obs"][:-1], obs[1:])
    assert not got["next_obs"][-1].any()
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "batch_size": 30,
            "fields": ["obs", "next_obs", "action"],
            "sources": [{"name": "all"}],
        }
    )
    sb = sample(store, recipe, rng=np.random.default_rng(2))
    last = sb["action"] == EP_LEN - 1
    assert last.any() and not sb["next_obs"][last].any()
    np.testing.assert_array_equal(sb["next_obs"][~last], obs[sb["action"][~last] + 1])


def test_a_delta_fields_check_keeps_the_rows_it_decoded_for_the_commit(redis_url, namespace):
    """The ingest check decodes a producer's delta key frames once; the commit makes its
    delta frames from those rows. A bad frame is named and its row dropped."""
    c = Codec.of("delta:4")
    obs = _obs(EP_LEN, 8)
    frames = [bytes(f) for f in encode(c, obs)]
    frames[4] = frames[4][:-4]  # truncated
    enc = Encoded(c, np.dtype("|u1"), (EP_LEN, *SHAPE), CodecFrames.of(frames))
    problems = enc.problems(1 << 20)
    assert list(problems) == [4] and "does not decode" in problems[4]
    good = np.setdiff1d(np.arange(EP_LEN), [4])
    part = enc.take(good)
    np.testing.assert_array_equal(part.decoded.reshape(-1, *SHAPE), obs[good])
    store = Store(redis_url, namespace)
    store.create(capacity=100, schema=_schema("delta:4"))
    b = _batch(0, 1, obs)
    b.fields["obs"] = enc
    b = b.take(good)
    got = store.get(store.commit(b).ids)
    np.testing.assert_array_equal(got["obs"], obs[good])


def test_metrics_serve_stored_and_raw_bytes_per_step(redis_url, namespace):
    from prometheus_client import generate_latest

    from orchestrator.cli.exporter import registry_for

    store = Store(redis_url, namespace)
    store.create(capacity=100, schema=_schema("zstd"))
    store.commit(_batch(0, 2, _obs(2 * EP_LEN, 9)))
    text = generate_latest(registry_for(redis_url, redis_url)).decode()
    values = {
        kind: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for kind in ("stored", "raw")
        if line.startswith("claw_payload_bytes_per_step{")
        and f'namespace="{namespace}"' in line
        and 'field="obs"' in line
        and f'kind="{kind}"' in line
    }
    assert values["raw"] == np.prod(SHAPE) and 0 < values["stored"] < values["raw"] / 1.5


def _keyed_frames(n: int, seed: int) -> np.ndarray:
    """Noise frames with a small changing patch: under ``delta:16`` every 16th step is a
    ~21 kB key frame and the others deltas of tens of bytes (the spread of Atari frames)."""
    rng = np.random.default_rng(seed)
    out = np.repeat(rng.integers(0, 256, (84, 84, 3), np.uint8)[None], n, 0)
    for i in range(n):
        k = 1 + i % 9
        y, x = (7 * i) % 70, (3 * i) % 60
        out[i, y : y + k, x : x + 2 * k] = rng.integers(0, 256, (k, 2 * k, 3))
    return out


def test_memory_of_compressed_frames_is_exact_not_sampled(own_redis_url):
    """What stats, the metrics and max_bytes eviction report grows by what Redis allocates
    (its used_memory) as frames of very different sizes arrive; a 5-entry sample of each
    frame hash was off by 0.25-3x here."""
    from prometheus_client import generate_latest

    from orchestrator.cli.exporter import registry_for
    from orchestrator.inspect.namespaces import memory_by_namespace
    from orchestrator.maintenance.lifecycle import namespace_bytes

    r = redis.Redis.from_url(own_redis_url)
    store = Store(own_redis_url, "frames")
    obs = FieldSpec("|u1", (84, 84, 3), "delta:16")
    store.create(capacity=10_000, n_shards=2, schema=Schema(fields={"obs": obs}))

    def commit(episode: str, frames: np.ndarray) -> None:
        n = len(frames)
        store.commit(
            StepBatch(
                episode=StrColumn.constant(episode, n),
                step_index=np.arange(n),
                reward=np.zeros(n, np.float32),
                terminated=np.arange(n) == n - 1,
                truncated=np.zeros(n, bool),
                fields={"obs": frames},
            )
        )

    def reported() -> list[int]:
        text = generate_latest(registry_for(own_redis_url, own_redis_url)).decode()
        (scraped,) = (
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('claw_namespace_memory_bytes{namespace="frames"}')
        )
        return [memory_by_namespace(r)["frames"], namespace_bytes(r, "frames"), int(scraped)]

    commit("warm-up", _keyed_frames(16, 99))  # scripts loaded, every key of a shard made
    used, before = r.info("memory")["used_memory"], reported()
    for e in range(6):
        commit(f"e{e}", _keyed_frames(500, e))
    grown = r.info("memory")["used_memory"] - used
    assert grown > 5_000_000
    for measure, was in zip(reported(), before, strict=True):
        assert measure - was == pytest.approx(grown, rel=0.05)
