"""Retrieval's index (Faiss IVF, calibrated ``nprobe``) beside Faiss HNSW and usearch on the
same states: recall and latency side by side, what chose retrieval's index
(docs/retrieval.md, "Recall and latency").

    python bench/ann.py [--n 1000000] [--data states,gaussian,mixture,halfcheetah]
        [--only claw,faiss-hnsw,usearch,hnswlib] [--queries 1024] [--threads 1]

Needs ``faiss-cpu`` (the ``retrieval`` extra) and, for the other candidates and data sets,
the ``bench`` extra (``usearch``, ``mujoco``; ``hnswlib`` only if installed).
Per data set (bench/statesets.py; ``halfcheetah`` records MuJoCo states first, ~2 minutes
of one core at 1M): ``n`` stored states and 1,024 held-out queries of the same process
(sets of episodes: 8 states of each of 128 episodes never stored; recall varies by
episode, and a few episodes' states would measure those few);
then 10,000 states added and the first 10,000 removed (each library's own way: Claw and
Faiss HNSW mask them, usearch removes them), and per candidate and setting:

- recall@10 of the held-out queries against an exact scan of the live states (after the
  adds and removals), and how many removed ids were returned (must be 0);
- latency of a 256-state batch at k=10: p50/p99 over 40 batches, wall and this process's
  CPU time (on a loaded machine the wall time is mostly waiting for a core);
- build time, resident memory added per vector, 10,000 adds.

``claw`` is retrieval's own index built the way the maintenance writer builds it (the
default ``IndexSpec`` for a capacity of ``n``: its lists, training sample and k-means, list
assignment by a flat scan of the centroids, ``nprobe`` calibrated to recall 0.95 on the
stored vectors) and searched through ``ivf_search``, what ``nearest()`` runs, with the
live rows as its mask; ``setting`` names the calibrated ``nprobe`` and the sample's
recall there. ``--nprobe 8,16`` adds fixed settings beside it. ``--baseline`` adds, in
the same run, the index with the same lists, float32 codes and a quantizer graph of 32
links, calibrated on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from statesets import EP_LEN, SETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 10
QUERY_EPISODES = 128


def rss() -> int:
    """This process's resident memory in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, batches) -> dict[str, float]:
    wall, cpu = [], []
    for q in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(q)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "p50_ms": round(float(np.percentile(wall, 50)) * 1e3, 2),
        "p99_ms": round(float(np.percentile(wall, 99)) * 1e3, 2),
        "cpu_p50_ms": round(float(np.percentile(cpu, 50)) * 1e3, 2),
        "cpu_p99_ms": round(float(np.percentile(cpu, 99)) * 1e3, 2),
    }


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [
        len(set(a[a >= 0]) & set(b)) / truth.shape[1] for a, b in zip(found, truth, strict=True)
    ]
    return round(float(np.mean(hits)), 4)


