"""Retrieval end to end on Claw's own code paths: build, memory, restart, recall, latency.

    .venv/bin/python bench/retrieval.py [--steps 1000000] [--dim 32] [--threads 1]

Fills a private redis-server with N steps whose ``obs`` are float32[dim] states
(bench/statesets.py: episodes on a low-dimensional manifold), defines the default vector
index (``kind: auto``: Faiss IVF, ``nlist`` from the capacity), then measures:

- build: the maintenance writer's projection and writes of every step (``Writer.run``
  ticks, as ``claw.maintenance.vectors`` runs them), and the quantizer's training;
- memory per step: the index's Redis keys (``MEMORY USAGE``), and a reader's copy
  (``VectorIndex.nbytes``);
- restart: a reader's cold load from the raw arrays (what a restarted worker does), and
  a restarted writer's first tick;
- recall@10 against an exact scan of the same vectors, for held-out states of the same
  process, and latency of a 256-state batch, k=10: the search alone
  (``VectorIndex.search`` with every row valid) and ``nearest()`` (syncs, masks, the
  store check, the ``action`` field read), p50/p99 of wall time and of this process's CPU
  time (on a loaded machine the wall time is mostly waiting for a core; the CPU time is
  what a quiet core would take).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import faiss
import numpy as np
from statesets import states

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.maintenance.lifecycle import key_bytes, namespace_keys
from orchestrator.retrieval import define_index, nearest
from orchestrator.retrieval.vectors import VectorIndex, exact_search
from orchestrator.retrieval.writer import Writer
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings


def percentiles(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(samples, 50)) * 1e3, 2),
        "p99_ms": round(float(np.percentile(samples, 99)) * 1e3, 2),
    }


def timed(fn, batches) -> dict[str, float]:
    wall, cpu = [], []
    for b in batches:
        t, c = time.perf_counter(), time.process_time()
        fn(b)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    cpu_p = percentiles(cpu)
    return {**percentiles(wall), "cpu_p50_ms": cpu_p["p50_ms"], "cpu_p99_ms": cpu_p["p99_ms"]}


def fill(store: Store, x: np.ndarray, ep_len: int = 500) -> None:
    for lo in range(0, len(x), 50_000):
        part = x[lo : lo + 50_000]
        n = len(part)
        eps = [f"e{(lo + i) // ep_len}" for i in range(n)]
        store.commit(
            StepBatch(
                episode=StrColumn.of(eps),
                step_index=(np.arange(lo, lo + n) % ep_len).astype(np.int64),
                reward=np.zeros(n, np.float32),
                terminated=np.zeros(n, bool),
                truncated=np.zeros(n, bool),
                fields={"obs": part, "action": np.arange(lo, lo + n, dtype=np.int64) % 2},
            )
        )


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [
        len(set(a[a >= 0]) & set(b)) / truth.shape[1] for a, b in zip(found, truth, strict=True)
    ]
    return round(float(np.mean(hits)), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=100)
    args = ap.parse_args()
    faiss.omp_set_num_threads(args.threads)
    out: dict = {"steps": args.steps, "dim": args.dim, "threads": args.threads}
    out["load_before"] = round(os.getloadavg()[0], 1)
    x = states(args.steps, args.dim, seed=0)
    q = states(args.queries, args.dim, seed=99)
    with RedisServer(options={"maxmemory": "8gb"}) as server:
        store = Store(server.url, "bench")
        store.create(capacity=args.steps)
        t = time.perf_counter()
        fill(store, x)
        out["fill_s"] = round(time.perf_counter() - t, 1)
        spec = define_index(store, {"kind": "auto"})
        index = SamplingIndex(store)
        index.sync()
        strings = Strings(store, index)
        writer = Writer(store, spec, ())
        t, ticks = time.perf_counter(), []
        while True:
            t0 = time.perf_counter()
            done = writer.run(index, strings, budget_s=5.0)
            ticks.append((round(time.perf_counter() - t0, 1), done))
            if not done["pending"] and writer.head is not None and writer.head.gen:
                break
        out["build_s"] = round(time.perf_counter() - t, 1)
        out["build_ticks"] = ticks
        out["nlist"] = spec.lists(args.steps)
        keys = [k for k in namespace_keys(store.r, "bench") if b":vx" in k]
        out["redis_bytes_per_step"] = round(sum(key_bytes(store.r, keys)) / args.steps, 1)

        t = time.perf_counter()
        restarted = Writer(store, spec, ())
        first = restarted.run(index, strings, budget_s=5.0)
        out["restarted_writer_first_tick"] = {"s": round(time.perf_counter() - t, 2), **first}

        t = time.perf_counter()
        reader = VectorIndex(store, spec, args.dim)
        reader.load()
        out["reader_load_s"] = round(time.perf_counter() - t, 2)
        out["reader_bytes_per_step"] = round(reader.nbytes / args.steps, 1)

        _, truth = exact_search(q, reader.vectors, 10, "l2")
        valid = reader.vid != 0
        batches = [q[i : i + 256] for i in range(0, len(q), 256)]
        repeat = (batches * (args.batches // len(batches) + 1))[: args.batches]
        out["search"] = []
        for nprobe in (4, 8, 16, 32):
            reader.spec = spec.model_copy(update={"nprobe": nprobe})
            found = np.concatenate([reader.search(b, 10, valid)[1] for b in batches])
            row = {"nprobe": nprobe, "recall@10": recall(found, truth)}
            row.update(timed(lambda b: reader.search(b, 10, valid), repeat))
            out["search"].append(row)
            print(json.dumps(row), flush=True)
        nearest(store, batches[0], 10, fields=["action"])  # the session's cold start
        e2e = timed(lambda b: nearest(store, b, 10, fields=["action"]), repeat[:50])
        out["nearest_e2e_nprobe16"] = e2e
    out["load_after"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
