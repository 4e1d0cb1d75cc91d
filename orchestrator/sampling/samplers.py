"""Draw a recipe's batch of global rows from the metadata columns.

Filters (``where``) are the language of :mod:`claw_tasks.where`.

Every batch holds exactly ``recipe.counts[i]`` rows of source ``i``, in source order. A
source's candidates are the rows that are alive, trainable and match its ``where``:

- ``uniform``: uniform over the candidates, with replacement; weight 1.
- ``priority``: P(i) = p_i^alpha / sum_j p_j^alpha with replacement, where an unset (NaN)
  priority counts as the current maximum priority of the namespace (1.0 if none is set);
  importance weight w_i = (N * P(i))^-beta / max over the source's rows in the batch.
- ``recent``: the newest candidates by step id, newest first, without replacement;
  weight 1. Deterministic: the same data gives the same rows.
- ``group``: whole groups of trajectories (:mod:`orchestrator.sampling.groups`); a
  source's count is in groups, its rows all their steps; weight 1.

:data:`SAMPLERS` maps each kind to its class.

Windows: ``last_steps: n`` keeps the n newest candidates by step id; ``max_age_s: s``
keeps the candidates with ``timestamp >= now - s``. A source that cannot fill its rows
raises :class:`InsufficientData` (a batch is never smaller): ``recent`` needs as many
candidates (in its window) as it has rows, the samplers with replacement need one.

When the recipe needs transitions (``next_obs`` in its fields, or ``n_step > 1``) a row is
drawn only if its n-step bootstrap row has its ``next_obs`` (or the episode terminated);
with ``sequence_length > 1`` only if the whole window is stored; with ``frame_stack > 1``
only if its stack has no gap (:mod:`orchestrator.sampling.stacks`). Rejected draws are
redrawn, which samples exactly the distribution restricted to the acceptable rows.

Each source keeps sum trees over all global rows (leaf = the row's sampling mass), so a
draw costs O(log N) and :meth:`RecipeSampler.refresh` with the changed rows keeps them
current in O(changed · log N). Windowed draws and ``recent`` work on the candidate row
list, cached per change, and cost O(candidates).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from claw_tasks.where import Encoder, Where
from orchestrator.recipe.model import Recipe, Source
from orchestrator.sampling.candidates import Columns, InsufficientData, eligible, recheck
from orchestrator.sampling.groups import Claims, GroupIndex, Groups
from orchestrator.sampling.sequences import n_step, windows
from orchestrator.sampling.stacks import Predecessors
from orchestrator.sampling.sumtree import MaxTree, SumTree

Accept = Callable[[Columns, np.ndarray], np.ndarray]
_MAX_TRIES = 1 << 20  # draws per source and batch before giving up on rejections
_MAX_ROUND = 1 << 16


class Draw(NamedTuple):
    """A batch's rows, in source order."""

    rows: np.ndarray  # int64 global rows
    weights: np.ndarray  # float32 importance weights (1 for uniform and recent)
    source: np.ndarray  # int16 index into recipe.sources
    groups: Groups | None = None  # group sources: which group and trajectory each row is


