"""``ClawDictReplayBuffer``: SB3's ``DictReplayBuffer`` on Claw, for ``spaces.Dict``
observations (``MultiInputPolicy``).

A Claw step has one ``obs`` field (and ``next_obs`` is still stored once), so each
observation is stored as one uint8 row, the keys' arrays' bytes side by side; ``sample``
unpacks them into SB3's ``DictReplayBufferSamples`` with every key's own dtype and shape.
Everything else is :class:`~orchestrator.adapters.sb3.buffer.ClawReplayBuffer`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from orchestrator.adapters.sb3.buffer import ClawReplayBuffer
from orchestrator.adapters.sb3.packing import DictLayout, NotDictSpace


class ClawDictReplayBuffer(ClawReplayBuffer):
    """SB3's ``DictReplayBuffer`` on Claw (see the module docstring); takes the same
    options as :class:`ClawReplayBuffer`."""

    _samples_type: Any = DictReplayBufferSamples

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        **claw: Any,
    ) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise NotDictSpace(
                "ClawDictReplayBuffer is for Dict observations (DictReplayBuffer must be used "
                "with Dict obs space only); use ClawReplayBuffer"
            )
        self.layout = DictLayout(observation_space)
        super().__init__(
            buffer_size,
            self.layout.space,
            action_space,
            device,
            n_envs,
            optimize_memory_usage,
            handle_timeout_termination,
            **claw,
        )
        self.observation_space = observation_space
        self._init_kw["observation_space"] = observation_space  # pickles as it came

    def add(  # type: ignore[override]  # SB3's DictReplayBuffer.add takes dict observations
        self,
        obs: Mapping[str, np.ndarray],
        next_obs: Mapping[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        n = self.n_envs
        super().add(
            self.layout.pack(obs, n), self.layout.pack(next_obs, n), action, reward, done, infos
        )

    def _observations(self, rows: np.ndarray, env: VecNormalize | None) -> dict[str, th.Tensor]:
        obs = self._normalize_obs(self.layout.unpack(rows), env)
        return {k: self.tensor(v) for k, v in obs.items()}
