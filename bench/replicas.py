"""What confirming a commit only once a replica has it costs (``CLAW_INGEST_REPLICAS``).

    .venv/bin/python bench/replicas.py [--steps 200000] [--sizes 64 1024 16384]
                                       [--shards 4] [--rounds 3]

On a standalone redis-server with one replica (loopback), and on a 3-master Redis Cluster
with a replica per master:

- commit: ``Store.commit`` in this process (no Celery) of vector steps (obs float32[8],
  string tags, so the dictionaries' round trip waits too) in batches of each ``--sizes``,
  over ``--shards`` shards, alternately without and with a replica required (up to 200
  batches of each); the median milliseconds per batch;
- ingest (standalone only): ``--steps`` vector steps through a real Celery worker
  (prefork, concurrency 2) in messages of 1,024 steps, with ``CLAW_INGEST_REPLICAS`` 0
  and 1, alternating, ``--rounds`` workers each; committed steps/s from the first
  ``add_batch`` to the last confirmation.

The cost is one ``WAIT`` per shard part of a batch, in the round trip of its commit: the
time the replica takes to acknowledge, a loopback round trip here, a network one between
hosts. Ratios within one run only; the machine's load is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import ingest
from sample_store import steps

from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from claw_tasks.store.replication import Replication
from tests.support.processes import Worker

FAST_SYNC = {"repl-diskless-sync-delay": "0"}
REPLICA = Replication(1, 1000)


def commits(url: str, args: argparse.Namespace) -> None:
    """Batches committed in turn into two namespaces, one waiting for a replica and one
    not (so the machine's load weighs on both alike): the median time per batch of each."""
    for size in args.sizes:
        n = max(size * 8, min(args.steps, size * 200))
        rng = np.random.default_rng(0)
        stores = {}
        for mode in ("off", "on"):
            stores[mode] = Store(url, f"c-{mode}-{time.monotonic_ns()}")
            stores[mode].create(capacity=3 * n, n_shards=args.shards)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for start in range(0, n, size):
            b = steps(start, min(size, n - start), rng)
            for mode, wait in (("off", None), ("on", REPLICA)):
                b.batch_id = f"{mode}-{start}"
                t = time.perf_counter()
                stores[mode].commit(b, replication=wait)
                times[mode].append(time.perf_counter() - t)
        off, on = (float(np.median(times[k])) * 1e3 for k in ("off", "on"))
        print(
            f"  commit, batches of {size:>6,} ({n // size} each): median {off:7.2f} ms "
            f"without, {on:7.2f} ms with a replica required "
            f"({size / off * 1e3:>9,.0f} / {size / on * 1e3:>9,.0f} steps/s): x{off / on:.2f}"
        )


def ingests(master: RedisServer, broker: str, args: argparse.Namespace, tmp: Path) -> None:
    rng = np.random.default_rng(0)
    runs: dict[str, list[float]] = {"0": [], "1": []}
    for i in range(args.rounds):
        for replicas in runs:
            env = {"CLAW_INGEST_REPLICAS": replicas}
            worker = Worker(master.url, "ingest", 2, tmp / f"w{i}-{replicas}.log", env, broker)
            try:
                b = steps(0, args.steps, rng)
                runs[replicas].append(
                    ingest(master.url, broker, f"i{i}-{replicas}", b, args.shards, 1024)
                )
            finally:
                worker.stop()
    off, on = (float(np.median(runs[k])) for k in ("0", "1"))
    print(
        f"  ingest through a worker ({args.steps:,} steps, messages of 1,024): {off:,.0f} "
        f"steps/s with CLAW_INGEST_REPLICAS=0, {on:,.0f} with 1: x{on / off:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 16384])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as d:
        with (
            RedisServer(options=FAST_SYNC) as master,
            RedisServer() as replica,
            RedisServer() as broker,
        ):
            replica.client().replicaof("127.0.0.1", master.port)
            while replica.client().info("replication").get("master_link_status") != "up":
                time.sleep(0.05)
            print("standalone redis-server with one replica:")
            commits(master.url, args)
            ingests(master, broker.url, args, Path(d))
        with LocalCluster(3, options=FAST_SYNC, replicas=1) as cluster:
            print("3-master cluster, a replica per master:")
            commits(cluster.url, args)
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
