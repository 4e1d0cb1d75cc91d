"""Token batches (a recipe with ``tokens``) as the tensors LLM policy-gradient trainers
take: :func:`token_tensors` (Claw's names, torch dtypes), :func:`verl_fields` and
:func:`verl_non_tensor` (verl's ``DataProto``, names checked against verl's agent loop),
:func:`trl_inputs` (what TRL's ``GRPOTrainer.compute_loss`` takes) and :func:`trl_rollout`
(what its ``rollout_func`` returns; :mod:`orchestrator.adapters.trl` is that function).
Neither library is imported here. docs/llm.md has the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from orchestrator.sampling.batch import Batch

__all__ = ["split", "token_tensors", "trl_inputs", "trl_rollout", "verl_fields", "verl_non_tensor"]

_LONG = ("input_ids", "attention_mask", "position_ids")
_FLOAT = ("loss_mask", "old_logprobs", "advantages", "rewards")
TRL_ROLLOUT_KEYS = (
    *("prompt_ids", "completion_ids", "logprobs", "env_mask"),  # what TRL reads itself
    *("claw_reward", "claw_group", "claw_step_ids"),  # handed to its reward functions
)


def token_tensors(batch: Batch | Mapping[str, np.ndarray], device: Any = None) -> dict:
    """The batch's arrays as tensors: ids, attention mask and positions int64 (what
    embedding layers and Hugging Face models take), ``loss_mask``, ``old_logprobs``,
    ``advantages``, ``rewards`` float32; the rest as their own dtypes."""
    out = {}
    for name, arr in batch.items():
        t = torch.from_numpy(np.array(arr))
        if name in _LONG:
            t = t.long()
        elif name in _FLOAT:
            t = t.float()
        out[name] = t if device is None else t.to(device)
    return out


def split(batch: Batch | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each sequence cut at its first response token: ``prompts`` (S, P) left-padded,
    ``responses`` (S, R) right-padded, their masks, and ``loss_mask``, ``old_logprobs``
    and ``advantages`` over the response positions (the layout verl and TRL use)."""
    attn = np.asarray(batch["attention_mask"], bool)
    S, T = attn.shape
    lengths = np.asarray(batch["seq_lengths"], np.int64)
    plen = np.asarray(batch["prompt_lengths"], np.int64)
    start = np.where(attn.any(1), attn.argmax(1), 0)  # first real token (left padding)
    P, R = int(plen.max(initial=0)), int((lengths - plen).max(initial=0))
    rows = np.arange(S)[:, None]
    j = np.arange(P)[None, :]
    p_at = start[:, None] + plen[:, None] - P + j
    p_ok = p_at >= start[:, None]
    r_at = start[:, None] + plen[:, None] + np.arange(R)[None, :]
    r_ok = np.arange(R)[None, :] < (lengths - plen)[:, None]

    def take(name: str, at: np.ndarray, ok: np.ndarray, fill: Any = 0) -> np.ndarray:
        arr = np.asarray(batch[name])
        return np.where(ok, arr[rows, np.clip(at, 0, T - 1)], fill)

    pad = int(np.asarray(batch["input_ids"])[~attn].flat[0]) if (~attn).any() else 0
    return {
        "prompts": take("input_ids", p_at, p_ok, pad),
        "prompt_mask": p_ok,
        "responses": take("input_ids", r_at, r_ok, pad),
        "response_attention": r_ok,
        "loss_mask": take("loss_mask", r_at, r_ok, False).astype(bool),
        "old_logprobs": take("old_logprobs", r_at, r_ok).astype(np.float32),
        "advantages": take("advantages", r_at, r_ok).astype(np.float32),
    }


