"""RLlib's ``SingleAgentEpisode`` in and out of Claw.

- :class:`EpisodeWriter` writes episode chunks (what an ``EnvRunner`` returns: a new
  episode, or the next piece of one with the same ``id_``) as steps of the Claw episode of
  that id. Step t of a chunk is ``(obs_t, action_t, reward_t)`` with ``step_index =
  t_started + t``, so the pieces of one episode line up in the store whichever writer (or
  process: a restored buffer) writes them, and Claw links them for n-step windows. A
  chunk's last step carries its ``next_obs`` explicitly: it can be drawn before the next
  chunk arrives, and when that chunk lands the windows run across the boundary.
- :func:`to_episodes` turns a batch of an n-step recipe into what RLlib's episode buffers
  return from ``sample(sample_episodes=True)``: one 1-step ``SingleAgentEpisode`` per row,
  observations ``[o_t, o_{t+m}]``, the discounted m-step reward, the termination within
  the window, and ``n_step`` and ``weights`` in ``extra_model_outputs`` (DQN's and SAC's
  losses bootstrap with ``gamma ** n_step`` and weight by ``weights``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from claw_tasks.client import Episode, Ingestor

FIELDS = [
    "obs",
    "action",
    "reward",
    "next_obs",
    "terminated",
    "truncated",
    "step_index",
    "episode_id",  # into batch.meta: each row's RLlib episode id_
]
"""What a recipe of these buffers reads."""


class EpisodeWriter:
    """Episode chunks into one Ingestor; keeps the Claw episode of each open ``id_``, the
    ``max_open`` newest (a chunk of one forgotten, e.g. of an EnvRunner that died, opens
    a new writer at its ``t_started``: the store joins the steps all the same)."""

    def __init__(self, ingestor: Ingestor, max_open: int = 10_000) -> None:
        self.ingestor = ingestor
        self.max_open = max_open
        self.open: dict[str, Episode] = {}
        self.observation_space: gym.Space | None = None
        self.action_space: gym.Space | None = None

    def add(self, eps: SingleAgentEpisode, priority: float | None = None) -> int:
        """Write ``eps``'s steps (each with ``priority``, None: Claw's default); returns
        how many. A chunk of no step (a reset only) writes nothing."""
        n = len(eps)
        if eps.observation_space is not None:
            self.observation_space, self.action_space = eps.observation_space, eps.action_space
        if n == 0:
            return 0
        obs = eps.get_observations(slice(0, n + 1))
        actions = eps.get_actions(slice(0, n))
        rewards = eps.get_rewards(slice(0, n))
        if isinstance(obs, dict) or isinstance(actions, dict):
            raise TypeError(
                "ClawEpisodeReplayBuffer stores array observations and actions (Box, "
                "Discrete, MultiDiscrete, ...); flatten Dict/Tuple spaces with a connector first"
            )
        writer = self.open.pop(eps.id_, None)
        if writer is None or writer.step_index != eps.t_started:
            writer = self.ingestor.episode(str(eps.id_))
            writer.step_index = int(eps.t_started)  # the env's step counter of obs[0]
        last = n - 1
        for t in range(n):
            writer.add(
                obs[t],
                actions[t],
                float(rewards[t]),
                next_obs=obs[t + 1] if t == last else None,
                terminated=t == last and bool(eps.is_terminated),
                truncated=t == last and bool(eps.is_truncated),
                priority=priority,
            )
        if eps.is_done:
            writer.end()
        else:
            self.open[eps.id_] = writer  # newest last: the oldest go first
            while len(self.open) > self.max_open:
                del self.open[next(iter(self.open))]
        return n


@dataclass
class Drawn:
    """One ``sample()``'s worth: the step ids drawn (priorities go back to them), the
    episodes RLlib gets, each row's episode id and the m of its window."""

    ids: np.ndarray
    episodes: list[SingleAgentEpisode]
    names: list[str]
    m: np.ndarray

    @classmethod
    def join(cls, parts: list[Drawn]) -> Drawn:
        """The parts' rows one after the other (an n-step range: one part per n)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.ids for p in parts]),
            [e for p in parts for e in p.episodes],
            [x for p in parts for x in p.names],
            np.concatenate([p.m for p in parts]),
        )

    def returned(self, to_numpy: bool) -> list[SingleAgentEpisode]:
        """The episodes as ``sample()`` returns them (numpy arrays when ``to_numpy``)."""
        if to_numpy:
            for eps in self.episodes:
                eps.to_numpy()
        return self.episodes


def steps_taken(discount: np.ndarray, gamma: float, n: int) -> np.ndarray:
    """m, the steps each row's n-step return summed, from its ``discount = gamma^m``
    (with ``gamma == 1`` every m gives the same target: n is reported)."""
    if not 0.0 < gamma < 1.0:
        return np.full(len(discount), n, np.int64)
    m = np.rint(np.log(np.maximum(discount, 1e-300)) / np.log(gamma)).astype(np.int64)
    return np.clip(m, 1, n)


def to_episodes(
    batch: Any,
    n_step: int,
    gamma: float,
    spaces: tuple[gym.Space | None, gym.Space | None] = (None, None),
    ids: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    t_started: np.ndarray | None = None,
) -> Drawn:
    """RLlib's 1-step episodes of the rows of ``batch`` (a :class:`~orchestrator.Batch` of a
    recipe reading :data:`FIELDS`; see the module docstring). ``ids`` holds RLlib's
    ``agent_id``/``module_id``/``multi_agent_episode_id`` for every episode, or one such
    mapping per row, when set; ``t_started`` each row's step in its RLlib episode (default
    its ``step_index``).

    ``is_truncated`` is the step's own flag with ``n_step`` 1; with more, that of the
    window's last step (``end_truncated``), as RLlib's ``episode.slice`` keeps the flags of
    a slice that reaches a truncated episode's end: the last stored steps of a running
    episode are not truncated. DQN's and SAC's losses never read it."""
    obs, nxt, act = batch["obs"], batch["next_obs"], batch["action"]
    reward = batch["reward"].astype(np.float64)
    if n_step > 1:
        done = np.asarray(batch["done"], bool)
        m = steps_taken(np.asarray(batch["discount"], np.float64), gamma, n_step)
        truncated = np.asarray(batch["end_truncated"], bool) & ~done
    else:
        done = np.asarray(batch["terminated"], bool)
        truncated = np.asarray(batch["truncated"], bool) & ~done
        m = np.ones(len(reward), np.int64)
    started = np.asarray(batch["step_index"] if t_started is None else t_started, np.int64)
    names = batch.meta["episode_id"]
    weights = np.asarray(batch.weights, np.float64)
    obs_space, act_space = spaces
    per_row = ids if isinstance(ids, Sequence) else [dict(ids or {})] * len(reward)
    out = []
    for i in range(len(reward)):
        out.append(
            SingleAgentEpisode(
                id_=names[i],
                observations=[obs[i], nxt[i]],
                actions=[act[i]],
                rewards=[float(reward[i])],
                terminated=bool(done[i]),
                truncated=bool(truncated[i]),
                extra_model_outputs={"n_step": [int(m[i])], "weights": [float(weights[i])]},
                observation_space=obs_space,
                action_space=act_space,
                t_started=int(started[i]),
                len_lookback_buffer=0,
                **per_row[i],
            )
        )
    return Drawn(np.asarray(batch.ids), out, list(names), m)
