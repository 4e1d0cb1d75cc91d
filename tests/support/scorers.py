"""Scorers the tests allow on their workers (CLAW_SCORERS): priorities and V-trace targets."""

from __future__ import annotations

from typing import Any

import numpy as np


def by_obs(steps: dict[str, np.ndarray], params: dict[str, Any]) -> np.ndarray:
    """``params['high']`` for steps whose obs[0] (the episode number) is odd, else 1."""
    return np.where(steps["obs"][:, 0] % 2 == 1, float(params["high"]), 1.0)


def rollout_target(fields: dict[str, np.ndarray], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """A V-trace target policy of a rollout test: log-prob -0.05 and value 0.1 times the
    step index (obs[2]), the value after every step 1."""
    t = fields["obs"][:, 2].astype(np.float64)
    assert "next_obs" in fields and params["policy_version"] >= 1
    return {"log_prob": -0.05 * t, "value": 0.1 * t, "next_value": np.ones(len(t))}
