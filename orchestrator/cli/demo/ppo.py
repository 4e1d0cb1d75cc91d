"""Phase 2: on-policy PPO through a ``rollout`` recipe (docs/recipes.md, "On-policy").

The learner (this process) collects each rollout itself: ``ENVS`` CartPole-v1 envs x
``N_STEPS`` steps recorded through ``RecordSteps`` with the policy version, the
behaviour's log-prob and value (each env's last step of a rollout ends its segment and
bootstraps with V(next_obs)), sent as one message. The commit of that message forms the
rollout in the worker (the steps of that version only, GAE advantages computed there) and
serves it as ``EPOCHS`` shuffled passes of minibatches; the learner takes a clipped PPO
step per minibatch, then moves the recipe's ``policy_version`` for the next rollout. Each
rollout's line shows what the mode guarantees (its version only, every step once per
epoch) and how long the learner waited from sending its last steps to the first
minibatch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rich.console import Console
from torch import nn

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.format.schema import Schema
from orchestrator.cli.devstack import DevStack
from orchestrator.delivery.client import BatchClient

RECIPE = "cartpole-ppo"
ENVS, N_STEPS, BATCH, EPOCHS = 8, 32, 64, 4
STEPS = ENVS * N_STEPS  # one rollout
PER_EPOCH = STEPS // BATCH


def recipe() -> dict[str, Any]:
    return {
        "name": RECIPE,
        "batch_size": BATCH,
        "fields": ["obs", "action"],
        "sources": [{"name": "learner"}],
        "params": {"policy_version": 0},
        "gamma": 0.98,
        "seed": 0,
        "prefetch": {"depth": EPOCHS * PER_EPOCH},
        "rollout": {"steps": STEPS, "epochs": EPOCHS, "gae_lambda": 0.8, "normalize": True},
    }


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        def mlp(out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out)
            )

        self.pi, self.vf = mlp(2), mlp(1)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.vf(obs).squeeze(-1)


@dataclass
class Rollout:
    version: int
    steps: int  # distinct steps its minibatches held
    once_per_epoch: bool
    versions: list[int]
    wait_ms: float  # from sending its last steps to its first minibatch
    mean_return: float  # of the episodes that ended while collecting it


@dataclass
class PPOResult:
    namespace: str
    rollouts: list[Rollout] = field(default_factory=list)
    dropped_stale: int = 0
    lost: int = 0

    def exact(self) -> bool:
        return all(
            r.once_per_epoch and r.steps == STEPS and r.versions == [r.version]
            for r in self.rollouts
        )


def _update(net: ActorCritic, opt: torch.optim.Optimizer, b: Any) -> None:
    obs = torch.tensor(b["obs"])
    logp = net.dist(obs).log_prob(torch.tensor(b["action"]))
    ratio = torch.exp(logp - torch.tensor(b["log_prob"]))
    adv = torch.tensor(b["advantages"])
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    vf = nn.functional.mse_loss(net.value(obs), torch.tensor(b["returns"]))
    opt.zero_grad()
    (pg + 0.5 * vf).backward()
    nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    opt.step()


def _envs(ingestor: Ingestor, net: ActorCritic) -> list[RecordSteps]:
    """``ENVS`` CartPole envs recording through ``ingestor``, each segment of ``N_STEPS``
    bootstrapped with ``net``'s value of its next obs."""

    def value_fn(obs: np.ndarray) -> float:
        with torch.no_grad():
            return float(net.value(torch.as_tensor(obs, dtype=torch.float32)[None])[0])

    return [
        RecordSteps(
            gym.make("CartPole-v1"),
            ingestor,
            agent_id="learner",
            value_fn=value_fn,
            segment_steps=N_STEPS,
        )
        for _ in range(ENVS)
    ]


