"""The LLM trainers adapter (adapters.llm_trainers): token tensors, the verl and TRL
layouts of a collated trajectory batch, and TRL rollouts of a batch of groups."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.delivery.tokens import collate_tokens
from orchestrator.recipe.options import Tokens
from orchestrator.sampling.groups import Groups
from tests.support.llmturns import LP, M1, P0, R0, R1, R2, one_group, tool_session


@pytest.mark.parametrize("side", ["right", "left"])
def test_torch_adapter_and_the_verl_and_trl_layouts(side):
    """The trajectory batch of the 3-turn session: token tensors, and the prompt/response
    split verl and TRL use (prompt left-padded, response right-padded)."""
    from orchestrator.adapters.llm_trainers import (
        token_tensors,
        trl_inputs,
        verl_fields,
        verl_non_tensor,
    )

    spec = Tokens(mode="trajectory", pad_multiple=8, padding_side=side, pad_token_id=99)
    fields = tool_session(p2=[*P0, 50, 22])
    out = collate_tokens(fields, np.array([7, 8, 9]), one_group((1.0, 1.0, 1.0)), spec).arrays
    t = token_tensors(out)
    assert t["input_ids"].dtype == t["attention_mask"].dtype == __import__("torch").int64
    assert t["loss_mask"].dtype == t["advantages"].dtype == __import__("torch").float32
    v, trl = verl_fields(out), trl_inputs(out)
    # sequence 0: turns 0-1 (prompt P0); sequence 1: turn 2 alone (prompt p2)
    np.testing.assert_array_equal(v["prompts"].numpy(), [[99, 99, *P0], [*P0, 50, 22]])
    resp0 = [*R0, 20, 21, *R1]
    np.testing.assert_array_equal(v["responses"].numpy(), [resp0, R2 + [99] * 8])
    np.testing.assert_array_equal(v["response_mask"].numpy()[0], [1, 1, 1, 0, 0, *M1])
    np.testing.assert_allclose(v["rollout_log_probs"].numpy()[0], [*LP[0], 0, 0, *LP[1]], 1e-6)
    assert v["response_mask"].dtype == __import__("torch").int64  # verl's agent loop's
    # the reward on each response's last token (verl's rm_scores -> token_level_scores)
    np.testing.assert_array_equal(v["rm_scores"].numpy(), [[0] * 8 + [1.0], [1.0] + [0] * 8])
    np.testing.assert_array_equal(v["input_ids"].numpy()[1, :6], [*P0, 50, 22, *R2])
    np.testing.assert_array_equal(v["attention_mask"].numpy()[0], [0, 0] + [1] * 12)
    np.testing.assert_array_equal(v["position_ids"].numpy()[0], [0, 0, *range(12)])
    np.testing.assert_array_equal(trl["tool_mask"].numpy(), v["response_mask"].numpy())
    np.testing.assert_array_equal(trl["completion_mask"].numpy()[1], [1] + [0] * 8)
    assert (trl["completion_mask"].numpy()[0] == 1).all()
    np.testing.assert_array_equal(trl["sampling_per_token_logps"], v["rollout_log_probs"])
    assert int(trl["num_items_in_batch"]) == v["response_mask"].sum()
    nt = verl_non_tensor(out)
    assert nt["uid"].tolist() == ["0", "0"] and nt["__num_turns__"].tolist() == [2, 1]
    np.testing.assert_array_equal(trl["prompt_ids"].numpy(), v["prompts"].numpy())
    assert trl["advantages"].shape == (2,)


def single_turns() -> tuple[dict, Groups]:
    """6 one-turn trajectories of 2 groups of 3, the groups' rows interleaved, prompts of
    two lengths, one empty response; returns 1, 0, 0 (group 0) and 0, 1, 1 (group 1)."""
    prompts = [[5, 6], [7, 8, 9], [5, 6], [7, 8, 9], [5, 6], [7, 8, 9]]
    responses = [[10, 11], [12], [13], [], [14, 15], [16, 17]]
    fields = {
        "prompt_ids": [np.array(p, np.int32) for p in prompts],
        "response_ids": [np.array(r, np.int32) for r in responses],
        "response_logprobs": [
            np.array([-0.1 * (k + 1)] * len(r), np.float32) for k, r in enumerate(responses)
        ],
    }
    group = np.array([0, 1, 0, 1, 0, 1], np.int32)
    returns = np.array([1, 0, 0, 1, 0, 1], np.float32)
    return fields, Groups(group, np.arange(6, dtype=np.int32), returns, ("a", "b"), 0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_trl_rollout_is_groups_in_blocks_unpadded(side):
    """What a TRL rollout_func returns: each group a block of num_generations rows, in the
    group's order; unpadded ids and log-probs; an empty response becomes one masked pad."""
    from orchestrator.adapters.llm_trainers import TRL_ROLLOUT_KEYS, trl_rollout

    fields, groups = single_turns()
    spec = Tokens(mode="transition", pad_multiple=4, padding_side=side, pad_token_id=99)
    out = trl_rollout(collate_tokens(fields, np.arange(100, 106), groups, spec).arrays, 3)
    assert tuple(out) == TRL_ROLLOUT_KEYS
    assert out["claw_group"] == [0, 0, 0, 1, 1, 1]
    assert out["prompt_ids"] == [[5, 6]] * 3 + [[7, 8, 9]] * 3
    assert out["completion_ids"] == [[10, 11], [13], [14, 15], [12], [99], [16, 17]]
    np.testing.assert_allclose(out["logprobs"][0], [-0.1, -0.1], 1e-6)
    np.testing.assert_allclose(out["logprobs"][5], [-0.6, -0.6], 1e-6)
    assert out["logprobs"][4] == [0.0] and out["env_mask"][4] == [0]
    assert out["env_mask"][0] == [1, 1]
    assert out["claw_reward"] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert out["claw_step_ids"] == [[100], [102], [104], [101], [103], [105]]


def test_trl_rollout_refuses_groups_of_another_size():
    from orchestrator.adapters.llm_trainers import trl_rollout

    fields, groups = single_turns()
    arrays = collate_tokens(fields, np.arange(6), groups, Tokens(mode="transition")).arrays
    with pytest.raises(ValueError, match="num_generations is 4: set the recipe's group_size"):
        trl_rollout(arrays, 4)
