"""A process's copy of one vector index, and search under a row mask.

The copy holds, per global row ``shard * cap + slot``, the stored vector and the id of
the step it was computed from (``vid``; 0: none), and, once the quantizer is trained, a
Faiss IVF whose ids are those rows (a direct map makes replacing a row's entry O(1)).
Its lists hold each vector's residual to its list's centroid as fp16 codes at a
dimension that is a multiple of 8 (:func:`new_ivf`: half the bytes a scan reads, and the
scan's cost is mostly reading them; float32 otherwise, or with ``codes: float32``); a
search re-ranks its best ``k + RERANK`` candidates exactly from the stored vectors, so
the distances it returns, and their order, are exact. The copy is loaded from the
index's raw arrays (no projection, no k-means, no list assignment: the writer stored
each vector's list), then kept current from the index's log (:meth:`refresh`); a log
trimmed past this copy, or a newly trained quantizer, reloads it.

Search takes a boolean mask over rows (the caller's: alive, trainable, ``vid == id``, its
``where``): few candidates (``exact_below``), an untrained or ``exact`` index: an exact
scan of just those rows' vectors; otherwise the IVF searched with the mask as a Faiss
``IDSelectorBitmap`` (``nprobe`` lists: the definition's, or else the one the writer
calibrated to its recall target and published in the head and the log; divided by the
share of rows the mask keeps; found by :class:`~orchestrator.retrieval.coarse.Coarse`,
which this copy builds from the stored centroids), falling back to the exact scan for
queries whose probed lists held fewer than ``k`` candidates."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from claw_tasks.store import Store
from orchestrator.retrieval.coarse import Coarse
from orchestrator.retrieval.engine import faiss
from orchestrator.retrieval.spec import IndexSpec
from orchestrator.retrieval.storage import Head, Storage

RERANK = 8
"""Candidates a scan of fp16 codes keeps beyond ``k`` for the exact re-rank. A code's
distance is off by at most ~``2 * 2**-11 * |q - x| * |r|`` (``r``: the vector's residual
to its centroid), far below the gaps between neighbours unless they sit much nearer each
other than their centroid: a clump of near-duplicates far from it is ranked almost at
random, and 8 more candidates find only some of its ``k`` nearest (bench/fp16_clumps.py;
``codes: float32`` keeps exact distances in the scan)."""
FP16_SAFE = 2.0**14
"""Vectors whose every component is below this in magnitude have residuals within fp16's
range (65,504); an index holding a larger one keeps float32 codes (``IndexIVFFlat``)."""
FP16_DIM = 8
"""fp16 codes only for a dimension that is a multiple of this: Faiss decodes them 8 (or
16) features at a time with SIMD and falls back to one feature at a time otherwise, which
costs more than scanning float32 vectors (17-d HalfCheetah states)."""
FALLBACK_NPROBE = 12
"""``nprobe`` of a trained index with no calibration yet (the writer calibrates it at its
next tick): readers take the calibrated one from the head or the log as soon as it is."""


def exact_search(
    queries: np.ndarray, base: np.ndarray, k: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest of ``queries`` in ``base``: (distances, positions), -1 past the end."""
    m = len(queries)
    dist = np.full((m, k), np.nan, np.float32)
    pos = np.full((m, k), -1, np.int64)
    if not len(base) or not m:
        return dist, pos
    kk = min(k, len(base))
    fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    d, p = faiss.knn(np.ascontiguousarray(queries), np.ascontiguousarray(base), kk, metric=fm)
    dist[:, :kk], pos[:, :kk] = d, p
    return dist, pos


def fits_fp16(vectors: np.ndarray) -> bool:
    """Whether fp16 residual codes hold ``vectors`` (every component finite, below
    ``FP16_SAFE``)."""
    if not vectors.size:
        return True
    return bool(max(vectors.max(), -vectors.min()) < FP16_SAFE)  # NaN: False


