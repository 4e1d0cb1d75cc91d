"""Faiss (IVF-Flat, HNSW) against hnswlib and usearch on the same states: what chose
retrieval's index (docs/retrieval.md, "Why Faiss IVF").

    python bench/ann.py [--n 1000000] [--data states|gaussian] [--queries 1024] [--threads 1]

Needs ``faiss-cpu``, ``hnswlib`` and ``usearch`` (``pip install faiss-cpu==1.15.1 hnswlib
usearch psutil``; the last two only here). Per library and setting: build time, recall@10
against an exact scan, latency of a 256-state batch at k=10 (p50/p99 over the query
batches, wall and this process's CPU time: on a loaded machine wall time is mostly
waiting for a core), resident memory the index added, the cost of 10,000 incremental
adds and of removing 10,000 vectors (or that it cannot), and the bytes it persists to.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import psutil
from statesets import gaussian, states


def rss() -> int:
    return psutil.Process().memory_info().rss


def timed(fn, batches):
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
    return float(
        np.mean([len(set(a) & set(b)) / truth.shape[1] for a, b in zip(found, truth, strict=True)])
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--data", default="states", choices=["states", "gaussian"])
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="faiss-ivf,faiss-hnsw,hnswlib,usearch")
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)
    make = states if args.data == "states" else gaussian
    x = make(args.n, seed=0)
    q = make(args.queries, seed=99)
    extra = make(10_000, seed=7)
    batches = [q[i : i + 256] for i in range(0, len(q), 256)] * 10
    t0 = time.perf_counter()
    _, truth = faiss.knn(q, x, 10)
    out = {
        "n": args.n,
        "data": args.data,
        "threads": args.threads,
        "load_before": os.getloadavg()[0],
        "exact_s_per_256": round((time.perf_counter() - t0) / (len(q) / 256), 2),
        "results": [],
    }
    only = set(args.only.split(","))
    ids = np.arange(args.n, dtype=np.int64)

    def report(name, build_s, mem, search, settings, add, remove, persist):
        for label, setup in settings:
            setup()
            found = np.concatenate([search(b) for b in batches[: len(q) // 256]])
            row = {
                "index": name,
                "setting": label,
                "build_s": round(build_s, 1),
                "mem_bytes_per_vector": round(mem / args.n, 1),
                "recall@10": round(recall(found, truth), 4),
                **timed(search, batches),
                "add_10k_s": add,
                "remove_10k": remove,
                "persist": persist,
            }
            print(json.dumps(row), flush=True)
            out["results"].append(row)

    if "faiss-ivf" in only:
        nlist = 4096
        m0, t0 = rss(), time.perf_counter()
        quant = faiss.IndexFlatL2(x.shape[1])
        ivf = faiss.IndexIVFFlat(quant, x.shape[1], nlist)
        sample = x[np.random.default_rng(1).choice(args.n, 39 * nlist, replace=False)]
        km = faiss.Kmeans(x.shape[1], nlist, niter=10, seed=1234)
        km.train(sample)
        quant.add(km.centroids)
        ivf.is_trained = True
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        ivf.add_with_ids(x, ids)
        build = time.perf_counter() - t0
        mem = rss() - m0
        t = time.perf_counter()
        ivf.add_with_ids(extra, np.arange(args.n, args.n + 10_000, dtype=np.int64))
        add = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        ivf.remove_ids(
            faiss.IDSelectorArray(10_000, faiss.swig_ptr(np.ascontiguousarray(ids[:10_000])))
        )
        remove = f"{time.perf_counter() - t:.3f} s (remove_ids, direct map)"
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            faiss.write_index(ivf, f"{d}/i")
            size = os.path.getsize(f"{d}/i") / args.n
            persist = f"{size:.0f} B/vector, {time.perf_counter() - t:.1f} s"
        sel_bits = np.packbits(np.ones(args.n + 10_000, bool), bitorder="little")

        def search(b):
            return ivf.search(b, 10)[1]

        def with_mask(b):  # what retrieval runs: a row mask as an IDSelectorBitmap
            sel = faiss.IDSelectorBitmap(args.n + 10_000, faiss.swig_ptr(sel_bits))
            return ivf.search(b, 10, params=faiss.SearchParametersIVF(sel=sel, nprobe=ivf.nprobe))[
                1
            ]

        def probe(n):
            return lambda: setattr(ivf, "nprobe", n)

        report(
            "faiss IVF4096,Flat",
            build,
            mem,
            search,
            [(f"nprobe {n}", probe(n)) for n in (4, 8, 16, 32)],
            add,
            remove,
            persist,
        )
        report(
            "faiss IVF4096,Flat + IDSelectorBitmap",
            build,
            mem,
            with_mask,
            [(f"nprobe {n}", probe(n)) for n in (8, 16)],
            add,
            remove,
            persist,
        )
        del ivf, quant
    if "faiss-hnsw" in only:
        m0, t0 = rss(), time.perf_counter()
        h = faiss.IndexHNSWFlat(x.shape[1], 32)
        h.hnsw.efConstruction = 80
        h.add(x)
        build, mem = time.perf_counter() - t0, rss() - m0
        t = time.perf_counter()
        h.add(extra)
        add = round(time.perf_counter() - t, 3)

        def ef(n):
            return lambda: setattr(h.hnsw, "efSearch", n)

        report(
            "faiss HNSW32,Flat",
            build,
            mem,
            lambda b: h.search(b, 10)[1],
            [(f"efSearch {n}", ef(n)) for n in (16, 32, 64)],
            add,
            "not supported (mask only)",
            "write_index",
        )
        del h
    if "hnswlib" in only:
        import hnswlib

        m0, t0 = rss(), time.perf_counter()
        h = hnswlib.Index("l2", x.shape[1])
        h.init_index(args.n + 10_000, M=16, ef_construction=100, allow_replace_deleted=True)
        h.set_num_threads(args.threads)
        h.add_items(x, ids)
        build, mem = time.perf_counter() - t0, rss() - m0
        t = time.perf_counter()
        h.add_items(extra, np.arange(args.n, args.n + 10_000))
        add = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        for i in range(10_000):
            h.mark_deleted(i)
        remove = f"{time.perf_counter() - t:.3f} s (mark_deleted: masked, slot reusable)"

        def ef(n):
            return lambda: h.set_ef(n)

        report(
            "hnswlib M16",
            build,
            mem,
            lambda b: h.knn_query(b, 10)[0],
            [(f"ef {n}", ef(n)) for n in (16, 32, 64)],
            add,
            remove,
            "save_index (own format)",
        )
        del h
    if "usearch" in only:
        from usearch.index import Index

        m0, t0 = rss(), time.perf_counter()
        u = Index(ndim=x.shape[1], metric="l2sq", connectivity=16, expansion_add=128)
        u.add(ids, x, threads=args.threads)
        build, mem = time.perf_counter() - t0, rss() - m0
        t = time.perf_counter()
        u.add(np.arange(args.n, args.n + 10_000), extra, threads=args.threads)
        add = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        u.remove(ids[:10_000])
        remove = f"{time.perf_counter() - t:.3f} s (remove)"

        def ex(n):
            return lambda: setattr(u, "expansion_search", n)

        report(
            "usearch M16",
            build,
            mem,
            lambda b: u.search(b, 10, threads=args.threads).keys,
            [(f"expansion {n}", ex(n)) for n in (16, 32, 64)],
            add,
            remove,
            "save/view (own format, mmap)",
        )
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
