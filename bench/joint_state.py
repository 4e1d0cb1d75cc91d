"""Bytes per joint step of multi-agent data: the global state stored once per joint step
(``RecordParallelSteps``: on the anchor record only), not at all, and on every agent's
record (as a per-agent recorder would, here by appending it to each agent's observation).

    .venv/bin/python bench/joint_state.py [--episodes 800] [--agents 3]

Starts a private redis-server and an ingest worker, records the same episodes of an env
with MPE ``simple_spread``'s shapes (``--agents`` agents, obs float32[6 * agents], state
float32[6 * agents**2]: each agent's observation side by side, as simple_spread's
``state()``; 25 steps an episode, Discrete(5) actions) into three namespaces, and reports
each namespace's exact memory (``MEMORY USAGE key SAMPLES 0`` of every key) per joint step
and per agent record, and what the ``state`` hashes hold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo.utils.env import ParallelEnv

from claw_tasks.client import Ingestor
from claw_tasks.client.pettingzoo import RecordParallelSteps
from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.store.keyscan import namespace_keys
from claw_tasks.store.usage import key_bytes
from claw_tasks.worker.command import worker_argv
from orchestrator.maintenance.lifecycle import namespace_bytes

ROOT = Path(__file__).resolve().parents[1]


class Spread(ParallelEnv):
    """simple_spread's shapes with random contents (``with_state``: obs carry the state)."""

    metadata = {"name": "spread_shapes"}

    def __init__(self, n: int, with_state: bool = False) -> None:
        self.possible_agents = [f"agent_{i}" for i in range(n)]
        self.agents: list[str] = []
        self.n, self.with_state = n, with_state
        self.rng = np.random.default_rng(0)
        self.t = 0

    def observation_space(self, agent: str) -> spaces.Space:
        size = 6 * self.n * (1 + self.n * self.with_state)
        return spaces.Box(-np.inf, np.inf, (size,), np.float32)

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(5)

    def state(self) -> np.ndarray:
        return np.concatenate([self._own[a] for a in self.possible_agents])

    def _obs(self) -> dict[str, np.ndarray]:
        self._own = {a: self.rng.random(6 * self.n, dtype=np.float32) for a in self.agents}
        if not self.with_state:
            return dict(self._own)
        s = self.state()
        return {a: np.concatenate([o, s]) for a, o in self._own.items()}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.rng = np.random.default_rng(seed)
        self.agents, self.t = list(self.possible_agents), 0
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        self.t += 1
        obs = self._obs()
        rewards = {a: float(self.rng.normal()) for a in self.agents}
        done = self.t >= 25
        terms = {a: False for a in self.agents}
        truncs = {a: done for a in self.agents}
        if done:
            self.agents = []
        return obs, rewards, terms, truncs, {a: {} for a in obs}


def record(url: str, ns: str, episodes: int, agents: int, layout: str) -> int:
    env = Spread(agents, with_state=layout == "every record")
    with Ingestor(ns, url, flush_interval=None, flush_steps=8192) as ing:
        rec = RecordParallelSteps(env, ing, state=layout == "once")
        joint = 0
        for e in range(episodes):
            rec.reset(seed=e)
            while rec.agents:
                rec.step({a: 0 for a in rec.agents})
                joint += 1
    return joint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=800)
    p.add_argument("--agents", type=int, default=3)
    args = p.parse_args()
    with RedisServer() as server:
        env = {**os.environ, "CLAW_REDIS_URL": server.url, "PYTHONPATH": str(ROOT)}
        env.pop("CLAW_BROKER_URL", None)
        worker = subprocess.Popen(
            worker_argv("ingest", 2, lone=True, heartbeat=False, loglevel="WARNING"),
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(3)
            r = redis_client(server.url)
            state_bytes = 4 * 6 * args.agents**2
            print(
                f"{args.episodes} episodes of 25 joint steps, {args.agents} agents, "
                f"obs float32[{6 * args.agents}], state float32[{6 * args.agents**2}] "
                f"({state_bytes} B)"
            )
            base = None
            for layout in ("none", "once", "every record"):
                ns = f"joint-{layout.replace(' ', '-')}"
                joint = record(server.url, ns, args.episodes, args.agents, layout)
                total = namespace_bytes(r, ns)
                keys = [k for k in namespace_keys(r, ns) if b":r:state:" in k]
                in_state = sum(key_bytes(r, keys)) if keys else 0
                entries = sum(r.hlen(k) for k in keys)
                per_joint = total / joint
                extra = "" if base is None else f", +{per_joint - base:.1f} B over none"
                base = per_joint if base is None else base
                print(
                    f"state {layout:>12}: {per_joint:8.1f} B per joint step, "
                    f"{total / (joint * args.agents):7.1f} B per agent record{extra}; "
                    f"state hashes {entries} entries, {in_state / joint:.1f} B per joint step"
                )
        finally:
            worker.terminate()
            worker.wait(30)


if __name__ == "__main__":
    main()
