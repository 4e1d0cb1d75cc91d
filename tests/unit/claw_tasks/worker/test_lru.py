"""The bounded LRU of the worker's per-process caches (worker.lru)."""

from __future__ import annotations

import pytest

from claw_tasks.worker.lru import LRU


def test_lru_keeps_the_most_recently_used():
    lru: LRU[str, int] = LRU(2)
    assert lru.get("a", lambda: 1) == 1 and lru.get("b", lambda: 2) == 2
    assert lru.get("a", lambda: 0) == 1  # a is now the most recent
    lru.get("c", lambda: 3)
    assert "b" not in lru and "a" in lru and "c" in lru and len(lru) == 2
    assert lru.drop(lambda k: k in "ac") == 2 and len(lru) == 0
    with pytest.raises(ValueError, match="maxsize >= 1"):
        LRU(0)


def test_an_entry_pushed_out_by_the_bound_is_handed_to_on_evict():
    gone: list[int] = []
    lru: LRU[str, int] = LRU(2, on_evict=gone.append)
    for i, k in enumerate("abc"):
        lru.put(k, i)
    assert gone == [0] and "a" not in lru
    lru.drop(lambda k: True)  # removed on purpose: the caller has them, not on_evict
    assert gone == [0]


def test_an_lru_bounded_by_bytes_keeps_what_fits_and_always_the_newest():
    gone: list[bytes] = []
    lru: LRU[str, bytes] = LRU(100, gone.append, weigh=len, max_bytes=10)
    lru.put("a", b"x" * 4)
    lru.get("b", lambda: b"x" * 4)
    assert lru.nbytes == 8 and len(lru) == 2
    lru.put("c", b"x" * 4)  # 12 > 10: the least recently used goes
    assert "a" not in lru and gone == [b"x" * 4] and lru.nbytes == 8
    lru.put("b", b"x")  # replaced: weighed again
    assert lru.nbytes == 5
    lru.put("huge", b"x" * 50)  # alone over the bound: kept, the rest let go
    assert list(lru) == ["huge"] and lru.nbytes == 50
    lru.drop(lambda k: True)
    assert lru.nbytes == 0
    with pytest.raises(ValueError, match="both weigh and max_bytes"):
        LRU(2, weigh=len)
