"""``nearest``'s ``k`` is bounded by ``CLAW_NEAREST_MAX_K`` before anything is allocated
or read: ``nearest(ns, x, k=10**9)`` asked a Faiss search for (m, 10**9 + 8) results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from claw_tasks.settings import use_settings
from orchestrator.retrieval import nearest
from orchestrator.retrieval.query import check_k

# No Redis is reached: a refused k fails before the session is opened (the URL is a closed
# port, so a k that got through would fail differently).
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize("k", [0, -1, 1025, 10**9, 10**20])
def test_a_k_out_of_bounds_is_refused_naming_k_and_its_bound(k):
    with pytest.raises(ValueError, match=r"^k must be in 1\.\.1024 \(CLAW_NEAREST_MAX_K\)"):
        nearest("ns", np.zeros((1, 4), np.float32), k, redis_url=NOWHERE)


@pytest.mark.parametrize("k", [1.5, "3", None, True, float("nan")])
def test_a_k_that_is_not_an_integer_is_refused(k):
    with pytest.raises(ValueError, match=r"^k must be an integer in 1\.\.1024"):
        nearest("ns", np.zeros((1, 4), np.float32), k, redis_url=NOWHERE)


def test_the_bound_is_a_setting(monkeypatch):
    monkeypatch.setenv("CLAW_NEAREST_MAX_K", "5000")
    use_settings()
    assert check_k(5000) == 5000
    with pytest.raises(ValueError, match=r"1\.\.5000"):
        check_k(5001)


@given(st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=8), st.none()))
def test_check_k_accepts_exactly_the_integers_in_bounds(k):
    ok = isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 1024
    if ok:
        assert check_k(k) == k
    else:
        with pytest.raises(ValueError, match=r"^k must be"):
            check_k(k)
