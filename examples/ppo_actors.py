"""PPO with many actors and one learner through Claw: rollouts by policy version.

N actor processes (``--actors``, each running 8 / N CartPole-v1 envs, so a rollout is
always 8 envs x ``--n-steps`` steps) load the newest weights the learner published in
Redis, record one segment of ``--n-steps`` steps per env through ``RecordSteps`` (each
step with its policy version, the behaviour log-prob and value; a segment's last step and
a truncated one with V(next_obs)), then wait for the next version. The prefetch workers
serve each policy version's rollout once, as ``--epochs`` shuffled passes of minibatches
with GAE advantages already computed (a ``rollout`` recipe; docs/recipes.md,
"On-policy"); the learner takes a clipped PPO step per minibatch, publishes version v + 1
and moves the recipe's ``policy_version`` to it. Hyperparameters are rl-zoo's for
CartPole-v1 (8 envs x 32 steps, minibatch 256, 20 epochs, gamma 0.98, lambda 0.8, linear
lr 1e-3 and clip 0.2). It stops when 20 deterministic evaluation episodes average
``--target`` (475). Needs the workers:

    claw up                                      # in another terminal
    python examples/ppo_actors.py --actors 4     # CLAW_REDIS_URL picks the Redis

Each update prints one JSON line (version, rollout number, the policy versions and the
count of distinct steps its minibatches held, the learner's wait from publishing to its
first minibatch, and of it the delivery: from the last actor's send to that minibatch);
the last line sums up, from the end of the first update on (the actors have started):
env steps per second, the mean wait and delivery per update.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.connection.client import redis_client
from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.schema import Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store, owned_key
from orchestrator import BatchClient
from orchestrator.cli.demo import weights

ENVS = 8  # rl-zoo's n_envs, split over the actors
RECIPE = "ppo"


class ActorCritic(nn.Module):
    """SB3's MlpPolicy for PPO: separate 64-64 tanh networks, orthogonal init."""

    def __init__(self) -> None:
        super().__init__()

        def mlp(out: int, gain: float) -> nn.Sequential:
            net = nn.Sequential(
                nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out)
            )
            for i, layer in enumerate(net):
                if isinstance(layer, nn.Linear):
                    nn.init.orthogonal_(layer.weight, gain if i == 4 else np.sqrt(2))
                    nn.init.zeros_(layer.bias)
            return net

        self.pi, self.vf = mlp(2, 0.01), mlp(1, 1.0)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.vf(obs).squeeze(-1)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy() for k, v in self.state_dict().items()}

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (v.dtype.str, v.shape) for k, v in self.arrays().items()}

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in arrays.items()})


def returns_key(namespace: str) -> str:
    return owned_key(namespace, "ppo:returns")


def sent_key(namespace: str) -> str:
    """Hash: actor -> when it sent its last segment (unix time, this host's clock)."""
    return owned_key(namespace, "ppo:sent")


