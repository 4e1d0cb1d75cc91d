"""RLlib DQN on CartPole-v1 with RLlib's own buffer vs ClawEpisodeReplayBuffer, one run.

    .venv/bin/python bench/rllib_dqn.py [--steps 20000] [--variants rllib,claw]
        [--rounds 1] [--prioritized]

RLlib 2.60's new API stack, seed 0, CPU, one torch thread, one local EnvRunner and a
local Learner (no remote actors: Ray is started with one CPU only for the algorithm's
bookkeeping). The same config for both (below: ``CONFIG``): lr 1e-3, batch 64, n_step 3,
gamma 0.99, target update every 500 steps, learning starts at 1,000 steps, epsilon
1.0 -> 0.02 over the first 10,000 steps, 16-step rollout fragments with 4 updates after
each (one update per 4 env steps), net [64]. ``--prioritized`` uses the prioritized
buffers (alpha 0.6, beta 0.4) on both sides. Starts a private redis-server and one real
Celery worker (ingest + prefetch, 2 processes); never the shared Redis. Reports, per
run: the mean return of the last 20 training episodes at the end and the best over the
run, wall time (and its ratio to RLlib's buffer in the same round), the trainer process's
CPU seconds, the time inside the buffer's ``add``/``sample``, and the Celery worker's
and Redis's CPU seconds. Prints markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray
import redis
import torch
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.utils.replay_buffers.episode_replay_buffer import (
    EpisodeReplayBuffer,
)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)

from bench.cpu import group_cpu, redis_cpu
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import get_settings, use_settings
from orchestrator.adapters.rllib import (
    ClawEpisodeReplayBuffer,
    ClawPrioritizedEpisodeReplayBuffer,
)
from tests.support.processes import Worker


class Timed:
    """Adds up the time spent in ``add`` and ``sample`` (a mixin over either buffer)."""

    add_s = sample_s = 0.0
    samples = 0

    def add(self, *a, **kw):
        t = time.perf_counter()
        out = super().add(*a, **kw)
        self.add_s += time.perf_counter() - t
        return out

    def sample(self, *a, **kw):
        t = time.perf_counter()
        out = super().sample(*a, **kw)
        self.sample_s += time.perf_counter() - t
        self.samples += 1
        return out


class TimedEpisodeReplayBuffer(Timed, EpisodeReplayBuffer):
    pass


class TimedPrioritizedEpisodeReplayBuffer(Timed, PrioritizedEpisodeReplayBuffer):
    pass


class TimedClawEpisodeReplayBuffer(Timed, ClawEpisodeReplayBuffer):
    pass


class TimedClawPrioritizedEpisodeReplayBuffer(Timed, ClawPrioritizedEpisodeReplayBuffer):
    pass


def config(buffer: dict, steps: int) -> DQNConfig:
    """The one config both variants run (the buffer's type and kwargs aside). The type is
    a dotted string: RLlib's Algorithm tests ``"EpisodeReplayBuffer" in type``."""
    return (
        DQNConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0, rollout_fragment_length=16, num_envs_per_env_runner=1)
        .learners(num_learners=0)
        .training(
            lr=1e-3,
            gamma=0.99,
            train_batch_size_per_learner=64,
            n_step=3,
            target_network_update_freq=500,
            num_steps_sampled_before_learning_starts=1000,
            training_intensity=16,  # 64-row batches over 16-step fragments: 4 updates each
            epsilon=[(0, 1.0), (10_000, 0.02)],
            double_q=True,
            dueling=True,
            replay_buffer_config={"capacity": 50_000, **buffer},
        )
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64], head_fcnet_hiddens=[64]))
        .reporting(min_sample_timesteps_per_iteration=1000, metrics_num_episodes_for_smoothing=20)
        .debugging(seed=0)
    )


def run(buffer: dict, steps: int) -> dict:
    """Train to ``steps`` env steps; the returns, times and the buffer."""
    algo = config(buffer, steps).build_algo()
    best, last, t0, c0 = float("-inf"), float("nan"), time.perf_counter(), time.process_time()
    done = 0
    while done < steps:
        res = algo.train()
        done = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
        last = float(res["env_runners"].get("episode_return_mean", float("nan")))
        best = max(best, last) if last == last else best
        print(f"  {done} steps: return {last:.1f}", flush=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rb = algo.local_replay_buffer
    out = {"last": last, "best": best, "wall": wall, "cpu": cpu, "rb": rb}
    if isinstance(rb, ClawEpisodeReplayBuffer):
        rb.close()
    algo.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--variants", default="rllib,claw")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prioritized", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = a.prioritized
    kinds = {
        "rllib": {"type": f"__main__.Timed{'Prioritized' if p else ''}EpisodeReplayBuffer"},
        "claw": {
            "type": f"__main__.TimedClaw{'Prioritized' if p else ''}EpisodeReplayBuffer",
            "timeout": 120,
        },
    }
    if p:
        for kw in kinds.values():
            kw.update(alpha=0.6, beta=0.4)
    rows = []
    with RedisServer() as server:
        url = server.url
        os.environ.update(CLAW_REDIS_URL=url, CLAW_BROKER_URL=url)
        use_settings()  # read again: imports above cached the default (shared) Redis URL
        assert get_settings().redis_url == url
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        worker = Worker(url, "ingest,prefetch", 2, Path("/tmp/claw-bench-rllib-worker.log"), {})
        try:
            r = redis.Redis.from_url(url)
            for k in range(a.rounds):
                for name in a.variants.split(","):
                    kw = dict(kinds[name])
                    if name == "claw":
                        kw["namespace"] = f"bench-rllib-dqn-{k}"
                    load = os.getloadavg()[0]
                    print(f"round {k} {name} (load {load:.1f})", flush=True)
                    w0, r0 = group_cpu(worker.proc.pid), redis_cpu(r)
                    got = run(kw, a.steps)
                    w1, r1 = group_cpu(worker.proc.pid), redis_cpu(r)
                    rows.append((k, name, load, got, w1 - w0, r1 - r0))
        finally:
            worker.stop()
            ray.shutdown()
    kind = "prioritized" if p else "uniform"
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, load average at the end "
        f"{os.getloadavg()[0]:.1f}; torch threads 1; {a.steps} env steps, seed 0, {kind}\n"
    )
    print(
        "| round | buffer | load | return (last 20 eps) | best | wall s | / RLlib's "
        "| trainer CPU s | in add() s | in sample() s | sample() calls | worker CPU s "
        "| Redis CPU s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, name, load, got, w, rc in rows:
        base = [x[3]["wall"] for x in rows if x[0] == k and x[1] == "rllib"]
        ratio = f"{got['wall'] / base[0]:.2f}x" if base else "-"
        rb = got["rb"]
        print(
            f"| {k} | {name} | {load:.1f} | {got['last']:.1f} | {got['best']:.1f} "
            f"| {got['wall']:.1f} | {ratio} | {got['cpu']:.1f} | {rb.add_s:.2f} "
            f"| {rb.sample_s:.2f} | {rb.samples} | {w:.1f} | {rc:.1f} |"
        )


if __name__ == "__main__":
    main()
