"""SumTree: every uniform maps to the leaf a global prefix sum gives, zero leaves are never
drawn, draws follow the leaves (chi-square), and updates equal a rebuild."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from orchestrator.sampling.sumtree import MaxTree, SumTree


def leaves(n: int, seed: int) -> np.ndarray:
    """Random masses with zero leaves, zero blocks and a few tiny and huge ones."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.01, 1.0, n) ** 0.6
    x[rng.random(n) < 0.5] = 0.0
    x[n // 3 : n // 3 + 700] = 0.0  # whole blocks without mass
    x[rng.integers(0, n, 5)] = 1e-9
    x[rng.integers(0, n, 5)] = 1e3
    return x


@pytest.mark.parametrize("n", [1, 7, 300, 50_000, 400_000])
def test_find_is_the_global_prefix_search(n):
    x = leaves(n, seed=n)
    if not x.any():
        x[-1] = 1.0
    tree = SumTree(x)
    cs = np.cumsum(x)
    assert tree.total == pytest.approx(cs[-1], rel=1e-12)
    u = np.concatenate(
        [np.linspace(0, tree.total, 20_001), np.random.default_rng(0).random(20_000) * tree.total]
    )
    got = tree.find(u)
    assert x[got].min() > 0  # never a zero leaf, also at 0 and at the total
    want = np.searchsorted(cs, np.minimum(u, np.nextafter(cs[-1], 0)), side="right")
    near = np.abs(u - cs[np.minimum(want, n - 1)]) < 1e-9 * cs[-1]
    near |= np.abs(u - np.where(want > 0, cs[want - 1], 0.0)) < 1e-9 * cs[-1]
    np.testing.assert_array_equal(got[~near], want[~near])


def test_draws_follow_the_leaves():
    x = np.random.default_rng(1).uniform(0.5, 2.0, 3_000)
    x[::3] = 0.0
    tree = SumTree(x)
    drawn = tree.find(np.random.default_rng(2).random(600_000) * tree.total)
    observed = np.bincount(drawn, minlength=len(x))
    assert observed[x == 0].sum() == 0
    expected = x[x > 0] / x.sum() * len(drawn)
    assert chisquare(observed[x > 0], expected).pvalue > 1e-3


def test_updates_equal_a_rebuild():
    rng = np.random.default_rng(3)
    x = leaves(200_000, seed=4)
    tree = SumTree(x)
    for _ in range(20):
        idx = np.unique(rng.integers(0, len(x), rng.integers(1, 600)))
        x[idx] = np.where(rng.random(len(idx)) < 0.3, 0.0, rng.random(len(idx)))
        tree.update(idx.copy(), x[idx])
    fresh = SumTree(x)
    np.testing.assert_array_equal(tree.leaves, fresh.leaves)
    assert tree.total == fresh.total
    u = rng.random(10_000) * fresh.total
    np.testing.assert_array_equal(tree.find(u), fresh.find(u))


@pytest.mark.parametrize("n", [1, 1023, 1025, 300_000])
def test_max_tree_follows_updates(n):
    """MaxTree's maximum after runs of consecutive and random updates (rises, falls, back
    to none) is the leaves' maximum."""
    rng = np.random.default_rng(n)
    x = np.where(rng.random(n) < 0.3, -np.inf, rng.uniform(0, 1, n)).astype(np.float32)
    tree = MaxTree(x, np.float32)
    assert tree.max == x.max()
    for step in range(30):
        if step % 3 == 0:  # a commit's consecutive rows
            start = int(rng.integers(0, n))
            idx = np.arange(start, min(n, start + 300))
        else:
            idx = np.unique(rng.integers(0, n, min(n, 256)))
        values = rng.uniform(0, 2 if step % 5 == 0 else 0.5, len(idx)).astype(np.float32)
        values[rng.random(len(idx)) < 0.2] = -np.inf
        if step == 10:  # the largest leaf leaves: the maximum falls
            idx = np.array([int(np.argmax(x))])
            values = np.array([-np.inf], np.float32)
        x[idx] = values
        tree.update(idx, values)
        assert tree.max == x.max()
    tree.update(np.arange(n), np.full(n, -np.inf, np.float32))
    assert tree.max == -np.inf
