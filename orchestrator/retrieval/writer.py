"""Keeping a vector index current: what ``claw.maintenance.vectors`` runs per index.

A tick (under the index's lock: one writer at a time, on any worker) finds the rows of the
namespace's sampling index whose live step has no vector yet (a new step, or a slot the
ring gave to another step), reads their field through the validated fetch (a row
overwritten meanwhile fails the read and waits for the next tick), projects them, and
writes vectors, ids and list assignments as raw arrays, then logs the rows. Once
``train_size`` vectors exist (``kind`` ``auto`` or ``ivf``) it trains the IVF quantizer
(k-means on a sample), assigns every stored vector, and publishes the centroids: readers
reload once. It trains again, the same way, each time the vectors have doubled since
(while the double still fits the capacity): a million-step namespace trains at 164k, 328k
and 655k vectors, the last time on a sample of most of its steps. Evicted steps are not
removed here: readers mask rows that are not alive, and a reused slot gets its new step's
vector on the next tick.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from claw_tasks.format.schema import FieldSpec
from claw_tasks.store import Store
from claw_tasks.store.compressed import decode_stored
from claw_tasks.store.slots import payload_read
from claw_tasks.where import Where
from orchestrator.retrieval.engine import faiss
from orchestrator.retrieval.spec import TWO_LEVEL_FROM, IndexSpec, Projection, per_list
from orchestrator.retrieval.storage import Head, Rows, Storage, check_field
from orchestrator.sampling.fetch import Fetcher
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings

BATCH_ROWS = 2048
"""Steps read and projected per fetch."""
ASSIGN_ROWS = 65536
"""Vectors assigned per call after training (the lock is renewed between calls)."""
KMEANS_ITER = 10
SEED = 1234
HNSW_M = 32
RETRAIN_GROWTH = 2
"""The quantizer is trained again once the vectors have doubled since its last training."""
"""Links per node of the HNSW quantizer's graph."""


def quantizer(centroids: np.ndarray, metric: str, kind: str = "flat") -> faiss.Index:
    """An index over the IVF centroids (L2, or inner product for ip/cosine): ``flat``
    (exact; the writer assigns vectors with it) or ``hnsw`` (a graph: a query finds its
    ``nprobe`` lists among 16,384 in a fraction of a flat scan's time)."""
    d, fm = centroids.shape[1], faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    q = faiss.IndexFlat(d, fm) if kind == "flat" else faiss.IndexHNSWFlat(d, HNSW_M, fm)
    q.add(np.ascontiguousarray(centroids, np.float32))
    return q


def assign(q: faiss.Index | None, vectors: np.ndarray) -> np.ndarray:
    """Each vector's list + 1 under quantizer ``q`` (0 for all without one)."""
    if q is None or not len(vectors):
        return np.zeros(len(vectors), np.int32)
    _, lists = q.search(np.ascontiguousarray(vectors, np.float32), 1)
    return (lists[:, 0] + 1).astype(np.int32)


def train_centroids(sample: np.ndarray, nlist: int, spherical: bool) -> np.ndarray:
    """k-means centroids of ``sample``. From ``TWO_LEVEL_FROM`` lists on, two levels
    (``sqrt(nlist)`` clusters, then each split in proportion to its size: faiss's
    ``two_level_clustering``): at 16,384 lists a seventeenth of one k-means's CPU time over
    every list, and as good for search (docs/benchmarks.md, "Retrieval")."""
    # The sample holds TRAIN_PER_LIST vectors per list on purpose: no warning about it.
    args = {"seed": SEED, "spherical": spherical, "verbose": False, "min_points_per_centroid": 1}
    if nlist < TWO_LEVEL_FROM:
        km = faiss.Kmeans(sample.shape[1], nlist, niter=KMEANS_ITER, **args)
        km.train(sample)
        return np.asarray(km.centroids, np.float32)
    from faiss.contrib.clustering import two_level_clustering

    top = round(math.sqrt(nlist))
    centroids, _ = two_level_clustering(sample, top, nlist, clustering_niter=KMEANS_ITER, **args)
    return np.ascontiguousarray(centroids, np.float32)


def read_rows(
    store: Store, fetch: Fetcher, spec: FieldSpec, name: str, rows: np.ndarray, ids: np.ndarray
) -> np.ndarray | None:
    """Field ``name`` at global ``rows`` as an ``(n, *shape)`` array, validated against
    ``ids`` (None: a row no longer holds its step)."""
    got = fetch(rows, ids, [payload_read(name, spec, rows)])
    if got is None:
        return None
    raw = got[0][0]
    if spec.codec is not None:
        return np.asarray(decode_stored(store, name, spec, raw))
    return raw.view(np.dtype(spec.dtype)).reshape(len(rows), *spec.shape)


