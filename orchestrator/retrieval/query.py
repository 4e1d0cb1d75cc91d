"""``nearest``: the k nearest stored steps of each query state, restricted by a ``where``.

Per process and namespace index a session keeps the namespace's sampling index (the
metadata a ``where`` reads; the host's shared one where there is one), the index's
vectors (:class:`~orchestrator.retrieval.vectors.VectorIndex`) and masks kept current
incrementally: ``valid`` (alive, trainable, and the stored vector is the one of the step
in the row now) and one per recent ``where``. A query syncs both indexes (the vectors'
log is read in the same round trip as the namespace's config: a namespace made again
starts a new session), searches the rows ``valid & where`` allows for ``k + SLACK``
candidates and reads the fields of the first ``k`` through the sampling fetch, whose
script checks in the round trip that reads them that each row still holds its step (the
slot not allocated again since, the alive bit set). Three round trips in all. When a row
fails that check (evicted since the sync) the query runs again, now checking the
candidates first (``Store.holding``) and keeping the first ``k`` live ones, whose fetch
checks them once more. A step evicted before the query started is masked by the sync or
fails a check, one evicted during it fails the fetch's: no evicted step is ever returned.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from claw_tasks.format.stepmeta import UNTRAINABLE
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.store.config import NamespaceConfig
from claw_tasks.where import Where
from claw_tasks.worker.context import context_for, forget
from claw_tasks.worker.lru import LRU
from orchestrator.recipe.model import Recipe
from orchestrator.recipe.options import Nearest
from orchestrator.retrieval.spec import IndexSpec, Projection, SpecError
from orchestrator.retrieval.storage import check_field, list_indexes
from orchestrator.retrieval.vectors import VectorIndex
from orchestrator.sampling.assembly import Assembly
from orchestrator.sampling.fetch import Fetcher
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.samplers import Draw
from orchestrator.sampling.shared import SharedIndex, make_index
from orchestrator.sampling.strings import Strings

ATTEMPTS = 8
"""Queries per call before giving up on steps evicted under it."""
SLACK = 8
"""Candidates asked for beyond ``k``: a few may turn out evicted since the sync."""
WHERE_CACHE = 8
"""Masks of this many recent ``where``s are kept (per session)."""


class RetrievalError(RuntimeError):
    """Every attempt of a query met steps evicted or overwritten before they were read."""


class Recreated(Exception):
    """The namespace's config changed its creation time (or it is gone): start afresh."""


@dataclass
class Neighbours:
    """The answer to a query of m states: per state its k neighbours, nearest first.

    ``ids`` int64 (m, k), -1 where fewer than k steps matched; ``distances`` float32
    (m, k), NaN there (squared L2 for ``l2``, inner products for ``ip``/``cosine``);
    ``fields`` the fields asked for, each (m, k, ...) (zeros where -1); ``meta`` string
    fields, nested lists ``[m][k]`` (None where -1)."""

    ids: np.ndarray
    distances: np.ndarray
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, list[list[Any]]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]


def nearest(
    namespace_or_store: str | Store,
    states: Any,
    k: int = 10,
    *,
    index: str = "default",
    where: str | Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    fields: Sequence[str] = (),
    redis_url: str | None = None,
    projected: bool = False,
) -> Neighbours:
    """The ``k`` nearest steps of each of ``states`` (a batch of the index's field, shape
    ``(m, *field shape)``, or ``(m, dim)`` vectors with ``projected``) in vector index
    ``index``, among the steps ``where`` selects (the where language, ``$params`` from
    ``params``), with ``fields`` read for each (payload fields, ``next_obs``, metadata
    keys: what a recipe's ``fields`` may name)."""
    k = check_k(k)
    states = np.asarray(states)
    for _ in range(2):
        session = open_session(namespace_or_store, redis_url, index)
        with session.lock:
            try:
                return session.query(states, k, where, params or {}, list(fields), projected)
            except Recreated:  # the namespace was made again since the session began
                forget(session.store.namespace, dropped=True)
    raise RetrievalError(f"nearest in {session.store.namespace!r}: the namespace keeps changing")


