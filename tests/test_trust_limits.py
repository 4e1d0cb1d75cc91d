"""Ingest limits that need a worker of their own (its settings differ): decompression
bombs stop at the frame header; dead letters are capped in bytes."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np

from claw_tasks.format.arrays import packb
from claw_tasks.store import Store
from claw_tasks.store.layout import Keys
from tests.hostile import (
    Publisher,
    headers,
    ingest_body,
    messages_done,
    outcomes,
    raw_batch,
    wait_for,
)
from tests.test_trust import _fill, _ingestor, _letters


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
