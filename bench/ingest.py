"""Ingest throughput and memory per step, end to end through a real Celery worker.

    .venv/bin/python bench/ingest.py [--vector-steps 1000000] [--image-steps 20000]

Starts a private redis-server and one ingest worker (prefork, concurrency 2), measures
committed steps/s from the first ``add_batch`` to the last confirmation, and Redis memory
per stored step. Each rate comes with the CPU seconds the producer (this process), the
worker and redis-server spent on it, which the machine's load skews less than wall time;
the worker's are split between its main process (it takes the messages from the broker
and sends Celery's events) and its pool (which commits). Baselines run in the same
process for ratios: the image bytes alone, pipelined ``SETRANGE``s of the same 512-step
batches into fresh 1 MB keys (redis-py's pipeline, and ``setrange_many``, which sends the
values without copying them), with no Claw around them; a hash-per-step store; and
batches inside their Celery messages.
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
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from claw_tasks.client import Ingestor
from claw_tasks.connection.resp import setrange_many
from claw_tasks.connection.server import RedisServer
from claw_tasks.store.keyscan import scan_keys
from tests.support.processes import Worker


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


class Cpu:
    """CPU seconds (user + system) of the producer, the worker's main process, its pool
    processes and redis-server between two samples."""

    def __init__(self, worker_pid: int, redis_pid: int) -> None:
        self.pids = {"producer": os.getpid(), "worker": worker_pid, "redis": redis_pid}

    @staticmethod
    def _seconds(procs: list[psutil.Process]) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def sample(self) -> dict[str, float]:
        out = {k: self._seconds([psutil.Process(pid)]) for k, pid in self.pids.items()}
        out["pool"] = self._seconds(psutil.Process(self.pids["worker"]).children(recursive=True))
        return out

    def since(self, before: dict[str, float]) -> str:
        d = {k: v - before[k] for k, v in self.sample().items()}
        worker = f"{d['worker'] + d['pool']:.2f} ({d['worker']:.2f} + {d['pool']:.2f})"
        return f"{d['producer']:.2f} / {worker} / {d['redis']:.2f}"


def families(r: redis.Redis, ns: str, n: int) -> str:
    """Bytes per step of a namespace by key family (``MEMORY USAGE ... SAMPLES 0`` of each
    key; ``m:id:0`` and ``m:id:1`` are one family, ``m:id``)."""
    per: dict[str, int] = {}
    for key in scan_keys(r, ns):
        head, _, tail = key.name.rpartition(":")
        family = head if tail.isdigit() else key.name
        per[family] = per.get(family, 0) + int(r.memory_usage(key.key, samples=0) or 0)
    top = sorted(per.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v / n:.2f}" for k, v in top if v / n >= 0.01)


def plain_setrange(r: redis.Redis, imgs: np.ndarray, batch: int, no_copy: bool) -> float:
    """Seconds to write ``imgs`` as Claw's image chunks lie (slots per ~1 MB key), in
    ``batch``-step pipelines of SETRANGE, nothing else."""
    rb = imgs[0].nbytes
    cs = (1024 * 1024 - 64) // rb
    raw = imgs.reshape(-1).data.cast("B")
    t0 = time.perf_counter()
    for b0 in range(0, len(imgs), batch):
        writes = []
        i = b0
        while i < min(len(imgs), b0 + batch):
            run = min(b0 + batch - i, cs - i % cs, len(imgs) - i)
            writes.append((f"plain:{i // cs}", (i % cs) * rb, raw[i * rb : (i + run) * rb]))
            i += run
        if no_copy:
            setrange_many(r, writes)
        else:
            with r.pipeline(transaction=False) as p:
                for key, off, v in writes:
                    p.setrange(key, off, v)
                p.execute()
    return time.perf_counter() - t0


def columns(n: int, obs: np.ndarray, ep_len: int = 1000, lap: int = 0) -> dict:
    rng = np.random.default_rng(0)
    return {
        "obs": obs,
        "action": rng.integers(0, 4, n),
        "reward": rng.standard_normal(n).astype(np.float32),
        "episode_id": np.repeat(
            np.char.add(f"{lap}-", np.arange(n // ep_len + 1).astype(str)), ep_len
        )[:n],
        "step_index": np.tile(np.arange(ep_len), n // ep_len + 1)[:n],
        "task_id": "bench",
    }


def run_claw(
    url: str,
    ns: str,
    cols: dict,
    flush_steps: int,
    claim_check_bytes: int = 128 * 1024,
    capacity: int | None = None,
) -> tuple[float, int]:
    ing = Ingestor(
        ns,
        url,
        flush_steps=flush_steps,
        flush_interval=None,
        capacity=capacity or len(cols["obs"]) + 10,
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
    ap.add_argument("--repeats", type=int, default=1, help="runs of the image part")
    ap.add_argument(
        "--parts", default="vector,image,inline,naive", help="comma-separated subset to run"
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    rows: list[tuple[str, str, str, str]] = []
    with RedisServer() as srv:
        r = srv.client()
        log = Path("/tmp/claw-bench-ingest-worker.log")
        worker = Worker(srv.url, "ingest", 2, log, {})
        assert srv.pid is not None
        cpu = Cpu(worker.proc.pid, srv.pid)
        n = args.vector_steps
        obs = np.random.default_rng(1).standard_normal((n, 8)).astype(np.float32)
        n_img = args.image_steps
        imgs = np.random.default_rng(2).integers(0, 256, (n_img, 84, 84, 3), dtype=np.uint8)
        try:
            if "vector" in parts:
                before, c0 = used(r), cpu.sample()
                dt, _ = run_claw(srv.url, "vec", columns(n, obs), args.flush_steps)
                gc.collect()
                per_vec = (used(r) - before) / n
                label = "vector float32[8] committed steps/s (Celery, end to end)"
                rows.append((label, f"{n / dt:,.0f}", cpu.since(c0), f"{n:,} steps"))
                label = "vector Redis bytes per stored step"
                rows.append((label, f"{per_vec:,.1f}", "", f"{n:,} steps"))
                by_family = families(r, "vec", n)
                r.flushdb()

            for rep in range(args.repeats if "image" in parts else 0):
                size = f"{n_img:,} steps, {args.image_flush_steps}-step batches"
                for no_copy, again in ((False, False), (True, False), (True, True)):
                    if again:  # the keys exist: their memory is reused
                        plain_setrange(r, imgs, args.image_flush_steps, no_copy)
                    c0 = cpu.sample()
                    dt = plain_setrange(r, imgs, args.image_flush_steps, no_copy)
                    r.flushdb()
                    label = (
                        "baseline: the image bytes alone, "
                        + ("setrange_many (no copy)" if no_copy else "redis-py pipeline")
                        + (", into existing keys" if again else "")
                        + ", steps/s"
                    )
                    rows.append((label, f"{n_img / dt:,.0f}", cpu.since(c0), size))
                before, c0 = used(r), cpu.sample()
                dt, _ = run_claw(srv.url, f"img{rep}", columns(n_img, imgs), args.image_flush_steps)
                per_img = (used(r) - before) / n_img
                label = "image uint8 84x84x3 committed steps/s"
                rows.append((label, f"{n_img / dt:,.0f}", cpu.since(c0), size))
                rows.append(
                    (
                        "image Redis bytes per stored step",
                        f"{per_img:,.0f} ({per_img / 21168:.3f} x 21,168)",
                        "",
                        f"{n_img:,} steps",
                    )
                )
                # A full ring, as a replay buffer runs: the same steps again into a
                # namespace that holds them (the first lap untimed), so every slot's older
                # step is evicted and the chunks' memory is reused, not newly faulted in.
                for lap in (0, 1):
                    c0 = cpu.sample()
                    dt, _ = run_claw(
                        srv.url,
                        f"ring{rep}",
                        columns(n_img, imgs, lap=lap),
                        args.image_flush_steps,
                        capacity=n_img,
                    )
                label = "image, into a full ring (chunks reused), committed steps/s"
                rows.append((label, f"{n_img / dt:,.0f}", cpu.since(c0), size))
                r.flushdb()

            if "inline" in parts:  # every batch inside its Celery message (no in-place writes)
                m = min(n, 200_000)
                c0 = cpu.sample()
                dt, _ = run_claw(srv.url, "vec256", columns(m, obs[:m]), 256, 1 << 40)
                label = "vector, 256-step batches inside Celery messages, steps/s"
                rows.append((label, f"{m / dt:,.0f}", cpu.since(c0), f"{m:,} steps"))
                m = min(n_img, 3000)
                c0 = cpu.sample()
                dt, _ = run_claw(srv.url, "img-inline", columns(m, imgs[:m]), 64, 1 << 40)
                label = "image, 64-step batches inside Celery messages, steps/s"
                rows.append((label, f"{m / dt:,.0f}", cpu.since(c0), f"{m:,} steps"))
                r.flushdb()

            if "naive" in parts and args.naive_steps > 0:
                m = args.naive_steps
                c0 = cpu.sample()
                rate, per = hash_per_step(r, obs[:m])
                label = "baseline: hash per step, steps/s (pipelined, no Celery)"
                rows.append((label, f"{rate:,.0f}", cpu.since(c0), f"{m:,} steps"))
                label = "baseline: hash per step, bytes per step"
                rows.append((label, f"{per:,}", "", f"{m:,} steps"))
        finally:
            worker.stop()
    py = platform.python_version()
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {py}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(
        "| figure | value | CPU s: producer / worker (main + pool) / redis | size |\n"
        "|---|---:|---:|---|"
    )
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if "vector" in parts:
        print(f"\nvector bytes per step by key family: {by_family}")


if __name__ == "__main__":
    main()
