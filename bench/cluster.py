"""The data store on a local Redis Cluster of 1, 2 and 3 masters, against one plain Redis.

    .venv/bin/python bench/cluster.py [--steps 400000] [--images 6000] [--shards 6]
                                      [--repeats 200] [--masters 1 2 3]

For each store (a standalone redis-server, then clusters of each ``--masters`` count,
every node a private redis-server on loopback): a namespace of ``--shards`` shards,

- ingest: vector steps (obs float32[8]) and image steps (uint8 84x84x3) through one real
  Celery worker (prefork, concurrency 2; its broker a separate standalone redis-server),
  committed steps/s from the first ``add_batch`` to the last confirmation;
- commit: ``Store.commit`` of 16,384-step vector batches in this process (no Celery):
  the store's own cost per step, spread over the shards;
- sampling: cold index build (every shard read), and ``orchestrator.sample`` of 256 rows
  (filter ``task_id in [grasp, reach]`` and ``reward > 0``, priority sampler; fields obs,
  action, reward, next_obs) with the index current: median and p95 ms;
- the shards each master holds.

Everything runs on this machine's cores: with 2 cores, more masters add processes and
round trips, not CPU, so the figures show a cluster's overhead, not its speed-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sample_store import RECIPE, image_steps, steps, timed

from claw_tasks.client import Ingestor
from claw_tasks.connection.client import is_cluster
from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from claw_tasks.store.batches import shard_home_key
from orchestrator import sample
from orchestrator.sampling.index import SamplingIndex
from tests.support.processes import Worker


def ingest(url: str, broker: str, ns: str, b, shards: int, flush: int) -> float:
    """Committed steps/s of batch ``b`` sent through the worker."""
    cols = {
        "obs": b.fields["obs"],
        "action": b.fields["action"],
        "reward": b.reward,
        "episode_id": np.array(b.episode.values)[b.episode.index],
        "step_index": b.step_index,
    }
    ing = Ingestor(
        ns,
        url,
        broker_url=broker,
        flush_steps=flush,
        flush_interval=None,
        capacity=3 * b.n,
        n_shards=shards,
    )  # episodes spread unevenly
    t0 = time.perf_counter()
    ing.add_batch(cols)
    res = ing.close(timeout=900)
    dt = time.perf_counter() - t0
    assert res.committed == b.n, res
    return b.n / dt


def measure(url: str, broker: str, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    rng = np.random.default_rng(0)
    out: dict[str, object] = {}
    log = tmp / f"worker-{time.monotonic_ns()}.log"
    worker = Worker(url, "ingest", 2, log, {}, broker)
    try:
        out["ingest vector"] = ingest(
            url, broker, "vec", steps(0, args.steps, rng), args.shards, 16384
        )
        out["ingest image"] = ingest(
            url, broker, "img", image_steps(0, args.images, rng), args.shards, 512
        )
    finally:
        worker.stop()
    store = Store(url, "smp")
    store.create(capacity=3 * args.steps, n_shards=args.shards)  # episodes spread unevenly
    t = time.perf_counter()
    for start in range(0, args.steps, 16384):
        store.commit(steps(start, min(16384, args.steps - start), rng))
    out["commit"] = args.steps / (time.perf_counter() - t)
    index = SamplingIndex(store)
    t = time.perf_counter()
    index.sync()
    out["cold ms"] = (time.perf_counter() - t) * 1e3
    sample(store, RECIPE, rng=rng, index=index)
    out["batch ms"] = timed(lambda: sample(store, RECIPE, rng=rng, index=index), args.repeats)
    if is_cluster(store.r):
        held: dict[str, int] = {}
        for s in range(args.shards):
            node = store.r.get_node_from_key(shard_home_key(store.namespace, s)).name
            held[node] = held.get(node, 0) + 1
        out["shards per master"] = "/".join(str(v) for v in sorted(held.values(), reverse=True))
    else:
        out["shards per master"] = str(args.shards)
    store.r.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--images", type=int, default=6_000)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--masters", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as broker:
        with RedisServer() as plain:
            rows.append(("redis (standalone)", measure(plain.url, broker.url, args, Path(tmp))))
        for m in args.masters:
            with LocalCluster(m) as cluster:
                rows.append(
                    (f"cluster, {m} master(s)", measure(cluster.url, broker.url, args, Path(tmp)))
                )
    py = platform.python_version()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {py}, "
        f"load average {load}; {args.shards} shards, {args.steps:,} vector steps, "
        f"{args.images:,} image steps\n"
    )
    base = rows[0][1]
    print(
        "| store | shards per master | ingest vector steps/s | ingest image steps/s | "
        "Store.commit steps/s | cold index ms | sample(256) ms median (p95) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, o in rows:
        med, p95 = o["batch ms"]  # type: ignore[misc]
        cells = [
            f"{o[k]:,.0f} ({o[k] / base[k]:.2f}x)"  # type: ignore[operator]
            for k in ("ingest vector", "ingest image", "commit")
        ]
        print(
            f"| {name} | {o['shards per master']} | "
            + " | ".join(cells)
            + f" | {o['cold ms']:,.0f} | {med:.2f} ({p95:.2f}) |"
        )
    print("\nPer shard (the whole figure divided by the shards, each shard's share):")
    print(
        "| store | vector steps/s per shard | image steps/s per shard | commit steps/s per shard "
        "| cold index ms per shard |"
    )
    print("|---|---:|---:|---:|---:|")
    n = args.shards
    for name, o in rows:
        print(
            f"| {name} | {o['ingest vector'] / n:,.0f} | {o['ingest image'] / n:,.0f} | "
            f"{o['commit'] / n:,.0f} | {o['cold ms'] / n:,.1f} |"
        )


if __name__ == "__main__":
    main()
