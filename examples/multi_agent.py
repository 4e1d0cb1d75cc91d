"""Two agents, one recipe: batches that mix their steps 70/30.

A cautious agent and a random one play CartPole-v1; each records under its own
``agent_id``. One recipe draws 70% of every batch from the cautious agent's steps and 30%
from the random agent's (a mixture of two sources, each with a ``where`` in the string form
of the where language). Needs a running stack:

    claw up                                   # in another terminal
    python examples/multi_agent.py
"""

from __future__ import annotations

import argparse
from collections import Counter

import gymnasium as gym
import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from orchestrator import BatchClient


def cautious(obs: np.ndarray) -> int:
    """Push the cart towards where the pole leans."""
    return int(obs[2] + 0.5 * obs[3] > 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="multi-agent")
    p.add_argument("--steps", type=int, default=2000, help="steps per agent")
    p.add_argument("--batches", type=int, default=5)
    args = p.parse_args()

    with Ingestor(args.namespace) as ingestor:
        for agent, seed in (("cautious", 0), ("random", 1)):
            env = RecordSteps(gym.make("CartPole-v1"), ingestor, task_id="balance", agent_id=agent)
            obs, _ = env.reset(seed=seed)
            env.action_space.seed(seed)
            for _ in range(args.steps):
                a = cautious(obs) if agent == "cautious" else env.action_space.sample()
                obs, _, terminated, truncated, _ = env.step(a)
                if terminated or truncated:
                    obs, _ = env.reset()

    client = BatchClient(args.namespace)
    client.register(
        {
            "name": "mix",
            "batch_size": 100,
            "fields": ["obs", "action", "reward", "agent_id"],
            "sources": [
                {"name": "cautious", "weight": 0.7, "where": "agent_id == 'cautious'"},
                {"name": "random", "weight": 0.3, "where": "agent_id == 'random'"},
            ],
        }
    )
    for _ in range(args.batches):
        batch = client.pop("mix", timeout=60.0)
        by_agent = Counter(batch.meta["agent_id"])
        by_source = Counter(batch.sources[i] for i in batch.source_index.tolist())
        print(
            f"batch of {len(batch.ids)}: agents {dict(sorted(by_agent.items()))}, "
            f"sources {dict(sorted(by_source.items()))}"
        )
    client.close()


if __name__ == "__main__":
    main()
