"""What ``timestamp`` as run tables (store format 3) costs where its runs are not long.

A private redis-server, one shard of 1,000,000 slots, vector steps (obs float32[8], int64
action). Printed: Redis CPU (``INFO cpu``) and wall time of 61 commits of 16,384 steps with
one time each (ingest) and with a time per row (a restore keeps each step's own), then of
3,000 one-step commits; reading the whole ``timestamp`` column (``meta_columns``) and 256
random slots (``read_meta``); ``used_memory``. Run it from two checkouts (PYTHONPATH) in
turn to compare layouts: the figures are docs/benchmarks.md's, "Bytes per step by key
family".
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store

CAP, N, BATCHES = 1_000_000, 16_384, 61


def steps(first_ep: int, n: int) -> StepBatch:
    """``n`` steps of 1,024-step episodes from ``first_ep`` on."""
    ep = first_ep + np.arange(n) // 1024
    return StepBatch(
        episode=StrColumn.of([str(e) for e in ep]),
        step_index=np.arange(n) % 1024,
        reward=np.ones(n, np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={"obs": np.zeros((n, 8), np.float32), "action": np.arange(n) % 4},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="", help="printed before each figure")
    ap.add_argument("--reads", type=int, default=10, help="repeats of each read")
    args = ap.parse_args()
    with RedisServer() as srv:
        r = srv.client()

        def cpu() -> float:
            info = r.info("cpu")
            return info["used_cpu_sys"] + info["used_cpu_user"]

        for mode in ("one time a commit", "a time per row"):
            r.flushdb()
            store = Store(srv.url, "ts")
            store.create(capacity=CAP, n_shards=1)
            batches = [steps(k * 16, N) for k in range(BATCHES)]
            c0, t0 = cpu(), time.perf_counter()
            for k, b in enumerate(batches):
                now = 1e9 + k if mode == "one time a commit" else 1e9 + k * N + np.arange(N)
                store.commit(b, now=now)
            wall, rc = time.perf_counter() - t0, cpu() - c0
            print(f"{args.label}{mode}: {BATCHES * N:,} steps {wall:.2f} s, redis cpu {rc:.2f} s")
            t0 = time.perf_counter()
            for _ in range(args.reads):
                store.meta_columns(0, ["timestamp"])
            ms = (time.perf_counter() - t0) / args.reads * 1000
            print(f"{args.label}{mode}: meta_columns timestamp {ms:.1f} ms")
            slots = np.random.default_rng(0).integers(0, CAP, 256)
            t0 = time.perf_counter()
            for _ in range(args.reads):
                store.read_meta(np.zeros(256, np.int64), slots, ["timestamp"])
            ms = (time.perf_counter() - t0) / args.reads * 1000
            print(f"{args.label}{mode}: read_meta 256 slots {ms:.2f} ms")
            mb = r.info("memory")["used_memory"] / 1e6
            print(f"{args.label}{mode}: used_memory {mb:.1f} MB")
        c0, t0 = cpu(), time.perf_counter()
        for k in range(3000):
            store.commit(steps(10_000 + k, 1))
        wall, rc = time.perf_counter() - t0, cpu() - c0
        print(f"{args.label}3,000 one-step commits: {wall:.2f} s, redis cpu {rc:.2f} s")


if __name__ == "__main__":
    main()
