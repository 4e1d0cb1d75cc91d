"""LLM turn helpers (format.turns): the prompt key is an exact float; how a trajectory's
reward spreads over its turns."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.format.turns import discount_turns, prompt_key, spread_rewards


def test_prompt_key_is_an_exact_float():
    k = prompt_key("What is 2+2?")
    assert k == int(k) and 0 <= k < 2**53 and np.float64(k) == k
    assert prompt_key("What is 2+2?") == k != prompt_key("What is 2+3?")


def test_spread_rewards_rule():
    np.testing.assert_array_equal(spread_rewards(3, 1.0), [0, 0, 1])
    got = spread_rewards(3, 1.0, [0.1, 0.2, 0.3])
    np.testing.assert_array_equal(got, np.float32([0.1, 0.2, 1.3]))
    with pytest.raises(ValueError, match="2 turn rewards for 3"):
        spread_rewards(3, 1.0, [0.1, 0.2])


def test_discounted_credit_equals_a_reference():
    """r[t] += gamma * r[t + 1] from the back is sum_k gamma^(k - t) r[k]: checked against
    the matrix form for random rewards and discounts (0 and 1 included)."""
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 40):
        r = rng.normal(size=n)
        for gamma in (0.0, 0.5, 0.9, 1.0):
            k = np.arange(n)
            weights = np.triu(gamma ** np.clip(k[None, :] - k[:, None], 0, None))
            np.testing.assert_allclose(discount_turns(r, gamma), weights @ r, rtol=1e-12)
    np.testing.assert_array_equal(discount_turns([1.0, 2.0], 0.0), [1.0, 2.0])
    assert discount_turns([], 0.9).shape == (0,)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="discount"):
            discount_turns([1.0], bad)