class Writer:
    """One index's writer in this process; ``index`` is the namespace's sampling index."""

    def __init__(self, store: Store, spec: IndexSpec, allowed: tuple[str, ...]) -> None:
        cfg = store.config(refresh=True)
        schema = cfg.schema
        assert schema is not None
        check_field(spec, schema.fields)
        self.store, self.spec = store, spec
        self.field = schema.fields[spec.field]
        self.project = Projection(spec, tuple(self.field.shape), allowed)  # type: ignore[arg-type]  # an indexed field has a fixed shape (no None)
        self.storage = Storage(store, spec, self.project.dim)
        self.fetch = Fetcher(store, cfg.cap)
        self.where = Where(spec.where or None, schema.tags)
        self.seen: np.ndarray | None = None  # per row: the id last projected (or skipped)
        self.head: Head | None = None
        self.q: faiss.Index | None = None
        self.log = ("0-0", 0)
        self.token = ""

    def _start(self) -> None:
        """Load what is stored (or start the index afresh for this namespace)."""
        head = self.storage.head()
        if head is None:
            self.storage.reset_head()
            head = self.storage.head()
        assert head is not None
        self.log = self.storage.log_position()
        self.seen = self.storage.read_all(("i",))["i"]
        self._use(head)

    def _use(self, head: Head) -> None:
        self.head = head
        self.q = None if head.centroids is None else quantizer(head.centroids, self.spec.metric)

    def _catch_up(self) -> None:
        """Rows another writer wrote since this one last looked (a worker's copy of
        ``seen`` stays current without reading every id)."""
        while True:
            lost, entries = self.storage.log_since(*self.log)
            if lost:
                self._start()
                return
            if not entries:
                return
            for eid, event in entries:
                if b"rows" in event:
                    rows = np.frombuffer(event[b"rows"], "<i8")
                    assert self.seen is not None
                    self.seen[rows] = self.storage.read(rows).ids
                elif b"gen" in event:
                    head = self.storage.head()
                    if head is not None:
                        self._use(head)
                self.log = (eid.decode(), self.log[1] + 1)

    def run(
        self, index: SamplingIndex, strings: Strings, budget_s: float, max_rows: int | None = None
    ) -> dict[str, Any]:
        """Project the steps without a vector (up to ``budget_s`` seconds or ``max_rows``),
        and train the quantizer when due. Returns counts."""
        token = self.storage.lock()
        if token is None:
            return {"written": 0, "locked": True}
        self.token = token
        try:
            done = self._run(index, strings, budget_s, max_rows)
            self.storage.ran(done)
            return done
        finally:
            self.storage.unlock(token)

    def _renew(self) -> None:
        """Keep the lock through a long training tick (k-means, then every stored vector
        assigned): another writer must not train a second quantizer meanwhile."""
        if not self.storage.renew(self.token):
            raise RuntimeError("vector index writer: lost its lock while training")

    def _run(
        self, index: SamplingIndex, strings: Strings, budget_s: float, max_rows: int | None
    ) -> dict[str, Any]:
        if self.seen is None or self.storage.head() is None:
            self._start()
        else:
            self._catch_up()
        assert self.seen is not None
        cols = index.columns
        todo = np.flatnonzero(cols["alive"] & (self.seen != cols["id"]))
        if len(todo) and self.where.conds:
            self.where.encode = strings.encode
            keep = self.where.mask(cols, rows=todo)
            self.seen[todo[~keep]] = cols["id"][todo[~keep]]  # never indexed, never read
            todo = todo[keep]
        if max_rows is not None:
            todo = todo[:max_rows]
        deadline, written, skipped = time.monotonic() + budget_s, 0, 0
        for lo in range(0, len(todo), BATCH_ROWS):
            if time.monotonic() > deadline:
                break
            rows = todo[lo : lo + BATCH_ROWS]
            ids = cols["id"][rows]
            x = read_rows(self.store, self.fetch, self.field, self.spec.field, rows, ids)
            if x is None:  # a row changed under the read: the next tick reads it again
                skipped += len(rows)
                break
            vectors = self.project(x)
            data = Rows(vectors, ids, assign(self.q, vectors))
            self.storage.write(rows, data)
            self.seen[rows] = ids
            written += len(rows)
        trained = self._train_if_due(index)
        self.log = self.storage.log_position()  # under the lock: every entry since is ours
        left = len(todo) - written
        return {"written": written, "pending": left, "skipped": skipped, "trained": trained}

    def _train_if_due(self, index: SamplingIndex) -> bool:
        """Train the IVF quantizer once enough vectors exist (kind ``auto``/``ivf``), and
        again each time they have grown ``RETRAIN_GROWTH``-fold since, while that still
        fits the capacity: the first training sees only the first steps written (a few
        hundred episodes of a million-step namespace), whose states cover less of the
        space than the later ones."""
        spec, head = self.spec, self.head
        if spec.kind == "exact" or head is None:
            return False
        cap = index.n_shards * index.cap
        cols = index.columns
        assert self.seen is not None
        have = cols["alive"] & (self.seen == cols["id"]) & (self.seen != 0)
        count = int(have.sum())
        if head.gen and not spec.retrain:
            return False
        if head.gen:
            nlist, need = head.nlist, per_list(head.nlist) * head.nlist
            again = RETRAIN_GROWTH * head.trained
            if not head.trained or count < again or again > cap:
                return False
        else:
            nlist, need = spec.lists(cap), spec.train_size(cap)
            if count < need:
                return False
        stored = self.storage.read_all(("v", "i"))
        rows = np.flatnonzero(have & (stored["i"] == cols["id"]))
        if len(rows) < need:
            return False
        rng = np.random.default_rng(SEED + head.gen)
        sample = stored["v"][np.sort(rng.choice(rows, need, replace=False))]
        centroids = train_centroids(sample, nlist, spec.metric == "cosine")
        self._renew()
        q = quantizer(centroids, spec.metric)
        every = np.flatnonzero(stored["i"] != 0)
        for lo in range(0, len(every), ASSIGN_ROWS):
            part = every[lo : lo + ASSIGN_ROWS]
            self.storage.write_assign(part, assign(q, stored["v"][part]))
            self._renew()
        self.storage.set_trained(centroids, len(rows))
        head = self.storage.head()
        if head is not None:
            self._use(head)
        return True
