"""A small PettingZoo parallel env for the joint-step tests: agents die and join
mid-episode, every observation and state is distinct (so a misaligned slice shows), and a
global ``state()``."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo.utils.env import ParallelEnv


class Crowd(ParallelEnv):
    """Agents ``a0..a3``: ``a0``-``a2`` start, ``a3`` joins at step 3; each agent dies
    (terminated) with probability ``p_die`` per step; the episode is truncated after ``T``
    steps. Observations ``float32[4]``, actions ``Discrete(3)``, state ``float32[6]``."""

    metadata = {"name": "crowd_v0"}

    def __init__(self, T: int = 12, p_die: float = 0.08, seed: int = 0) -> None:
        self.possible_agents = ["a0", "a1", "a2", "a3"]
        self.T, self.p_die = T, p_die
        self.rng = np.random.default_rng(seed)
        self.agents: list[str] = []
        self.t = 0
        self.episode = 0
        self.noise = np.zeros(3)

    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Box(-np.inf, np.inf, (4,), np.float32)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(3)

    def _obs(self, agent: str) -> np.ndarray:
        i = self.possible_agents.index(agent)
        return np.array([self.episode, self.t, i, self.rng.random()], np.float32)

    def state(self) -> np.ndarray:
        return np.array([self.episode, self.t, len(self.agents), *self.noise], np.float32)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.episode += 1
        self.t = 0
        self.agents = self.possible_agents[:3]
        self.noise = self.rng.random(3)
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        acting = list(self.agents)
        rewards = {a: float(self.rng.normal() + int(actions[a])) for a in acting}
        terms = {a: bool(self.rng.random() < self.p_die) for a in acting}
        truncs = {a: self.t >= self.T and not terms[a] for a in acting}
        obs = {a: self._obs(a) for a in acting}
        self.agents = [a for a in acting if not (terms[a] or truncs[a])]
        if self.t == 3 and self.t < self.T:  # a3 joins: its first observation now
            self.agents.append("a3")
            obs["a3"] = self._obs("a3")
        self.noise = self.rng.random(3)
        infos = {a: {} for a in obs}
        return obs, rewards, terms, truncs, infos