class SourceIndex:
    """One source's candidates and sampling trees, kept current from changed rows."""

    def __init__(self, source: Source, where: Where, tags: Mapping[str, str] | None = None):
        self.source, self.where = source, where
        self.kind, self.alpha = source.sampler.kind, source.sampler.alpha
        window = source.window
        # Trees serve draws over all candidates: not for recent, nor an age window.
        self._trees = self.kind != "recent" and (window is None or window.max_age_s is None)
        self.n = 0  # candidates
        self.version = 0  # bumps on every change of the candidates or their priorities
        self._params: Mapping[str, Any] = {}
        self._key: tuple[Any, ...] | None = None  # resolved where the state was built for
        self._cand: np.ndarray | None = None  # bool per global row
        self._mass: SumTree | None = None  # priority: p^alpha of candidates with a priority
        self._count: SumTree | None = None  # 1 per candidate (priority: only unset ones)
        self._cache: dict[str, Any] = {}

    def invalidate(self) -> None:
        """Forget the state; the next draw rebuilds it from the columns."""
        self._cand = self._mass = self._count = None
        self._cache.clear()

    def refresh(self, columns: Columns, rows: np.ndarray) -> None:
        """Re-evaluate ``rows`` (their metadata changed: insert, priority, eviction, curation)."""
        if self._cand is None:
            return
        rows, cand, delta = recheck(self._cand, columns, rows, self.where, self._params)
        self.n += delta
        self._update_trees(columns, rows, cand)
        self.version += 1

    def draw(
        self,
        columns: Columns,
        params: Mapping[str, Any],
        k: int,
        rng: np.random.Generator,
        max_priority: float,
        now: float,
        accept: Accept | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``k`` rows and their importance weights."""
        key = self.where.key(params)
        if self._cand is None or key != self._key:
            self._build(columns, params, key)
        pool = self._pool(columns, now)
        n = self.n if pool is None else len(pool)
        need = k if self.kind == "recent" else 1
        if n < need:
            raise InsufficientData(self.source.name, n, need)
        if self.kind == "recent":
            pool = self._candidates(columns)[0] if pool is None else pool
            return self._newest(columns, pool, k, accept), np.ones(k, dtype=np.float32)
        sample, total = self._sampler(columns, pool, rng, max_priority)
        rows = self._accepted(columns, sample, k, n, accept)
        if self.kind == "uniform":
            return rows, np.ones(k, dtype=np.float32)
        p = columns["priority"][rows].astype(np.float64)
        prob = np.where(np.isnan(p), max_priority, p) ** self.alpha / total
        w = (n * prob) ** -self.source.sampler.beta
        return rows, (w / w.max()).astype(np.float32)

    def _build(self, columns: Columns, params: Mapping[str, Any], key: tuple[Any, ...]) -> None:
        self._cand = eligible(columns) & self.where.mask(columns, params)
        self._params, self._key = dict(params), key
        self.n = int(self._cand.sum())
        self._cache.clear()
        self.version += 1
        if not self._trees:
            return
        if self.kind == "uniform":
            self._count = SumTree(self._cand.astype(np.float64))
        elif self.kind == "priority":
            p = columns["priority"]
            unset = np.isnan(p)
            mass = np.zeros(len(p))
            idx = np.flatnonzero(self._cand & ~unset)
            mass[idx] = p[idx].astype(np.float64) ** self.alpha
            self._mass = SumTree(mass)
            self._count = SumTree((self._cand & unset).astype(np.float64))

    def _update_trees(self, columns: Columns, rows: np.ndarray, cand: np.ndarray) -> None:
        if not self._trees:
            return
        if self.kind == "uniform":
            self._count.update(rows, cand.astype(np.float64))
        elif self.kind == "priority":
            p = columns["priority"][rows].astype(np.float64)
            unset = np.isnan(p)
            self._mass.update(rows, np.where(cand & ~unset, p**self.alpha, 0.0))
            self._count.update(rows, (cand & unset).astype(np.float64))

    def _candidates(self, columns: Columns) -> tuple[np.ndarray, np.ndarray]:
        """Candidate rows and their ids, cached per version."""
        if self._cache.get("version") != self.version:
            rows = np.flatnonzero(self._cand)
            self._cache = {"version": self.version, "rows": rows, "ids": columns["id"][rows]}
        return self._cache["rows"], self._cache["ids"]

    def _pool(self, columns: Columns, now: float) -> np.ndarray | None:
        """The window's rows, or None when the window holds every candidate."""
        window = self.source.window
        if window is None or (window.last_steps is not None and window.last_steps >= self.n):
            return None
        rows, ids = self._candidates(columns)
        if window.max_age_s is not None:
            return rows[columns["timestamp"][rows] >= now - window.max_age_s]
        if "last" not in self._cache:
            cut = len(ids) - window.last_steps
            self._cache["last"] = rows[np.argpartition(ids, cut)[cut:]]
        return self._cache["last"]

    def _sampler(
        self, columns: Columns, pool: np.ndarray | None, rng: np.random.Generator, max_p: float
    ) -> tuple[Callable[[int], np.ndarray], float]:
        """A function drawing m rows from the source distribution, and its total mass."""
        if self.kind == "uniform":
            if pool is None:
                count = self._count
                return lambda m: count.find(rng.random(m) * count.total), float(self.n)
            return lambda m: pool[rng.integers(len(pool), size=m)], float(len(pool))
        if pool is None:
            mass, count = self._mass, self._count
            unset_mass = max_p**self.alpha
            set_total, unset_total = mass.total, count.total * unset_mass
            total = set_total + unset_total
            self._check_mass(total, self.n)

            def sample(m: int) -> np.ndarray:
                u = rng.random(m) * total
                hit = (u < set_total) | (unset_total == 0)
                out = np.empty(m, dtype=np.int64)
                if hit.any():
                    out[hit] = mass.find(u[hit])
                if not hit.all():
                    out[~hit] = count.find((u[~hit] - set_total) / unset_mass)
                return out

            return sample, total
        p = columns["priority"][pool].astype(np.float64)
        cs = np.cumsum(np.where(np.isnan(p), max_p, p) ** self.alpha)
        total = float(cs[-1]) if len(cs) else 0.0
        self._check_mass(total, len(pool))
        top = np.nextafter(total, 0.0)

        def sample_pool(m: int) -> np.ndarray:
            u = np.minimum(rng.random(m) * total, top)
            return pool[np.searchsorted(cs, u, side="right")]

        return sample_pool, total

    def _check_mass(self, total: float, n: int) -> None:
        if not total > 0:
            raise InsufficientData(self.source.name, n, 1, "every candidate has priority 0")

    def _accepted(
        self,
        columns: Columns,
        sample: Callable[[int], np.ndarray],
        k: int,
        n: int,
        accept: Accept | None,
    ) -> np.ndarray:
        """``k`` draws, redrawing those ``accept`` rejects."""
        rows = sample(k)
        if accept is None:
            return rows
        bad = np.flatnonzero(~accept(columns, rows))
        tries, good = k, k - len(bad)
        limit = min(_MAX_TRIES, 64 * (k + n))
        while len(bad):
            if tries >= limit:
                raise InsufficientData(
                    self.source.name, n, k, f"only {good} of {tries} draws were complete"
                )
            m = min(int(len(bad) * 2 * tries / max(good, 1)) + 8, _MAX_ROUND)
            more = sample(m)
            more = more[accept(columns, more)]
            tries, good = tries + m, good + len(more)
            take = min(len(more), len(bad))
            rows[bad[:take]] = more[:take]
            bad = bad[take:]
        return rows

    def _newest(
        self, columns: Columns, pool: np.ndarray, k: int, accept: Accept | None
    ) -> np.ndarray:
        """The ``k`` newest acceptable rows of ``pool`` by step id, newest first."""
        ids = columns["id"][pool]
        m = k
        while True:
            m = min(4 * m, len(pool))
            top = np.argpartition(-ids, m - 1)[:m] if m < len(pool) else np.arange(m)
            rows = pool[top[np.argsort(-ids[top], kind="stable")]]
            if accept is not None:
                rows = rows[accept(columns, rows)]
            if len(rows) >= k:
                return rows[:k]
            if m == len(pool):
                raise InsufficientData(
                    self.source.name, len(pool), k, f"only {len(rows)} are complete"
                )


SAMPLERS: dict[str, type[SourceIndex] | type[GroupIndex]] = {
    "uniform": SourceIndex,
    "priority": SourceIndex,
    "recent": SourceIndex,
    "group": GroupIndex,
}
"""The class behind each ``sampler.kind`` of a recipe source."""


class RecipeSampler:
    """Draws a recipe's batches from the columns of one namespace.

    ``encode`` maps strings to dictionary codes, ``tags`` is the schema's free tags
    (name -> 'str' | 'num'), ``cap`` the slots per shard. Call :meth:`refresh` with the rows
    whose metadata changed since the last call (or None when unknown) before sampling.
    """

    def __init__(self, recipe: Recipe, encode: Encoder, tags: Mapping[str, str], cap: int):
        self.recipe, self.cap = recipe, cap
        self.sources = [
            SAMPLERS[s.sampler.kind](s, Where(s.where, tags, encode), tags) for s in recipe.sources
        ]
        self.counts = recipe.counts
        self.stacks = Predecessors(cap) if recipe.frame_stack > 1 else None
        """Each row's predecessor, for ``frame_stack`` recipes (the batch's stacks too)."""
        self._accept = _acceptor(recipe, cap, self.stacks)
        self._needs_max = any(s.kind == "priority" for s in self.sources)
        self._max: MaxTree | None = None

    def refresh(self, columns: Columns, rows: np.ndarray | None = None) -> None:
        """Account for changed ``rows``; None rebuilds everything on the next draw."""
        if self.stacks is not None:
            self.stacks.refresh(rows)
        if rows is None:
            self._max = None
            for s in self.sources:
                s.invalidate()
            return
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if self._max is not None:
            self._max.update(rows, _max_leaves(columns, rows))
        for s in self.sources:
            s.refresh(columns, rows)

    def max_priority(self, columns: Columns) -> float:
        """Largest priority set on a live step (1.0 when none is): what unset steps count as."""
        if self._max is None:
            self._max = MaxTree(_max_leaves(columns, None), np.float32)
        m = self._max.max
        return m if m > -np.inf else 1.0

    def sample(
        self,
        columns: Columns,
        rng: np.random.Generator,
        params: Mapping[str, Any] | None = None,
        now: float | None = None,
        claims: Claims | None = None,
    ) -> Draw:
        """One batch. ``params`` override the recipe's; ``now`` defaults to the clock;
        ``claims``: the groups a ``once`` recipe delivered in its current pass."""
        live = {**self.recipe.params, **(params or {})}
        now = time.time() if now is None else now
        if self.recipe.grouped:
            return self._groups(columns, rng, live, now, claims)
        max_p = self.max_priority(columns) if self._needs_max else 1.0
        rows, weights, source = [], [], []
        for i, (s, k) in enumerate(zip(self.sources, self.counts, strict=True)):
            r, w = s.draw(columns, live, k, rng, max_p, now, self._accept)
            rows.append(r)
            weights.append(w)
            source.append(np.full(k, i, dtype=np.int16))
        return Draw(np.concatenate(rows), np.concatenate(weights), np.concatenate(source))

    def _groups(
        self,
        columns: Columns,
        rng: np.random.Generator,
        live: Mapping[str, Any],
        now: float,
        claims: Claims | None,
    ) -> Draw:
        """Whole groups from each source (``counts`` groups each), numbered across sources."""
        rows, group, traj, ret, ids, source, stale = [], [], [], [], [], [], []
        pass_no = 0
        for i, (s, k) in enumerate(zip(self.sources, self.counts, strict=True)):
            r, g = s.draw_groups(columns, live, k, rng, now, claims)
            rows.append(r)
            group.append(g.group + len(ids))
            traj.append(g.trajectory + (int(traj[-1][-1]) + 1 if traj else 0))
            ret.append(g.returns)
            ids += g.ids
            stale += g.stale
            pass_no = max(pass_no, g.pass_no)
            source.append(np.full(len(r), i, dtype=np.int16))
        cat = np.concatenate
        groups = Groups(cat(group), cat(traj), cat(ret), tuple(ids), pass_no, tuple(stale))
        all_rows = cat(rows)
        return Draw(all_rows, np.ones(len(all_rows), np.float32), cat(source), groups)


def _max_leaves(columns: Columns, rows: np.ndarray | None) -> np.ndarray:
    p, alive = columns["priority"], columns["alive"]
    if rows is not None:
        p, alive = p[rows], alive[rows]
    return np.where(alive & ~np.isnan(p), p, -np.inf).astype(np.float32)


def _acceptor(recipe: Recipe, cap: int, stacks: Predecessors | None) -> Accept | None:
    """The completeness check a recipe's rows must pass, if any."""
    transitions = "next_obs" in recipe.fields or recipe.n_step > 1
    length, n, k = recipe.sequence_length, recipe.n_step, recipe.frame_stack
    if length == 1 and not transitions and stacks is None:
        return None

    def accept(columns: Columns, rows: np.ndarray) -> np.ndarray:
        if length == 1:
            ok = np.ones(len(rows), bool)
            if transitions:
                ok &= n_step(columns, rows, n, 1.0, cap).ready
            if stacks is not None:
                ok &= stacks.complete(columns, rows, k)
            return ok
        win = windows(columns, rows, length, cap)
        ok = win[:, -1] >= 0
        if transitions:
            flat = np.where(ok[:, None], win, rows[:, None]).ravel()
            ok &= n_step(columns, flat, n, 1.0, cap).ready.reshape(-1, length).all(axis=1)
        return ok

    return accept
