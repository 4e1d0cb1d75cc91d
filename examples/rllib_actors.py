"""Ray actors record into Claw, a learner trains from Claw: DQN on CartPole-v1.

``--actors`` Ray remote actors (plain ``@ray.remote`` classes, where an RLlib ``EnvRunner``
would sit) each step their own CartPole-v1 with an epsilon-greedy copy of the Q-network
(numpy, no torch in the actors) and record every step through ``RecordSteps`` and an
``Ingestor``: the steps travel to Claw's Celery ingest workers as from any producer. Ray
is only how this program runs its actors; Claw runs no Ray and starts no second task
system. The learner (this process) pops prefetched 3-step batches of a recipe (Claw's
prefetch workers draw them) and takes Double-DQN steps while the actors collect the next
round; after each round it puts the new weights into Ray's object store, and the actors
load them and tag their steps with the new ``policy_version``.

Needs the workers and Ray (``pip install -e '.[rllib]'``):

    claw up                                      # in another terminal
    python examples/rllib_actors.py --actors 2   # CLAW_REDIS_URL picks the Redis

Each round prints one JSON line (round, env steps, updates, the policy versions the
round's batches held, the mean return of the episodes the actors finished); the last line
sums up, with a greedy evaluation. ``--short`` is a few small rounds (the CI check).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import gymnasium as gym
import numpy as np
import ray
import torch
from torch import nn

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator import BatchClient

RECIPE = "rllib-actors"


def q_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )


def to_numpy(net: nn.Sequential) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in net.parameters()]


def greedy(weights: list[np.ndarray], obs: np.ndarray) -> int:
    """The Q-network's argmax in numpy (Linear, ReLU, Linear, ReLU, Linear)."""
    w1, b1, w2, b2, w3, b3 = weights
    h = np.maximum(obs @ w1.T + b1, 0.0)
    h = np.maximum(h @ w2.T + b2, 0.0)
    return int(np.argmax(h @ w3.T + b3))


@ray.remote
class Collector:
    """One CartPole-v1 whose every step goes to Claw through an Ingestor."""

    def __init__(self, index: int, namespace: str, redis_url: str, seed: int) -> None:
        self.ingestor = Ingestor(namespace, redis_url, flush_steps=256, flush_interval=0.25)
        self.env = RecordSteps(gym.make("CartPole-v1"), self.ingestor, agent_id=f"actor-{index}")
        self.rng = np.random.default_rng([seed, index])
        self.obs, _ = self.env.reset(seed=seed * 100 + index)
        self.ret = 0.0

    def collect(
        self, steps: int, weights: list[np.ndarray], epsilon: float, version: int
    ) -> list[float]:
        """``steps`` env steps with epsilon-greedy ``weights``; the returns of the
        episodes finished."""
        self.env.policy_version = version
        returns = []
        for _ in range(steps):
            if self.rng.random() < epsilon:
                action = int(self.rng.integers(2))
            else:
                action = greedy(weights, self.obs)
            self.obs, reward, term, trunc, _ = self.env.step(action)
            self.ret += float(reward)
            if term or trunc:
                returns.append(self.ret)
                self.ret = 0.0
                self.obs, _ = self.env.reset()
        self.ingestor.flush(wait=False)
        return returns

    def close(self) -> None:
        """Write what is buffered and wait for the store."""
        self.ingestor.close()


def evaluate(net: nn.Sequential, episodes: int, seed: int) -> float:
    env = gym.make("CartPole-v1")
    weights, total = to_numpy(net), 0.0
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + 10_000 + k)
        done = False
        while not done:
            obs, r, term, trunc, _ = env.step(greedy(weights, obs))
            total += float(r)
            done = term or trunc
    return total / episodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="rllib-actors")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps-per-round", type=int, default=500, help="per actor")
    p.add_argument("--updates-per-round", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--target", type=float, default=475.0, help="stop at this greedy return")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short", action="store_true", help="3 rounds of 100 steps (the CI check)")
    a = p.parse_args()
    if a.short:
        a.rounds, a.steps_per_round, a.updates_per_round, a.eval_episodes = 3, 100, 20, 1
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    url = get_settings().redis_url
    ray.init(num_cpus=a.actors, include_dashboard=False, log_to_driver=False)
    actors = [Collector.remote(i, a.namespace, url, a.seed) for i in range(a.actors)]
    net, target = q_net(), q_net()
    target.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    client = BatchClient(a.namespace)
    gamma, started, updates, steps = 0.99, time.monotonic(), 0, 0
    weights = ray.put(to_numpy(net))
    recent: list[float] = []
    greedy_return = float("nan")
    for rnd in range(a.rounds):
        epsilon = max(0.05, 1.0 - rnd / (0.3 * a.rounds))
        pending = [act.collect.remote(a.steps_per_round, weights, epsilon, rnd) for act in actors]
        versions: Counter[int] = Counter()
        if rnd == 0:  # the recipe needs steps to draw from: wait for the first round
            ray.get(pending)
            client.register(
                {
                    "name": RECIPE,
                    "batch_size": a.batch_size,
                    "fields": ["obs", "action", "reward", "next_obs", "policy_version"],
                    "n_step": 3,
                    "gamma": gamma,
                    "sources": [{"name": "all", "window": {"last_steps": 50_000}}],
                    "prefetch": {"depth": 16},
                    "seed": a.seed,
                }
            )
        for _ in range(a.updates_per_round):  # while the actors collect the next round
            batch = client.pop(RECIPE, timeout=120)
            versions.update(batch["policy_version"].tolist())
            obs = torch.as_tensor(batch["obs"])
            nxt = torch.as_tensor(batch["next_obs"])
            act = torch.as_tensor(batch["action"]).long().reshape(-1)
            with torch.no_grad():
                best = net(nxt).argmax(1, keepdim=True)
                boot = target(nxt).gather(1, best).squeeze(1)
                y = torch.as_tensor(batch["reward"]) + torch.as_tensor(batch["discount"]) * boot * (
                    1 - torch.as_tensor(batch["done"]).float()
                )
            q = net(obs).gather(1, act[:, None]).squeeze(1)
            loss = nn.functional.smooth_l1_loss(q, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1
            if updates % 250 == 0:
                target.load_state_dict(net.state_dict())
        returns = [r for got in ray.get(pending) for r in got]
        steps += a.steps_per_round * a.actors
        recent = (recent + returns)[-20:]
        weights = ray.put(to_numpy(net))
        line = {
            "round": rnd,
            "env_steps": steps,
            "updates": updates,
            "batch_policy_versions": sorted(versions),
            "return_mean": round(float(np.mean(recent)), 1) if recent else None,
        }
        print(json.dumps(line), flush=True)
        if recent and np.mean(recent) >= a.target and rnd % 5 == 4:
            greedy_return = evaluate(net, a.eval_episodes, a.seed)
            if greedy_return >= a.target:
                break
    if greedy_return != greedy_return:
        greedy_return = evaluate(net, a.eval_episodes, a.seed)
    ray.get([act.close.remote() for act in actors])
    recorded = int(Store(url, a.namespace).info()["committed_total"])
    client.unregister(RECIPE)
    client.close()
    ray.shutdown()
    print(
        f"done: {a.actors} Ray actors recorded {recorded} steps into {a.namespace!r}, "
        f"{updates} updates from Claw batches in {time.monotonic() - started:.0f} s; "
        f"greedy return {greedy_return:.1f}"
    )


if __name__ == "__main__":
    main()
