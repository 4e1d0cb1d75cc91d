"""Keeping a vector index current: what ``claw.maintenance.vectors`` runs per index.

A tick (under the index's lock: one writer at a time, on any worker) finds the rows of the
namespace's sampling index whose live step has no vector yet (a new step, or a slot the
ring gave to another step), reads their field through the validated fetch (a row
overwritten meanwhile fails the read and waits for the next tick), projects them, and
writes vectors, ids and list assignments as raw arrays, then logs the rows. Once
``train_size`` vectors exist (``kind`` ``auto`` or ``ivf``) it trains the IVF quantizer
(k-means on a sample), assigns every stored vector, calibrates ``nprobe`` to the index's
recall target (orchestrator/retrieval/calibrate.py) and publishes the centroids with it:
readers reload once. It calibrates again, without training, whenever the vectors have
grown by half since the last calibration (readers take the new ``nprobe`` from the log).
It trains again, the same way, each time the vectors have doubled since (while the double
still fits the capacity): a million-step namespace trains at 164k, 328k and 655k vectors,
the last time on a sample of most of its steps. Evicted steps are not removed here:
readers mask rows that are not alive, and a reused slot gets its new step's vector on the
next tick."""

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
from orchestrator.retrieval.calibrate import Calibration, calibrate, held_out
from orchestrator.retrieval.coarse import Coarse
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
RETRAIN_GROWTH = 2
"""The quantizer is trained again once the vectors have doubled since its last training."""
RECALIBRATE_GROWTH = 1.5
"""``nprobe`` is calibrated again once the vectors have grown by half since the last time
(and at every training)."""


