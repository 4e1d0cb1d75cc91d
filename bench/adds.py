"""The producer's cost of a recorded step: SB3's ``ReplayBuffer.add`` against
``ClawReplayBuffer.add``, and ``Episode.add`` against ``StepColumns.append``.

    .venv/bin/python bench/adds.py [--steps 20000] [--rounds 2]

CartPole-shaped transitions (obs float32[4], one env, episodes of ~50 steps), the same
arrays for every writer. A private redis-server and one real Celery worker (ingest, 2
processes) commit what is sent; each Claw writer's steps are flushed and confirmed after
the timed loop (every step committed, checked). Per step: the CPU time of the producer's
thread inside its add calls (``time.thread_time``) and of the whole producer process over
the loop and the final flush (its sending threads included: encoding and publishing moved
off the producer's thread is still its process's CPU). Wall time is left out: the machine
is shared. Writers run in turn, ``--rounds`` times over. Runs on older code too (no
``StepColumns`` then): ``PYTHONPATH=<older tree> python bench/adds.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
from stable_baselines3.common.buffers import ReplayBuffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.settings import use_settings
from claw_tasks.store import Store
from tests.support.processes import Worker


def transitions(n: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((n + 1, 1, 4)).astype(np.float32)
    actions = rng.integers(0, 2, (n, 1))
    rewards = np.ones((n, 1), np.float32)
    dones = rng.random((n, 1)) < 0.02
    return obs, actions, rewards, dones


def timed(loop, finish=None) -> tuple[float, float]:
    """(thread CPU s inside ``loop``, process CPU s over ``loop`` and ``finish``)."""
    p0, t0 = time.process_time(), time.thread_time()
    loop()
    t1 = time.thread_time()
    if finish is not None:
        finish()
    return t1 - t0, time.process_time() - p0


def run_buffer(buf, data) -> None:
    obs, actions, rewards, dones = data
    info = [{"TimeLimit.truncated": False}]
    for i in range(len(actions)):
        buf.add(obs[i], obs[i + 1], actions[i], rewards[i], dones[i], info)


def write(ing: Ingestor, columns: bool, data: tuple[np.ndarray, ...]) -> None:
    """The transitions as episodes: through ``Episode.add`` or ``StepColumns.append``."""
    obs, actions, rewards, dones = data
    cols = ing.columns() if columns else None
    ids = iter(range(len(actions) + 1))
    episode, eid, t = None, f"e{next(ids)}", 0
    for i in range(len(actions)):
        end = bool(dones[i, 0])
        nxt = obs[i + 1, 0] if end else None
        if cols is not None:
            cols.append(
                eid, t, obs[i, 0], actions[i], float(rewards[i, 0]), terminated=end, next_obs=nxt
            )
        else:
            episode = episode or ing.episode(eid)
            episode.add(obs[i, 0], actions[i], float(rewards[i, 0]), terminated=end, next_obs=nxt)
        t += 1
        if end:
            episode, eid, t = None, f"e{next(ids)}", 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = args.steps
    data = transitions(n)
    env = gym.make("CartPole-v1")
    spaces = env.observation_space, env.action_space
    schema = Schema(fields={"obs": FieldSpec("<f4", (4,)), "action": FieldSpec("<i8", (1,))})
    rows: list[tuple[str, float, float, float]] = []
    with RedisServer() as server:
        url = server.url
        os.environ["CLAW_REDIS_URL"] = url
        use_settings()
        from orchestrator.adapters.sb3 import ClawReplayBuffer

        worker = Worker(url, "ingest", 2, Path("/tmp/claw-bench-adds.log"), {})
        try:
            for k in range(args.rounds):
                sb3 = ReplayBuffer(100_000, *spaces, device="cpu")
                rows.append(
                    ("SB3 `ReplayBuffer.add`", *timed(lambda b=sb3: run_buffer(b, data)), 0)
                )
                ns = f"adds-sb3-{k}"
                claw = ClawReplayBuffer(100_000, *spaces, device="cpu", namespace=ns)
                cpu = timed(lambda b=claw: run_buffer(b, data), claw.flush)
                claw.close()
                rows.append(("`ClawReplayBuffer.add` (no kwargs)", *cpu, Store(url, ns).count()))
                writers = [("`Episode.add`", False), ("`StepColumns.append`", True)]
                if not hasattr(Ingestor, "columns"):  # older code (run for comparison)
                    writers = writers[:1]
                for label, columns in writers:
                    ns = f"adds-{'cols' if columns else 'ep'}-{k}"
                    ing = Ingestor(ns, url, schema=schema, flush_steps=256, flush_interval=0.25)

                    def loop(ing: Ingestor = ing, columns: bool = columns) -> None:
                        write(ing, columns, data)

                    cpu = timed(loop, ing.close)
                    rows.append((label, *cpu, Store(url, ns).count()))
        finally:
            worker.stop()
    print(
        f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{n:,} steps per writer, load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| writer | producer thread µs/step | process µs/step | committed |")
    print("|---|---:|---:|---:|")
    for label, thread_s, proc_s, committed in rows:
        print(
            f"| {label} | {thread_s / n * 1e6:.1f} | {proc_s / n * 1e6:.1f} | {committed:,} |"
            if committed
            else f"| {label} | {thread_s / n * 1e6:.1f} | {proc_s / n * 1e6:.1f} | (in memory) |"
        )


if __name__ == "__main__":
    main()
