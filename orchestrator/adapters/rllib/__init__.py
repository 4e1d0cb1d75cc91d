"""RLlib (new API stack) replay buffers backed by Claw: :class:`ClawEpisodeReplayBuffer`
(``buffer``), :class:`ClawPrioritizedEpisodeReplayBuffer` (``prioritized``) and
:class:`ClawMultiAgentEpisodeReplayBuffer` (``multi_agent``: ``MultiAgentEpisode``s as
joint-step records); ``episodes`` maps ``SingleAgentEpisode`` chunks to Claw steps and
batches back to RLlib's 1-step episodes; ``state`` is what a checkpoint keeps,
``sample_args`` the checks of a ``sample()`` request, ``metrics`` what RLlib logs of one.
Name them in ``replay_buffer_config["type"]`` by these dotted paths."""

from orchestrator.adapters.rllib.buffer import ClawEpisodeReplayBuffer
from orchestrator.adapters.rllib.multi_agent import ClawMultiAgentEpisodeReplayBuffer
from orchestrator.adapters.rllib.prioritized import ClawPrioritizedEpisodeReplayBuffer

__all__ = [
    "ClawEpisodeReplayBuffer",
    "ClawMultiAgentEpisodeReplayBuffer",
    "ClawPrioritizedEpisodeReplayBuffer",
]
