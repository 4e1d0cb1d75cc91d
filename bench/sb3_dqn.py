"""SB3 DQN on CartPole with SB3's own buffer vs ClawReplayBuffer, and read-ahead pop latency.

    .venv/bin/python bench/sb3_dqn.py [--steps 50000] [--pops 2000] [--rounds 1]
        [--variants sb3,defaults,gs128]

rl-zoo hyperparameters (lr 2.3e-3, batch 64, buffer 100k, learning_starts 1000, train_freq
256, gradient_steps 128, target_update_interval 10, net [256, 256]), seed 0, CPU, one torch
thread. Starts a private redis-server and one real Celery worker (ingest + prefetch, 2
processes). Reports, in one run: wall time of each, the trainer's time inside
``sample()``, the worker's and Redis's CPU seconds during the Claw run, and the p50/p99 of a
read-ahead ``pop`` of 256 x float32[8] when a batch is ready. Prints markdown. Variants:
``sb3`` (SB3's ``ReplayBuffer``), ``defaults`` (``ClawReplayBuffer`` with no kwargs but a
namespace, as a new user writes it), ``gs128`` (hand-tuned: ``gradient_steps=128``), each
Claw one also with ``-thread`` (``defaults-thread``: the read-ahead in a thread, not a
child process); they
run in the order given, ``--rounds`` times over (interleaved A/B under a changing load),
and the table has one row per run with the load average at its start.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import redis
import torch
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.logger import Logger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import children_cpu, group_cpu, redis_cpu, thread_cpu
from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.settings import get_settings, use_settings
from orchestrator.adapters.sb3 import ClawReplayBuffer
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.readahead import ReadAhead
from tests.support.processes import Worker

ZOO = dict(
    learning_rate=2.3e-3,
    batch_size=64,
    buffer_size=100_000,
    learning_starts=1000,
    gamma=0.99,
    target_update_interval=10,
    train_freq=256,
    gradient_steps=128,
    exploration_fraction=0.16,
    exploration_final_eps=0.04,
    policy_kwargs={"net_arch": [256, 256]},
)


class Timed:
    """Adds up the time spent in ``sample`` (a mixin over either buffer)."""

    sample_s = 0.0
    samples = 0

    def sample(self, *a, **kw):
        t = time.perf_counter()
        out = super().sample(*a, **kw)
        self.sample_s += time.perf_counter() - t
        self.samples += 1
        return out


class TimedSB3(Timed, ReplayBuffer):
    pass


class TimedClaw(Timed, ClawReplayBuffer):
    pass


def run(cls: type, steps: int, kwargs: dict) -> tuple[float, ReplayBuffer, dict[str, float]]:
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        seed=0,
        device="cpu",
        replay_buffer_class=cls,
        replay_buffer_kwargs=kwargs,
        **ZOO,
    )
    model.set_logger(Logger(None, []))  # SB3's default makes a SB3-<time> folder in /tmp
    before = thread_cpu()
    t = time.perf_counter()
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - t
    after = thread_cpu()  # before the buffer closes: its threads are still alive
    threads = {k: v - before.get(k, 0.0) for k, v in after.items()}
    threads["read-ahead process"] = children_cpu("orchestrator.delivery.readahead_child")
    return wall, model.replay_buffer, threads


def pop_latency(url: str, pops: int) -> tuple[float, float]:
    ns = "bench-readahead"
    rng = np.random.default_rng(0)
    n = 20_000
    ing = Ingestor(ns, url, flush_interval=None, flush_steps=4096, capacity=n + 1)
    ing.add_batch(
        {
            "obs": rng.normal(size=(n, 8)).astype(np.float32),
            "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32),
            "episode_id": (np.arange(n) // 500).astype(str),
            "step_index": np.arange(n) % 500,
            "terminated": np.arange(n) % 500 == 499,
        }
    )
    ing.close()
    client = BatchClient(ns, url)
    client.register(
        {
            "name": "v",
            "batch_size": 256,
            "fields": ["obs", "reward"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 64},
        }
    )
    ra = ReadAhead(client, "v", count=32)
    times = []
    for _ in range(pops):
        while len(ra) == 0:  # time the pop, not the production
            time.sleep(0.001)
        t = time.perf_counter()
        ra.pop()
        times.append(time.perf_counter() - t)
    ra.close()
    client.close()
    q = statistics.quantiles(times, n=100)
    return q[49] * 1e3, q[98] * 1e3


VARIANTS = {
    "sb3": (TimedSB3, {}),
    "defaults": (TimedClaw, {}),
    "gs128": (TimedClaw, {"gradient_steps": 128}),
}
THREAD = "-thread"
"""A variant's suffix: its read-ahead in a thread of the trainer (``CLAW_READAHEAD_PROCESS=0``),
as before the read-ahead process."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--pops", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default="sb3,defaults,gs128")
    a = ap.parse_args()
    torch.set_num_threads(1)
    names = a.variants.split(",")
    rows = []
    with RedisServer() as server:
        url = server.url
        os.environ.update(CLAW_REDIS_URL=url, CLAW_BROKER_URL=url)
        use_settings()  # read again: imports above cached the default (shared) Redis URL
        assert get_settings().redis_url == url
        worker = Worker(url, "ingest,prefetch", 2, Path("/tmp/claw-bench-sb3-worker.log"), {})
        try:
            r = redis.Redis.from_url(url)
            for k in range(a.rounds):
                for name in names:
                    cls, kw = VARIANTS[name.removesuffix(THREAD)]
                    if cls is TimedClaw:
                        kw = {"namespace": f"bench-dqn-{name}-{k}", **kw}
                    os.environ["CLAW_READAHEAD_PROCESS"] = "0" if name.endswith(THREAD) else "1"
                    use_settings()
                    load = os.getloadavg()[0]
                    w0, r0 = group_cpu(worker.proc.pid), redis_cpu(r)
                    c0 = time.process_time()
                    wall, rb, threads = run(cls, a.steps, kw)
                    cpu = time.process_time() - c0
                    w1, r1 = group_cpu(worker.proc.pid), redis_cpu(r)
                    if cls is TimedClaw:
                        rb.close()
                    rows.append((k, name, load, wall, cpu, rb, w1 - w0, r1 - r0, threads))
            p50, p99 = pop_latency(url, a.pops)
        finally:
            worker.stop()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average at the end "
        f"{os.getloadavg()[0]:.1f}; torch threads 1; {a.steps} steps, seed 0\n"
    )
    print(
        "| round | buffer | load | wall s | / sb3 | trainer CPU s | sample() calls "
        "| in sample() s | per call ms | worker CPU s | Redis CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, name, load, wall, cpu, rb, w, rc, _ in rows:
        base = [x[3] for x in rows if x[0] == k and x[1] == "sb3"]
        ratio = f"{wall / base[0]:.2f}x" if base else "-"
        per = rb.sample_s / max(rb.samples, 1) * 1e3
        print(
            f"| {k} | {name} | {load:.1f} | {wall:.1f} | {ratio} | {cpu:.1f} | {rb.samples} "
            f"| {rb.sample_s:.2f} | {per:.3f} | {w:.1f} | {rc:.1f} |"
        )
    print(
        "\ntrainer CPU s by thread (threads of one name summed; >= 0.05 s), and its "
        "read-ahead child process's:\n"
    )
    for k, name, *_, threads in rows:
        busy = sorted(((v, t) for t, v in threads.items() if v >= 0.05), reverse=True)
        print(f"- {k} {name}: " + ", ".join(f"{t} {v:.2f}" for v, t in busy))
    print(
        f"\nread-ahead pop of 256 x float32[8] (a batch ready): p50 {p50:.4f} ms, "
        f"p99 {p99:.4f} ms over {a.pops} pops"
    )


if __name__ == "__main__":
    main()