def train_centroids(sample: np.ndarray, nlist: int, spherical: bool) -> np.ndarray:
    """k-means centroids of ``sample``. From ``TWO_LEVEL_FROM`` lists on, two levels
    (``sqrt(nlist)`` clusters, then each split in proportion to its size, as faiss's
    ``two_level_clustering``): at 16,384 lists a seventeenth of one k-means's CPU time over
    every list, and as good for search (docs/benchmarks.md, "Retrieval"). A first-level
    cluster too small for a list of its own (a few states far from every other) gets none,
    where faiss's function fails on it: its share goes to the clusters after it (``nlist``
    in all while the sample holds at least ``nlist`` vectors), and its states join the
    lists of their nearest centroids when every vector is assigned."""
    # The sample holds TRAIN_PER_LIST vectors per list on purpose: no warning about it.
    args = {"seed": SEED, "spherical": spherical, "verbose": False, "min_points_per_centroid": 1}
    d = sample.shape[1]
    if nlist < TWO_LEVEL_FROM:
        km = faiss.Kmeans(d, nlist, niter=KMEANS_ITER, **args)
        km.train(sample)
        return np.asarray(km.centroids, np.float32)
    top = faiss.Kmeans(
        d, round(math.sqrt(nlist)), niter=KMEANS_ITER, max_points_per_centroid=2000, **args
    )
    top.train(sample)
    _, first = top.index.search(sample, 1)
    first = first[:, 0]
    sizes = np.bincount(first, minlength=top.k)
    ends = np.cumsum(sizes) * nlist // len(sample)  # lists per cluster, nlist in all
    lists = np.minimum(np.diff(ends, prepend=0), sizes)
    order = np.argsort(first, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    parts = []
    for c in np.flatnonzero(lists):
        sub = np.ascontiguousarray(sample[order[bounds[c] : bounds[c + 1]]])
        if lists[c] == len(sub):
            parts.append(sub)
            continue
        km = faiss.Kmeans(d, int(lists[c]), **args)  # faiss's iterations at the second level
        km.train(sub)
        parts.append(km.centroids)
    return np.ascontiguousarray(np.vstack(parts), np.float32)


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
        self.skipped: np.ndarray | None = None  # per row: its ``seen`` step was skipped
        self.head: Head | None = None
        self.coarse: Coarse | None = None  # assigns new vectors their lists once trained
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
        self.skipped = np.zeros(len(self.seen), bool)
        self._use(head)

    def _use(self, head: Head) -> None:
        self.head = head
        centroids, metric = head.centroids, self.spec.metric
        self.coarse = None if centroids is None else Coarse(centroids, metric, "flat")

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
                    assert self.seen is not None and self.skipped is not None
                    self.seen[rows] = self.storage.read(rows).ids
                    self.skipped[rows] = False
                elif b"gen" in event or b"nprobe" in event:
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
            assert self.skipped is not None
            self.skipped[todo] = ~keep
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
            none = np.zeros(len(rows), np.int32)  # not trained yet: no list
            lists = none if self.coarse is None else self.coarse.assign(vectors)
            self.storage.write(rows, Rows(vectors, ids, lists))
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
        space than the later ones. Otherwise calibrate ``nprobe`` again when due."""
        spec, head = self.spec, self.head
        if spec.kind == "exact" or head is None:
            return False
        cap = index.n_shards * index.cap
        cols = index.columns
        assert self.seen is not None and self.skipped is not None
        # The steps with a vector (those the index's ``where`` skipped have none): what the
        # growth that trains and calibrates again is counted in.
        have = cols["alive"] & (self.seen == cols["id"]) & (self.seen != 0) & ~self.skipped
        count = int(have.sum())
        if head.gen:
            nlist, need = head.nlist, per_list(head.nlist) * head.nlist
            again = RETRAIN_GROWTH * head.trained
            due = spec.retrain and head.trained and count >= again and again <= cap
        else:
            nlist, need = spec.lists(cap), spec.train_size(cap)
            due = count >= need
        if not due:
            grown = count and count >= RECALIBRATE_GROWTH * head.calibrated
            if head.gen and spec.nprobe is None and grown:
                self._calibrate(index, have)
            return False
        stored = self.storage.read_all(("v", "i"))
        rows = np.flatnonzero(have & (stored["i"] == cols["id"]))
        if len(rows) < need:
            return False
        rng = np.random.default_rng(SEED + head.gen)
        # Episodes held out for the calibration stay out of the k-means sample: states a
        # training has seen sit nearer their centroids than a learner's states do.
        episodes = self._episodes(index, rows)
        out = np.zeros(len(rows), bool)
        if spec.nprobe is None:
            out = held_out(episodes, rng)
        pool = rows[~out]
        sample = stored["v"][np.sort(rng.choice(pool, min(need, len(pool)), replace=False))]
        centroids = train_centroids(sample, nlist, spec.metric == "cosine")
        self._renew()
        flat = Coarse(centroids, spec.metric, "flat")
        every = np.flatnonzero(stored["i"] != 0)
        lists = np.zeros(len(stored["i"]), np.int32)
        for lo in range(0, len(every), ASSIGN_ROWS):
            part = every[lo : lo + ASSIGN_ROWS]
            lists[part] = flat.assign(stored["v"][part])
            self.storage.write_assign(part, lists[part])
            self._renew()
        cal = None
        if spec.nprobe is None:
            vectors, at = stored["v"][rows], lists[rows] - 1
            cal = self._calibration(vectors, at, centroids, episodes, out, None, len(rows))
        newest = int(cols["id"][rows].max())
        self.storage.set_trained(centroids, len(rows), cal, newest)
        head = self.storage.head()
        if head is not None:
            self._use(head)
        return True

    @staticmethod
    def _episodes(index: SamplingIndex, rows: np.ndarray) -> np.ndarray:
        """The episode of each of ``rows`` as one integer (codes are per shard)."""
        codes = index.columns["episode"][rows].astype(np.int64) * index.n_shards
        return codes + rows // index.cap

    def _calibration(
        self,
        vectors: np.ndarray,
        lists: np.ndarray,
        centroids: np.ndarray,
        episodes: np.ndarray,
        out: np.ndarray,
        fresh: np.ndarray | None,
        seed: int,
    ) -> Calibration:
        """``nprobe`` for ``spec.recall`` on ``vectors``, queried from the held-out
        episodes ``out`` (orchestrator/retrieval/calibrate.py)."""
        spec = self.spec
        readers = Coarse(centroids, spec.metric, spec.quantizer, spec.quantizer_ef)
        cal = calibrate(
            vectors, lists, centroids, self.spec, readers, episodes, out, fresh, SEED + seed
        )
        self._renew()
        return cal

    def _calibrate(self, index: SamplingIndex, have: np.ndarray) -> None:
        """Calibrate the current quantizer again on every stored vector (they have grown
        ``RECALIBRATE_GROWTH``-fold since the last time) and publish it. The queries are
        steps written since the last training (none of them in its k-means sample), or any
        when there are none."""
        assert self.head is not None and self.head.centroids is not None
        stored = self.storage.read_all(("v", "i", "a"))
        ids = index.columns["id"]
        rows = np.flatnonzero(have & (stored["i"] == ids) & (stored["a"] > 0))
        if not len(rows):
            return
        fresh = ids[rows] > self.head.trained_id
        if not fresh.any():  # nothing written since (evictions shrank it): any step
            fresh[:] = True
        episodes = self._episodes(index, rows)
        rng = np.random.default_rng(SEED + len(rows))
        out = held_out(episodes, rng, fresh)
        vectors, lists = stored["v"][rows], stored["a"][rows] - 1
        cal = self._calibration(
            vectors, lists, self.head.centroids, episodes, out, fresh, len(rows)
        )
        self.storage.set_calibrated(cal, len(rows))
        self.head.nprobe, self.head.calibrated = cal.nprobe, len(rows)