def check_k(k: Any, name: str = "k") -> int:
    """``k`` as an int in ``1..CLAW_NEAREST_MAX_K``; else ``ValueError`` naming ``name`` and
    the bound. A query holds (states x (k + SLACK)) candidates and (states x k) rows of every
    field asked for: an unbounded ``k`` is an allocation of the caller's choosing in a
    process (a prefetch worker) that serves other namespaces too."""
    bound = get_settings().nearest_max_k
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise ValueError(f"{name} must be an integer in 1..{bound}, got {k!r:.40}")
    if not 1 <= k <= bound:
        raise ValueError(f"{name} must be in 1..{bound} (CLAW_NEAREST_MAX_K), got {k}")
    return int(k)


SESSIONS = "retrieval"
"""The retrieval sessions' name in a namespace context: an ``LRU`` of index name ->
:class:`Session`, the ``INDEX_SESSIONS`` most recently used."""
INDEX_SESSIONS = 8
"""Vector indexes of one namespace a process keeps a session of: each holds the index's
vectors, so a process holds at most ``namespace_cache_size`` x 8 indexes' vectors."""


def open_session(target: str | Store, redis_url: str | None, name: str) -> Session:
    """This process's session of index ``name`` (made on first use, kept in the
    namespace's context: later queries reuse its copy of the index and catch it up from
    the log; each query checks the namespace's config in the round trip that reads the
    log)."""
    ctx = context_for(target, redis_url)
    sessions: LRU[str, Session] = ctx.part(SESSIONS, lambda: LRU(INDEX_SESSIONS))
    return sessions.get(name, lambda: Session(ctx.store, name))


