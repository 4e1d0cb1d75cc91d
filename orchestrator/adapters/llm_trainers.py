"""Token batches (a recipe with ``tokens``) as the tensors LLM policy-gradient trainers
take: :func:`token_tensors` (Claw's names, torch dtypes), :func:`verl_fields` (the names of
verl's ``DataProto.batch``) and :func:`trl_inputs` (TRL's GRPO trainer inputs). Names only:
neither library is imported. docs/llm.md has the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from orchestrator.sampling.batch import Batch

_LONG = ("input_ids", "attention_mask", "position_ids")
_FLOAT = ("loss_mask", "old_logprobs", "advantages", "rewards")


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
    """verl's ``DataProto.batch`` keys: ``prompts``, ``responses``, ``input_ids`` (prompts
    then responses), ``attention_mask``, ``position_ids``, ``response_mask``,
    ``old_log_probs``, ``advantages`` (the last three over the response positions)."""
    s = split(batch)
    mask = np.concatenate([s["prompt_mask"], s["response_attention"]], 1)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    return {
        "prompts": torch.from_numpy(s["prompts"]).long(),
        "responses": torch.from_numpy(s["responses"]).long(),
        "input_ids": torch.from_numpy(np.concatenate([s["prompts"], s["responses"]], 1)).long(),
        "attention_mask": torch.from_numpy(mask).long(),
        "position_ids": torch.from_numpy(pos).long(),
        "response_mask": torch.from_numpy(s["loss_mask"]).float(),
        "old_log_probs": torch.from_numpy(s["old_logprobs"]),
        "advantages": torch.from_numpy(s["advantages"]),
    }


def trl_inputs(batch: Batch | Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """TRL's GRPO inputs: ``prompt_ids``/``prompt_mask`` (left-padded),
    ``completion_ids``/``completion_mask`` (right-padded; the mask is the loss mask),
    ``old_per_token_logps`` and ``advantages`` (one per sequence)."""
    s = split(batch)
    loss = s["loss_mask"]
    per_seq = np.where(loss.any(1), (s["advantages"] * loss).sum(1) / np.maximum(loss.sum(1), 1), 0)
    return {
        "prompt_ids": torch.from_numpy(s["prompts"]).long(),
        "prompt_mask": torch.from_numpy(s["prompt_mask"]).long(),
        "completion_ids": torch.from_numpy(s["responses"]).long(),
        "completion_mask": torch.from_numpy(loss).long(),
        "old_per_token_logps": torch.from_numpy(s["old_logprobs"]),
        "advantages": torch.from_numpy(per_seq.astype(np.float32)),
    }
