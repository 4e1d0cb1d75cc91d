"""Hand-built LLM turns (the ``Schema.llm`` fields), committed with ``Store.commit``; GRPO
recipes; a 3-turn tool-use session with its hand-built token layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.schema import tag_column
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.groups import Groups


def turns_batch(turns: Sequence[dict[str, Any]]) -> StepBatch:
    """One step per turn dict: ``traj`` (str), ``turn``, ``prompt``, ``response``,
    ``logprobs`` (default -0.5 each), ``mask`` (default all 1), ``reward`` (0), ``last``
    (False), ``key`` (the ``prompt_uid`` number), ``version`` (``policy_version``, 0)."""
    n = len(turns)
    lp = [t.get("logprobs", [-0.5] * len(t["response"])) for t in turns]
    masks = [t.get("mask", [1] * len(t["response"])) for t in turns]
    return StepBatch(
        episode=StrColumn.of([t["traj"] for t in turns]),
        step_index=np.array([t["turn"] for t in turns], np.int64),
        reward=np.array([t.get("reward", 0.0) for t in turns], np.float32),
        terminated=np.array([t.get("last", False) for t in turns], bool),
        truncated=np.zeros(n, bool),
        policy_version=np.array([t.get("version", 0) for t in turns], np.int64),
        fields={
            "prompt_ids": Ragged.of([np.asarray(t["prompt"], np.int32) for t in turns]),
            "response_ids": Ragged.of([np.asarray(t["response"], np.int32) for t in turns]),
            "response_logprobs": Ragged.of([np.asarray(x, np.float32) for x in lp]),
            "response_mask": Ragged.of([np.asarray(m, np.uint8) for m in masks]),
        },
        nums={tag_column("prompt_uid"): np.array([float(t["key"]) for t in turns])},
    )


def rollouts(n_prompts: int, n_rollouts: int, n_turns: int, seed: int) -> list[dict]:
    """Every turn of ``n_prompts x n_rollouts`` trajectories, interleaved at random (each
    trajectory's turns in order, trajectories finishing out of order). Trajectory
    ``p{i}r{j}``, key ``1000 + i``; its last turn has reward ``i + j / 10``."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n_prompts):
        for j in range(n_rollouts):
            turns, context = [], [1, i + 2]
            for t in range(n_turns):
                response = [5 + t, 6 + j]
                turns.append(
                    {
                        "traj": f"p{i}r{j}",
                        "turn": t,
                        "key": 1000 + i,
                        "prompt": list(context),
                        "response": response,
                        "reward": (i + j / 10) if t == n_turns - 1 else 0.0,
                        "last": t == n_turns - 1,
                    }
                )
                context += [*response, 3, 4]  # the tool's answer
            trajs.append(turns)
    order = rng.permutation(np.repeat(np.arange(len(trajs)), n_turns))
    nxt = [0] * len(trajs)
    out = []
    for k in order.tolist():
        out.append(trajs[k][nxt[k]])
        nxt[k] += 1
    return out


# ---- GRPO recipes ------------------------------------------------------------------
TOKEN_FIELDS = [
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "response_mask",
    "tags.prompt_uid",
]


def group_recipe(k: int = 2, n: int = 4, **sampler: Any) -> Recipe:
    """``k`` groups of ``n`` trajectories per batch (kind ``group``; ``sampler`` adds keys)."""
    return Recipe.model_validate(
        {
            "name": "grpo",
            "batch_size": k,
            "fields": TOKEN_FIELDS,
            "sources": [{"name": "s", "sampler": {"kind": "group", "group_size": n, **sampler}}],
        }
    )


# ---- a 3-turn tool-use session -------------------------------------------------------
# turn 0: prompt [1 2 3]            response [10 11 12] (12 is a tool call)
# turn 1: prompt [1 2 3 10 11 12 | 20 21]  (the tool's answer)   response [13 30 31 14],
#         with a tool result spliced into the response: mask [1 0 0 1]
# turn 2: prompt [... turn 1 ... 13 30 31 14 | 22]                response [15]
P0, R0 = [1, 2, 3], [10, 11, 12]


P1, R1, M1 = [*P0, *R0, 20, 21], [13, 30, 31, 14], [1, 0, 0, 1]


P2, R2 = [*P1, *R1, 22], [15]


LP = {0: [-0.1, -0.2, -0.3], 1: [-0.4, -0.5, -0.6, -0.7], 2: [-0.8]}


def tool_session(p2: list[int] = P2) -> dict[str, Any]:
    """The session's fields as collate_tokens gets them (``p2``: turn 2's prompt)."""
    prompts = [np.array(p, np.int32) for p in (P0, P1, p2)]
    return {
        "prompt_ids": prompts,
        "response_ids": [np.array(r, np.int32) for r in (R0, R1, R2)],
        "response_logprobs": [np.array(LP[t], np.float32) for t in range(3)],
        "response_mask": [np.array(m, np.uint8) for m in ([1, 1, 1], M1, [1])],
        "reward": np.array([0, 0, 2.0], np.float32),
    }


def one_group(returns=(2.0, 2.0, 2.0), group=(0, 0, 0)) -> Groups:
    """The session as one trajectory of one group (``returns`` per turn)."""
    return Groups(
        np.array(group, np.int32), np.zeros(3, np.int32), np.array(returns, np.float32), ("g",), 0
    )
