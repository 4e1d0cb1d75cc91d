"""An IVF index's search breadth (``nprobe``) calibrated to a recall target.

A reader ranks every vector of the lists a query probes (by its fp16 residual code or
its float32 vector) and the best ``k + RERANK`` again exactly, so a query finds one of
its true neighbours when that neighbour's list is among the probed ones, unless fp16
rounding puts more than ``RERANK`` others ahead of it (near-duplicates far from their
centroid, :data:`~orchestrator.retrieval.vectors.RERANK`: the recall measured here does
not count that; on the benchmark's sets the fp16 scan's recall@10 was within 0.001 of
float32 vectors' at the same lists and ``nprobe``). The writer holds out whole episodes
of the stored vectors (at least ``MIN_GROUPS``, at most an eighth of the vectors) from
the k-means sample and takes ``SAMPLE`` of their vectors as queries: a learner's states
come from episodes the index was not trained on and does not hold (a state a training
saw sits nearer its centroid than a learner's state does), and a stored state's own
episode holds its nearest neighbours (the steps beside it), which a query from elsewhere
would not find so easily: on 200k states of a smooth process, queries from stored
episodes gave recall 0.99 at ``nprobe`` 2, held-out episodes 0.78. Each query's ``K``
true neighbours come from an exact search of the rest, and each neighbour's list is
ranked among the query's centroids: a neighbour whose list ranks ``r`` is found from
``nprobe = r`` on. That gives the recall at every ``nprobe`` at once, with no IVF built.
The smallest ``nprobe`` whose recall is at least the target with a margin (the mean
recall minus ``Z`` standard errors of it, counted over episodes) is then checked with
the lists readers find at it (:class:`~orchestrator.retrieval.coarse.Coarse`: its HNSW
graph finds almost, not always, the nearest lists) and raised by a quarter until that
check passes too.

A fixed ``nprobe`` cannot be right for every data set: 12 lists of 16,384 give recall@10
0.976 on 1M 32-d states of a smooth process, 0.487 on a Gaussian mixture of the same
size, which needs 132 (docs/retrieval.md, "Recall and latency"). The writer calibrates
after each training and whenever the vectors have grown by half since the last time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchestrator.retrieval.coarse import Coarse
from orchestrator.retrieval.engine import faiss
from orchestrator.retrieval.spec import IndexSpec

SAMPLE = 512
"""Held-out vectors used as queries (the exact search of every stored vector for them is
most of the cost: ~3 s of one core at 1M x 32)."""
MIN_GROUPS = 64
"""Episodes the queries are drawn from, at least (their recall varies by episode)."""
HOLD_SHARE = 8
"""At most one vector in this many is held out (out of the k-means sample and of the
exact search: the first training has only just enough vectors)."""
K = 10
"""The recall is recall@K (queries asking for more neighbours find a little fewer)."""
Z = 2.0
"""Standard errors of the sample's mean recall kept below it: the target holds with ~98 %
confidence for queries like the sample."""
RAISE = 1.25
"""Factor ``nprobe`` grows by while the check with the readers' quantizer falls short."""
EXACT_ROWS = 65536
"""Stored vectors per call of the exact search (no copy of all of them at once)."""


@dataclass(frozen=True)
class Calibration:
    """The ``nprobe`` chosen, the sample's mean recall@K there and its lower bound."""

    nprobe: int
    recall: float
    bound: float


