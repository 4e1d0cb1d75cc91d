"""LLM agent turns as steps (the ``Schema.llm`` preset), as data: the group key's hash, the
checks a turn passes before it is buffered, and the rule that spreads a trajectory's rewards
over its turns. What reads and rewards stored turns is :mod:`claw_tasks.store.turns`;
docs/llm.md is the reference."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.format.schema import SchemaError


def prompt_key(prompt_uid: str) -> float:
    """The stored ``tags.prompt_uid`` of a group key: a 53-bit hash, exact in float64, so
    it filters (``tags.prompt_uid == $key``) and groups as a number column instead of one
    dictionary entry per prompt. Collisions are negligible below ~10^7 groups."""
    digest = hashlib.blake2b(prompt_uid.encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") >> 11)


def turn_fields(
    prompt_ids: Any,
    response_ids: Any,
    response_logprobs: Any,
    response_mask: Any,
    with_mask: bool,
    where: str,
) -> dict[str, np.ndarray]:
    """The payload fields of one turn, cast to the preset's dtypes after checking that the
    values survive the cast (token ids fit int32, log-probs are finite and <= 0) and that
    the response arrays have one entry per response token."""
    fields: dict[str, np.ndarray] = {}
    for name, raw in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        arr = np.asarray(raw)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise SchemaError(f"{where}: {name} must be a 1-d list of integer token ids")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise SchemaError(f"{where}: {name} holds ids outside 0..2^31-1")
        fields[name] = arr.astype(np.int32)
    lp = np.asarray(response_logprobs, np.float64)
    if lp.ndim != 1 or not np.all(np.isfinite(lp)) or np.any(lp > 1e-6):
        raise SchemaError(f"{where}: response_logprobs must be a 1-d list of finite values <= 0")
    fields["response_logprobs"] = lp.astype(np.float32)
    n = len(fields["response_ids"])
    if len(lp) != n:
        raise SchemaError(f"{where}: {len(lp)} response_logprobs for {n} response_ids")
    if response_mask is not None and not with_mask:
        raise SchemaError(
            f"{where}: response_mask given but the namespace schema has none; create it "
            "with Schema.llm(response_mask=True)"
        )
    if with_mask:
        mask = np.ones(n, np.uint8) if response_mask is None else np.asarray(response_mask)
        if mask.shape != (n,) or not np.isin(mask, (0, 1)).all():
            raise SchemaError(f"{where}: response_mask must be {n} values of 0/1")
        fields["response_mask"] = mask.astype(np.uint8)
    return fields


def turn_info(
    prompt_uid: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    tool_calls: Sequence[Mapping[str, Any]] | None,
    info: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A turn's ``info``: the group key as written, and the chat messages and tool calls
    as JSON text (info holds scalars only)."""
    out = dict(info or {})
    if prompt_uid is not None:
        out["prompt_uid"] = prompt_uid
    if messages is not None:
        out["messages"] = json.dumps(list(messages), separators=(",", ":"))
    if tool_calls is not None:
        out["tool_calls"] = json.dumps(list(tool_calls), separators=(",", ":"))
    return out


def spread_rewards(
    n_turns: int, final_reward: float, turn_rewards: Sequence[float] | None = None
) -> np.ndarray:
    """The reward rule: turn t's ``reward`` is its own turn reward (0 if none given) and
    the last turn's also adds ``final_reward``; so a trajectory's rewards sum to the
    final reward plus the turn rewards. Every turn also gets ``tags.final_reward``."""
    per_turn = np.zeros(n_turns, np.float64)
    if turn_rewards is not None:
        if len(turn_rewards) != n_turns:
            raise ValueError(f"{len(turn_rewards)} turn rewards for {n_turns} recorded turns")
        per_turn[:] = turn_rewards
    per_turn[-1] += final_reward
    return per_turn.astype(np.float32)


def discount_turns(rewards: Sequence[float] | np.ndarray, gamma: float) -> np.ndarray:
    """Turn-level credit (AReaL's interaction cache): each turn's reward plus the
    discounted rewards after it, ``r[t] += gamma * r[t + 1]`` from the last turn back, so
    turn t holds ``sum_k gamma^(k - t) r[k]``. Computed in float64."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"discount {gamma} must be in [0, 1]")
    out = np.asarray(rewards, np.float64).copy()
    for t in range(len(out) - 2, -1, -1):
        out[t] += gamma * out[t + 1]
    return out