class Run:
    """One data set: stored states, held-out queries, the adds and removals, the truth."""

    def __init__(self, data: str, n: int, queries: int) -> None:
        import faiss

        make, self.data = SETS[data], data
        ep = EP_LEN.get(data)
        held = queries if ep is None else QUERY_EPISODES * ep
        t = time.perf_counter()
        made = make(n + held + 10_000, seed=0)
        self.make_s = round(time.perf_counter() - t, 1)
        self.x, self.extra, q = made[:n], made[n + held :], made[n : n + held]
        if ep is not None:  # 8 states of each of QUERY_EPISODES episodes never stored
            eps = q.reshape(QUERY_EPISODES, ep, -1)
            per = -(-queries // QUERY_EPISODES)
            pick = np.random.default_rng(5).choice(ep, (QUERY_EPISODES, per))
            q = np.take_along_axis(eps, pick[:, :, None], axis=1).reshape(-1, q.shape[1])
        self.q = np.ascontiguousarray(q[:queries])
        self.n, self.removed = n, np.arange(10_000, dtype=np.int64)
        self.live = np.ones(n + 10_000, bool)
        self.live[self.removed] = False
        base = np.concatenate([self.x, self.extra])
        ids = np.flatnonzero(self.live)
        t = time.perf_counter()
        _, pos = faiss.knn(self.q, base[ids], K)
        self.exact_s_per_256 = round((time.perf_counter() - t) / (queries / 256), 2)
        self.truth = ids[pos]
        self.batches = [self.q[i : i + 256] for i in range(0, len(self.q), 256)]
        self.rows: list[dict] = []

    def report(self, name, build_s, mem, search, settings, add) -> None:
        for label, setup in settings:
            label = setup() or label
            found = np.concatenate([search(b) for b in self.batches])
            row = {
                "index": name,
                "setting": label,
                "build_s": round(build_s, 1),
                "mem_bytes_per_vector": round(mem / self.n, 1),
                "recall@10": recall(found, self.truth),
                "removed_returned": int(np.isin(found, self.removed).sum()),
                **timed(search, (self.batches * 40)[:40]),
                "add_10k_s": add,
            }
            print(json.dumps(row), flush=True)
            self.rows.append(row)


def build(run: Run, nlist: int, fp16: bool, links: int | None = None) -> dict:
    """Retrieval's index over ``run`` as the writer trains, assigns and calibrates it and a
    reader loads it (fp16 residual codes or float32), with ``links`` per node of the
    quantizer's graph (None: retrieval's ``HNSW_M``)."""
    import faiss

    from orchestrator.retrieval.calibrate import calibrate, held_out
    from orchestrator.retrieval.coarse import HNSW_M, Coarse
    from orchestrator.retrieval.spec import IndexSpec, per_list
    from orchestrator.retrieval.vectors import new_ivf
    from orchestrator.retrieval.writer import train_centroids

    spec, n, dim = IndexSpec(), run.n, run.x.shape[1]
    need = per_list(nlist) * nlist
    m0, t0 = rss(), time.perf_counter()
    episodes = np.arange(n) // EP_LEN.get(run.data, 1)  # as they would be committed
    rng = np.random.default_rng(1)
    out = held_out(episodes, rng)  # the writer's: held-out episodes are not trained on
    pool = np.flatnonzero(~out)
    sample = run.x[np.sort(rng.choice(pool, min(need, len(pool)), replace=False))]
    centroids = train_centroids(sample, nlist, False)
    m = links or HNSW_M  # the graph readers (and the calibration's check) search
    readers = Coarse(centroids, "l2", spec.quantizer, spec.quantizer_ef, m)
    at_n = range(0, n, 65536)  # the writer's assignment: every vector's list, exactly
    lists = np.concatenate([readers.assign(run.x[i : i + 65536]) for i in at_n])
    cal = calibrate(run.x, lists - 1, centroids, spec, readers, episodes, out)
    calibrate_s = time.perf_counter() - t0
    ivf = new_ivf(readers, dim, "l2", fp16)

    def add(x: np.ndarray, at: np.ndarray, to: np.ndarray) -> None:
        x, ids = np.ascontiguousarray(x), np.ascontiguousarray(at, np.int64)
        lists0 = np.ascontiguousarray(to.astype(np.int64) - 1)
        ivf.add_core(len(x), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(lists0))

    add(run.x, np.arange(n), lists)  # what a reader's cold load does
    built_s, mem = time.perf_counter() - t0, rss() - m0
    t = time.perf_counter()
    add(run.extra, np.arange(n, n + 10_000), readers.assign(run.extra))
    add_s = round(time.perf_counter() - t, 3)
    label = (
        f"nprobe {cal.nprobe} (calibrated: sample recall {cal.recall}, bound {cal.bound}; "
        f"training and calibration {calibrate_s:.0f} s)"
    )
    return {"ivf": ivf, "readers": readers, "centroids": centroids, "cal": cal, "label": label,
            "build_s": built_s, "mem": mem, "add_s": add_s}  # fmt: skip


def claw(run: Run, fixed: list[int], graph: bool = False, baseline: bool = False) -> None:
    import faiss

    from orchestrator.retrieval.coarse import quantizer
    from orchestrator.retrieval.spec import IndexSpec
    from orchestrator.retrieval.vectors import RERANK, fp16_codes, ivf_search, rerank

    spec, n = IndexSpec(), run.n
    nlist = spec.lists(n)
    got = build(run, nlist, True)
    ivf, readers, centroids, cal = got["ivf"], got["readers"], got["centroids"], got["cal"]
    build_s, mem, add_s = got["build_s"], got["mem"], got["add_s"]
    rows = np.concatenate([run.x, run.extra])  # a reader's vectors by row (the re-rank's)
    nprobe = [cal.nprobe]

    def search(b):
        return ivf_search(ivf, readers, b, K, run.live, nprobe[0], rows)[1]

    def at(p):
        return lambda: nprobe.__setitem__(0, p)

    settings = [(got["label"], at(cal.nprobe))] + [(f"nprobe {p}", at(p)) for p in fixed]
    codes = "SQfp16 residual" if fp16_codes(ivf) else "Flat"
    name = f"claw IVF{nlist},{codes} (mask{', re-rank' if fp16_codes(ivf) else ''})"
    run.report(name, build_s, mem, search, settings, add_s)
    if baseline:  # beside it: the same lists, float32 codes, a graph of 32 links
        base = build(run, nlist, False, links=32)
        p0 = [base["cal"].nprobe]

        def base_search(b):
            return ivf_search(base["ivf"], base["readers"], b, K, run.live, p0[0], rows)[1]

        name = f"claw IVF{nlist},Flat, HNSW32 quantizer (mask)"
        run.report(name, base["build_s"], base["mem"], base_search,
                   [(base["label"], lambda: None)], base["add_s"])  # fmt: skip
    if graph:  # beside it: the HNSW graph finding the lists at every nprobe, queries in order
        bits = np.packbits(run.live, bitorder="little")
        sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
        hnsw = readers.graph or quantizer(centroids, "l2", "hnsw")  # below 2,048 lists: its own

        def graph_search(b):
            share = min(1.0, np.count_nonzero(run.live) / ivf.ntotal)
            probes = min(nlist, int(np.ceil(nprobe[0] / share)))
            hp = faiss.SearchParametersHNSW(efSearch=max(spec.quantizer_ef, probes))
            near, lists = hnsw.search(b, probes, params=hp)
            kc, b = K + RERANK if fp16_codes(ivf) else K, np.ascontiguousarray(b)
            d, i = np.empty((len(b), kc), np.float32), np.empty((len(b), kc), np.int64)
            params = faiss.SearchParametersIVF(sel=sel, nprobe=probes)
            ivf.search_preassigned_c(
                len(b), faiss.swig_ptr(b), kc, faiss.swig_ptr(lists),
                faiss.swig_ptr(near), faiss.swig_ptr(d), faiss.swig_ptr(i), False, params,
            )  # fmt: skip
            return rerank(b, rows, i, K, False)[1] if kc > K else i

        run.report(
            f"claw IVF{nlist},{codes} (graph at every nprobe, mask)",
            build_s, mem, graph_search, settings, add_s,
        )  # fmt: skip


def faiss_hnsw(run: Run) -> None:
    import faiss

    m0, t0 = rss(), time.perf_counter()
    h = faiss.IndexHNSWFlat(run.x.shape[1], 32)
    h.hnsw.efConstruction = 40
    h.add(run.x)
    build, mem = time.perf_counter() - t0, rss() - m0
    t = time.perf_counter()
    h.add(run.extra)
    add_s = round(time.perf_counter() - t, 3)
    bits = np.packbits(run.live, bitorder="little")
    sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
    ef = [16]

    def search(b):
        return h.search(b, K, params=faiss.SearchParametersHNSW(sel=sel, efSearch=ef[0]))[1]

    def at(e):
        return lambda: ef.__setitem__(0, e)

    settings = [(f"efSearch {e}", at(e)) for e in (16, 32, 64, 128)]
    run.report("faiss HNSW32,Flat (mask)", build, mem, search, settings, add_s)


def usearch(run: Run, threads: int) -> None:
    from usearch.index import Index

    m0, t0 = rss(), time.perf_counter()
    u = Index(ndim=run.x.shape[1], metric="l2sq", connectivity=16, expansion_add=128)
    u.add(np.arange(run.n), run.x, threads=threads)
    build, mem = time.perf_counter() - t0, rss() - m0
    t = time.perf_counter()
    u.add(np.arange(run.n, run.n + 10_000), run.extra, threads=threads)
    add_s = round(time.perf_counter() - t, 3)
    u.remove(run.removed)

    def search(b):
        return u.search(b, K, threads=threads).keys.astype(np.int64)

    def at(e):
        return lambda: setattr(u, "expansion_search", e)

    settings = [(f"expansion {e}", at(e)) for e in (32, 64, 128)]
    run.report("usearch M16 (remove)", build, mem, search, settings, add_s)


def hnswlib_index(run: Run, threads: int) -> None:
    import hnswlib

    m0, t0 = rss(), time.perf_counter()
    h = hnswlib.Index("l2", run.x.shape[1])
    h.init_index(run.n + 10_000, M=16, ef_construction=100)
    h.set_num_threads(threads)
    h.add_items(run.x, np.arange(run.n))
    build, mem = time.perf_counter() - t0, rss() - m0
    t = time.perf_counter()
    h.add_items(run.extra, np.arange(run.n, run.n + 10_000))
    add_s = round(time.perf_counter() - t, 3)
    for i in run.removed:
        h.mark_deleted(int(i))

    def at(e):
        return lambda: h.set_ef(e)

    settings = [(f"ef {e}", at(e)) for e in (32, 64, 128)]
    run.report(
        "hnswlib M16 (mark_deleted)",
        build,
        mem,
        lambda b: h.knn_query(b, K)[0].astype(np.int64),
        settings,
        add_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--data", default="states,gaussian,mixture,halfcheetah")
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="claw")
    ap.add_argument("--nprobe", default="", help="fixed nprobe settings beside the calibrated")
    ap.add_argument(
        "--graph", action="store_true", help="also: the HNSW graph finds the lists at any nprobe"
    )
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also: the same lists with float32 codes and a quantizer graph of 32 links",
    )
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    only = set(args.only.split(","))
    fixed = [int(p) for p in args.nprobe.split(",") if p]
    out = {"n": args.n, "threads": args.threads, "load_before": os.getloadavg()[0], "sets": {}}
    for data in args.data.split(","):
        run = Run(data, args.n, args.queries)
        print(json.dumps({"data": data, "made_s": run.make_s, "dim": run.x.shape[1]}), flush=True)
        if "claw" in only:
            claw(run, fixed, args.graph, args.baseline)
        if "faiss-hnsw" in only:
            faiss_hnsw(run)
        if "usearch" in only:
            usearch(run, args.threads)
        if "hnswlib" in only:
            hnswlib_index(run, args.threads)
        out["sets"][data] = {"exact_s_per_256": run.exact_s_per_256, "results": run.rows}
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