class Session:
    """One index of one namespace in this process (see the module docstring)."""

    def __init__(self, store: Store, name: str) -> None:
        specs = list_indexes(store)
        if name not in specs:
            known = ", ".join(specs) or "none"
            raise SpecError(
                f"namespace {store.namespace!r} has no vector index {name!r} (defined: {known})"
            )
        cfg = store.config(refresh=True)
        if cfg.schema is None:
            raise SpecError(f"namespace {store.namespace!r} has no steps yet")
        self.spec: IndexSpec = specs[name]
        self.created, self.config_raw = cfg.created, cfg.to_bytes()
        self.store, self.lock = store, threading.Lock()
        check_field(self.spec, cfg.schema.fields)
        shape = tuple(cfg.schema.fields[self.spec.field].shape)
        self.project = Projection(self.spec, shape, get_settings().features)  # type: ignore[arg-type]  # an indexed field has a fixed shape (no None)
        self.index: SamplingIndex = make_index(store)
        self.strings = Strings(store, self.index)
        self.fetch = Fetcher(store, cfg.cap)
        self.vectors = VectorIndex(store, self.spec, self.project.dim)
        self.valid = np.zeros(0, bool)
        self.masks: dict[tuple[Any, ...], np.ndarray] = {}
        self.compiled: dict[Any, Where] = {}
        self._meta: list[np.ndarray | None] = []
        self.index.subscribe(self._changed)
        self.recipes: dict[tuple[str, ...], Recipe] = {}  # what _read assembles, by fields

    def _changed(self, rows: np.ndarray | None) -> None:
        self.strings.observe(rows)
        self._meta.append(rows)

    def close(self, dropped: bool) -> None:
        """Detach from the host's shared index (``dropped``: every process rebuilds it)."""
        if isinstance(self.index, SharedIndex):
            self.index.close(invalidate=dropped)

    # ---- masks ---------------------------------------------------------------------------
    def _update_masks(self, vec_rows: np.ndarray | None) -> None:
        cols = self.index.columns
        changed = [*self._meta, vec_rows]
        self._meta.clear()
        if any(c is None for c in changed) or len(self.valid) != len(cols["id"]):
            self.valid = self._valid(None)
            self.masks.clear()
            return
        rows: np.ndarray = np.unique(np.concatenate(cast(list[np.ndarray], changed)))
        if not len(rows):
            return
        self.valid[rows] = self._valid(rows)
        for (where, pkey), mask in self.masks.items():
            mask[rows] = where.mask(cols, dict(pkey), rows=rows)

    def _valid(self, rows: np.ndarray | None) -> np.ndarray:
        cols = self.index.columns
        at = slice(None) if rows is None else rows
        vid = self.vectors.vid[at]
        return (
            cols["alive"][at]
            & ((cols["flags"][at] & UNTRAINABLE) == 0)
            & (vid == cols["id"][at])
            & (vid != 0)
        )

    def _where_mask(self, where: Where | None, params: Mapping[str, Any]) -> np.ndarray:
        if where is None or not where.conds:
            return self.valid
        if "age" in where.keys:  # moves with the clock: never cached
            return self.valid & where.mask(self.index.columns, params)
        key = (where, tuple(sorted((p, params[p]) for p in where.params)))
        mask = self.masks.get(key)
        if mask is None:
            mask = self.masks[key] = where.mask(self.index.columns, params)
            while len(self.masks) > WHERE_CACHE:
                self.masks.pop(next(iter(self.masks)))
        return self.valid & mask

    # ---- query ---------------------------------------------------------------------------
    def query(
        self,
        states: np.ndarray,
        k: int,
        where: str | Mapping[str, Any] | None,
        params: Mapping[str, Any],
        fields: list[str],
        projected: bool,
    ) -> Neighbours:
        try:
            return self._query(states, k, where, params, fields, projected)
        finally:
            self.index.release()

    def _compile(self, where: str | Mapping[str, Any] | None) -> Where | None:
        if not where:
            return None
        key = _where_key(where)
        if key not in self.compiled:
            tags = self.index.schema.tags if self.index.schema else {}
            self.compiled[key] = Where(where, tags, self.strings.encode)
        return self.compiled[key]

    def _query(
        self,
        states: np.ndarray,
        k: int,
        where: str | Mapping[str, Any] | None,
        params: Mapping[str, Any],
        fields: list[str],
        projected: bool,
    ) -> Neighbours:
        if states.ndim == len(self.project.shape):  # one state
            states = states[None]
        queries = states.astype(np.float32) if projected else self.project(states)
        if queries.shape[1:] != (self.project.dim,):
            raise SpecError(
                f"query vectors of shape {queries.shape[1:]}, index dim {self.project.dim}"
            )
        for attempt in range(ATTEMPTS):
            # The config first: a namespace made again must not reach the old geometry.
            changed = self.vectors.refresh(watch=(self.store.queue_config, self._check_config))
            self.index.sync()
            self._update_masks(changed)
            mask = self._where_mask(self._compile(where), params)
            dist, rows = self.vectors.search(queries, k + SLACK, mask)
            if attempt == 0:  # the first k: the fetch checks them (most often all live)
                picked: tuple[np.ndarray, np.ndarray] | None = (dist[:, :k], rows[:, :k])
            else:  # some were gone last time: keep the first k that still hold their step
                picked = self._live(dist, rows, k)
            if picked is None:
                continue
            dist, rows = picked
            got = self._read(rows, fields)
            if got is not None:
                ids, out, meta = got
                return Neighbours(ids, dist, out, meta)
        raise RetrievalError(
            f"nearest in {self.store.namespace!r}: {ATTEMPTS} queries in a row returned steps "
            "evicted or overwritten before they were read (an eviction is removing many of "
            "them: try again)"
        )

    def _check_config(self, raw: bytes | None) -> None:
        """Raise :class:`Recreated` when the config read with the log belongs to another
        namespace of the same name (or there is none)."""
        if raw == self.config_raw:
            return
        if (
            raw is None
            or NamespaceConfig.from_bytes(raw, self.store.namespace).created != self.created
        ):
            raise Recreated(self.store.namespace)
        self.config_raw = raw  # new tags or retention: the sampling index takes them up

    def _live(
        self, dist: np.ndarray, rows: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The first ``k`` candidates of each query that still hold their steps (one
        ``Store.holding`` call per shard, after the search); None when some query lost
        more than ``SLACK`` of them and had more: those rows are masked, search again."""
        uniq = np.unique(rows[rows >= 0])
        dead = uniq[~self._alive(uniq)] if len(uniq) else uniq
        if len(dead):
            self.valid[dead] = False  # until a sync says what they hold now
        live = (rows >= 0) & ~np.isin(rows, dead)
        short = (live.sum(axis=1) < k) & (rows[:, -1] >= 0)  # lost some, and had more
        if short.any():
            return None
        order = np.argsort(~live, axis=1, kind="stable")[:, :k]  # live ones first, in order
        rows = np.where(np.take_along_axis(live, order, 1), np.take_along_axis(rows, order, 1), -1)
        dist = np.where(rows >= 0, np.take_along_axis(dist, order, 1), np.nan)
        return dist.astype(np.float32), rows

    def _alive(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` (sorted) still holds the step the index says."""
        cols, cap, n_shards = self.index.columns, self.index.cap, self.index.n_shards
        return self.store.holding(rows // cap, rows % cap, cols["id"][rows] // n_shards)

    def _read(
        self, rows: np.ndarray, fields: list[str]
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, list[list[Any]]]] | None:
        """Ids and fields of the neighbour ``rows``, validated in one fetch (None: a row
        no longer holds its step)."""
        cols = self.index.columns
        m, k = rows.shape
        found = rows >= 0
        uniq, inverse = np.unique(rows[found], return_inverse=True)
        ids = np.full((m, k), -1, np.int64)
        ids[found] = cols["id"][uniq][inverse]
        if not len(uniq):
            return ids, {f: np.zeros((m, k)) for f in fields}, {}
        names = tuple(fields) or ("id",)
        recipe = self.recipes.get(names)
        if recipe is None:  # validated once per fields: a Recipe costs ~0.3 ms to build
            recipe = self.recipes[names] = Recipe(
                name="nearest",
                batch_size=1,
                fields=list(names),
                sources=[{"name": "nearest"}],
            )
        draw = Draw(uniq, np.ones(len(uniq), np.float32), np.zeros(len(uniq), np.int16))
        batch = Assembly(self, recipe, draw).run()
        if batch is None:
            return None
        out: dict[str, np.ndarray] = {}
        for name in fields if fields else []:
            if name not in batch.fields:
                continue
            values = np.asarray(batch.fields[name])
            full = np.zeros((m, k, *values.shape[1:]), values.dtype)
            full[found] = values[inverse]
            out[name] = full
        meta: dict[str, list[list[Any]]] = {}
        for name, values in batch.meta.items():
            grid: list[list[Any]] = [[None] * k for _ in range(m)]
            for (i, j), u in zip(np.argwhere(found).tolist(), inverse.tolist(), strict=True):
                grid[i][j] = values[u]
            meta[name] = grid
        return ids, out, meta


def _where_key(where: str | Mapping[str, Any]) -> Any:
    return where if isinstance(where, str) else repr(sorted(where.items()))


def neighbour_fields(
    store: Store, near: Nearest, states: np.ndarray, ids: np.ndarray
) -> dict[str, np.ndarray]:
    """What a recipe's ``nearest`` section adds to a batch whose rows are the steps
    ``ids`` with query field ``states``: ``nearest.<field>`` (B, k, ...), ``nearest.id``
    and ``nearest.distance`` (B, k). With ``exclude_self`` a row's own step is dropped
    from its neighbours (k + 1 are asked for)."""
    target = store if near.namespace in (None, store.namespace) else Store(store.r, near.namespace)
    same = target.namespace == store.namespace and near.exclude_self
    k = near.k + 1 if same else near.k
    got = nearest(target, states, k, index=near.index, where=near.where or None, fields=near.fields)
    keep = np.ones(got.ids.shape, bool)
    if same:  # each row's own step, or else its farthest neighbour, goes
        own = got.ids == np.asarray(ids)[:, None]
        keep = ~own
        keep[~own.any(axis=1), -1] = False
    order = np.argsort(~keep, axis=1, kind="stable")[:, : near.k]

    def pick(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(a, order.reshape(*order.shape, *[1] * (a.ndim - 2)), axis=1)

    out = {"nearest.id": pick(got.ids), "nearest.distance": pick(got.distances)}
    for name, values in got.fields.items():
        out[f"nearest.{name}"] = pick(values)
    return out
