"""Retrieval end to end on Claw's own code paths: build, memory, restart, recall, latency.

    .venv/bin/python bench/retrieval.py [--steps 1000000] [--data states] [--threads 1]

Defines two vector indexes in a private redis-server's namespace and fills it with N steps
whose ``obs`` are float32[dim] states (bench/statesets.py: episodes on a low-dimensional
manifold), in ``--parts`` parts, each index's writer catching up after each part (the data
arrives over time, as in a live namespace), then measures:

- build: the maintenance writer's projection and writes of every step (``Writer.run``
  ticks, as ``claw.maintenance.vectors`` runs them), and the quantizer's trainings;
- memory per step: the index's Redis keys (``MEMORY USAGE``), and a reader's copy
  (``VectorIndex.nbytes``);
- restart: a reader's cold load from the raw arrays (what a restarted worker does), and
  a restarted writer's first tick;
- recall@10 against an exact scan of the same vectors, for held-out states of the same
  process, and latency of a 256-state batch, k=10: the search alone
  (``VectorIndex.search`` with every row valid) at several ``nprobe`` and ``nearest()``
  (syncs, masks, the store check, the ``action`` field read; its stages timed one by
  one), also with a ``where`` keeping half the steps, p50/p99 of wall time and of this
  process's CPU time (on a loaded machine the wall time is mostly waiting for a core; the
  CPU time is what a quiet core would take);

for two definitions in one run: ``fixed`` (``nprobe`` 12 whatever the data) and
``default`` (``nprobe`` calibrated to the recall target by the writer); the ``where``
query for ``default`` only. ``--data`` names a set of bench/statesets.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import faiss
import numpy as np
from statesets import SETS

from claw_tasks.connection.server import RedisServer
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from claw_tasks.store.keyscan import namespace_keys
from claw_tasks.store.usage import key_bytes
from orchestrator.retrieval import define_index, list_indexes, nearest
from orchestrator.retrieval.query import Session, open_session
from orchestrator.retrieval.storage import IndexKeys
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


def fill(store: Store, x: np.ndarray, ep_len: int = 500, offset: int = 0) -> None:
    """Commit states ``x`` as episodes of ``ep_len`` steps (``x[0]`` is step ``offset``)."""
    for lo in range(0, len(x), 50_000):
        part = x[lo : lo + 50_000]
        n, first = len(part), offset + lo
        eps = [f"e{(first + i) // ep_len}" for i in range(n)]
        store.commit(
            StepBatch(
                episode=StrColumn.of(eps),
                step_index=(np.arange(first, first + n) % ep_len).astype(np.int64),
                reward=np.zeros(n, np.float32),
                terminated=np.zeros(n, bool),
                truncated=np.zeros(n, bool),
                fields={"obs": part, "action": np.arange(first, first + n, dtype=np.int64) % 2},
            )
        )


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [
        len(set(a[a >= 0]) & set(b)) / truth.shape[1] for a, b in zip(found, truth, strict=True)
    ]
    return round(float(np.mean(hits)), 4)


CONFIGS = {
    # a fixed nprobe: 16 * sqrt(capacity) lists (16,384, two-level k-means on 10 each),
    # found by an HNSW graph, nprobe 12 whatever the data, trained again as they double
    "fixed": {"name": "fixed", "kind": "auto", "nprobe": 12},
    # the default: the same lists, nprobe calibrated by the writer to recall@10 0.95
    "default": {"name": "default", "kind": "auto"},
}
STAGES = {
    "session": None,  # nearest()'s own lookups (the namespace config) before the query
    "sync": ("index", "sync"),  # the sampling index caught up (metadata)
    "refresh": ("vectors", "refresh"),  # the vectors caught up from the index's log
    "masks": (None, "_update_masks"),
    "search": ("vectors", "search"),  # Faiss
    "live": (None, "_live"),  # Store.holding: one script call per shard
    "read": (None, "_read"),  # the fields, through the validated fetch
}


def build(store: Store, x: np.ndarray, parts: int) -> dict[str, dict]:
    """Fill ``x`` in ``parts`` equal parts, every index's writer catching up after each
    (``Writer.run`` ticks, as ``claw.maintenance.vectors`` runs them): the data arrives
    over time, as in a live namespace, so a first training sees only the first part."""
    index = SamplingIndex(store)
    strings = Strings(store, index)
    specs = {label: define_index(store, config) for label, config in CONFIGS.items()}
    writers: dict[str, Writer] = {}  # made once the namespace has a schema
    out: dict[str, dict] = {
        label: {"build_s": 0.0, "ticks": 0, "train_ticks_s": []} for label in specs
    }
    fill_s, size = 0.0, -(-len(x) // parts)
    for lo in range(0, len(x), size):
        t = time.perf_counter()
        fill(store, x[lo : lo + size], offset=lo)
        fill_s += time.perf_counter() - t
        index.sync()
        for label, spec in specs.items():
            if label not in writers:
                writers[label] = Writer(store, spec, ())
            writer = writers[label]
            row, t = out[label], time.perf_counter()
            while True:
                t0 = time.perf_counter()
                done = writer.run(index, strings, budget_s=5.0)
                row["ticks"] += 1
                if done.get("trained"):
                    row["train_ticks_s"].append(round(time.perf_counter() - t0, 1))
                if not done["pending"]:
                    break
            row["build_s"] += time.perf_counter() - t
    for label, writer in writers.items():
        head = writer.storage.head()
        out[label]["build_s"] = round(out[label]["build_s"], 1)
        out[label].update(
            generations=head.gen if head else 0, trained_on=head.trained if head else 0
        )
    out["fill_s"] = round(fill_s, 1)  # type: ignore[assignment]
    return out


def staged(session: Session, fn, batches) -> dict[str, float]:
    """``fn`` over ``batches`` with each stage of the session's query timed (wall, ms per
    query, median), the rest counted as ``session``."""
    spent: dict[str, list[float]] = {k: [] for k in STAGES}
    originals = []
    for stage, where in STAGES.items():
        if where is None:
            continue
        owner = session if where[0] is None else getattr(session, where[0])
        orig = getattr(owner, where[1])
        originals.append((owner, where[1], orig))

        def timed_call(*a, _orig=orig, _stage=stage, **kw):
            t = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spent[_stage][-1] += time.perf_counter() - t

        setattr(owner, where[1], timed_call)
    totals = []
    try:
        for b in batches:
            for v in spent.values():
                v.append(0.0)
            t = time.perf_counter()
            fn(b)
            totals.append(time.perf_counter() - t)
            spent["session"][-1] = totals[-1] - sum(
                v[-1] for k, v in spent.items() if k != "session"
            )
    finally:
        for owner, name, orig in originals:
            setattr(owner, name, orig)
    out = {k: round(float(np.median(v)) * 1e3, 2) for k, v in spent.items()}
    out["total"] = round(float(np.median(totals)) * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32, help="of states, gaussian, mixture")
    ap.add_argument("--data", default="states", choices=sorted(SETS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--parts", type=int, default=5, help="the fill arrives in this many parts")
    args = ap.parse_args()
    faiss.omp_set_num_threads(args.threads)
    out: dict = {"steps": args.steps, "data": args.data, "threads": args.threads}
    out["load_before"] = round(os.getloadavg()[0], 1)
    make = SETS[args.data]
    sized = {} if args.data == "halfcheetah" else {"dim": args.dim}
    x = make(args.steps, seed=0, **sized)
    q = make(args.queries, seed=99, **sized)
    args.dim = x.shape[1]
    batches = [q[i : i + 256] for i in range(0, len(q), 256)]
    repeat = (batches * (args.batches // len(batches) + 1))[: args.batches]
    with RedisServer(options={"maxmemory": "8gb"}) as server:
        store = Store(server.url, "bench")
        store.create(capacity=args.steps)
        built = build(store, x, args.parts)
        out["fill_s"] = built.pop("fill_s")
        index = SamplingIndex(store)
        index.sync()
        strings = Strings(store, index)
        truth = None
        for label in CONFIGS:
            spec = list_indexes(store)[CONFIGS[label]["name"]]
            head = IndexKeys(store, spec.name).head
            row: dict = {"nlist": int(store.r.hget(head, "nlist") or 0)}  # its last training's
            row["quantizer"] = spec.quantizer
            row["nprobe"] = spec.nprobe or int(store.r.hget(head, "nprobe") or 0)
            row["calibrated_recall"] = (store.r.hget(head, "recall") or b"").decode()
            row.update(built[label])
            name = spec.name
            keys = [k for k in namespace_keys(store.r, "bench") if f":vx:{name}:".encode() in k]
            keys.append(IndexKeys(store, name).head.encode())
            row["redis_bytes_per_step"] = round(sum(key_bytes(store.r, keys)) / args.steps, 1)

            t = time.perf_counter()
            first = Writer(store, spec, ()).run(index, strings, budget_s=5.0)
            row["restarted_writer_first_tick"] = {"s": round(time.perf_counter() - t, 2), **first}

            t = time.perf_counter()
            reader = VectorIndex(store, spec, args.dim)
            reader.load()
            row["reader_load_s"] = round(time.perf_counter() - t, 2)
            row["reader_bytes_per_step"] = round(reader.nbytes / args.steps, 1)
            if truth is None:
                _, truth = exact_search(q, reader.vectors, 10, "l2")
                kept = np.flatnonzero(np.arange(args.steps) % 500 < 250)
                _, pos = exact_search(q, reader.vectors[kept], 10, "l2")
                truth_half = kept[pos]
            valid = reader.vid != 0
            row["search"] = []
            for nprobe in sorted({row["nprobe"], 4, 8, 12, 16, 24} - {0}):
                reader.nprobe = nprobe
                found = np.concatenate([reader.search(b, 10, valid)[1] for b in batches])
                r = {"nprobe": nprobe, "recall@10": recall(found, truth)}
                r.update(timed(lambda b, rd=reader, v=valid: rd.search(b, 10, v), repeat))
                row["search"].append(r)
                print(label, json.dumps(r), flush=True)
            del reader

            def query(b, n=name):
                return nearest(store, b, 10, index=n, fields=["action"])

            query(batches[0])  # the session's cold start
            row["nearest_e2e"] = timed(query, repeat[:50])
            found = np.concatenate([query(b).ids - 1 for b in batches])  # one shard: row = id - 1
            row["nearest_recall@10"] = recall(found, truth)
            session = open_session(store, None, name)
            row["nearest_stages_ms"] = staged(session, query, repeat[:50])
            row["nearest_loads"] = session.vectors.loads  # 1: one cold load, then the log

            if label == "default":  # a where keeping half the steps (step_index: i % 500)

                def half(b, n=name):
                    return nearest(store, b, 10, index=n, where="step_index < 250")

                found = np.concatenate([half(b).ids - 1 for b in batches])
                row["where_half_recall@10"] = recall(found, truth_half)
                row["where_half_e2e"] = timed(half, repeat[:50])
            print(label, json.dumps({k: v for k, v in row.items() if k != "search"}), flush=True)
            out[label] = row
    out["load_after"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
