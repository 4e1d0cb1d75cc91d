"""Where an IVF search of 256 states spends its CPU: finding the lists (HNSW graph of 16
links, as readers build it, or of 32, or flat scan of the centroids), scanning them as
float32 vectors (with and without the removal mask, queries in their own order or sorted
by nearest list, one Faiss thread or two), as readers scan them (fp16 residual codes
under the mask, ``k + RERANK`` candidates re-ranked exactly), and as 8-bit
scalar-quantized codes (``--sq``, with an exact re-rank of 40 candidates).
docs/retrieval.md, "Where the time goes".

    python bench/ivf_profile.py --data mixture --n 1000000 [--nlist 16384]
        [--nprobe 8,32,132] [--sq]

One data set of bench/statesets.py, the writer's k-means and list assignment for ``nlist``
lists (default: retrieval's for a capacity of ``n``), ``nprobe`` calibrated as the writer
does, 10,000 rows masked as removed; queries: 256 states drawn i.i.d. from those held out
(8 of each of 32 episodes for sets made of episodes). Per ``nprobe``: the median CPU ms of
each part over 7 repetitions, and recall@10 of the scan (lists found exactly).
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


def cpu_ms(fn, reps: int = 7) -> float:
    spent = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        spent.append(time.process_time() - t)
    return round(float(np.median(spent)) * 1e3, 2)


def scan(ivf, q, lists, near, sel, k=K):
    """``search_preassigned`` of ``q`` over ``lists`` (what ``ivf_search`` runs)."""
    import faiss

    m, nprobe = lists.shape
    params = faiss.SearchParametersIVF(nprobe=nprobe)
    if sel is not None:
        params.sel = sel
    d, i = np.empty((m, k), np.float32), np.empty((m, k), np.int64)
    ivf.search_preassigned_c(
        m, faiss.swig_ptr(q), k, faiss.swig_ptr(lists), faiss.swig_ptr(near),
        faiss.swig_ptr(d), faiss.swig_ptr(i), False, params,
    )  # fmt: skip
    return i


def main() -> None:
    import faiss

    from orchestrator.retrieval.calibrate import calibrate, held_out
    from orchestrator.retrieval.coarse import Coarse, quantizer
    from orchestrator.retrieval.spec import IndexSpec, per_list
    from orchestrator.retrieval.vectors import new_ivf
    from orchestrator.retrieval.writer import train_centroids

    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="mixture")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--nlist", type=int, default=0)
    ap.add_argument("--nprobe", default="")
    ap.add_argument("--sq", action="store_true")
    args = ap.parse_args()
    faiss.omp_set_num_threads(1)
    n, ep = args.n, EP_LEN.get(args.data, 1)
    made = SETS[args.data](n + 10_000 + 32 * max(ep, 8), seed=0)
    x, held = np.ascontiguousarray(made[:n]), made[n + 10_000 :]
    if ep > 1:  # 8 states of each of 32 episodes never stored
        eps = held[: 32 * ep].reshape(32, ep, -1)
        pick = np.random.default_rng(5).choice(ep, (32, 8))
        held = np.take_along_axis(eps, pick[:, :, None], axis=1).reshape(256, -1)
    q = np.ascontiguousarray(held[:256])
    spec = IndexSpec(nlist=args.nlist or None)
    nlist, d = spec.lists(n), x.shape[1]
    need = per_list(nlist) * nlist
    episodes = np.arange(n) // ep
    rng = np.random.default_rng(1)
    out = held_out(episodes, rng)
    pool = np.flatnonzero(~out)
    t = time.perf_counter()
    sample = x[np.sort(rng.choice(pool, min(need, len(pool)), replace=False))]
    centroids = train_centroids(sample, nlist, False)
    coarse = Coarse(centroids, "l2", "hnsw", spec.quantizer_ef)
    graph = coarse.graph or quantizer(centroids, "l2", "hnsw")  # below 2,048 lists: its own
    graph32 = quantizer(centroids, "l2", "hnsw", m=32)  # twice the links, beside it
    lists = np.concatenate([coarse.assign(x[i : i + 65536]) for i in range(0, n, 65536)]) - 1
    cal = calibrate(x, lists, centroids, spec, coarse, episodes, out)
    at, ids = np.ascontiguousarray(lists.astype(np.int64)), np.arange(n, dtype=np.int64)
    ivfs = {"flat": new_ivf(coarse, d, "l2", fp16=False), "fp16": new_ivf(coarse, d, "l2")}
    if args.sq:
        qt = faiss.ScalarQuantizer.QT_8bit
        ivfs["sq8"] = faiss.IndexIVFScalarQuantizer(
            coarse.flat, d, nlist, qt, faiss.METRIC_L2, False
        )
        ivfs["sq8"].sq.train(sample)
    for ivf in ivfs.values():
        ivf.is_trained = True
        ivf.add_core(n, faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(at))
    live = np.ones(n, bool)
    live[:10_000] = False
    bits = np.packbits(live, bitorder="little")
    sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
    _, truth = faiss.knn(q, x[10_000:], K)
    truth += 10_000
    exact = cpu_ms(lambda: faiss.knn(q, x[10_000:], K), reps=3)
    head = {"data": args.data, "n": n, "nlist": nlist, "calibrated_nprobe": cal.nprobe}
    head |= {"build_s": round(time.perf_counter() - t), "exact_scan_ms": exact}
    print(json.dumps(head | {"load": os.getloadavg()[0]}), flush=True)
    probes = [int(p) for p in args.nprobe.split(",") if p] or [cal.nprobe]
    for p in probes:
        row = profile(p, x, q, truth, coarse, (graph, graph32), ivfs, sel, spec.quantizer_ef)
        print(json.dumps(row | {"load": os.getloadavg()[0]}), flush=True)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [len(set(a) & set(b)) / K for a, b in zip(found, truth, strict=True)]
    return round(float(np.mean(hits)), 4)


def profile(p, x, q, truth, coarse, graph, ivfs, sel, ef) -> dict:
    """One ``nprobe``'s parts (module docstring)."""
    import faiss

    from orchestrator.retrieval.vectors import RERANK, rerank

    hp = faiss.SearchParametersHNSW(efSearch=max(ef, p))
    near, found = coarse.flat.search(q, p)
    o = np.argsort(found[:, 0], kind="stable")
    qs, fs, ns = (np.ascontiguousarray(a[o]) for a in (q, found, near))
    ivf = ivfs["flat"]
    row = {"nprobe": p, "coarse_graph": cpu_ms(lambda: graph[0].search(q, p, params=hp))}
    row["coarse_graph_m32"] = cpu_ms(lambda: graph[1].search(q, p, params=hp))
    row["coarse_flat"] = cpu_ms(lambda: coarse.flat.search(q, p))
    row["scan"] = cpu_ms(lambda: scan(ivf, q, found, near, None))
    row["scan_mask"] = cpu_ms(lambda: scan(ivf, q, found, near, sel))
    row["scan_mask_sorted"] = cpu_ms(lambda: scan(ivf, qs, fs, ns, sel))
    faiss.omp_set_num_threads(2)
    row["scan_mask_2_threads"] = cpu_ms(lambda: scan(ivf, q, found, near, sel))
    row["coarse_flat_2_threads"] = cpu_ms(lambda: coarse.flat.search(q, p))
    faiss.omp_set_num_threads(1)
    row["recall"] = recall(scan(ivf, q, found, near, sel), truth)

    def fp16():  # what readers scan: fp16 residual codes, k + RERANK re-ranked exactly
        cand = scan(ivfs["fp16"], q, found, near, sel, K + RERANK)
        return rerank(q, x, cand, K, False)[1]

    row["fp16_rerank"] = cpu_ms(fp16)
    row["fp16_recall"] = recall(fp16(), truth)
    if "sq8" in ivfs:

        def reranked():
            cand = scan(ivfs["sq8"], q, found, near, sel, 4 * K)
            dist = ((x[np.maximum(cand, 0)] - q[:, None, :]) ** 2).sum(-1)
            dist[cand < 0] = np.inf
            return np.take_along_axis(cand, np.argsort(dist, axis=1)[:, :K], 1)

        row["sq8_rerank"] = cpu_ms(reranked)
        row["sq8_recall"] = recall(reranked(), truth)
    return row


if __name__ == "__main__":
    main()
