"""Token batches (delivery.tokens): advantages against a numpy reference, transition and
trajectory collation of a 3-turn tool-use session against hand-built references."""

from __future__ import annotations

import numpy as np

from orchestrator.delivery.tokens import advantages, collate_tokens
from orchestrator.recipe.options import Tokens
from tests.support.llmturns import LP, M1, P0, P1, P2, R0, R1, R2, one_group, tool_session


def test_advantages_equal_a_numpy_reference():
    rng = np.random.default_rng(7)
    group = np.repeat(np.arange(6), 5)
    returns = rng.normal(size=30).round(2)
    returns[:5] = 1.0  # a group whose rewards are all equal: advantage 0, not NaN
    ref_grpo, ref_dr = np.zeros(30), np.zeros(30)
    for g in range(6):
        r = returns[group == g]
        ref_dr[group == g] = r - r.mean()
        ref_grpo[group == g] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    perm = rng.permutation(30)  # trajectories in any order
    for kind, ref in (("grpo", ref_grpo), ("dr_grpo", ref_dr)):
        np.testing.assert_allclose(advantages(returns[perm], group[perm], kind), ref[perm], 1e-5)
    np.testing.assert_array_equal(advantages(returns, group, "none"), returns.astype(np.float32))
    assert np.all(advantages(returns, group, "grpo")[:5] == 0)


def test_transition_collation_equals_the_hand_built_reference():
    spec = Tokens(mode="transition", pad_multiple=4, pad_token_id=99, advantage="none")
    out = collate_tokens(tool_session(), np.array([7, 8, 9]), None, spec).arrays
    # lengths 6, 12, 14 -> width 16 (a multiple of 4), right padding
    ref_ids = np.full((3, 16), 99)
    ref_loss = np.zeros((3, 16), bool)
    ref_lp = np.zeros((3, 16), np.float32)
    for i, (p, r, m) in enumerate(((P0, R0, [1, 1, 1]), (P1, R1, M1), (P2, R2, [1]))):
        ref_ids[i, : len(p) + len(r)] = p + r
        ref_loss[i, len(p) : len(p) + len(r)] = m
        ref_lp[i, len(p) : len(p) + len(r)] = LP[i]
    np.testing.assert_array_equal(out["input_ids"], ref_ids)
    np.testing.assert_array_equal(out["attention_mask"], ref_ids != 99)
    np.testing.assert_array_equal(out["loss_mask"], ref_loss)
    np.testing.assert_array_equal(out["old_logprobs"], ref_lp)  # masked tokens keep theirs
    np.testing.assert_array_equal(out["position_ids"][1], [*range(12), *[0] * 4])
    np.testing.assert_array_equal(out["advantages"], np.where(ref_loss, [[0], [0], [2.0]], 0))
    np.testing.assert_array_equal(out["seq_lengths"], [6, 12, 14])
    np.testing.assert_array_equal(out["prompt_lengths"], [3, 8, 13])
    np.testing.assert_array_equal(out["step_ids"], [[7], [8], [9]])


def test_trajectory_collation_equals_the_hand_built_reference_left_padded():
    spec = Tokens(mode="trajectory", pad_multiple=8, padding_side="left")
    out = collate_tokens(tool_session(), np.array([7, 8, 9]), one_group(), spec).arrays
    seq = [*P2, *R2]  # 14 tokens: the whole session is one sequence
    assert out["input_ids"].shape == (1, 16)
    np.testing.assert_array_equal(out["input_ids"][0], [0] * 2 + seq)
    np.testing.assert_array_equal(out["attention_mask"][0], [0] * 2 + [1] * 14)
    np.testing.assert_array_equal(out["position_ids"][0], [0] * 2 + list(range(14)))
    #                 pads     P0       R0       tool     R1 (masked)  tool  R2
    loss = np.array([0] * 2 + [0] * 3 + [1] * 3 + [0] * 2 + M1 + [0] + [1], bool)
    np.testing.assert_array_equal(out["loss_mask"][0], loss)
    lp = [0] * 2 + [0] * 3 + LP[0] + [0] * 2 + LP[1] + [0] + LP[2]
    np.testing.assert_allclose(out["old_logprobs"][0], lp)
    # one group of one trajectory: its GRPO advantage is 0
    np.testing.assert_array_equal(out["advantages"], np.zeros((1, 16)))
    np.testing.assert_array_equal(out["step_ids"], [[7, 8, 9]])
    np.testing.assert_array_equal(out["prompt_lengths"], [3])


def test_trajectory_mode_falls_back_where_a_prefix_breaks():
    """Turn 2's context was rewritten (turn 1's response dropped): turns 0-1 stay one
    sequence, turn 2 is a transition of its own; advantages still per trajectory."""
    p2 = [*P0, 50, 22]
    spec = Tokens(mode="trajectory", advantage="dr_grpo")
    groups = one_group(returns=(3.0, 3.0, 3.0))
    out = collate_tokens(tool_session(p2), np.array([7, 8, 9]), groups, spec).arrays
    assert out["input_ids"].shape == (2, 12)
    np.testing.assert_array_equal(out["input_ids"][0], [*P1, *R1])
    np.testing.assert_array_equal(out["input_ids"][1, :6], [*p2, *R2])
    np.testing.assert_array_equal(out["loss_mask"][1], [0] * 5 + [1] + [0] * 6)
    np.testing.assert_array_equal(out["step_ids"], [[7, 8], [9, -1]])
    np.testing.assert_array_equal(out["trajectory_index"], [0, 0])
    assert out["old_logprobs"][1, 5] == np.float32(LP[2][0])
    np.testing.assert_array_equal(out["advantages"][out["loss_mask"]], 0.0)  # R - mean = 0