def _collect(
    envs: list[RecordSteps], net: ActorCritic, obs: np.ndarray, ret: np.ndarray, version: int
) -> list[float]:
    """One rollout of ``version`` recorded from each env (``obs`` and the running returns
    ``ret`` carried on): the returns of the episodes that ended in it."""
    returns = []
    for e in envs:
        e.policy_version = version
    for _ in range(N_STEPS):
        with torch.no_grad():
            x = torch.as_tensor(obs)
            dist = net.dist(x)
            action = dist.sample()
            logp, value = dist.log_prob(action).numpy(), net.value(x).numpy()
        for i, e in enumerate(envs):
            o, rew, term, trunc, _ = e.step(
                int(action[i]), log_prob=float(logp[i]), value=float(value[i])
            )
            ret[i] += rew
            if term or trunc:
                returns.append(ret[i])
                ret[i] = 0.0
                o, _ = e.reset()
            obs[i] = o
    return returns


def _train(
    client: BatchClient,
    net: ActorCritic,
    opt: torch.optim.Optimizer,
    version: int,
    sent: float,
    returns: list[float],
) -> Rollout:
    """PPO steps on each minibatch of the rollout of ``version`` (its last steps sent at
    ``sent``), and what its minibatches held."""
    seen = [Counter() for _ in range(EPOCHS)]
    versions: set[int] = set()
    wait_ms = 0.0
    for k in range(EPOCHS * PER_EPOCH):
        b = client.pop(RECIPE, timeout=120)
        if k == 0:
            wait_ms = (time.perf_counter() - sent) * 1e3
        seen[b.meta["rollout"]["epoch"]].update(b.ids.tolist())
        versions.update(np.unique(b["policy_version"]).tolist())
        _update(net, opt, b)
    once = all(len(c) == STEPS and set(c.values()) == {1} for c in seen)
    return Rollout(
        version,
        len(seen[0]),
        once,
        sorted(versions),
        wait_ms,
        float(np.mean(returns)) if returns else float("nan"),
    )


def run(
    stack: DevStack, namespace: str, *, rollouts: int, seed: int, console: Console
) -> PPOResult:
    torch.manual_seed(seed)
    net = ActorCritic()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-5)
    url, broker = stack.redis_url, stack.broker_url
    ingestor = Ingestor(
        namespace,
        url,
        broker_url=broker,
        capacity=8 * STEPS,
        schema=Schema.rollout((4,)),
        flush_steps=1 << 16,  # a rollout is sent whole, when collected
        flush_interval=None,
    )
    client = BatchClient(namespace, url, broker_url=broker)
    result = PPOResult(namespace)
    envs = _envs(ingestor, net)
    began = time.perf_counter()
    try:
        client.register(recipe())
        obs = np.stack([e.reset(seed=seed * 100 + i)[0] for i, e in enumerate(envs)])
        ret = np.zeros(ENVS)
        for v in range(rollouts):
            returns = _collect(envs, net, obs, ret, v)
            ingestor.flush(wait=False)
            r = _train(client, net, opt, v, time.perf_counter(), returns)
            result.rollouts.append(r)
            console.print(
                f"rollout {v + 1}/{rollouts}: policy_version {v}, {r.steps} steps "
                f"(versions {r.versions}), each once in each of {EPOCHS} epochs: "
                f"{'yes' if r.once_per_epoch else '[red]no[/]'}; waited {r.wait_ms:.0f} ms "
                f"for it; "
                + (
                    f"mean return {r.mean_return:.1f}"
                    if np.isfinite(r.mean_return)
                    else "no episode ended in it"
                ),
                highlight=False,
                soft_wrap=True,  # one line each (the tests read them)
            )
            if v + 1 < rollouts:
                client.set_params(RECIPE, policy_version=v + 1)  # the next rollout's
        st = client.stats(RECIPE)[RECIPE]["rollout"]
        result.dropped_stale, result.lost = int(st["dropped_stale"]), int(st["lost"])
        console.print(
            f"{len(result.rollouts)} rollouts, each its version's {STEPS} steps only, "
            f"each step once per epoch: {'yes' if result.exact() else '[red]no[/]'}; "
            f"dropped stale {result.dropped_stale}, lost {result.lost}; "
            f"{time.perf_counter() - began:.1f} s",
            highlight=False,
            soft_wrap=True,
        )
    finally:
        for e in envs:
            e.close()
        ingestor.close()
        client.close()
    return result
