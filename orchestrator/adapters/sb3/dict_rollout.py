"""``ClawDictRolloutBuffer``: :class:`~orchestrator.adapters.sb3.rollout.ClawRolloutBuffer`
for ``spaces.Dict`` observations (``MultiInputPolicy``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictRolloutBufferSamples

from orchestrator.adapters.sb3.packing import DictLayout, NotDictSpace
from orchestrator.adapters.sb3.rollout import ClawRolloutBuffer


class ClawDictRolloutBuffer(ClawRolloutBuffer):
    """SB3's ``DictRolloutBuffer`` on Claw: each observation stored as one uint8 row (the
    keys' bytes side by side, :class:`~orchestrator.adapters.sb3.packing.DictLayout`) and
    unpacked per epoch; the same options as :class:`ClawRolloutBuffer`."""

    _samples_type: Any = DictRolloutBufferSamples

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        gae_lambda: float = 1,
        gamma: float = 0.99,
        n_envs: int = 1,
        **claw: Any,
    ) -> None:
        if not isinstance(observation_space, spaces.Dict):
            raise NotDictSpace(
                "ClawDictRolloutBuffer is for Dict observations (DictRolloutBuffer must be used "
                "with Dict obs space only); use ClawRolloutBuffer"
            )
        self.layout = DictLayout(observation_space)
        super().__init__(
            buffer_size, observation_space, action_space, device, gae_lambda, gamma, n_envs, **claw
        )

    def _row_space(self, observation_space: spaces.Space) -> spaces.Space:
        return self.layout.space

    def _row_shape(self) -> tuple[int, ...]:
        return tuple(self.layout.space.shape)

    def _rows(self, obs: Any) -> np.ndarray:
        return self.layout.pack(obs, self.n_envs)

    def _observations(self, rows: np.ndarray) -> dict[str, th.Tensor]:
        return {k: self.to_torch(v) for k, v in self.layout.unpack(rows).items()}
