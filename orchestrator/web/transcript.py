"""The LLM trajectory view: an episode of ``Schema.llm`` turns (docs/llm.md) as a chat
transcript (messages and tool calls from each turn's ``info``), response tokens with their
log-probs, rewards per turn, and the other rollouts of its group (same ``prompt_uid``).
Every text here is untrusted and only ever rendered escaped."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.format.schema import LLM_FIELDS, tag_column

ROLES = ("system", "user", "assistant", "tool")
TOKENS_SHOWN = 400  # per turn
TEXT_CHARS = 4000  # per message
GROUP_SHOWN = 8  # other rollouts of the group


def is_llm(fields: Mapping[str, Any]) -> bool:
    return all(name in fields for name in LLM_FIELDS)


def _cut(text: str, n: int = TEXT_CHARS) -> str:
    return text if len(text) <= n else text[:n] + "…"


def _json_list(value: Any) -> list[Any]:
    """``messages``/``tool_calls`` are stored as JSON text; anything else shows as is."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [value]
    return list(value) if isinstance(value, list | tuple) else ([] if value is None else [value])


def messages(info: Any) -> list[dict[str, str]]:
    out = []
    raw = info.get("messages") if isinstance(info, dict) else None
    for m in _json_list(raw):
        if isinstance(m, dict):
            role = str(m.get("role", ""))
            content = m.get("content", "")
            text = content if isinstance(content, str) else json.dumps(content, default=str)
        else:
            role, text = "", str(m)
        out.append(
            {"role": role or "?", "kind": role if role in ROLES else "other", "content": _cut(text)}
        )
    return out


def tool_calls(info: Any) -> str:
    raw = info.get("tool_calls") if isinstance(info, dict) else None
    calls = _json_list(raw)
    return _cut(json.dumps(calls, indent=1, default=str, ensure_ascii=False)) if calls else ""


def tokens(ids: np.ndarray, logprobs: np.ndarray, mask: np.ndarray | None) -> dict[str, Any]:
    """The first TOKENS_SHOWN response tokens: id, log-prob, a 0-4 confidence bucket (for
    the colour) and whether the mask leaves it out of training."""
    n = len(ids)
    shown = []
    for k in range(min(n, TOKENS_SHOWN)):
        lp = float(logprobs[k]) if k < len(logprobs) else float("nan")
        bucket = 0 if not np.isfinite(lp) else min(4, int(-lp // 0.5))
        masked = mask is not None and k < len(mask) and not mask[k]
        shown.append({"id": int(ids[k]), "lp": lp, "bucket": bucket, "masked": masked})
    lp = np.asarray(logprobs, np.float64)
    return {"shown": shown, "total": n, "sum_logprob": float(lp.sum()) if len(lp) else 0.0}


def group_rows(cols: Mapping[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Index rows of every live turn of the group of ``rows``' trajectory (its prompt_uid);
    empty when it has none."""
    col = cols.get(tag_column("prompt_uid"))
    if col is None or not len(rows):
        return np.zeros(0, np.int64)
    key = col[rows[0]]
    if not np.isfinite(key):
        return np.zeros(0, np.int64)
    return np.flatnonzero((col == key) & cols["alive"])


def rollouts(cols: Mapping[str, np.ndarray], rows: np.ndarray, this: int) -> list[dict[str, Any]]:
    """The group's trajectories (``this`` is the viewed one's episode code) with their
    turns, return and final reward; the viewed one first, then by final reward."""
    codes = cols["episode"][rows]
    final_col = tag_column("final_reward")
    out = []
    for code in np.unique(codes).tolist():
        sel = rows[codes == code]
        last = sel[np.argmax(cols["step_index"][sel])]
        final = cols[final_col][last] if final_col in cols else np.nan
        out.append(
            {
                "code": int(code),
                "row": int(last),
                "turns": len(sel),
                "return": float(cols["reward"][sel].astype(np.float64).sum()),
                "final": None if not np.isfinite(final) else float(final),
                "this": code == this,
            }
        )
    out.sort(key=lambda r: (not r["this"], -(r["final"] if r["final"] is not None else -np.inf)))
    return out[: GROUP_SHOWN + 1]


def turns(
    steps: Sequence[dict[str, Any]], infos: Sequence[Any], fields: Mapping[str, list[np.ndarray]]
) -> list[dict[str, Any]]:
    mask = fields.get("response_mask")
    out = []
    for i, step in enumerate(steps):
        info = infos[i]
        out.append(
            {
                "step_index": step["step_index"],
                "reward": step["reward"],
                "final_reward": step["tags"].get("final_reward"),
                "prompt_tokens": len(fields["prompt_ids"][i]),
                "messages": messages(info),
                "tool_calls": tool_calls(info),
                "tokens": tokens(
                    fields["response_ids"][i],
                    fields["response_logprobs"][i],
                    None if mask is None else mask[i],
                ),
            }
        )
    return out
