"""Compressed fields through the real pipeline: Ingestors compressing at the producer or
leaving it to a real Celery ingest worker, a hostile producer whose frames lie about
their size (dead-lettered with the reason, before anything is stored), and a real
prefetch fill that decodes before it augments."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from claw_tasks.client import Ingestor
from claw_tasks.client.sending import encode_batch
from claw_tasks.codecs import Codec, CodecFrames, encode
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from orchestrator.delivery.client import BatchClient
from tests.stack.test_prefetch import _is_replicate_shift
from tests.support.producer import outcome, send_unchecked

SHAPE = (40, 40, 3)


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """Game-like frames: a flat background, a moving block."""
    out = np.full((n, *SHAPE), 30, np.uint8)
    rng = np.random.default_rng(seed)
    for i, (y, x) in enumerate(rng.integers(0, 34, (n, 2)).tolist()):
        out[i, y : y + 6, x : x + 6] = (200, 100 + i % 50, 50)
    return out


def _record(ing: Ingestor, frames: np.ndarray, episodes: int) -> None:
    per = len(frames) // episodes
    for e in range(episodes):
        with ing.episode(episode_id=f"e{e}", task_id="play") as ep:
            for t in range(per):
                i = e * per + t
                last = t == per - 1
                ep.add(
                    frames[i],
                    np.int64(i),
                    float(t),
                    terminated=last,
                    next_obs=255 - frames[i] if last else None,
                )


def _check_stored(store: Store, frames: np.ndarray, episodes: int) -> None:
    per = len(frames) // episodes
    for e in range(episodes):
        ep = store.episode(f"e{e}")
        np.testing.assert_array_equal(ep["obs"], frames[e * per : (e + 1) * per])
        np.testing.assert_array_equal(ep["next_obs"][:-1], frames[e * per + 1 : (e + 1) * per])
        np.testing.assert_array_equal(ep["next_obs"][-1], 255 - frames[(e + 1) * per - 1])


@pytest.mark.parametrize(
    ("codec", "where", "claim_check"),
    [
        ("zstd", "producer", 4096),
        ("zstd", "worker", 4096),
        ("png", "producer", 4096),
        ("delta:8", "worker", 4096),
        ("zstd", "worker", 256),
        ("delta:8", "producer", 256),
    ],
)
def test_ingest_through_a_real_worker(redis_url, namespace, workers, codec, where, claim_check):
    frames = _frames(120)
    # Over claim_check bytes of fixed-shape payload a batch writes it in place (256: the
    # 50 actions of 8 bytes are); a compressed field never is: it travels in the message,
    # encoded or not, beside the fields written in place.
    ing = Ingestor(
        namespace,
        redis_url,
        flush_interval=None,
        flush_steps=50,
        claim_check_bytes=claim_check,
        codecs={"obs": codec},
        compress_at=where,
    )
    _record(ing, frames, episodes=3)
    assert ing.close().committed == 120
    store = Store(redis_url, namespace)
    assert store.schema().codecs == {"obs": Codec.of(codec)}
    _check_stored(store, frames, episodes=3)
    assert not store.r.exists(store.layout_keys.field(0, "obs", 0))


def test_the_producer_sends_frames_the_worker_sends_raw_rows(redis_url, namespace):
    schema = Schema(fields={"obs": FieldSpec("|u1", SHAPE, "zstd"), "action": FieldSpec("<i8", ())})
    frames = _frames(64)
    b = _batch(frames)
    sent = encode_batch(b, schema)
    assert isinstance(sent.fields["obs"], Encoded) and isinstance(sent.next_obs, Encoded)
    # what crosses the link: frames, smaller than the raw rows even after the message's lz4
    assert len(sent.encode()) < len(b.encode()) and len(sent.encode()) * 10 < frames.nbytes


def _batch(frames: np.ndarray, ep: str = "h") -> StepBatch:
    n = len(frames)
    return StepBatch(
        episode=StrColumn.of([ep] * n),
        step_index=np.arange(n),
        reward=np.zeros(n, np.float32),
        terminated=np.arange(n) == n - 1,
        truncated=np.zeros(n, bool),
        fields={"obs": frames, "action": np.arange(n, dtype=np.int64)},
        next_rows=np.array([n - 1], np.int32),
        next_obs=frames[-1:],
    )


def test_hostile_frames_are_dead_lettered_before_they_are_stored(redis_url, namespace, workers):
    """Each bad frame costs only its own step: the rest of the batch commits, the dead
    letter names the cause, and the stored steps all decode."""
    store = Store(redis_url, namespace)
    schema = Schema(fields={"obs": FieldSpec("|u1", SHAPE, "zstd"), "action": FieldSpec("<i8", ())})
    store.create(capacity=1000, schema=schema)
    frames = _frames(8)
    zstd = Codec.of("zstd")
    good = list(encode(zstd, frames))
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 26))  # 64 MiB of zeros in ~2 KiB
    hostile = {
        1: bomb,
        2: zstandard.ZstdCompressor(write_content_size=False).compress(frames[2].tobytes()),
        3: good[3][:-5],  # truncated: the header is right, the body does not decode
        5: b"\x28\xb5\x2f\xfd" + bytes(20),  # a zstd magic, then garbage
    }
    sent = [hostile.get(i, f) for i, f in enumerate(good)]
    b = _batch(frames)
    b.fields["obs"] = Encoded(zstd, np.dtype("|u1"), (8, *SHAPE), CodecFrames.of(sent))
    b.next_obs = Encoded(zstd, np.dtype("|u1"), (1, *SHAPE), encode(zstd, frames[-1:]))
    send_unchecked(redis_url, store, b)
    out = outcome(store, b.batch_id)
    assert (out.committed, out.rejected) == (4, 4)
    text = " ".join(out.errors)
    assert "declares 67108864 decoded bytes" in text and "without its content size" in text
    assert "does not decode" in text
    dead = store.r.xrange(store.layout_keys.dead)
    assert dead and b"declares 67108864" in dead[-1][1][b"reason"]
    got = store.episode("h")
    assert sorted(got["action"].tolist()) == [0, 4, 6, 7]
    np.testing.assert_array_equal(got["obs"], frames[[0, 4, 6, 7]])
    # frames declaring more than CLAW_MAX_DECOMPRESSED_BYTES (256 MiB) in all: refused whole
    b3 = _batch(frames, "h3")
    b3.fields["obs"] = Encoded(zstd, np.dtype("|u1"), (8, *SHAPE), CodecFrames.of([bomb] * 8))
    b3.next_obs = None
    b3.next_rows = np.zeros(0, np.int32)
    send_unchecked(redis_url, store, b3)
    out = outcome(store, b3.batch_id)
    assert out.committed == 0 and "CLAW_MAX_DECOMPRESSED_BYTES" in out.errors[0]
    # a frame of another codec than the namespace's is a schema mismatch: refused whole
    b2 = _batch(frames, "h2")
    lz4c = Codec.of("lz4")
    b2.fields["obs"] = Encoded(lz4c, np.dtype("|u1"), (8, *SHAPE), encode(lz4c, frames))
    b2.next_obs = None
    b2.next_rows = np.zeros(0, np.int32)
    send_unchecked(redis_url, store, b2)
    out = outcome(store, b2.batch_id)
    assert out.committed == 0 and "(lz4), schema says" in out.errors[0]


def test_prefetch_decodes_in_the_fill_before_augmentation(redis_url, namespace, workers):
    frames = _frames(120, seed=1)
    ing = Ingestor(namespace, redis_url, flush_interval=None, flush_steps=60, codecs={"obs": "png"})
    _record(ing, frames, episodes=2)
    assert ing.close().committed == 120
    client = BatchClient(namespace, redis_url)
    client.register(
        {
            "name": "pix",
            "batch_size": 32,
            "fields": ["obs", "action", "next_obs"],
            "sources": [{"name": "all"}],
            "augment": {"obs": [{"random_shift": {"pad": 2}}], "next_obs": "same"},
            "prefetch": {"depth": 2},
        }
    )
    store = Store(redis_url, namespace)
    for _ in range(2):
        batch = client.pop("pix", timeout=60)
        assert batch["obs"].shape == (32, *SHAPE) and batch["obs"].dtype == np.uint8
        stored = store.get(batch.ids)
        for i in range(32):
            assert _is_replicate_shift(batch["obs"][i], frames[batch["action"][i]], 2)
            assert _is_replicate_shift(batch["next_obs"][i], stored["next_obs"][i], 2)
    client.close()
