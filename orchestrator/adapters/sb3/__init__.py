"""Stable-Baselines3 buffers backed by Claw: the replay buffers :class:`ClawReplayBuffer`
(``buffer``) and :class:`ClawDictReplayBuffer` for Dict observations (``dict_buffer``),
the rollout buffers :class:`ClawRolloutBuffer` (``rollout``; what it holds in Claw in
``rollout_claw``, its epochs in ``epochs``) and :class:`ClawDictRolloutBuffer`
(``dict_rollout``) for PPO and A2C; ``state`` is what pickling a replay buffer keeps,
``packing`` how a Dict observation becomes one stored row."""

from orchestrator.adapters.sb3.buffer import ClawReplayBuffer
from orchestrator.adapters.sb3.dict_buffer import ClawDictReplayBuffer
from orchestrator.adapters.sb3.dict_rollout import ClawDictRolloutBuffer
from orchestrator.adapters.sb3.rollout import ClawRolloutBuffer

__all__ = ["ClawDictReplayBuffer", "ClawDictRolloutBuffer", "ClawReplayBuffer", "ClawRolloutBuffer"]
