"""Ingest limits that need a worker of their own (its settings differ): decompression
bombs stop at the frame header, and the budget holds for a whole message; dead letters
are capped in bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lz4.block
import msgpack
import numpy as np
import psutil
import zstandard

from claw_tasks.codecs import Codec, CodecFrames
from claw_tasks.format.arrays import packb
from claw_tasks.format.encoded import Encoded
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from tests.stack.test_trust import _fill, _ingestor, _letters
from tests.stack.test_trust_values import _send
from tests.support.hostile import (
    Publisher,
    headers,
    ingest_body,
    messages_done,
    outcomes,
    raw_batch,
    wait_for,
)


# ---- 5: decompression bombs stop at the frame header ----------------------------------
def test_decompression_bomb_is_refused_before_inflating(redis_url, namespace, r, start_worker):
    start_worker("ingest", 1, CLAW_MAX_DECOMPRESSED_BYTES=str(32 << 20))
    pub = Publisher(redis_url)
    ing = _ingestor(redis_url, namespace)  # a fresh namespace: the bomb would set its schema
    rows = 16
    obs = np.zeros((rows, 1 << 20), np.float32)  # 64 MiB of zeros: ~256 KiB once compressed
    bomb = raw_batch(rows, fields={"obs": obs, "action": np.zeros(rows, np.int64)})
    data = bomb.encode()
    assert len(data) < (1 << 20)
    forged = raw_batch(2)  # an lz4 frame whose header declares 600 MiB for a few bytes
    enc = msgpack.unpackb(forged.encode(), raw=False)
    enc["fields"]["obs"] = ["<f4", [2, 8], (600 << 20).to_bytes(4, "little") + b"\0" * 16, True]
    start = messages_done(r, namespace)
    pub.publish(
        ingest_body(namespace, bomb.batch_id, None, Keys(namespace).stage(bomb.batch_id)), headers()
    )
    r.set(Keys(namespace).stage(bomb.batch_id), data, ex=600)
    pub.publish(ingest_body(namespace, forged.batch_id, packb(enc)))
    assert wait_for(r, start + 2, namespace) == start + 2
    assert Store(redis_url, namespace).count() == 0
    codes = outcomes(r, namespace)
    assert codes.get("dead:decode") == 2
    reasons = b" ".join(f[b"reason"] for f in _letters(r, Keys(namespace).dead))
    assert b"over the 33554432-byte budget" in reasons
    assert b"lz4 frame declares 629145600 bytes" in reasons
    ing.close()


# ---- 4: the decompression budget holds for the whole message -------------------------
def _peak_rss(worker) -> int:
    """High-water RSS of the worker's pool process (the one that decodes)."""
    (child,) = psutil.Process(worker.proc.pid).children()
    for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _lz4_zeros(nbytes: int) -> list:
    """An lz4 array frame of ``nbytes`` of float32 zeros (~1/255 of it on the wire)."""
    return ["<f4", [1, nbytes // 4], lz4.block.compress(bytes(nbytes)), True]


def test_decompression_budget_is_per_message_and_counts_what_inflating_holds(
    redis_url, namespace, r, start_worker
):
    budget = 64 << 20
    worker = start_worker("ingest", 1, CLAW_MAX_DECOMPRESSED_BYTES=str(budget))
    pub = Publisher(redis_url)
    _fill(redis_url, namespace, 1)
    zc = zstandard.ZstdCompressor()
    cases = {}
    two = msgpack.unpackb(raw_batch(1, episode="two").encode(), raw=False)
    two["fields"] = {"obs": _lz4_zeros(40 << 20), "action": _lz4_zeros(40 << 20)}
    cases["two"] = two  # each frame fits the budget, the two do not
    one = msgpack.unpackb(raw_batch(1, episode="one").encode(), raw=False)
    one["fields"]["obs"] = _lz4_zeros(40 << 20)  # fits once, not with the copy inflating makes
    cases["one"] = one
    mixed = msgpack.unpackb(raw_batch(1, episode="mixed").encode(), raw=False)
    mixed["fields"]["obs"] = _lz4_zeros(24 << 20)
    mixed["fields"]["img"] = Encoded(
        Codec.of("zstd"), np.dtype("|u1"), (1, 8, 8), CodecFrames.of([zc.compress(bytes(30 << 20))])
    ).to_msg()  # an lz4 array frame and a compressed field's frame: one budget
    cases["mixed"] = mixed
    before = outcomes(r, namespace)
    _send(pub, r, namespace, ("warm", raw_batch(1, episode="warm", batch_id="warm").encode()))
    peak = _peak_rss(worker)
    _send(pub, r, namespace, *((d["id"], packb(d)) for d in cases.values()))
    grown = _peak_rss(worker) - peak
    assert grown < 16 << 20, f"the worker inflated a frame of a refused message (+{grown} B)"
    stats = outcomes(r, namespace)
    assert stats.get("dead:decode", 0) - before.get("dead:decode", 0) == len(cases)
    letters = _letters(r, Keys(namespace).dead)[-len(cases) :]
    for f in letters:
        assert b"CLAW_MAX_DECOMPRESSED_BYTES" in f[b"reason"], f[b"reason"]
    pub.close()


# ---- 9 (part): dead letters keep a prefix and a digest, under a byte cap ---------------
def test_dead_letters_are_capped_in_bytes(redis_url, namespace, r, start_worker):
    cap, prefix = 256 * 1024, 16 * 1024
    start_worker("ingest", 1, CLAW_DEAD_LETTER_BYTES=str(cap), CLAW_DEAD_LETTER_PREFIX=str(prefix))
    pub = Publisher(redis_url)
    _fill(redis_url, namespace, 1)
    rng = np.random.default_rng(0)
    sent = {f"junk{i}": b"\xc1" + rng.bytes(40_000) for i in range(60)}  # 2.4 MB of garbage
    start = messages_done(r, namespace)
    for batch_id, payload in sent.items():
        pub.publish(ingest_body(namespace, batch_id, payload))
    assert wait_for(r, start + len(sent), namespace) == start + len(sent)
    stats = outcomes(r, namespace)
    assert stats["dead"] == stats["dead:decode"] == len(sent)  # every one counted ...
    letters = _letters(r, Keys(namespace).dead)
    assert stats["dead_trimmed"] == len(sent) - len(letters) > 0  # ... the oldest trimmed
    assert sum(int(f[b"cost"]) for f in letters) == stats["dead_bytes"] <= cap
    assert r.memory_usage(Keys(namespace).dead, samples=0) <= cap * 1.1
    for f in letters:
        full = sent[f[b"batch_id"].decode()]
        assert f[b"payload"] == full[:prefix] and int(f[b"payload_bytes"]) == len(full)
        assert f[b"digest"] == b"sha256:" + hashlib.sha256(full).hexdigest().encode()
