"""Predecessor links of frame stacks (sampling.stacks) against a brute-force inverse of
``next``, built at once and kept current from changed rows."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.sampling.sequences import follow
from orchestrator.sampling.stacks import Predecessors
from tests.unit.orchestrator.sampling.test_sequences import random_ring


def brute_prev(cols, cap):
    """The live row whose next step is each row (-1: none)."""
    n = len(cols["id"])
    prev = np.full(n, -1)
    nxt = follow(cols, np.arange(n), cap)
    for r in range(n):
        if nxt[r] >= 0 and cols["alive"][r]:
            assert prev[nxt[r]] == -1
            prev[nxt[r]] = r
    return prev


@pytest.mark.parametrize("seed", range(8))
def test_predecessors_are_the_inverse_of_next(seed):
    """Built at once, and kept current through later commits from the changed rows alone
    (ring wrap-around, successor-first commits, evictions)."""
    ring = random_ring(seed)
    cols, cap = ring.c, ring.cap
    early = {k: v.copy() for k, v in cols.items()}
    n = len(cols["id"])
    kept = Predecessors(cap)
    assert kept.back(early, np.arange(n)).tolist() == brute_prev(early, cap).tolist()
    more = random_ring(seed + 100)  # more commits on top: replay them onto ring
    for (ep, step), (row, _) in sorted(more.at.items(), key=lambda kv: kv[1][1]):
        ring.add(ep + 100, step, 0.0, int(more.c["flags"][row]))
    changed = np.flatnonzero(
        (cols["id"] != early["id"])
        | (cols["next"] != early["next"])
        | (cols["alive"] != early["alive"])
    )
    kept.refresh(changed)
    want = brute_prev(cols, cap)
    assert kept.back(cols, np.arange(n)).tolist() == want.tolist()
    assert Predecessors(cap).back(cols, np.arange(n)).tolist() == want.tolist()
    chain = kept.chain(cols, np.arange(n), 3)
    assert chain[:, 2].tolist() == list(range(n))
    assert chain[:, 1].tolist() == want.tolist()
    assert chain[:, 0].tolist() == [-1 if p < 0 else want[p] for p in want.tolist()]