# ---- actors ------------------------------------------------------------------------------
def act(namespace: str, actor: int, envs: int, n_steps: int, seed: int) -> None:
    """One actor: ``envs`` envs, a segment of ``n_steps`` per env for every version."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    r = redis_client(get_settings().redis_url)
    # One message per segment, sent when it is complete: the actor waits for the next
    # version anyway, so it waits for the commit too (no timer thread, nothing in flight).
    ingestor = Ingestor(namespace, flush_interval=None, flush_steps=1 << 16)
    net = ActorCritic()
    layout = net.layout()

    def value_fn(obs: np.ndarray) -> float:
        with torch.no_grad():
            return float(net.value(torch.as_tensor(obs)[None])[0])

    wrapped = [
        RecordSteps(
            gym.make("CartPole-v1"),
            ingestor,
            agent_id=f"actor-{actor}",
            value_fn=value_fn,
            segment_steps=n_steps,
        )
        for _ in range(envs)
    ]
    obs = np.stack([e.reset(seed=seed * 100 + i)[0] for i, e in enumerate(wrapped)])
    ret, length, version = np.zeros(envs), np.zeros(envs, int), -1
    while not stop:
        got = weights.latest_version(r, namespace)
        if got is None or got == version:
            time.sleep(0.005)
            continue
        version, arrays = weights.fetch(r, namespace, layout)  # type: ignore[misc]
        net.load_arrays(arrays)
        for e in wrapped:
            e.policy_version = version
        for _ in range(n_steps):
            with torch.no_grad():
                x = torch.as_tensor(obs)
                dist = net.dist(x)
                action = dist.sample()
                logp, value = dist.log_prob(action).numpy(), net.value(x).numpy()
            for i, e in enumerate(wrapped):
                o, rew, term, trunc, _ = e.step(
                    int(action[i]), log_prob=float(logp[i]), value=float(value[i])
                )
                ret[i] += rew
                length[i] += 1
                if term or trunc:
                    r.rpush(
                        returns_key(namespace),
                        packb([actor, version, float(ret[i]), int(length[i])]),
                    )
                    ret[i], length[i] = 0.0, 0
                    o, _ = e.reset()
                obs[i] = o
        r.hset(sent_key(namespace), str(actor), time.time())  # before: the rollout may
        ingestor.flush()  # form, and the learner read the hash, before the flush returns
    ingestor.close()


# ---- learner -----------------------------------------------------------------------------
def evaluate(net: ActorCritic, episodes: int, seed: int) -> float:
    env = gym.make("CartPole-v1")
    total = 0.0
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        done = False
        while not done:
            with torch.no_grad():
                a = int(net.pi(torch.as_tensor(obs)).argmax())
            obs, rew, term, trunc, _ = env.step(a)
            total += rew
            done = term or trunc
    return total / episodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="ppo-actors")
    p.add_argument("--actors", type=int, default=4, help="actor processes (a divisor of 8)")
    p.add_argument("--n-steps", type=int, default=32, help="steps per env and version")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--timesteps", type=int, default=100_000, help="the schedules' horizon")
    p.add_argument("--updates", type=int, default=0, help="stop after this many (0: at --target)")
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--actor", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if ENVS % args.actors:
        p.error("--actors must divide 8")
    if args.actor is not None:
        act(args.namespace, args.actor, ENVS // args.actors, args.n_steps, args.seed + args.actor)
        return
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    r = redis_client(get_settings().redis_url)
    store = Store(r, args.namespace)
    rollout_steps = ENVS * args.n_steps
    if not store.exists():
        store.create(capacity=max(100_000, 8 * rollout_steps), schema=Schema.rollout((4,)))
    client = BatchClient(args.namespace)
    per_epoch = rollout_steps // args.batch_size
    client.register(
        {
            "name": RECIPE,
            "batch_size": args.batch_size,
            "fields": ["obs", "action"],
            "sources": [{"name": "actors"}],
            "params": {"policy_version": 0},
            "gamma": 0.98,
            "seed": args.seed,
            "prefetch": {"depth": args.epochs * per_epoch},
            "rollout": {
                "steps": rollout_steps,
                "epochs": args.epochs,
                "gae_lambda": 0.8,
                "normalize": True,
            },
        }
    )
    net = ActorCritic()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-5)
    weights.publish(r, args.namespace, 0, net.arrays())
    script = str(Path(__file__).resolve())
    actors = [
        subprocess.Popen([sys.executable, script, *sys.argv[1:], "--actor", str(k)], env=os.environ)
        for k in range(args.actors)
    ]
    waits, deliveries, steps, v, warm = [], [], 0, 0, 0.0
    try:
        while True:
            progress = min(1.0, steps / args.timesteps)
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (1.0 - progress)
            clip = 0.2 * (1.0 - progress)
            seen: list[Counter] = [Counter() for _ in range(args.epochs)]
            versions, rollouts = set(), set()
            asked = time.monotonic()
            for k in range(args.epochs * per_epoch):
                b = client.pop(RECIPE, timeout=120 if v else 900)  # the first: actors start
                if k == 0:
                    waits.append(time.monotonic() - asked)
                    sent = r.hvals(sent_key(args.namespace))
                    deliveries.append(time.time() - max(float(x) for x in sent))
                ro = b.meta["rollout"]
                seen[ro["epoch"]].update(b.ids.tolist())
                versions.update(np.unique(b["policy_version"]).tolist())
                rollouts.add(ro["no"])
                obs = torch.tensor(b["obs"])
                dist = net.dist(obs)
                logp = dist.log_prob(torch.tensor(b["action"]))
                ratio = torch.exp(logp - torch.tensor(b["log_prob"]))
                adv = torch.tensor(b["advantages"])
                pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv).mean()
                vf = nn.functional.mse_loss(net.value(obs), torch.tensor(b["returns"]))
                opt.zero_grad()
                (pg + 0.5 * vf).backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
            steps += rollout_steps
            if v == 0:  # from here on the actors run: the steady state the summary measures
                warm = time.monotonic()
            once = all(set(c.values()) == {1} and len(c) == rollout_steps for c in seen)
            v += 1
            done = [unpackb(x) for x in r.lrange(returns_key(args.namespace), -20, -1)]
            mean20 = float(np.mean([d[2] for d in done])) if done else 0.0
            line = {
                "update": v,
                "rollouts": sorted(rollouts),
                "versions": sorted(versions),
                "steps": len(seen[0]),
                "each_step_once_per_epoch": once,
                "wait_s": round(waits[-1], 4),
                "delivery_s": round(deliveries[-1], 4),
                "train_return": round(mean20, 1),
            }
            ev = None
            if mean20 >= 0.9 * args.target or (args.updates and v >= args.updates):
                ev = line["eval_return"] = evaluate(net, 20, seed=10_000)
            print(json.dumps(line), flush=True)
            if (args.updates and v >= args.updates) or (ev is not None and ev >= args.target):
                break  # the actors stop before version v exists: no rollout of it forms
            weights.publish(r, args.namespace, v, net.arrays())
            client.set_params(RECIPE, policy_version=v)
    finally:
        for a in actors:
            a.send_signal(signal.SIGTERM)
        for a in actors:
            a.wait(30)
    weights.publish(r, args.namespace, v, net.arrays())
    elapsed = time.monotonic() - warm
    steady = max(1, len(waits) - 1)  # the first update waited for the actors to start
    summary = {
        "done": v,
        "actors": args.actors,
        "env_steps": steps,
        "seconds": round(elapsed, 1),
        "env_steps_per_s": round((steps - rollout_steps) / elapsed, 1),
        "mean_wait_s": round(float(np.mean(waits[-steady:])), 4),
        "mean_delivery_s": round(float(np.mean(deliveries[-steady:])), 4),
        "eval_return": ev,
        "stats": client.stats(RECIPE)[RECIPE]["rollout"],
    }
    print(json.dumps(summary), flush=True)
    client.close()


if __name__ == "__main__":
    main()
