"""Token batches: LLM turns collated into the padded arrays a policy-gradient trainer feeds
its model, with group-relative advantages (GRPO), in the prefetch workers.

A recipe with a ``tokens`` section (docs/recipes.md, "Token batches") gets, per sequence
(``transition``: one per turn; ``trajectory``: one per run of turns that extend each other,
:mod:`orchestrator.sampling.turns`), with T the longest sequence rounded up to a multiple of
``pad_multiple`` and the pads on ``padding_side``:

- ``input_ids`` int32 (S, T): the tokens, ``pad_token_id`` in the pads;
- ``attention_mask`` bool (S, T): the tokens; ``position_ids`` int32 (S, T): 0, 1, ... over
  the tokens, 0 in the pads;
- ``loss_mask`` bool (S, T): the trainable response tokens (``response_mask`` of each turn
  when the recipe asks for it, else every response token); never a prompt, a tool result
  spliced in as a later prompt's extension, or a pad;
- ``old_logprobs`` float32 (S, T): each response token's behaviour log-prob at its own
  position (the model's logits at position t - 1 score it), 0 elsewhere;
- ``advantages`` float32 (S, T): the sequence's advantage on its ``loss_mask`` tokens;
- ``rewards`` float32 (S,): the trajectory's return (group recipes) or the turn's
  ``reward``; ``seq_lengths``, ``prompt_lengths`` int32 (S,): tokens in all and before the
  first response; ``step_ids`` int64 (S, turns): the sequence's steps, -1 padded; with
  groups ``group_index`` and ``trajectory_index`` int32 (S,).

Advantages (:func:`advantages`): ``grpo`` is (R - mean of the group) / (std of the group +
eps) with the sample std (ddof 1, as TRL and verl), ``dr_grpo`` is R - mean, ``none`` is R.
The other fields of the recipe are the sequence's last turn's. ``ids`` are the last steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from orchestrator.recipe.options import Tokens
from orchestrator.sampling.groups import Groups
from orchestrator.sampling.turns import segments, sequence_tokens

TOKEN_INPUTS = ("prompt_ids", "response_ids", "response_logprobs", "response_mask")


def advantages(returns: np.ndarray, group: np.ndarray, kind: str, eps: float = 1e-6) -> np.ndarray:
    """Per trajectory: its advantage within its group (``group``: group number per
    trajectory). A group of one has std 0."""
    returns = np.asarray(returns, np.float64)
    if kind == "none":
        return returns.astype(np.float32)
    _, inv, size = np.unique(group, return_inverse=True, return_counts=True)
    mean = np.bincount(inv, returns) / size
    centred = returns - mean[inv]
    if kind == "dr_grpo":
        return centred.astype(np.float32)
    var = np.bincount(inv, centred**2) / np.maximum(size - 1, 1)
    std = np.sqrt(np.where(size > 1, var, 0.0))
    return (centred / (std[inv] + eps)).astype(np.float32)


class TokenBatch:
    """A collated token batch: ``arrays`` (per sequence), the batch row of each sequence's
    last turn (``rows``) and the recipe's other fields at those rows (``rest``), for the
    generic collation."""

    def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray, rest: dict[str, Any]):
        self.arrays, self.rows, self.rest = arrays, rows, rest


def collate_tokens(
    fields: Mapping[str, Any], ids: np.ndarray, groups: Groups | None, spec: Tokens
) -> TokenBatch:
    """Build the token arrays of a sampled batch's ``fields`` and step ``ids`` (see the
    module docstring)."""
    prompts, responses = fields["prompt_ids"], fields["response_ids"]
    logprobs, masks = fields["response_logprobs"], fields.get("response_mask")
    n = len(prompts)
    traj = groups.trajectory if groups is not None else np.arange(n, dtype=np.int32)
    segs = segments(prompts, responses, traj, spec.mode)
    if groups is None and spec.max_tokens:  # row draws: keep the leading sequences in budget
        total = np.cumsum(sequence_tokens(prompts, responses, segs))
        segs = segs[: max(1, int(np.searchsorted(total, spec.max_tokens, "right")))]
    seqs = [_sequence(s, prompts, responses, logprobs, masks) for s in segs]
    last = np.array([s[-1] for s in segs], np.int64)
    lengths = np.array([len(t) for t, *_ in seqs], np.int32)
    width = -(-int(lengths.max(initial=1)) // spec.pad_multiple) * spec.pad_multiple
    S = len(seqs)
    tok = np.full((S, width), spec.pad_token_id, np.int32)
    attn = np.zeros((S, width), bool)
    pos = np.zeros((S, width), np.int32)
    loss = np.zeros((S, width), bool)
    old = np.zeros((S, width), np.float32)
    for i, (t, lm, lp) in enumerate(seqs):
        at = slice(0, len(t)) if spec.padding_side == "right" else slice(width - len(t), width)
        tok[i, at], attn[i, at], loss[i, at], old[i, at] = t, True, lm, lp
        pos[i, at] = np.arange(len(t))
    if groups is not None:
        kind = spec.advantage or "grpo"  # the recipe default with groups
        adv = _per_trajectory(groups, kind, spec.eps)[groups.trajectory[last]]
        rewards = groups.returns[last]
    else:
        reward = fields.get("reward")
        rewards = np.zeros(S, np.float32) if reward is None else np.asarray(reward)[last]
        adv = rewards.astype(np.float32)
    turns = max(len(s) for s in segs)
    step_ids = np.full((S, turns), -1, np.int64)
    for i, s in enumerate(segs):
        step_ids[i, : len(s)] = ids[s]
    arrays = {
        "input_ids": tok,
        "attention_mask": attn,
        "position_ids": pos,
        "loss_mask": loss,
        "old_logprobs": old,
        "advantages": np.where(loss, adv[:, None], 0).astype(np.float32),
        "rewards": np.asarray(rewards, np.float32),
        "seq_lengths": lengths,
        "prompt_lengths": np.array([len(prompts[s[0]]) for s in segs], np.int32),
        "step_ids": step_ids,
    }
    if groups is not None:
        arrays["group_index"] = groups.group[last]
        arrays["trajectory_index"] = groups.trajectory[last]
    rest = {}
    for name, value in fields.items():
        if name in TOKEN_INPUTS:
            continue
        rest[name] = value[last] if isinstance(value, np.ndarray) else [value[i] for i in last]
    return TokenBatch(arrays, last, rest)


def _sequence(
    turns: list[int], prompts: Any, responses: Any, logprobs: Any, masks: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, loss mask and old log-probs of one sequence of turns."""
    tok, lm, lp = [], [], []
    have = 0
    for t in turns:
        p, r = prompts[t], responses[t]
        ext = p[have:]
        tok += [ext, r]
        lm += [np.zeros(len(ext), bool), _mask(masks, t, len(r))]
        lp += [np.zeros(len(ext), np.float32), np.asarray(logprobs[t], np.float32)]
        have = len(p) + len(r)
    return np.concatenate(tok), np.concatenate(lm), np.concatenate(lp)


def _mask(masks: Any, t: int, n: int) -> np.ndarray:
    if masks is None:
        return np.ones(n, bool)
    return np.asarray(masks[t]).astype(bool)


def group_arrays(groups: Groups, kind: str = "grpo", eps: float = 1e-6) -> dict[str, np.ndarray]:
    """Per step of a group recipe without ``tokens``: ``group_index``, ``trajectory_index``,
    ``returns`` (the trajectory's) and its GRPO ``advantages``."""
    per_traj = _per_trajectory(groups, kind, eps)
    return {
        "group_index": groups.group,
        "trajectory_index": groups.trajectory,
        "returns": groups.returns,
        "advantages": per_traj[groups.trajectory],
    }


def _per_trajectory(groups: Groups, kind: str, eps: float) -> np.ndarray:
    """The advantage of each trajectory of the batch (trajectories numbered from 0)."""
    first = np.unique(groups.trajectory, return_index=True)[1]
    return advantages(groups.returns[first], groups.group[first], kind, eps)
