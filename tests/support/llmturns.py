"""Hand-built LLM turns (the ``Schema.llm`` fields), committed with ``Store.commit``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.schema import tag_column


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
