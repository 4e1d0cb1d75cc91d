"""LLM turn helpers (format.turns): the prompt key is an exact float; how a trajectory's
reward spreads over its turns."""

from __future__ import annotations

import numpy as np
import pytest

from claw_tasks.format.turns import prompt_key, spread_rewards


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
