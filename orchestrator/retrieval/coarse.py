"""How a query finds the IVF lists it scans: the ``nprobe`` nearest centroids.

Two indexes over the same centroids. The flat one computes every centroid's distance (for
a batch of queries one BLAS product, then a heap per query): its cost grows with the
number of lists, not with ``nprobe``; the writer assigns every vector's list with it. The
HNSW graph (``quantizer: hnsw``) visits a few hundred centroids per query at a small
``efSearch``, but its cost has a floor (~1.2 ms of CPU per 256 queries, what a flat scan
of ~1,000 centroids costs) and grows with ``efSearch``, which must be at least ``nprobe``.
A batch is searched by the graph when there are at least ``GRAPH_FROM`` lists and
``nprobe`` is below ``nlist / FLAT_SHARE``, by the flat scan otherwise (both measured in
docs/retrieval.md, "Where the time goes"); both find the same lists, the graph almost
always.
"""

from __future__ import annotations

import numpy as np

from orchestrator.retrieval.engine import faiss

HNSW_M = 16
"""Links per node of the HNSW quantizer's graph: 0.64-0.74x the CPU of 32 links at the
same ``efSearch``. It misses a near list a little more often, which the calibration's
check with it answers by a larger ``nprobe`` where it matters (1M HalfCheetah states: 20
where 32 links need 16; docs/retrieval.md, "Recall and latency")."""
GRAPH_FROM = 2048
"""Below this many lists the flat scan of the centroids is always the cheaper."""
FLAT_SHARE = 64
"""From ``nprobe >= nlist / FLAT_SHARE`` on the flat scan of the centroids is cheaper than
the graph at ``efSearch = nprobe`` (at 16,384 lists they cross between 132 and 256)."""


def quantizer(
    centroids: np.ndarray, metric: str, kind: str = "flat", m: int = HNSW_M
) -> faiss.Index:
    """An index over the IVF centroids (L2, or inner product for ip/cosine): ``flat``
    (exact) or ``hnsw`` (a graph of ``m`` links per node)."""
    d, fm = centroids.shape[1], faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    q = faiss.IndexFlat(d, fm) if kind == "flat" else faiss.IndexHNSWFlat(d, m, fm)
    q.add(np.ascontiguousarray(centroids, np.float32))
    return q


class Coarse:
    """The lists of a batch of queries, by the graph (``m`` links per node) or the flat
    scan (module docstring). ``flat`` is also the IVF's own quantizer and what assigns a
    vector its list."""

    def __init__(
        self,
        centroids: np.ndarray,
        metric: str,
        kind: str = "hnsw",
        ef: int = 16,
        m: int = HNSW_M,
    ) -> None:
        self.nlist, self.ef, self.m = len(centroids), ef, m
        self.flat = quantizer(centroids, metric, "flat")
        graph = kind == "hnsw" and self.nlist >= GRAPH_FROM  # below: never searched
        self.graph = quantizer(centroids, metric, "hnsw", m) if graph else None

    @property
    def nbytes(self) -> int:
        """Memory of the centroids (twice with the graph) and the graph's links."""
        one = self.flat.ntotal * self.flat.d * 4
        return one if self.graph is None else 2 * one + self.nlist * 8 * self.m

    def uses_graph(self, nprobe: int) -> bool:
        """Whether a search for ``nprobe`` lists goes through the graph."""
        return self.graph is not None and nprobe * FLAT_SHARE < self.nlist

    def search(self, queries: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Distances to, and numbers of, the ``nprobe`` lists of each query, nearest first."""
        nprobe = min(nprobe, self.nlist)
        if self.uses_graph(nprobe):
            assert self.graph is not None
            params = faiss.SearchParametersHNSW(efSearch=max(self.ef, nprobe))
            return self.graph.search(queries, nprobe, params=params)
        return self.flat.search(queries, nprobe)

    def assign(self, vectors: np.ndarray) -> np.ndarray:
        """Each vector's list + 1 (the flat scan: exactly the nearest centroid)."""
        if not len(vectors):
            return np.zeros(0, np.int32)
        _, lists = self.flat.search(np.ascontiguousarray(vectors, np.float32), 1)
        return (lists[:, 0] + 1).astype(np.int32)
