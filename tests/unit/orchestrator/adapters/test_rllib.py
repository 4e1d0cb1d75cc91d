"""The RLlib adapter's pure parts: how an n-step request splits into recipes, and the m
of a window from its discount."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray.rllib", reason="ray[rllib] is not installed (pip install -e '.[rllib]')")

from orchestrator.adapters.rllib.episodes import steps_taken
from orchestrator.adapters.rllib.sample_args import n_step_rows


def test_one_n_takes_every_row():
    assert n_step_rows(64, 3) == [(3, 64)]


def test_a_range_splits_the_rows_evenly_over_its_ns():
    assert n_step_rows(64, (2, 5)) == [(2, 22), (3, 21), (4, 21)]
    assert n_step_rows(2, (1, 5)) == [(1, 1), (2, 1)]  # an n with no row gets no recipe
    assert sum(r for _, r in n_step_rows(1000, (1, 8))) == 1000


def test_the_window_length_comes_back_from_the_discount():
    gamma, n = 0.99, 5
    m = np.array([1, 2, 3, 4, 5])
    discount = (gamma**m).astype(np.float32)  # as a batch carries it
    np.testing.assert_array_equal(steps_taken(discount, gamma, n), m)
    # gamma 1: every m gives the same target, n is reported
    np.testing.assert_array_equal(steps_taken(np.ones(3, np.float32), 1.0, n), [5, 5, 5])
