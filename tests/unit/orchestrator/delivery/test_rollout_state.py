"""A rollout's epoch orders: each epoch a permutation, the same whatever order the epochs
are asked in, and held in memory bounded by a few epochs, not by ``epochs`` x ``steps``."""

from __future__ import annotations

import tracemalloc

import numpy as np

from orchestrator.delivery.rollout_state import EpochOrders


def test_epochs_are_the_generators_permutations_in_turn_whatever_order_asked():
    n = 1000
    rng = np.random.default_rng([7, 3])
    want = [rng.permutation(n) for _ in range(6)]
    orders = EpochOrders(7, 3, n)
    for e in (4, 0, 5, 1, 4, 2, 3, 0):
        np.testing.assert_array_equal(orders[e], want[e])
        assert not orders[e].flags.writeable
    np.testing.assert_array_equal(EpochOrders(7, 3, n)[5], want[5])  # not the asking order


def test_memory_does_not_grow_with_the_epochs():
    n, epochs = 100_000, 40  # one order: 800 kB
    orders = EpochOrders(1, 1, n)
    tracemalloc.start()
    try:
        for e in range(epochs):
            orders[0]  # a trainer's first positions
            orders[e]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 4 * n * 8, f"{held / 1e6:.1f} MB held for {epochs} epochs"
