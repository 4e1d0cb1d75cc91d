"""Which LLM turns make one token sequence: the rule shared by token collation
(:mod:`orchestrator.delivery.tokens`) and the token budget of a draw.

``transition``: every turn is a sequence (its prompt, then its response). ``trajectory``: a
turn joins the sequence of the turn before it (same trajectory, in order) when its prompt
extends that turn's prompt + response, so the sequence is the last turn's prompt +
response with every response at its place; a turn whose prompt does not (the agent
rewrote or truncated its context) starts a new sequence, so a lone such turn is a
transition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Mode = Literal["transition", "trajectory"]


def segments(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    trajectory: np.ndarray,
    mode: Mode,
) -> list[list[int]]:
    """The turns (row positions, in order) of each sequence. Rows of one trajectory are
    contiguous and in turn order."""
    out: list[list[int]] = []
    prev: np.ndarray | None = None
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        joins = (
            mode == "trajectory"
            and prev is not None
            and i > 0
            and trajectory[i] == trajectory[i - 1]
            and len(p) >= len(prev)
            and np.array_equal(p[: len(prev)], prev)
        )
        if joins:
            out[-1].append(i)
        else:
            out.append([i])
        prev = np.concatenate([p, r])
    return out


def sequence_tokens(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], segs: list[list[int]]
) -> np.ndarray:
    """Tokens of each sequence: its last turn's prompt + response."""
    return np.array([len(prompts[s[-1]]) + len(responses[s[-1]]) for s in segs], np.int64)
