"""What lineage costs per batch: the trainer's encoding, Redis memory per entry, and the
time of the two queries over a full log.

    .venv/bin/python bench/lineage.py [--entries 100000] [--batch 256] [--steps 1000000]

Starts a private redis-server and appends ``--entries`` entries (as ``BatchClient`` does:
``XADD MAXLEN ~`` queued on a pipeline) of ``--batch`` ids drawn uniformly from
``--steps`` ids, a new policy every 100 batches. Prints the encoding time per batch (in
the trainer), the stream's ``MEMORY USAGE`` per entry, and the time of "which data trained
policy v" and "which policies trained on step s" over the whole log.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.delivery.lineage import LineageLog, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1_000_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, args.steps + 1, args.batch) for _ in range(1000)]
    t = time.perf_counter()
    for k, ids in enumerate(batches):
        record("r", 1, k // 100, ids)
    per_batch = (time.perf_counter() - t) / len(batches)
    with RedisServer() as server:
        r = redis_client(server.url)
        store = Store(r, "bench")
        log = LineageLog(store, maxlen=args.entries)
        t = time.time()
        for at in range(0, args.entries, 1000):
            with r.pipeline(transaction=False) as pipe:
                for k in range(at, min(at + 1000, args.entries)):
                    log.queue(pipe, record("r", 1, k // 100, batches[k % len(batches)]))
                pipe.execute()
        filled = time.time() - t
        used = int(r.memory_usage(log.key, samples=0) or 0)
        n = log.length()
        t = time.perf_counter()
        found = log.trained(n // 200)
        q_policy = time.perf_counter() - t
        t = time.perf_counter()
        log.policies(batches[0][:1])
        q_step = time.perf_counter() - t
    print(
        f"{n:,} entries of {args.batch} ids from {args.steps:,} steps "
        f"(appended in {filled:.0f} s); load {os.getloadavg()[0]:.1f}"
    )
    print(f"trainer: {per_batch * 1e6:.0f} µs to encode a batch's entry")
    print(
        f"Redis: {used / n:,.0f} B per entry ({used / n / args.batch:.2f} B per row), "
        f"{used / 2**20:,.1f} MiB in all"
    )
    print(f"which data trained policy v ({len(found)} batches): {q_policy:.2f} s")
    print(f"which policies trained on step s: {q_step:.2f} s")


if __name__ == "__main__":
    main()
