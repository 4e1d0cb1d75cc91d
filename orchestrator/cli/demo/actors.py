"""A demo actor process: epsilon-greedy copies of the learner's policy play CartPole-v1
and record every step through ``RecordSteps``, tagged with the policy version.

Run by ``claw demo`` (one process each, ``python -m orchestrator.cli.demo.actors``). Before
each episode the actor loads the newest published weights (:mod:`.weights`). Epsilon
anneals with the learner's progress, from 1 to the actor's own floor (Ape-X gives every
actor a different one). Each finished episode is reported on the namespace's episode list
as msgpack ``[actor, policy_version, length, return, unix time]``; SIGTERM stops the actor
after the current step, and it exits once the store confirmed what it sent.
"""

from __future__ import annotations

import argparse
import signal
import time
from types import FrameType

import gymnasium as gym
import numpy as np
import torch

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.connection.client import redis_client
from claw_tasks.format.arrays import packb
from claw_tasks.store import owned_key
from orchestrator.cli.demo import dqn, weights

TASK_ID = "cartpole"


def episodes_key(namespace: str) -> str:
    return owned_key(namespace, "demo:episodes")


def epsilon(version: int, anneal_versions: int, floor: float) -> float:
    return max(floor, 1.0 - version / max(1, anneal_versions))


class _Stop:
    requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def run(
    redis_url: str,
    broker_url: str,
    namespace: str,
    actor: int,
    *,
    seed: int,
    anneal_versions: int,
    floor: float,
    max_rate: float,
) -> None:
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    torch.set_num_threads(1)
    r = redis_client(redis_url)
    ingestor = Ingestor(
        namespace, redis_url, broker_url=broker_url, flush_steps=128, flush_interval=0.25
    )
    env = RecordSteps(gym.make("CartPole-v1"), ingestor, task_id=TASK_ID, agent_id=f"actor-{actor}")
    net = dqn.mlp(4, 2)
    expected = dqn.layout(net)
    rng = np.random.default_rng(seed)
    version, episode = 0, 0
    print(f"actor {actor} ready", flush=True)
    started, steps = time.monotonic(), 0
    while not stop.requested:
        if (weights.latest_version(r, namespace) or 0) != version:
            got = weights.fetch(r, namespace, expected)
            if got is not None:
                version, arrays = got
                dqn.load_arrays(net, arrays)
        env.policy_version = version
        obs, _ = env.reset(seed=seed * 100_000 + episode)
        eps = epsilon(version, anneal_versions, floor)
        length, ret = 0, 0.0
        while not stop.requested:
            a = int(rng.integers(2)) if rng.random() < eps else dqn.greedy(net, obs)
            obs, reward, terminated, truncated, _ = env.step(a)
            length, ret, steps = length + 1, ret + float(reward), steps + 1
            if max_rate > 0:  # leave the CPU to the learner and the workers
                ahead = steps / max_rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
            if terminated or truncated:
                r.rpush(episodes_key(namespace), packb([actor, version, length, ret, time.time()]))
                break
        episode += 1
    ingestor.close(timeout=60)
    r.close()
    print(f"actor {actor} stopped after {steps} steps", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--broker-url", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--actor", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--anneal-versions", type=int, default=40)
    p.add_argument("--floor", type=float, default=0.05)
    p.add_argument("--max-rate", type=float, default=0.0, help="steps/s; 0: unlimited")
    a = p.parse_args()
    run(
        a.redis_url,
        a.broker_url,
        a.namespace,
        a.actor,
        seed=a.seed,
        anneal_versions=a.anneal_versions,
        floor=a.floor,
        max_rate=a.max_rate,
    )


if __name__ == "__main__":
    main()