def new_ivf(coarse: Coarse, dim: int, metric: str, fp16: bool = True) -> faiss.IndexIVF:
    """An empty IVF over ``coarse``'s centroids (filled with ``add_core`` at the stored
    lists), its ids the rows, with a direct map: fp16 codes of each vector's residual to its
    centroid (``IndexIVFScalarQuantizer``, nothing to train), or float32 vectors
    (``IndexIVFFlat``) when ``fp16`` is false or ``dim`` is not a multiple of
    ``FP16_DIM``."""
    fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    nlist = coarse.flat.ntotal
    if fp16 and dim % FP16_DIM == 0:
        qt = faiss.ScalarQuantizer.QT_fp16
        ivf = faiss.IndexIVFScalarQuantizer(coarse.flat, dim, nlist, qt, fm, True)
    else:
        ivf = faiss.IndexIVFFlat(coarse.flat, dim, nlist, fm)
    ivf.is_trained = True
    ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
    return ivf


def fp16_codes(ivf: faiss.IndexIVF) -> bool:
    """Whether ``ivf`` holds fp16 codes (its distances approximate) rather than float32
    vectors (exact)."""
    return ivf.code_size < 4 * ivf.d


def rerank(
    queries: np.ndarray, vectors: np.ndarray, rows: np.ndarray, k: int, metric_ip: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest of each query's candidate ``rows`` (-1: none, after the others) by
    exact distances to ``vectors[rows]`` (Faiss's ``knn_*_by_idx``: no copy)."""
    assert vectors.dtype == np.float32 and vectors.flags.c_contiguous
    m, c = rows.shape
    dist, out = np.empty((m, k), np.float32), np.empty((m, k), np.int64)
    fn = faiss.knn_inner_products_by_idx if metric_ip else faiss.knn_L2sqr_by_idx
    fn(
        faiss.swig_ptr(queries),
        faiss.swig_ptr(vectors),
        faiss.swig_ptr(rows),
        vectors.shape[1],
        m,
        len(vectors),
        c,
        k,
        faiss.swig_ptr(dist),
        faiss.swig_ptr(out),
        c,
    )
    return dist, out


def ivf_search(
    ivf: faiss.IndexIVF,
    coarse: Coarse,
    queries: np.ndarray,
    k: int,
    mask: np.ndarray,
    nprobe: int,
    vectors: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``ivf`` searched for the ``k`` nearest of ``queries`` (float32, contiguous) among the
    ids ``mask`` allows (an ``IDSelectorBitmap`` evaluated inside the scan), ``nprobe``
    lists divided by the share of the indexed vectors the mask keeps: about as many
    allowed candidates as an unrestricted query scans (each masked one costs a bit test).
    ``coarse`` finds each query's lists. When the batch probes more lists than there are
    (``len(queries) * nprobe >= nlist``: each list is scanned for several queries), the
    queries are scanned in the order of their nearest list, so that those probing the same
    lists follow each other while the lists are in cache (docs/retrieval.md, "Where the
    time goes"). Over fp16 codes the scan keeps ``k + RERANK`` candidates by the codes'
    distances, ranked again exactly against ``vectors`` (the rows' vectors, float32,
    contiguous); float32 codes give exact distances already. Ids -1 where the probed lists
    held fewer than ``k``."""
    bits = np.packbits(mask, bitorder="little")
    sel = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))  # its size in bytes
    share = min(1.0, np.count_nonzero(mask) / max(ivf.ntotal, 1))
    probes = min(ivf.nlist, math.ceil(nprobe / max(share, 1e-9)))
    near, lists = coarse.search(queries, probes)
    m = len(queries)
    order = None
    if m * probes >= ivf.nlist:
        order = np.argsort(lists[:, 0], kind="stable")
        queries, near, lists = queries[order], near[order], lists[order]
    q = np.ascontiguousarray(queries)
    near, lists = np.ascontiguousarray(near), np.ascontiguousarray(lists)
    approximate = fp16_codes(ivf)
    kc = k + RERANK if approximate else k
    dist, rows = np.empty((m, kc), np.float32), np.empty((m, kc), np.int64)
    params = faiss.SearchParametersIVF(sel=sel, nprobe=probes)
    ivf.search_preassigned_c(
        m,
        faiss.swig_ptr(q),
        kc,
        faiss.swig_ptr(lists),
        faiss.swig_ptr(near),
        faiss.swig_ptr(dist),
        faiss.swig_ptr(rows),
        False,
        params,
    )
    if approximate:
        dist, rows = rerank(q, vectors, rows, k, ivf.metric_type != faiss.METRIC_L2)
    if order is None:
        return dist, rows
    back = np.empty_like(order)
    back[order] = np.arange(m)
    return dist[back], rows[back]


class VectorIndex:
    """The vectors of index ``spec`` of ``store``'s namespace, as of the last :meth:`refresh`."""

    def __init__(self, store: Store, spec: IndexSpec, dim: int) -> None:
        self.store, self.spec, self.dim = store, spec, dim
        self.storage = Storage(store, spec, dim)
        n = self.storage.n_shards * self.storage.cap
        self.vectors = np.zeros((n, dim), np.float32)
        self.vid = np.zeros(n, np.int64)
        self.lists = np.zeros(n, np.int32)  # list + 1 of the row's IVF entry (0: none)
        self.ivf: faiss.IndexIVF | None = None
        self.coarse: Coarse | None = None
        self.head: Head | None = None
        self.nprobe = spec.nprobe or FALLBACK_NPROBE
        self.log = ("0-0", 0)
        self.loads = 0  # cold loads so far (tests, stats)

    @property
    def nbytes(self) -> int:
        """Memory this copy holds (arrays and IVF lists, not Faiss's small overheads)."""
        ivf = 0
        if self.ivf is not None:
            code = self.ivf.code_size  # 2 B a feature (fp16) or 4 (float32)
            ivf = self.ivf.ntotal * (code + 8) + 16 * self.ivf.ntotal  # + direct map
        if self.coarse is not None:
            ivf += self.coarse.nbytes
        return self.vectors.nbytes + self.vid.nbytes + self.lists.nbytes + ivf

    def load(self) -> None:
        """Everything from Redis: the log position first (what is written after it is
        replayed), then the raw arrays."""
        self.log = self.storage.log_position()
        self.head = self.storage.head()
        got = self.storage.read_all()
        self.vectors, self.vid = got["v"], got["i"]
        self.lists = np.zeros(len(self.vid), np.int32)
        self.ivf, self.coarse = None, None
        self.loads += 1
        calibrated = 0 if self.head is None else self.head.nprobe
        self.nprobe = self.spec.nprobe or calibrated or FALLBACK_NPROBE
        if self.head is None or self.head.centroids is None:
            return
        spec = self.spec
        self.coarse = Coarse(self.head.centroids, spec.metric, spec.quantizer, spec.quantizer_ef)
        rows = np.flatnonzero(self.vid != 0)
        stored = got["a"][rows]
        missing = stored == 0  # written before the training finished: assign here
        stored[missing] = self.coarse.assign(self.vectors[rows[missing]])
        fp16 = spec.codes == "fp16" and fits_fp16(self.vectors)
        fp16 = fp16 and fits_fp16(self.head.centroids)
        self.ivf = new_ivf(self.coarse, self.dim, spec.metric, fp16)
        self._add(rows, stored)

    def _add(self, rows: np.ndarray, lists: np.ndarray) -> None:
        assert self.ivf is not None and self.coarse is not None
        if not len(rows):
            return
        x = np.ascontiguousarray(self.vectors[rows])
        if fp16_codes(self.ivf) and not fits_fp16(x):
            # a vector beyond fp16's range: every entry again, as float32 codes
            self.ivf = new_ivf(self.coarse, self.dim, self.spec.metric, fp16=False)
            held = np.flatnonzero(self.lists != 0)  # entries of the old IVF (not ``rows``)
            rows = np.concatenate([held, rows])
            lists = np.concatenate([self.lists[held], lists])
            x = np.ascontiguousarray(self.vectors[rows])
        ids = np.ascontiguousarray(rows, np.int64)
        at = np.ascontiguousarray(lists.astype(np.int64) - 1)
        self.ivf.add_core(len(rows), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(at))
        self.lists[rows] = lists

    def refresh(
        self, watch: tuple[Callable[[Any], None], Callable[[bytes | None], None]] | None = None
    ) -> np.ndarray | None:
        """Apply the log since the last look: returns the rows whose vector changed, or
        None after a cold load (every row may have). ``watch``: what queues one read of a
        namespace-level key on a pipeline (the same round trip as the log), and what to call
        with its reply before anything is applied (it may raise)."""
        if self.head is None:
            if watch is not None:
                with self.store.r.pipeline(transaction=False) as pipe:
                    watch[0](pipe)
                    watch[1](pipe.execute()[0])
            self.load()
            return None
        changed = []
        while True:
            if watch is not None:
                lost, entries, value = self.storage.log_and_get(*self.log, watch[0])
                watch, check = None, watch[1]  # its first page's round trip
                check(value)
            else:
                lost, entries = self.storage.log_since(*self.log)
            if lost or any(b"gen" in e for _, e in entries):
                self.load()
                return None
            if not entries:
                break
            for _, e in entries:
                if b"nprobe" in e and self.spec.nprobe is None:
                    self.nprobe = int(e[b"nprobe"])
            written = [np.frombuffer(e[b"rows"], "<i8") for _, e in entries if b"rows" in e]
            rows = np.unique(np.concatenate(written)) if written else np.zeros(0, np.int64)
            if len(rows):
                self._apply(rows)
                changed.append(rows)
            self.log = (entries[-1][0].decode(), self.log[1] + len(entries))
        return np.unique(np.concatenate(changed)) if changed else np.zeros(0, np.int64)

    def _apply(self, rows: np.ndarray) -> None:
        got = self.storage.read(rows)
        self.vectors[rows], self.vid[rows] = got.vectors, got.ids
        if self.ivf is None:
            return
        present = rows[self.lists[rows] != 0]
        if len(present):
            self.ivf.remove_ids(faiss.IDSelectorArray(len(present), faiss.swig_ptr(present)))
            self.lists[present] = 0
        lists = got.assign.copy()
        missing = (lists == 0) & (got.ids != 0)
        assert self.coarse is not None
        lists[missing] = self.coarse.assign(got.vectors[missing])
        keep = got.ids != 0
        self._add(rows[keep], lists[keep])

    def search(
        self, queries: np.ndarray, k: int, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest rows of each query among the rows ``mask`` allows: (distances,
        rows), rows -1 (distance NaN) past the candidates. Distances are faiss's: squared
        L2 for ``l2``, inner products (larger is nearer) for ``ip`` and ``cosine``."""
        queries = np.ascontiguousarray(queries, np.float32)
        exact = self.ivf is None or self.spec.kind == "exact"
        allowed = np.count_nonzero(mask)
        if exact or allowed <= self.spec.exact_below:
            return self._exact(queries, k, mask)
        assert self.ivf is not None and self.coarse is not None
        dist, rows = ivf_search(self.ivf, self.coarse, queries, k, mask, self.nprobe, self.vectors)
        short = (rows < 0).any(axis=1)
        if short.any():  # the probed lists held fewer than k candidates: scan exactly
            dist[short], rows[short] = self._exact(queries[short], k, mask)
        dist[rows < 0] = np.nan
        return dist, rows

    def _exact(
        self, queries: np.ndarray, k: int, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """An exact scan of the rows ``mask`` allows."""
        candidates = np.flatnonzero(mask)
        dist, pos = exact_search(queries, self.vectors[candidates], k, self.spec.metric)
        if not len(candidates):  # every row masked (evicted or filtered out): all -1
            return dist, pos
        return dist, np.where(pos >= 0, candidates[np.maximum(pos, 0)], -1)
