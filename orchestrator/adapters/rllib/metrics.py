"""What RLlib's buffers log of an ``add`` and a ``sample()``, as the keyword arguments of
their ``_update_add_metrics`` / ``_update_sample_metrics``: the single-agent buffer's, and
the multi-agent one's per agent and module."""

from __future__ import annotations

from typing import Any

import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID

from orchestrator.adapters.rllib.episodes import Drawn


def add_metrics(new: int, steps: int, evicted: int) -> dict[str, Any]:
    """An ``add`` of ``new`` episodes and ``steps`` steps that evicted ``evicted``."""
    agent, module = {DEFAULT_AGENT_ID: new}, {DEFAULT_MODULE_ID: new}
    return dict(
        num_episodes_added=new,
        num_env_steps_added=steps,
        num_episodes_evicted=0,
        num_env_steps_evicted=evicted,
        agent_to_num_episodes_added=agent,
        agent_to_num_steps_added={DEFAULT_AGENT_ID: steps},
        agent_to_num_episodes_evicted={DEFAULT_AGENT_ID: 0},
        agent_to_num_steps_evicted={DEFAULT_AGENT_ID: evicted},
        module_to_num_episodes_added=module,
        module_to_num_steps_added={DEFAULT_MODULE_ID: steps},
        module_to_num_episodes_evicted={DEFAULT_MODULE_ID: 0},
        module_to_num_steps_evicted={DEFAULT_MODULE_ID: evicted},
    )


def sample_metrics(drawn: Drawn, size: int) -> dict[str, Any]:
    """A sample of ``size`` rows."""
    steps, eps = len(np.unique(drawn.ids)), len(set(drawn.names))
    mean_n = float(drawn.m.mean()) if len(drawn.m) else 0.0
    return dict(
        num_env_steps_sampled=size,
        num_episodes_per_sample=eps,
        num_env_steps_per_sample=steps,
        sampled_n_step=mean_n,
        num_resamples=0,
        agent_to_num_steps_sampled={DEFAULT_AGENT_ID: size},
        agent_to_num_episodes_per_sample={DEFAULT_AGENT_ID: eps},
        agent_to_num_steps_per_sample={DEFAULT_AGENT_ID: steps},
        agent_to_sampled_n_step={DEFAULT_AGENT_ID: mean_n},
        agent_to_num_resamples={DEFAULT_AGENT_ID: 0},
        module_to_num_steps_sampled={DEFAULT_MODULE_ID: size},
        module_to_num_episodes_per_sample={DEFAULT_MODULE_ID: eps},
        module_to_num_steps_per_sample={DEFAULT_MODULE_ID: steps},
        module_to_sampled_n_step={DEFAULT_MODULE_ID: mean_n},
        module_to_num_resamples={DEFAULT_MODULE_ID: 0},
    )


def multi_agent_sample_metrics(drawn: Drawn) -> dict[str, Any]:
    """What RLlib's multi-agent buffer logs of a sample, per agent and module."""
    m = drawn.m
    out: dict[str, Any] = {
        "num_env_steps_sampled": len(m),
        "num_episodes_per_sample": len({e.multi_agent_episode_id for e in drawn.episodes}),
        "num_env_steps_per_sample": len(np.unique(drawn.ids)),
        "sampled_n_step": float(m.mean()) if len(m) else 0.0,
        "num_resamples": 0,
    }
    for kind in ("agent", "module"):
        keys = np.array([getattr(e, f"{kind}_id") for e in drawn.episodes], object)
        rows, eps, steps, mean_n = {}, {}, {}, {}
        for k in dict.fromkeys(keys.tolist()):
            mine = keys == k
            rows[k] = int(mine.sum())
            eps[k] = len({x for x, y in zip(drawn.names, mine, strict=True) if y})
            steps[k] = len(np.unique(drawn.ids[mine]))
            mean_n[k] = float(m[mine].mean())
        out[f"{kind}_to_num_steps_sampled"] = rows
        out[f"{kind}_to_num_episodes_per_sample"] = eps
        out[f"{kind}_to_num_steps_per_sample"] = steps
        out[f"{kind}_to_sampled_n_step"] = mean_n
        out[f"{kind}_to_num_resamples"] = dict.fromkeys(rows, 0)
    return out
