"""RLlib (new API stack) replay buffers backed by Claw: :class:`ClawEpisodeReplayBuffer`
(``buffer``) and :class:`ClawPrioritizedEpisodeReplayBuffer` (``prioritized``); ``episodes``
maps ``SingleAgentEpisode`` chunks to Claw steps and batches back to RLlib's 1-step
episodes. Name them in ``replay_buffer_config["type"]`` by these dotted paths."""

from orchestrator.adapters.rllib.buffer import ClawEpisodeReplayBuffer
from orchestrator.adapters.rllib.prioritized import ClawPrioritizedEpisodeReplayBuffer

__all__ = ["ClawEpisodeReplayBuffer", "ClawPrioritizedEpisodeReplayBuffer"]
