"""DrQ-style augmentation done by the prefetch workers: the trainer only pops.

CartPole-v1 is rendered as 84x84 RGB images (``orchestrator.cli.demo.pixels``, numpy only)
and recorded through ``RecordSteps``. The recipe asks for ``random_shift`` on ``obs`` and,
with its own draws, on ``next_obs`` (``next_obs: same``); prefetch workers sample, shift
and collate, so the training loop spends its time on the network. Needs a running stack
and torch:

    claw up                                   # in another terminal
    python examples/drq_pixels.py --steps 3000 --updates 200
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from orchestrator import BatchClient
from orchestrator.cli.demo import dqn
from orchestrator.cli.demo.pixels import SIZE, Pixels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="drq-pixels")
    p.add_argument("--steps", type=int, default=3000, help="pixel steps to record")
    p.add_argument("--updates", type=int, default=200, help="learner steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    # Record: random actions are enough to have images to learn from.
    with Ingestor(args.namespace, flush_steps=256) as ingestor:
        env = RecordSteps(Pixels(gym.make("CartPole-v1")), ingestor, task_id="cartpole-pixels")
        env.reset(seed=args.seed)
        env.action_space.seed(args.seed)
        for _ in range(args.steps):
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
    print(f"recorded {args.steps} steps of {SIZE}x{SIZE}x3 images")

    client = BatchClient(args.namespace)
    client.register(
        {
            "name": "drq",
            "batch_size": 32,
            "fields": ["obs", "action", "reward", "next_obs"],
            "sources": [{"name": "all"}],
            "n_step": 3,
            "gamma": 0.99,
            "augment": {"obs": [{"random_shift": {"pad": 4}}], "next_obs": "same"},
            "prefetch": {"depth": 8},
        }
    )
    learner = dqn.DQN(dqn.ConvQ((SIZE, SIZE, 3), 2), lr=3e-4, target_every=100)
    waits = []
    for _ in range(args.updates):
        t0 = time.perf_counter()
        batch = client.pop("drq", timeout=60.0)  # sampled, shifted and collated already
        waits.append(time.perf_counter() - t0)
        learner.update(batch, batch.weights)
    median_ms = np.median(waits) * 1e3
    print(
        f"done: {args.updates} updates; data time per batch median {median_ms:.2f} ms "
        "(the workers did the sampling and the shifts)"
    )
    client.close()


if __name__ == "__main__":
    main()
