"""``setrange_many``: the in-place payload writes, sent without copying the values."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis

from claw_tasks.connection.client import Client
from claw_tasks.connection.resp import setrange_many

pytestmark = pytest.mark.both_stores


def test_values_land_at_their_offsets_from_array_memory(r: Client) -> None:
    key = f"t-srm:{{{uuid.uuid4().hex}}}"  # one hash tag: one slot on a cluster
    rows = np.arange(3 * 5, dtype=np.uint8).reshape(3, 5)
    raw = rows.data.cast("B")
    setrange_many(r, [(key, 10, raw[5:15]), (key, 0, raw[0:5]), (f"{key}:b", 3, raw[:0])])
    got = r.get(key)
    assert got == bytes(raw[0:5]) + b"\0" * 5 + bytes(raw[5:15])
    assert r.exists(f"{key}:b") == 0  # an empty value at an offset creates nothing
    setrange_many(r, [])  # nothing to send
    other = f"t-srm:{{{uuid.uuid4().hex}}}"  # writes spanning slots: the pipeline's route
    setrange_many(r, [(key, 0, raw[:1]), (other, 1, raw[:1])])
    assert (r.get(key)[:1], r.get(other)) == (b"\0", b"\0\0")


def test_a_refused_write_raises_after_the_others_and_the_client_stays_usable(
    r: Client,
) -> None:
    key = f"t-srm:{{{uuid.uuid4().hex}}}"
    r.hset(f"{key}:hash", "f", "v")
    value = memoryview(b"xyz")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        setrange_many(r, [(f"{key}:hash", 0, value), (key, 2, value)])
    assert r.get(key) == b"\0\0xyz"  # the write after the refused one happened
    assert r.ping()
    setrange_many(r, [(key, 0, value)])
    assert r.get(key) == b"xyzyz"
