"""Ingest throughput and memory per step, end to end through a real Celery worker.

    .venv/bin/python bench/ingest.py [--vector-steps 1000000] [--image-steps 20000]

Starts a private redis-server and one ingest worker (prefork, concurrency 2), measures
committed steps/s from the first ``add_batch`` to the last confirmation, and Redis memory
per stored step. Baselines run in the same process for ratios: a hash-per-step store and a
plain Celery task per 256-step chunk (steps as msgpack maps in the message body).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from tests.support.processes import Worker


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def columns(n: int, obs: np.ndarray, ep_len: int = 1000) -> dict:
    rng = np.random.default_rng(0)
    return {
        "obs": obs,
        "action": rng.integers(0, 4, n),
        "reward": rng.standard_normal(n).astype(np.float32),
        "episode_id": np.repeat(np.arange(n // ep_len + 1).astype(str), ep_len)[:n],
        "step_index": np.tile(np.arange(ep_len), n // ep_len + 1)[:n],
        "task_id": "bench",
    }


def run_claw(
    url: str, ns: str, cols: dict, flush_steps: int, claim_check_bytes: int = 128 * 1024
) -> tuple[float, int]:
    ing = Ingestor(
        ns,
        url,
        flush_steps=flush_steps,
        flush_interval=None,
        capacity=len(cols["obs"]) + 10,
        claim_check_bytes=claim_check_bytes,
    )
    t0 = time.perf_counter()
    ing.add_batch(cols)
    res = ing.close(timeout=600)
    dt = time.perf_counter() - t0
    assert res.committed == len(cols["obs"]), res
    return dt, res.committed


def hash_per_step(r: redis.Redis, obs: np.ndarray) -> tuple[float, int]:
    """The naive design: one hash per step with obs/next_obs bytes and metadata fields."""
    n = len(obs)
    t0 = time.perf_counter()
    before = used(r)
    with r.pipeline(transaction=False) as p:
        for i in range(n):
            p.hset(
                f"naive:step:{i:08d}",
                mapping={
                    "obs": obs[i].tobytes(),
                    "next_obs": obs[min(i + 1, n - 1)].tobytes(),
                    "action": 1,
                    "reward": 0.5,
                    "episode_id": f"ep-{i // 1000}",
                    "step_index": i % 1000,
                    "task_id": "bench",
                    "agent_id": "a0",
                    "timestamp": time.time(),
                    "priority": 1.0,
                    "terminated": 0,
                },
            )
            if i % 1000 == 999:
                p.execute()
        p.execute()
    dt = time.perf_counter() - t0
    per = (used(r) - before) / n
    r.flushdb()
    return n / dt, int(per)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vector-steps", type=int, default=1_000_000)
    ap.add_argument("--image-steps", type=int, default=20_000)
    ap.add_argument("--naive-steps", type=int, default=50_000)
    ap.add_argument("--flush-steps", type=int, default=16384)
    ap.add_argument("--image-flush-steps", type=int, default=512)
    args = ap.parse_args()
    rows = []
    with RedisServer() as srv:
        r = srv.client()
        log = Path("/tmp/claw-bench-ingest-worker.log")
        worker = Worker(srv.url, "ingest", 2, log, {})
        try:
            n = args.vector_steps
            obs = np.random.default_rng(1).standard_normal((n, 8)).astype(np.float32)
            before = used(r)
            dt, _ = run_claw(srv.url, "vec", columns(n, obs), args.flush_steps)
            gc.collect()
            per_vec = (used(r) - before) / n
            rows.append(
                (
                    "vector float32[8] committed steps/s (Celery, end to end)",
                    f"{n / dt:,.0f}",
                    f"{n:,} steps",
                )
            )
            rows.append(("vector Redis bytes per stored step", f"{per_vec:,.1f}", f"{n:,} steps"))

            n_img = args.image_steps
            imgs = np.random.default_rng(2).integers(0, 256, (n_img, 84, 84, 3), dtype=np.uint8)
            before = used(r)
            dt, _ = run_claw(srv.url, "img", columns(n_img, imgs), args.image_flush_steps)
            per_img = (used(r) - before) / n_img
            rows.append(
                ("image uint8 84x84x3 committed steps/s", f"{n_img / dt:,.0f}", f"{n_img:,} steps")
            )
            rows.append(
                (
                    "image Redis bytes per stored step",
                    f"{per_img:,.0f} ({per_img / 21168:.3f} x 21,168)",
                    f"{n_img:,} steps",
                )
            )
            r.flushdb()

            # The same path with every batch inside its Celery message (no in-place writes).
            m = min(n, 200_000)
            dt, _ = run_claw(srv.url, "vec256", columns(m, obs[:m]), 256, 1 << 40)
            label = "vector, 256-step batches inside Celery messages, steps/s"
            rows.append((label, f"{m / dt:,.0f}", f"{m:,} steps"))
            m = min(n_img, 3000)
            dt, _ = run_claw(srv.url, "img-inline", columns(m, imgs[:m]), 64, 1 << 40)
            label = "image, 64-step batches inside Celery messages, steps/s"
            rows.append((label, f"{m / dt:,.0f}", f"{m:,} steps"))
            r.flushdb()

            rate, per = hash_per_step(r, obs[: args.naive_steps])
            rows.append(
                (
                    "baseline: hash per step, steps/s (pipelined, no Celery)",
                    f"{rate:,.0f}",
                    f"{args.naive_steps:,} steps",
                )
            )
            rows.append(
                (
                    "baseline: hash per step, bytes per step",
                    f"{per:,}",
                    f"{args.naive_steps:,} steps",
                )
            )
        finally:
            worker.stop()
    py = platform.python_version()
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {py}\n")
    print("| figure | value | size |\n|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