def verl_fields(batch: Batch | Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """verl's ``DataProto.batch`` as its agent loop hands it to the trainer
    (``verl/experimental/agent_loop/agent_loop.py``, ``_postprocess``): ``prompts``,
    ``responses``, ``input_ids`` (prompts then responses), ``attention_mask``,
    ``position_ids``, ``response_mask`` (int64, 0 on tool tokens), ``rollout_log_probs``
    (the inference server's: verl recomputes ``old_log_probs`` with the actor, or copies
    these in its bypass mode), ``rm_scores`` (the reward on the last response token, which
    verl turns into ``token_level_scores``), and ``advantages`` (Claw's, over the response;
    verl's own GRPO estimator recomputes them from the scores and ``uid``)."""
    s = split(batch)
    mask = np.concatenate([s["prompt_mask"], s["response_attention"]], 1)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    attn = s["response_attention"]
    scores = np.zeros(attn.shape, np.float32)
    last = attn.sum(1) - 1
    rows = np.flatnonzero(last >= 0)
    scores[rows, last[rows]] = np.asarray(batch["rewards"], np.float32)[rows]
    return {
        "prompts": torch.from_numpy(s["prompts"]).long(),
        "responses": torch.from_numpy(s["responses"]).long(),
        "input_ids": torch.from_numpy(np.concatenate([s["prompts"], s["responses"]], 1)).long(),
        "attention_mask": torch.from_numpy(mask).long(),
        "position_ids": torch.from_numpy(pos).long(),
        "response_mask": torch.from_numpy(s["loss_mask"]).long(),
        "rollout_log_probs": torch.from_numpy(s["old_logprobs"]),
        "rm_scores": torch.from_numpy(scores),
        "advantages": torch.from_numpy(s["advantages"]),
    }


def verl_non_tensor(batch: Batch | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """verl's ``DataProto.non_tensor_batch``: ``uid`` (the group, as verl's GRPO estimator
    keys it; object strings as verl's trainer makes them) and ``__num_turns__``."""
    group = _groups(batch, len(batch["seq_lengths"]))
    turns = (np.asarray(batch["step_ids"]) >= 0).sum(1).astype(np.int32)
    return {"uid": np.array([str(g) for g in group], dtype=object), "__num_turns__": turns}


def trl_inputs(batch: Batch | Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The inputs TRL's ``GRPOTrainer.compute_loss`` takes (what its
    ``_generate_and_score_completions`` returns, TRL 1.16): ``prompt_ids``/``prompt_mask``
    (left-padded), ``completion_ids``/``completion_mask`` (right-padded; the mask is the
    completion's tokens), ``tool_mask`` (0 on tool tokens: the loss mask is
    ``completion_mask * tool_mask``), ``sampling_per_token_logps`` (the inference server's
    log-probs), ``old_per_token_logps`` (the same: the clipped ratio is then taken against
    the behaviour policy, as TRL does when it recomputes them), ``advantages`` (one per
    sequence: the mean over its loss mask) and ``num_items_in_batch``."""
    s = split(batch)
    loss = s["loss_mask"]
    per_seq = np.where(loss.any(1), (s["advantages"] * loss).sum(1) / np.maximum(loss.sum(1), 1), 0)
    old = torch.from_numpy(s["old_logprobs"])
    return {
        "prompt_ids": torch.from_numpy(s["prompts"]).long(),
        "prompt_mask": torch.from_numpy(s["prompt_mask"]).long(),
        "completion_ids": torch.from_numpy(s["responses"]).long(),
        "completion_mask": torch.from_numpy(s["response_attention"]).long(),
        "tool_mask": torch.from_numpy(loss).long(),
        "sampling_per_token_logps": old,
        "old_per_token_logps": old.clone(),
        "advantages": torch.from_numpy(per_seq.astype(np.float32)),
        "num_items_in_batch": torch.tensor(int(loss.sum())),
    }


def trl_rollout(
    batch: Batch | Mapping[str, np.ndarray], num_generations: int
) -> dict[str, list[Any]]:
    """What a ``rollout_func`` of TRL's ``GRPOTrainer`` returns, one entry per sequence,
    unpadded, groups in blocks of ``num_generations`` (TRL normalises rewards over such
    blocks): ``prompt_ids``, ``completion_ids``, ``logprobs`` (the behaviour log-probs
    Claw served), ``env_mask`` (1 on trainable tokens, 0 on tool tokens: TRL's mask for
    tokens a rollout did not sample), and extra fields TRL hands its reward functions:
    ``claw_reward`` (the trajectory's return), ``claw_group`` and ``claw_step_ids``. A
    sequence with no response token gets one pad token, masked (TRL reads each
    completion's last token). A group of another size is a ``ValueError``: the recipe's
    ``group_size`` must be ``num_generations`` and each trajectory one sequence."""
    s = split(batch)
    n = len(s["prompts"])
    group = _groups(batch, n)
    order = np.argsort(group, kind="stable")
    _, sizes = np.unique(group, return_counts=True)
    if n == 0 or (sizes != num_generations).any():
        raise ValueError(
            f"groups of {sorted(set(sizes.tolist()))} sequences, TRL's num_generations is "
            f"{num_generations}: set the recipe's group_size to it, with one sequence per "
            "trajectory (tokens.mode transition for one-turn rollouts)"
        )
    attn = np.asarray(batch["attention_mask"], bool)
    pad = int(np.asarray(batch["input_ids"])[~attn].flat[0]) if (~attn).any() else 0
    steps = np.asarray(batch["step_ids"])
    rewards = np.asarray(batch["rewards"], np.float64)
    out: dict[str, list[Any]] = {k: [] for k in TRL_ROLLOUT_KEYS}
    for i in order:
        r = s["response_attention"][i]
        ids = s["responses"][i][r].tolist()
        lps = s["old_logprobs"][i][r].tolist()
        mask = s["loss_mask"][i][r].astype(int).tolist()
        if not ids:
            ids, lps, mask = [pad], [0.0], [0]
        out["prompt_ids"].append(s["prompts"][i][s["prompt_mask"][i]].tolist())
        out["completion_ids"].append(ids)
        out["logprobs"].append(lps)
        out["env_mask"].append(mask)
        out["claw_reward"].append(float(rewards[i]))
        out["claw_group"].append(int(group[i]))
        out["claw_step_ids"].append([int(x) for x in steps[i] if x >= 0])
    return out


def _groups(batch: Batch | Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """The group of each sequence (each its own without groups)."""
    return np.asarray(batch["group_index"]) if "group_index" in batch else np.arange(n)
