"""What an exact namespace memory figure costs: ``MEMORY USAGE key SAMPLES 0`` against
Redis's default 5-entry sample, on a namespace of compressed frames.

    .venv/bin/python bench/stats_memory.py [--steps 1000000] [--shards 8] [--repeat 3]

Starts a private redis-server and fills a namespace through ``Store.commit`` (not timed):
``--steps`` steps of 84x84x3 noise frames with a small changing patch under ``delta:16``
(a ~21 kB key frame every 16 steps, deltas of tens of bytes: the spread of Atari frames)
and an int64 action. Then, ``--repeat`` times each, MEMORY USAGE of every key of the
namespace, default and exact: the bytes per step each reports, the round trip's wall time
and the server's time for it (INFO commandstats), against ``used_memory``. Last, the rest
of what ``claw stats`` reads (``Statistics.namespace``), for scale.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from claw_tasks.store.keyscan import scan_keys
from orchestrator.inspect.stats import Statistics

SHAPE = (84, 84, 3)
BATCH = 4096


def frames(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.repeat(rng.integers(0, 256, SHAPE, np.uint8)[None], n, 0)
    for i in range(n):
        k = 1 + i % 9
        y, x = (7 * i) % 70, (3 * i) % 60
        out[i, y : y + k, x : x + 2 * k] = rng.integers(0, 256, (k, 2 * k, 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with RedisServer() as server:
        r = redis_client(server.url)
        store = Store(r, "bench")
        obs = FieldSpec("|u1", SHAPE, "delta:16")
        schema = Schema(fields={"obs": obs, "action": FieldSpec("<i8", ())})
        store.create(capacity=2 * args.steps, n_shards=args.shards, schema=schema)
        base = frames(BATCH, 0)
        t = time.time()
        for e in range(-(-args.steps // BATCH)):
            store.commit(
                StepBatch(
                    episode=StrColumn.constant(f"e{e}", BATCH),
                    step_index=np.arange(BATCH),
                    reward=np.zeros(BATCH, np.float32),
                    terminated=np.arange(BATCH) == BATCH - 1,
                    truncated=np.zeros(BATCH, bool),
                    fields={"obs": np.roll(base, e, axis=1), "action": np.zeros(BATCH, np.int64)},
                )
            )
        steps = store.info()["steps"]
        keys = [k.key for k in scan_keys(r, "bench")]
        print(f"{steps:,} steps, {len(keys):,} keys, filled in {time.time() - t:.0f} s")
        print(f"used_memory {r.info('memory')['used_memory']:,} B; load {os.getloadavg()[0]:.1f}")
        for label, samples in (("default", None), ("SAMPLES 0", 0)):
            for _ in range(args.repeat):
                r.config_resetstat()
                t = time.perf_counter()
                with r.pipeline(transaction=False) as pipe:
                    for k in keys:
                        pipe.memory_usage(k, samples=samples)
                    total = sum(int(u or 0) for u in pipe.execute())
                wall = time.perf_counter() - t
                stat = r.info("commandstats")["cmdstat_memory|usage"]
                server, per_key = stat["usec"] / 1e3, stat["usec_per_call"]
                print(
                    f"{label:>9}: {total:,} B = {total / steps:,.1f} B/step; wall "
                    f"{wall * 1e3:.0f} ms, server {server:.1f} ms ({per_key:.0f} us a key)"
                )
        t = time.perf_counter()
        Statistics(store.r).namespace(store.namespace, 0)
        ms = (time.perf_counter() - t) * 1e3
        print(f"Statistics.namespace (the rest of claw stats): {ms:.0f} ms")


if __name__ == "__main__":
    main()
