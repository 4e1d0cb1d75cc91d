"""Hand-built steps for the index and sampling tests, committed with ``Store.commit``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import tag_column

OBS = 4  # obs is float32[4]: [episode number, step_index, explicit next_obs marker, 0]


def obs_of(ep: int, step: int, explicit: bool = False) -> np.ndarray:
    return np.array([ep, step, float(explicit), 0], np.float32)


def batch(steps: Sequence[dict[str, Any]]) -> StepBatch:
    """A batch from step dicts: ``ep`` (int), ``step``; optional ``reward``, ``terminated``,
    ``truncated``, ``next_obs`` (True: store ``obs_of(ep, step + 1, explicit=True)``),
    ``priority``, ``task_id``, ``skill_tag``, ``tags`` (name -> str | float)."""
    n = len(steps)

    def col(key: str, default: Any, dtype: Any) -> np.ndarray:
        return np.array([s.get(key, default) for s in steps], dtype)

    explicit = [i for i, s in enumerate(steps) if s.get("next_obs")]
    b = StepBatch(
        episode=StrColumn.of([f"ep{s['ep']}" for s in steps]),
        step_index=col("step", 0, np.int64),
        reward=col("reward", 0.0, np.float32),
        terminated=col("terminated", False, bool),
        truncated=col("truncated", False, bool),
        fields={
            "obs": np.stack([obs_of(s["ep"], s["step"]) for s in steps]),
            "action": np.array([s["step"] % 3 for s in steps], np.int64),
        },
        priority=col("priority", math.nan, np.float32)
        if any("priority" in s for s in steps)
        else None,
        next_rows=np.array(explicit, np.int32),
        next_obs=np.stack([obs_of(steps[i]["ep"], steps[i]["step"] + 1, True) for i in explicit])
        if explicit
        else None,
    )
    for key in ("task_id", "skill_tag"):
        if any(key in s for s in steps):
            b.strs[key] = StrColumn.of([s.get(key) for s in steps])
    names = sorted({t for s in steps for t in s.get("tags", {})})
    for name in names:
        values = [s.get("tags", {}).get(name) for s in steps]
        if any(isinstance(v, str) for v in values):
            b.strs[tag_column(name)] = StrColumn.of(values)
        else:
            b.nums[tag_column(name)] = np.array([math.nan if v is None else v for v in values])
    assert n == b.n
    return b


def episode(ep: int, length: int, end: str = "", first: int = 0, **kw: Any) -> list[dict]:
    """Steps ``first..length-1`` of an episode with reward ``ep + step / 100``; ``end`` is
    ``terminated`` or ``truncated`` (with an explicit next_obs) on its last step."""
    out = []
    for t in range(first, length):
        s = {"ep": ep, "step": t, "reward": ep + t / 100, **kw}
        if t == length - 1 and end == "terminated":
            s["terminated"] = True
        if t == length - 1 and end == "truncated":
            s.update(truncated=True, next_obs=True)
        out.append(s)
    return out


def interleave(*episodes: list[dict]) -> list[dict]:
    """Round-robin the episodes' steps (so they mix in the ring)."""
    out, longest = [], max(len(e) for e in episodes)
    for i in range(longest):
        out += [e[i] for e in episodes if i < len(e)]
    return out


def one_episode(obs: np.ndarray, *, counted: bool = False) -> StepBatch:
    """One episode ``"e"`` of ``len(obs)`` steps with these observations, for tests that
    commit steps without Celery: rewards zero and no end, or with ``counted`` rewards
    0, 1, 2, ... and terminated at the last step."""
    n = len(obs)
    return StepBatch(
        episode=StrColumn.constant("e", n),
        step_index=np.arange(n),
        reward=np.arange(n, dtype=np.float32) if counted else np.zeros(n, np.float32),
        terminated=np.arange(n) == n - 1 if counted else np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": obs},
    )
