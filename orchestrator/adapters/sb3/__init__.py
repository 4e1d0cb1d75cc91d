"""Stable-Baselines3 replay buffers backed by Claw: :class:`ClawReplayBuffer` (``buffer``)
and :class:`ClawDictReplayBuffer` for Dict observations (``dict_buffer``); ``state`` is
what pickling keeps."""

from orchestrator.adapters.sb3.buffer import ClawReplayBuffer
from orchestrator.adapters.sb3.dict_buffer import ClawDictReplayBuffer

__all__ = ["ClawDictReplayBuffer", "ClawReplayBuffer"]
