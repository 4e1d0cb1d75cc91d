"""``RecordSteps``: a gymnasium wrapper that records every step into Claw."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from claw_tasks.client import Episode, Ingestor


class RecordSteps(gym.Wrapper):
    """Records each transition through ``ingestor``; the user's loop stays unchanged.

    The final observation of an episode is stored as an explicit ``next_obs``; all other
    ``next_obs`` are the next step's ``obs`` and are stored once. ``info`` scalars are kept
    when ``record_info`` is set. Steps are tagged ``origin = online`` (unless ``origin`` is
    given), and the env's observation and action spaces are recorded in the namespace
    config (offline formats such as Minari need them). ``policy_version`` (settable: an
    actor that loads newer weights sets it) is tagged on the steps of the episodes reset
    from then on.
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
        **tags: Any,
    ) -> None:
        super().__init__(env)
        self.ingestor = ingestor
        self._meta = {"task_id": task_id, "agent_id": agent_id, "origin": "online", **tags}
        _record_spaces(env, ingestor)
        self.record_info = record_info
        self.policy_version = policy_version
        self._episode: Episode | None = None
        self._obs: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._episode = self.ingestor.episode(**self._meta, policy_version=self.policy_version)
        self._obs = obs
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
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
        self._episode.add(
            self._obs,
            np.asarray(action),
            float(reward),
            next_obs=obs if ended else None,
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=small_info,
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
