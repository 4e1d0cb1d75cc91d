"""``ClawPrioritizedEpisodeReplayBuffer``: RLlib's ``PrioritizedEpisodeReplayBuffer`` over a
Claw namespace, with Claw's ``priority`` sampler.

Rows are drawn with P(i) = p_i^alpha / sum_j p_j^alpha and weighted (N P(i))^-beta, as
RLlib's; ``update_priorities`` sends ``max(|td_error|, 1e-12)`` of the rows of the last
``sample()`` to Claw, written behind the trainer's call (``BatchClient.update_priorities``),
and a step no update reached counts at the largest priority set on a live step (1.0 before any),
as RLlib's running maximum. Where it differs from RLlib's:

- The weights are normalised by the largest weight among the batch's rows (RLlib divides
  by the weight of the smallest priority in the whole buffer): the same direction per row,
  a scale at most as large.
- Batches already prefetched keep the priorities they were drawn with; the update reaches
  the next fills (RLlib's sum tree changes before the next draw).
- Like the uniform buffer it cuts n-step windows at an episode's end (RLlib's prioritized
  buffer draws such rows again, so it never samples an episode's last n - 1 steps).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)

from orchestrator.adapters.rllib.buffer import ClawEpisodeReplayBuffer


class ClawPrioritizedEpisodeReplayBuffer(ClawEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer):
    """Prioritized replay over a Claw namespace (see the module docstring); ``alpha`` as
    RLlib's, ``beta`` comes with each ``sample()`` (DQN passes its config's). The other
    arguments are :class:`~orchestrator.adapters.rllib.ClawEpisodeReplayBuffer`'s.

    It subclasses RLlib's prioritized buffer so that DQN sends it the TD errors; none of
    that class's segment trees are built."""

    def __init__(self, capacity: int = 10000, *, alpha: float = 1.0, **kwargs: Any) -> None:
        if alpha < 0:
            raise ValueError(f"alpha={alpha}: must be >= 0")
        self._alpha = float(alpha)
        ClawEpisodeReplayBuffer.__init__(self, capacity, **kwargs)
        self._init_kw["alpha"] = self._alpha
        self._last_sampled_indices: list[int] = []

    def add(
        self,
        episodes: list[SingleAgentEpisode] | SingleAgentEpisode,
        weight: float | None = None,
    ) -> None:
        """Write the episodes' steps with priority ``weight`` (None: Claw's running
        maximum, as RLlib's ``None``)."""
        self._add(episodes, None if weight is None else float(weight))

    def sample(self, num_items: int | None = None, **kwargs: Any) -> list[SingleAgentEpisode]:
        beta = kwargs.get("beta", 0.0)
        if beta is not None and beta < 0:
            raise ValueError(f"beta={beta}: must be >= 0")
        kwargs.setdefault("sample_episodes", True)
        if kwargs["sample_episodes"] is False:  # RLlib's prioritized buffer always
            kwargs["sample_episodes"] = True  # returns episodes
        episodes = super().sample(num_items, **kwargs)
        self._last_sampled_indices = self._last_ids.tolist()
        return episodes

    def _source(self, beta: float) -> dict[str, Any]:
        return {"kind": "priority", "alpha": self._alpha, "beta": beta}

    def update_priorities(self, priorities: ArrayLike, module_id: str | None = None) -> None:
        """Priorities of the rows of the last ``sample()``, in its order (DQN's TD errors)."""
        p = np.abs(np.asarray(priorities, np.float64).reshape(-1))
        ids = self._last_ids
        if len(p) != len(ids):
            raise ValueError(
                f"update_priorities: {len(p)} priorities for the {len(ids)} rows of the last "
                "sample(); sampling and updating must alternate"
            )
        self.client.update_priorities(ids, np.maximum(p, 1e-12))
        self._last_ids = np.zeros(0, np.int64)
        self._last_sampled_indices = []

    def flush(self, timeout: float = 60.0) -> None:
        """Write every step added and every priority submitted, and wait for both."""
        super().flush(timeout)
        self.client.flush_priorities(timeout)
