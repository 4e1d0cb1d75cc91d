"""The LLM trainers adapter (adapters.llm_trainers): token tensors and the verl and TRL
layouts of a collated trajectory batch."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.delivery.tokens import collate_tokens
from orchestrator.recipe.model import Tokens
from tests.support.llmturns import LP, M1, P0, R0, R1, R2, one_group, tool_session


@pytest.mark.parametrize("side", ["right", "left"])
def test_torch_adapter_and_the_verl_and_trl_layouts(side):
    """The trajectory batch of the 3-turn session: token tensors, and the prompt/response
    split verl and TRL use (prompt left-padded, response right-padded)."""
    from orchestrator.adapters.llm_trainers import token_tensors, trl_inputs, verl_fields

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
    np.testing.assert_allclose(v["old_log_probs"].numpy()[0], [*LP[0], 0, 0, *LP[1]], 1e-6)
    np.testing.assert_array_equal(v["input_ids"].numpy()[1, :6], [*P0, 50, 22, *R2])
    np.testing.assert_array_equal(v["attention_mask"].numpy()[0], [0, 0] + [1] * 12)
    np.testing.assert_array_equal(v["position_ids"].numpy()[0], [0, 0, *range(12)])
    np.testing.assert_array_equal(trl["completion_mask"].numpy(), v["response_mask"].numpy())
    np.testing.assert_array_equal(trl["prompt_ids"].numpy(), v["prompts"].numpy())
    assert trl["advantages"].shape == (2,)
