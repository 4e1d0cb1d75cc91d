"""RLlib's MultiAgentEpisodeReplayBuffer vs ClawMultiAgentEpisodeReplayBuffer (with and without
lineage), the calls multi-agent DQN makes, one run.

    .venv/bin/python bench/rllib_multi_agent.py [--steps 6000] [--burst 16] [--rounds 2]

Two-agent CartPole (random actions, two modules), the episodes a one-env
``MultiAgentEnvRunner`` returns every 16 env steps. The first half of the steps fill each
buffer; then, per fragment of the second half, one ``add`` and a burst of ``--burst``
``sample(32, n_step=3, gamma=0.99)`` calls (32 rows per module, DQN's training intensity
over 16 env steps), as multi-agent DQN alternates them. Variants: ``rllib`` (RLlib's
buffer), ``claw`` (prefetched, read ahead, lineage recorded: ``policy_version="updates"``)
and ``claw-nolineage`` (``policy_version=None``), the two Claw variants in turn first and
second (round by round: the first Claw run of a process pays warm-ups). Reports the mean
time of an ``add`` and of a ``sample()`` in the trainer, the ratio to RLlib's in the same
round, and the Celery worker's CPU seconds. Starts a private redis-server and one Celery
worker (ingest + prefetch, 2 processes); never the shared Redis. No Ray start. Prints
markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import (
    MultiAgentEpisodeReplayBuffer,
)

from bench.cpu import group_cpu
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import get_settings, use_settings
from orchestrator.adapters.rllib import ClawMultiAgentEpisodeReplayBuffer
from tests.support.processes import Worker


def fragments(steps: int, every: int, seed: int = 0) -> list[list[MultiAgentEpisode]]:
    """What ``MultiAgentEnvRunner.sample()`` returns every ``every`` env steps."""
    env = MultiAgentCartPole({"num_agents": 2})
    rng = np.random.default_rng(seed)
    out, calls = [], []

    def reset() -> MultiAgentEpisode:
        eps = MultiAgentEpisode(agent_to_module_mapping_fn=lambda a, e: f"p{a}")
        obs, infos = env.reset(seed=int(rng.integers(1 << 30)))
        eps.add_env_reset(observations=obs, infos=infos)
        return eps

    eps = reset()
    for t in range(1, steps + 1):
        actions = {a: int(rng.integers(2)) for a in eps.get_agents_to_act()}
        obs, rew, terms, truncs, infos = env.step(actions)
        eps.add_env_step(obs, actions, rew, infos, terminateds=terms, truncateds=truncs)
        if eps.is_done:
            out.append(eps.to_numpy())
            eps = reset()
        if t % every == 0:
            if eps.env_steps():
                running, eps = eps, eps.cut(len_lookback_buffer=1)
                out.append(running.to_numpy())
            calls.append(out)
            out = []
    return calls


def run(variant: str, calls: list[list], burst: int, worker: Worker) -> dict[str, float]:
    if variant == "rllib":
        buf = MultiAgentEpisodeReplayBuffer(capacity=100_000)
    else:
        buf = ClawMultiAgentEpisodeReplayBuffer(
            100_000,
            namespace=f"bench-rllib-ma-{uuid.uuid4().hex[:8]}",
            timeout=120,
            policy_version="updates" if variant == "claw" else None,
        )
    half = len(calls) // 2
    for call in calls[:half]:
        buf.add(call)
    if variant != "rllib":
        buf.flush()
    cpu0 = group_cpu(worker.proc.pid)
    add_s = sample_s = 0.0
    samples = 0
    for call in calls[half:]:
        t0 = time.perf_counter()
        buf.add(call)
        add_s += time.perf_counter() - t0
        for _ in range(burst):
            t0 = time.perf_counter()
            got = buf.sample(32, n_step=3, gamma=0.99)
            sample_s += time.perf_counter() - t0
            samples += 1
            assert len(got) == 64
    worker_cpu = group_cpu(worker.proc.pid) - cpu0
    if variant != "rllib":
        buf.close()
    adds = len(calls) - half
    return {"add_ms": 1e3 * add_s / adds, "sample_ms": 1e3 * sample_s / samples, "cpu": worker_cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    calls = fragments(a.steps, 16)
    agent_steps = sum(len(sa) for c in calls for e in c for sa in e.agent_episodes.values())
    with RedisServer() as server:
        url = server.url
        os.environ.update(CLAW_REDIS_URL=url, CLAW_BROKER_URL=url)
        use_settings()  # read again: imports above cached the default (shared) Redis URL
        assert get_settings().redis_url == url
        worker = Worker(url, "ingest,prefetch", 2, Path("/tmp/claw-bench-rllib-ma.log"), {})
        try:
            print(f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, {platform.node()}")
            print(f"{a.steps} env steps ({agent_steps} agent steps), {len(calls)} fragments\n")
            print(
                "| round | buffer | add (ms) | sample() 2 x 32 rows (ms) | vs RLlib "
                "| worker CPU (s) |"
            )
            print("|---|---|---|---|---|---|")
            for k in range(a.rounds):
                base = None
                claws = ["claw", "claw-nolineage"][:: 1 if k % 2 == 0 else -1]  # both orders
                for variant in ["rllib", *claws]:
                    got = run(variant, calls, a.burst, worker)
                    base = base or got["sample_ms"]
                    print(
                        f"| {k + 1} | {variant} | {got['add_ms']:.2f} | {got['sample_ms']:.2f} "
                        f"| {got['sample_ms'] / base:.2f} | {got['cpu']:.1f} |",
                        flush=True,
                    )
            print(f"\nload after: {os.getloadavg()[0]:.1f}")
        finally:
            worker.stop()


if __name__ == "__main__":
    main()
