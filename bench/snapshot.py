"""What a snapshot costs: Redis memory against the namespace's, and the time to take one,
read one back and roll back to it.

    .venv/bin/python bench/snapshot.py [--steps 1000000] [--shards 1] [--repeat 3]
        [--threads 1,4]

Starts a private redis-server and fills a namespace through ``Store.commit`` (not timed):
``--steps`` steps of a float32[8] obs and an int64 action (docs/benchmarks.md's smallest
step: a snapshot is the largest fraction of a namespace of small steps), with a free
string tag. Then labels 10 % of the steps untrainable and a quality on another 10 %, and
gives every step a random priority (the worst case for compression: unset priorities and
unlabelled steps cost almost nothing). Takes ``--repeat`` snapshots per entry of
``--threads`` (``snapshots.THREADS``: 1 reads, packs and writes one shard after the other,
as before the pipeline), the settings taking turns so load changes hit each alike, and
prints the snapshot's ``MEMORY USAGE`` (every key, exact) against the namespace's
(``namespace_bytes``, snapshots excluded); then ``Store.labels`` of one and a rollback that
rewrites a tenth of the priorities.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from claw_tasks.connection.client import redis_client
from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch, StrColumn
from claw_tasks.format.schema import FieldSpec, Schema, tag_column
from claw_tasks.store import Store, snapshots
from claw_tasks.store.batches import snapshot_keys
from claw_tasks.store.keyscan import namespace_keys
from claw_tasks.store.usage import key_bytes

BATCH = 50_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default=f"1,{snapshots.THREADS}")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with RedisServer() as server:
        r = redis_client(server.url)
        store = Store(r, "bench")
        schema = Schema(
            fields={"obs": FieldSpec("<f4", (8,)), "action": FieldSpec("<i8", ())},
            tags={"level": "str"},
        )
        store.create(capacity=args.steps, n_shards=args.shards, schema=schema)
        t = time.time()
        ids = []
        for e in range(-(-args.steps // BATCH)):
            n = min(BATCH, args.steps - e * BATCH)
            b = StepBatch(
                episode=StrColumn.of([f"e{e}-{i // 1000}" for i in range(n)]),
                step_index=np.arange(n) % 1000,
                reward=rng.random(n, np.float32),
                terminated=np.arange(n) % 1000 == 999,
                truncated=np.zeros(n, bool),
                fields={
                    "obs": rng.random((n, 8), np.float32),
                    "action": rng.integers(0, 4, n).astype(np.int64),
                },
            )
            b.strs[tag_column("level")] = StrColumn.of([f"l{i % 5}" for i in range(n)])
            ids.append(store.commit(b).ids)
        all_ids = np.concatenate(ids)
        pick = rng.permutation(all_ids)
        tenth = len(all_ids) // 10
        store.curate(pick[:tenth], trainable=False)
        store.curate(pick[tenth : 2 * tenth], quality="checked")
        for at in range(0, len(all_ids), 100_000):
            part = all_ids[at : at + 100_000]
            store.update_priorities(part, rng.random(len(part), np.float32) + 0.01)
        ns_keys = [k for k in namespace_keys(r, "bench") if b":snap" not in k]
        ns_bytes = sum(key_bytes(r, ns_keys))
        print(
            f"{len(all_ids):,} steps in {args.shards} shard(s), filled and labelled in "
            f"{time.time() - t:.0f} s; namespace {ns_bytes / 2**20:,.1f} MiB "
            f"({ns_bytes / len(all_ids):.0f} B/step); load {os.getloadavg()[0]:.1f}"
        )
        settings = [int(x) for x in args.threads.split(",")]
        times: dict[int, list[float]] = {n: [] for n in settings}
        cpus: dict[int, list[float]] = {n: [] for n in settings}

        def cpu() -> float:  # this process's CPU seconds (every thread) and redis-server's
            info = r.info("cpu")
            return time.process_time() + info["used_cpu_user"] + info["used_cpu_sys"]

        for k in range(args.repeat):
            for n in settings:
                snapshots.THREADS = n
                t, c = time.perf_counter(), cpu()
                info = store.snapshot(f"s{k}-{n}")
                times[n].append(time.perf_counter() - t)
                cpus[n].append(cpu() - c)
                if (k, n) != (0, settings[0]):
                    store.drop_snapshot(f"s{k}-{n}")
        snap_keys = [
            k.encode() for k in snapshot_keys(store.namespace, f"s0-{settings[0]}", args.shards)
        ]
        snap = sum(key_bytes(r, snap_keys))
        for n, runs in times.items():
            med, first = statistics.median(runs), statistics.median(times[settings[0]])
            print(
                f"snapshot, {n} thread(s): median {med:.3f} s, best {min(runs):.3f} s of "
                f"{args.repeat} (all {', '.join(f'{x:.2f}' for x in runs)}); CPU (client + "
                f"Redis) median {statistics.median(cpus[n]):.3f} s; the first setting's "
                f"median / this one's: {first / med:.2f}"
            )
        print(
            f"snapshot: {info.bytes / 2**20:.2f} MiB compressed columns, MEMORY USAGE "
            f"{snap / 2**20:.2f} MiB = {100 * snap / ns_bytes:.2f} % of the namespace "
            f"({snap / len(all_ids):.2f} B/step)"
        )
        t = time.perf_counter()
        store.labels(f"s0-{settings[0]}")
        print(f"labels of a snapshot read back: {time.perf_counter() - t:.2f} s")
        store.update_priorities(all_ids[:tenth], np.ones(tenth, np.float32))
        t = time.perf_counter()
        done = store.rollback(f"s0-{settings[0]}")
        print(
            f"rollback rewriting {done.changed.get('priority', 0):,} priorities: "
            f"{time.perf_counter() - t:.2f} s"
        )


if __name__ == "__main__":
    main()