def _bound(found: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """Mean recall of per-query found flags ``(m, K)``, and that mean minus ``Z`` standard
    errors of it, from the mean of each episode's queries (the queries of one episode are
    alike: their spread would understate the error)."""
    per_query = found.mean(axis=1)
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    per_group = np.bincount(inverse, per_query) / counts
    mean = float(per_query.mean())
    if len(per_group) < 2:
        return mean, mean
    return mean, mean - Z * float(per_group.std(ddof=1)) / math.sqrt(len(per_group))


def exact_neighbours(
    queries: np.ndarray, vectors: np.ndarray, base: np.ndarray, ip: bool
) -> np.ndarray:
    """The ``K`` nearest of ``queries`` among ``vectors[base]`` (``K <= len(base)``), as
    indices into ``vectors``: an exact search of ``EXACT_ROWS`` of them at a time."""
    heap = faiss.ResultHeap(len(queries), K, keep_max=ip)
    fm = faiss.METRIC_INNER_PRODUCT if ip else faiss.METRIC_L2
    for lo in range(0, len(base), EXACT_ROWS):
        part = base[lo : lo + EXACT_ROWS]
        x = np.ascontiguousarray(vectors[part], np.float32)
        dist, pos = faiss.knn(queries, x, min(K, len(part)), metric=fm)
        heap.add_result(dist, part[pos])
    heap.finalize()
    return heap.I


def held_out(
    groups: np.ndarray, rng: np.random.Generator, fresh: np.ndarray | None = None
) -> np.ndarray:
    """Which vectors are held out: whole episodes (``groups``) with a ``fresh`` vector
    (default: all are), drawn at random until their fresh vectors number ``SAMPLE`` and
    they are ``MIN_GROUPS`` episodes, or they hold ``1 / HOLD_SHARE`` of the vectors. An
    episode holding more than that share is never held out whole; when every episode with
    a fresh vector does (one episode only, or a few endless ones), single vectors are."""
    fresh = np.ones(len(groups), bool) if fresh is None else fresh
    share = len(groups) // HOLD_SHARE
    _, inverse = np.unique(groups, return_inverse=True)
    counts = np.bincount(inverse)
    usable = np.bincount(inverse, fresh).astype(np.int64)
    if not ((usable > 0) & (counts <= share)).any():
        inverse = np.arange(len(groups))
        counts, usable = np.ones(len(groups), np.int64), fresh.astype(np.int64)
    order = rng.permutation(np.flatnonzero((usable > 0) & (counts <= max(share, 1))))
    got = np.cumsum(usable[order])
    enough = np.flatnonzero((got >= SAMPLE) & (np.arange(1, len(order) + 1) >= MIN_GROUPS))
    take = int(enough[0]) + 1 if len(enough) else len(order)
    most = int(np.searchsorted(np.cumsum(counts[order]), share, side="right"))
    out = np.zeros(len(counts), bool)
    out[order[: max(1, min(take, most))]] = True
    return out[inverse]


def calibrate(
    vectors: np.ndarray,
    lists: np.ndarray,
    centroids: np.ndarray,
    spec: IndexSpec,
    coarse: Coarse,
    groups: np.ndarray,
    out: np.ndarray,
    fresh: np.ndarray | None = None,
    seed: int = 0,
) -> Calibration:
    """The smallest ``nprobe`` reaching ``spec.recall`` on ``vectors`` (every stored
    vector a query may find), whose IVF lists (0-based) are ``lists`` under
    ``centroids``; ``coarse`` is how readers find a query's lists among them. ``out``:
    the vectors held out (:func:`held_out`: whole episodes, none of them in the k-means
    sample); the queries are ``SAMPLE`` of those that are also ``fresh``; ``groups`` is
    each vector's episode."""
    nlist, n = len(centroids), len(vectors)
    pool = np.flatnonzero(out if fresh is None else out & fresh)
    if n - len(np.flatnonzero(out)) < K or not len(pool) or nlist <= 1:
        return Calibration(nlist, 1.0, 1.0)
    rng = np.random.default_rng(seed)
    at = np.sort(rng.choice(pool, min(SAMPLE, len(pool)), replace=False))
    base = np.flatnonzero(~out)
    queries = np.ascontiguousarray(vectors[at], np.float32)
    ip = spec.metric != "l2"
    nb = exact_neighbours(queries, vectors, base, ip)
    truth = lists[nb].astype(np.int64)  # (m, K): the list of each true neighbour
    groups = np.asarray(groups)[at]

    c = np.ascontiguousarray(centroids, np.float32)
    scores = -(queries @ c.T) if ip else (c * c).sum(axis=1)[None, :] - 2 * (queries @ c.T)
    mine = np.take_along_axis(scores, truth, axis=1)
    scores.sort(axis=1)
    rank = np.stack(
        [np.searchsorted(row, t, side="left") for row, t in zip(scores, mine, strict=True)]
    )
    need = np.minimum(rank + 1, nlist)  # lists probed before the neighbour is found
    lo, hi = 1, nlist  # the bound grows with nprobe: the smallest that passes
    while lo < hi:
        mid = (lo + hi) // 2
        if _bound(need <= mid, groups)[1] >= spec.recall:
            hi = mid
        else:
            lo = mid + 1
    nprobe = lo
    while True:
        _, probed = coarse.search(queries, nprobe)
        found = np.stack([np.isin(t, p) for t, p in zip(truth, probed, strict=True)])
        mean, bound = _bound(found, groups)
        if bound >= spec.recall or nprobe >= nlist:
            return Calibration(nprobe, round(mean, 4), round(bound, 4))
        nprobe = min(nlist, math.ceil(nprobe * RAISE))
