"""Prioritized double DQN on CartPole through Claw: the learner of `claw demo`, standalone.

One process acts and learns: an epsilon-greedy copy of the network plays CartPole-v1 and
records every step through ``RecordSteps`` (tagged with the policy version); the learner
pops prioritized 3-step batches that the prefetch workers made, takes a double-DQN step
(``orchestrator.cli.demo.dqn``, the demo's learner) and sends the TD errors back as
priorities. Needs a running stack and torch:

    claw up                                   # in another terminal
    python examples/dqn_per.py --updates 3000 # CLAW_REDIS_URL picks the Redis

`claw demo` runs the same learner Ape-X style, with actor processes and weights published
through Redis.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="dqn-per")
    p.add_argument("--updates", type=int, default=3000, help="learner steps")
    p.add_argument("--warmup", type=int, default=1000, help="steps recorded before learning")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    net = dqn.mlp(4, 2)
    learner = dqn.DQN(net, lr=1e-3, target_every=250)

    ingestor = Ingestor(args.namespace, flush_steps=64, flush_interval=0.25)
    env = RecordSteps(gym.make("CartPole-v1"), ingestor, task_id="cartpole", agent_id="dqn")
    client = BatchClient(args.namespace)
    recipe = {
        "name": "dqn-per",
        "batch_size": 64,
        "fields": ["obs", "action", "reward", "next_obs"],
        "sources": [{"name": "replay", "sampler": {"kind": "priority", "alpha": 0.6, "beta": 0.4}}],
        "n_step": 3,
        "gamma": 0.99,
        "prefetch": {"depth": 8},
        "rate_limit": {"samples_per_insert": 16.0, "error_buffer": 5000, "min_size": args.warmup},
    }

    obs, _ = env.reset(seed=args.seed)
    env.policy_version = 0
    returns, ret, registered = [], 0.0, False
    updates, steps, started = 0, 0, time.monotonic()
    while updates < args.updates:
        # Act: a few env steps per learner step, epsilon annealed over the first 2/3.
        eps = max(0.05, 1.0 - updates / (0.66 * args.updates))
        for _ in range(4):
            a = int(rng.integers(2)) if rng.random() < eps else dqn.greedy(net, obs)
            obs, reward, terminated, truncated, _ = env.step(a)
            ret, steps = ret + float(reward), steps + 1
            if terminated or truncated:
                returns.append(ret)
                env.policy_version = updates  # the next episode's steps carry it
                obs, ret = env.reset()[0], 0.0
        if not registered:
            if steps < 64:  # the first steps fix the namespace schema the recipe is checked on
                continue
            ingestor.flush()
            client.register(recipe)
            registered = True
        if steps < args.warmup:
            continue
        # Learn: pop what the workers prefetched, step, send priorities back.
        batch = client.pop("dqn-per", timeout=60.0)
        td = learner.update(batch, batch.weights)
        client.update_priorities(batch.ids, td + 1e-3)
        updates += 1
        if updates % 500 == 0:
            print(
                f"{updates} updates, {steps} env steps, mean return of the last 20 "
                f"episodes {np.mean(returns[-20:]):.1f}",
                flush=True,
            )
    mean = float(np.mean(returns[-20:])) if returns else 0.0
    print(
        f"done: {updates} updates in {time.monotonic() - started:.0f} s, {steps} env steps, "
        f"{len(returns)} episodes, mean return of the last 20 {mean:.1f}"
    )
    client.close()
    ingestor.close()


if __name__ == "__main__":
    main()
