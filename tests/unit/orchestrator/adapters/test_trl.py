"""The TRL adapter (adapters.trl): groups put in TRL's prompt order, and the names it and
``trl_inputs`` hand TRL checked against the installed TRL's GRPOTrainer source (read, not
imported: importing TRL takes seconds). The adapter driving a real GRPOTrainer:
tests/stack/test_trl.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from orchestrator.adapters.llm_trainers import TRL_ROLLOUT_KEYS, trl_inputs
from orchestrator.adapters.trl import align, claw_reward
from orchestrator.delivery.tokens import collate_tokens
from orchestrator.recipe.options import Tokens
from tests.support.llmturns import one_group, tool_session


def test_align_puts_each_wanted_prompt_on_a_served_group_once():
    served = [[1, 2], [3], [1, 2], [4, 4]]
    assert align(served, [[3], [1, 2], [4, 4], [1, 2]]) == [1, 0, 3, 2]
    assert align(served, [[1, 2], [1, 2], [3], [4, 4]]) == [0, 2, 1, 3]
    assert align(served, [[1, 2], [1, 2], [1, 2], [3]]) is None  # only two such groups
    assert align(served, [[9], [3], [1, 2], [4, 4]]) is None  # rolled out by someone else


def test_claw_reward_returns_the_served_rewards():
    assert claw_reward(["a", "b"], claw_reward=[1.0, 0], prompts=["x", "y"]) == [1.0, 0.0]


def grpo_source() -> str:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("the trl extra: pip install -e '.[trl]'")
    return (Path(spec.origin).parent / "trainer" / "grpo_trainer.py").read_text()


def test_rollout_keys_are_the_ones_trl_reads():
    """TRL requires prompt_ids, completion_ids and logprobs of a rollout_func, takes its
    env_mask as the tool mask, and hands the other keys to the reward functions."""
    src = grpo_source()
    required = re.search(r"required_keys = \{([^}]*)\}", src).group(1)
    assert set(re.findall(r'"(\w+)"', required)) == set(TRL_ROLLOUT_KEYS[:3])
    assert 'extra_fields.pop("env_mask"' in src
    assert "rollout_func: RolloutFunc | None" in src


def test_trl_inputs_are_names_trl_s_loss_reads():
    """Every key of trl_inputs is one TRL's loss computation reads from its inputs."""
    src = grpo_source()
    loss = src[src.index("def _compute_loss(") :]
    read = set(re.findall(r'inputs(?:\.get\(|\[)"(\w+)"', loss))
    fields = tool_session()
    arrays = collate_tokens(fields, np.array([7, 8, 9]), one_group(), Tokens(mode="trajectory"))
    got = set(trl_inputs(arrays.arrays))
    assert got - read <= {"num_items_in_batch"}  # TRL passes that one to compute_loss
    assert {"prompt_ids", "completion_ids", "completion_mask", "advantages"} <= read
