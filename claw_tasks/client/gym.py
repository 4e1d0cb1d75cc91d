"""``RecordSteps``: a gymnasium wrapper that records every step into Claw."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from claw_tasks.client.episode import Episode
from claw_tasks.client.ingestor import Ingestor
from claw_tasks.format.schema import BOOTSTRAP_VALUE

__all__ = ["RecordSteps"]


class RecordSteps(gym.Wrapper):
    """Records each transition through ``ingestor``; the user's loop stays unchanged.

    The final observation of an episode is stored as an explicit ``next_obs``; all other
    ``next_obs`` are the next step's ``obs`` and are stored once. ``info`` scalars are kept
    when ``record_info`` is set. Steps are tagged ``origin = online`` (unless ``origin`` is
    given), and the env's observation and action spaces are recorded in the namespace
    config (offline formats such as Minari need them). ``policy_version`` (settable: an
    actor that loads newer weights sets it) is recorded on the steps taken from then on.

    On-policy actors (docs/recipes.md, "On-policy") pass what their policy said to
    ``step(action, log_prob=..., value=...)`` (floats; recorded as tags) and give
    ``value_fn`` (obs -> V(obs), float) and ``segment_steps`` (PPO's ``n_steps``): every
    ``segment_steps``-th step (counted across episodes) ends a segment, and it and every
    truncated step get ``bootstrap_value = value_fn(next_obs)``; the episode goes on.
    """

    def __init__(
        self,
        env: gym.Env,
        ingestor: Ingestor,
        *,
        task_id: str | None = None,
        agent_id: str | None = None,
        record_info: bool = False,
        policy_version: int | None = None,
        value_fn: Callable[[Any], float] | None = None,
        segment_steps: int | None = None,
        **tags: Any,
    ) -> None:
        super().__init__(env)
        if segment_steps is not None and (segment_steps < 1 or value_fn is None):
            raise ValueError("segment_steps: a positive count, with a value_fn to bootstrap")
        self.ingestor = ingestor
        self._meta = {"task_id": task_id, "agent_id": agent_id, "origin": "online", **tags}
        _record_spaces(env, ingestor)
        self.record_info = record_info
        self.policy_version = policy_version
        self.value_fn, self.segment_steps = value_fn, segment_steps
        self.segment_step = 0
        """Steps recorded in the current segment (0 right after a segment ended)."""
        self._episode: Episode | None = None
        self._obs: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._episode = self.ingestor.episode(**self._meta, policy_version=self.policy_version)
        self._obs = obs
        return obs, info

    def step(self, action: Any, **step_tags: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """The env's step, recorded with ``step_tags`` (e.g. ``log_prob``, ``value``:
        numbers, a 0-d tensor included, become float tags)."""
        if self._episode is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        obs, reward, terminated, truncated, info = self.env.step(action)
        ended = bool(terminated or truncated)
        small_info = None
        if self.record_info:
            small_info = {
                k: v.item() if isinstance(v, np.generic) else v
                for k, v in info.items()
                if isinstance(v, str | int | float | bool | np.generic)
            }
        step_tags = {k: v if isinstance(v, str) else float(v) for k, v in step_tags.items()}
        self.segment_step += 1
        cut = self.segment_steps is not None and self.segment_step >= self.segment_steps
        if cut:
            self.segment_step = 0
        if self.value_fn is not None and not terminated and (truncated or cut):
            step_tags = {**step_tags, BOOTSTRAP_VALUE: float(self.value_fn(obs))}
        self._episode.add(
            self._obs,
            np.asarray(action),
            float(reward),
            next_obs=obs if ended else None,
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=small_info,
            policy_version=self.policy_version,
            **step_tags,
        )
        self._obs = obs
        if ended:
            self._episode = None
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        self.ingestor.flush(wait=False)
        super().close()


def _record_spaces(env: gym.Env, ingestor: Ingestor) -> None:
    """The env's spaces in Minari's serialization, into the namespace config."""
    from minari.serialization import serialize_space

    try:
        spaces = serialize_space(env.observation_space), serialize_space(env.action_space)
    except NotImplementedError:  # a space Minari cannot describe: nothing to record
        return
    ingestor.store.set_spaces(*spaces)
