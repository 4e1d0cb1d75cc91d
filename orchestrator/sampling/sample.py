"""Direct, synchronous sampling by recipe: :func:`sample` and :func:`update_priorities`.

Each process keeps one session per namespace: its
:class:`~orchestrator.sampling.index.SamplingIndex`, one
:class:`~orchestrator.sampling.samplers.RecipeSampler` per recipe (replaced when the recipe
changes in more than ``version`` and ``params``) and the string caches. A call syncs the
index from the change logs, refreshes the samplers with the changed rows, draws the rows,
and reads their payloads with one pipelined round trip (:mod:`orchestrator.sampling.fetch`),
checked by the change-log entries read after them: a drawn row whose slot was reused
since the sync makes the batch be drawn again, and a batch never holds a step that is
gone. When the last fetch found the logs quiet (and the last call found nothing logged
at its start), the call skips the sync: it draws from the index as it is, and the
fetch's log read (each log from the index's last entry) proves the index current, one
round trip in all; any new entry means a sync, which applies the entries that fetch read
instead of reading them again, and a new draw. A store that changes between calls is
synced first: two round trips (log page with the re-read of the slots it names,
checked fetch) and one draw.

Batch fields, in the recipe's order:

- payload fields (``obs``, ``action``, …): as stored; ragged fields as lists of arrays;
- ``next_obs``: the ``next_obs`` of the n-step bootstrap row (the next step's ``obs`` or
  the one stored with the step); zeros where the episode terminated without one;
- ``reward``: the step's reward, or with ``n_step > 1`` the n-step return
  ``sum_{k<m} gamma^k r_{t+k}``; then ``discount`` (``gamma^m``) and ``done``
  (terminated within the m steps) are added: the target is
  ``reward + discount * (1 - done) * V(next_obs)``;
- ``terminated``, ``truncated``: the step's own flags;
- metadata keys (``step_index``, ``task_id``, ``tags.<name>``, …): from the index; numbers
  are fields, strings (None = missing) and ``info`` (a dict per row) go to ``batch.meta``
  as lists, as in a popped batch (:mod:`orchestrator.sampling.batch`).

With ``frame_stack`` k > 1, ``obs`` and ``next_obs`` are stacks of the step's k newest
frames (:mod:`orchestrator.transforms.framestack` has the layout); each frame is read once.

With ``sequence_length`` L > 1 each field has shape ``(B, L, …)`` (lists nest ``[B][L]``):
windows of consecutive steps of one episode. ``ids``, ``weights`` and ``source_index`` are
per drawn row (a window's first step), the rows priorities apply to.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED
from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua
from claw_tasks.worker.context import context_for
from orchestrator.recipe.model import Recipe, RecipeLike, as_recipe, same_recipe
from orchestrator.sampling.asof import AsOf
from orchestrator.sampling.assembly import Assembly
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.fetch import Fetcher, LogChecked
from orchestrator.sampling.groups import Claim, Claims, Groups, claims_key
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.jointbatch import assemble_joint
from orchestrator.sampling.rollouts import Selection, select
from orchestrator.sampling.samplers import Draw, RecipeSampler
from orchestrator.sampling.sequences import follow, n_step, windows
from orchestrator.sampling.shared import SharedIndex, make_index
from orchestrator.sampling.stacks import Predecessors
from orchestrator.sampling.strings import Strings
from orchestrator.sampling.turns import segments, sequence_tokens

__all__ = [
    "StoreChangingError",
    "hit_rates",
    "read_steps",
    "sample",
    "select_rollout",
    "update_priorities",
]

_ATTEMPTS = 8  # draws per call before giving up on rows overwritten under us


class StoreChangingError(RuntimeError):
    """Every draw of a call hit rows that were overwritten or evicted before their payloads
    were read (or groups another worker claimed): the batch is refused, never returned
    with a step that is gone."""


def sample(
    namespace_or_store: str | Store,
    recipe: RecipeLike,
    *,
    redis_url: str | None = None,
    rng: np.random.Generator | None = None,
    params: Mapping[str, Any] | None = None,
    index: SamplingIndex | None = None,
) -> Batch:
    """Draw one batch of ``recipe`` (a :class:`Recipe`, its dict form or a YAML path, as
    ``BatchClient.register`` takes) from a namespace.

    ``redis_url`` defaults to ``CLAW_REDIS_URL``; ``rng`` to the recipe's own stream (seeded
    with ``recipe.seed``); ``params`` override the recipe's live params; ``index`` replaces
    the process's cached index of the namespace. Raises
    :class:`~orchestrator.sampling.candidates.InsufficientData` when a source cannot fill its rows.
    """
    recipe = as_recipe(recipe)
    session = _session(namespace_or_store, redis_url, index)
    with session.lock:
        return session.sample(recipe, rng, params)


def select_rollout(
    namespace_or_store: str | Store,
    recipe: Recipe,
    classified: np.ndarray,
    window: tuple[int, int],
    *,
    redis_url: str | None = None,
) -> Selection:
    """The candidates of a ``rollout`` recipe's source not in ``classified`` (sorted ids),
    sorted by the window ``(lo, hi)`` of policy versions, and ``recipe.rollout.steps`` of
    them as chains when that many are ready (:mod:`orchestrator.sampling.rollouts`)."""
    assert recipe.rollout is not None
    session = _session(namespace_or_store, redis_url, None)
    with session.lock:
        try:
            # Current, not a shared index's recent columns: the sweep after a commit must
            # see that commit's steps, or the rollout it completes waits for a pop or beat.
            session.index.sync(current=True)
            src = session.bind(recipe).sampler.sources[0]
            src.candidates(session.index.columns, recipe.params)
            assert src.cand is not None
            lo, hi = window
            return select(
                session.index.columns,
                src.cand,
                session.index.cap,
                classified,
                lo,
                hi,
                recipe.rollout.steps,
            )
        finally:
            session.index.release()


def read_steps(
    namespace_or_store: str | Store,
    recipe: Recipe,
    ids: np.ndarray,
    fields: Sequence[str] | None = None,
    *,
    held: bool = False,
    redis_url: str | None = None,
) -> Batch | None:
    """The ``fields`` (default: the recipe's) of the steps ``ids``, in that order, read as
    a batch of ``recipe`` is (decoded, ``next_obs`` followed); None when one of them is no
    longer stored (evicted, or its slot reused).

    ``held``: the caller synced this process's index of the namespace a moment ago (a
    fill serving the rollout it has just formed): the steps are read from the columns as
    they are and the fetch's log check proves them current, one round trip in all; only
    when something was logged since does a sync (applying the entries that fetch read)
    and a second read follow."""
    session = _session(namespace_or_store, redis_url, None)
    if fields is not None:
        recipe = recipe.model_copy(update={"fields": list(fields)})
    ids = np.asarray(ids, np.int64)
    with session.lock:
        index, fetch = session.index, session.fetch
        fetch.read = None
        try:
            for exact in (True, False) if held and index.hold() else (False,):
                fetch.exact = exact
                if not exact:
                    index.sync(fetch.read)
                seq = ids // index.n_shards
                rows = (ids % index.n_shards) * index.cap + (seq - 1) % index.cap
                cols = index.columns
                if not (cols["alive"][rows] & (cols["id"][rows] == ids)).all():
                    if exact:
                        continue  # the sync decides
                    return None
                ones = np.ones(len(ids), np.float32)
                draw = Draw(rows, ones, np.zeros(len(ids), np.int16))
                batch = Assembly(session, recipe, draw).run()
                if batch is not None or not exact:
                    return batch
            return None
        finally:
            fetch.exact, fetch.read = False, None
            index.release()


@dataclass(frozen=True)
class Unassembled:
    """Rows :func:`read_drawn` cannot assemble (positions): their step is not stored
    (``gone``), or a step their n-step return, window, stack or ``next_obs`` follows is not
    (``incomplete``)."""

    gone: np.ndarray
    incomplete: np.ndarray


def read_drawn(
    namespace_or_store: str | Store,
    recipe: Recipe,
    ids: np.ndarray,
    *,
    redis_url: str | None = None,
) -> Batch | Unassembled:
    """The batch of ``recipe`` whose drawn rows are the steps ``ids``, in that order,
    assembled as a draw of them is (n-step returns, sequence windows, frame stacks, weights
    of 1); or the rows that cannot be (:class:`Unassembled`)."""
    session = _session(namespace_or_store, redis_url, None)
    ids = np.asarray(ids, np.int64)
    with session.lock:
        try:
            index = session.index
            index.sync()
            cols, cap = index.columns, index.cap
            rows = (ids % index.n_shards) * cap + (ids // index.n_shards - 1) % cap
            stored = cols["alive"][rows] & (cols["id"][rows] == ids)
            stacks = Predecessors(cap) if recipe.frame_stack > 1 else None
            whole = complete(cols, np.where(stored, rows, 0), recipe, cap, stacks)
            if not (stored & whole).all():
                return Unassembled(np.flatnonzero(~stored), np.flatnonzero(stored & ~whole))
            ones = np.ones(len(ids), np.float32)
            draw = Draw(rows, ones, np.zeros(len(ids), np.int16))
            batch = Assembly(session, recipe, draw, stacks).run()
            if batch is None:  # a slot reused while it was read
                return Unassembled(np.arange(len(ids)), np.zeros(0, np.int64))
            return batch
        finally:
            session.index.release()


def complete(
    cols: Mapping[str, np.ndarray],
    rows: np.ndarray,
    recipe: Recipe,
    cap: int,
    stacks: Predecessors | None,
) -> np.ndarray:
    """Whether each row's assembly finds every step it follows stored: its n-step chain
    up to ``n_step`` steps or its episode's end, the bootstrap row's ``next_obs`` (or the
    end), its window's steps up to the episode's end, its frame stack."""
    ok = np.ones(len(rows), bool)
    starts = rows
    if recipe.sequence_length > 1:
        win = windows(cols, rows, recipe.sequence_length, cap)
        for j in range(1, win.shape[1]):
            prev = win[:, j - 1]
            ended = (cols["flags"][np.maximum(prev, 0)] & (TERMINATED | TRUNCATED)) != 0
            ok &= (prev < 0) | ended | (win[:, j] >= 0)
        starts = win[win >= 0]
        ok_of = np.repeat(np.arange(len(rows)), (win >= 0).sum(axis=1))
    else:
        ok_of = np.arange(len(rows))
    cur, active = starts, np.ones(len(starts), bool)
    chain = np.ones(len(starts), bool)
    for _ in range(recipe.n_step - 1):
        active &= (cols["flags"][cur] & (TERMINATED | TRUNCATED)) == 0
        nxt = follow(cols, cur, cap)
        chain &= ~active | (nxt >= 0)
        active &= nxt >= 0
        cur = np.where(active, nxt, cur)
    if "next_obs" in recipe.fields:
        chain &= n_step(cols, starts, recipe.n_step, recipe.gamma, cap).ready
    ok &= np.bincount(ok_of, ~chain, minlength=len(rows)) == 0
    if stacks is not None:
        ok &= stacks.complete(cols, rows, recipe.frame_stack)
    return ok


def hit_rates(namespace_or_store: str | Store, recipe: str) -> tuple[tuple[int, ...], int]:
    """The candidates of each source of ``recipe`` and the namespace's live steps, as this
    process's last draw of it saw them (``((), 0)`` before one): the sample hit rate."""
    session = _session(namespace_or_store, None, None)
    with session.lock:
        bound = session.bound.get(recipe)
        return ((), 0) if bound is None else bound.hits


def update_priorities(
    namespace_or_store: str | Store,
    ids: Sequence[int] | np.ndarray,
    priorities: Any,
    *,
    redis_url: str | None = None,
) -> int:
    """Set the priorities of steps, one script call per shard; ids evicted or overwritten
    are skipped (their slot's new step keeps its own priority). Returns how many were set."""
    return _store(namespace_or_store, redis_url).update_priorities(ids, priorities)


# ---- sessions ------------------------------------------------------------------------
# Per process and namespace, the sampling session is a part of the namespace's context
# (claw_tasks.worker.context): bounded with it, forgotten with it.
_lock = threading.Lock()
SESSION = "sampling"
"""The sampling session's name in a namespace context."""


def _store(target: str | Store, redis_url: str | None) -> Store:
    return target if isinstance(target, Store) else context_for(target, redis_url).store


def _session(target: str | Store, redis_url: str | None, index: SamplingIndex | None) -> _Session:
    if index is not None:
        with _lock:
            if "session" not in index.attached:
                index.attached["session"] = _Session(index)
            return index.attached["session"]
    ctx = context_for(target, redis_url)
    return ctx.part(SESSION, lambda: _Session(make_index(ctx.store)))


@dataclass
class _Bound:
    recipe: Recipe
    sampler: RecipeSampler
    rng: np.random.Generator
    as_of: AsOf | None = None  # a recipe of a snapshot: the columns it draws from
    hits: tuple[tuple[int, ...], int] = ((), 0)  # the last draw's candidates per source, live

    def columns(self, cols: Mapping[str, np.ndarray], rows: np.ndarray | None) -> Any:
        return cols if self.as_of is None else self.as_of.columns(cols, rows)


class _Session:
    """A namespace's index and the samplers bound to it."""

    def __init__(self, index: SamplingIndex) -> None:
        self.index, self.store = index, index.store
        self.lock = threading.Lock()
        self.strings = Strings(self.store, index)
        self.fetch = LogChecked(Fetcher(self.store, index.cap), index)
        self.bound: dict[str, _Bound] = {}
        self._live: tuple[np.ndarray, int] | None = None  # an alive column and its count
        self._changing = False  # the last call found entries logged since the one before
        index.subscribe(self._changed)

    def close(self, dropped: bool) -> None:
        """Detach from the host's shared index (``dropped``: every process's next sync
        rebuilds it); the last process to detach removes its files."""
        if isinstance(self.index, SharedIndex):
            self.index.close(invalidate=dropped)

    def _changed(self, rows: np.ndarray | None) -> None:
        self.strings.observe(rows)
        if rows is None or len(rows):
            live, delta = self._live, self.index.live_delta
            if rows is None or live is None or delta is None:
                self._live = None
            elif live[0] is self.index.columns.get("alive"):  # a 1M count is ~30-50 us
                self._live = (live[0], live[1] + delta)
            else:
                self._live = None
            for b in self.bound.values():
                b.sampler.refresh(b.columns(self.index.columns, rows), rows)

    def bind(self, recipe: Recipe) -> _Bound:
        """The recipe's sampler, made on first use and when the recipe changed (a new
        ``version`` or other ``params`` alone keep it: params are live)."""
        b = self.bound.get(recipe.name)
        if b is not None and (b.recipe is recipe or _same(b.recipe, recipe)):
            b.recipe = b.sampler.recipe = recipe
            return b
        schema = self.index.schema
        if schema is None:
            src = recipe.sources[0]
            raise InsufficientData(src.name, 0, recipe.counts[0], "the namespace has no steps")
        recipe.validate_against(schema)
        sampler = RecipeSampler(recipe, self.strings.encode, schema.tags, self.index.cap)
        as_of = None if recipe.as_of is None else AsOf(self.store, recipe.as_of)
        rng = np.random.default_rng(recipe.seed)
        b = self.bound[recipe.name] = _Bound(recipe, sampler, rng, as_of)
        return b

    def sample(
        self,
        recipe: Recipe,
        rng: np.random.Generator | None,
        params: Mapping[str, Any] | None,
    ) -> Batch:
        live = {**recipe.params, **(params or {})}
        once = recipe.grouped and any(getattr(s.sampler, "once", False) for s in recipe.sources)
        key = claims_key(self.store, recipe.name)
        try:
            return self._sample(recipe, rng, live, once, key)
        finally:
            self.fetch.exact, self.fetch.read = False, None  # a page read is this call's only
            self.index.release()  # a shared index: other processes may write it again

    def _sample(
        self,
        recipe: Recipe,
        rng: np.random.Generator | None,
        live: dict[str, Any],
        once: bool,
        key: str,
    ) -> Batch:
        for attempt in range(_ATTEMPTS):
            # The logs were quiet at the last fetch and the last call found nothing new at
            # its start: draw from the columns as they are and let the fetch's log check
            # prove them current (one round trip). Else sync first (a store that changes
            # between calls would make that draw a wasted one), applying the entries a
            # refused fetch of this call read instead of reading them again.
            exact = attempt == 0 and self.fetch.quiet and not self._changing and self.index.hold()
            self.fetch.exact = exact
            if not exact:
                before = list(self.index.log_last)
                self.index.sync(self.fetch.read)
                if attempt == 0:
                    self._changing = self.index.log_last != before
            try:
                batch = self._draw(recipe, rng, live, once, key)
            except Exception:
                if not exact:
                    raise
                continue  # e.g. too few candidates before the sync: the sync decides
            finally:
                if exact:
                    self._changing = not self.fetch.quiet
            if batch is not None:
                return batch
        raise StoreChangingError(
            f"recipe {recipe.name!r}: {_ATTEMPTS} draws in a row hit steps overwritten or "
            "evicted before they were read, or groups claimed by another worker; the "
            "namespace's capacity is too small for its ingest rate, an eviction is removing "
            "many of the steps drawn (try again), or too many prefetch workers share too few "
            "groups"
        )

    def _draw(
        self,
        recipe: Recipe,
        rng: np.random.Generator | None,
        live: dict[str, Any],
        once: bool,
        key: str,
    ) -> Batch | None:
        """One draw and its fetch from the index's columns as they are; None: draw again."""
        b = self.bind(recipe)
        claims = (
            Claims.from_hash(cast(dict[bytes, bytes], self.store.r.hgetall(key))) if once else None
        )
        if b.as_of is not None:
            b.as_of.check(recipe.sources[0].name, recipe.counts[0])
        columns = (
            self.index.columns
            if b.as_of is None
            else b.as_of.columns(self.index.columns, np.zeros(0, np.int64))
        )
        draw = b.sampler.sample(columns, b.rng if rng is None else rng, live, claims=claims)
        if b.sampler.joint is not None:
            batch = assemble_joint(self, recipe, draw, b.sampler.joint, columns)
        else:  # the batch's metadata from what was drawn from (a snapshot's labels)
            batch = Assembly(self, recipe, draw, b.sampler.stacks, columns=columns).run()
        if batch is None:
            return None
        b.hits = (tuple(s.n for s in b.sampler.sources), self._count_live(columns["alive"]))
        if recipe.tokens is not None and recipe.tokens.max_tokens and batch.groups:
            batch = _within_budget(batch, recipe)
        if once:
            claim = self._claim(key, batch.groups)  # type: ignore[arg-type]  # a once recipe is a group recipe: its batch has groups
            if claim is None:
                return None
            batch.claim = claim
        return batch

    def _count_live(self, alive: np.ndarray) -> int:
        """Live steps in ``alive`` (counted again only after a sync changed rows)."""
        if self._live is None or self._live[0] is not alive:
            self._live = (alive, int(np.count_nonzero(alive)))
        return self._live[1]

    def _claim(self, key: str, groups: Groups) -> Claim | None:
        claim = Claim(groups.pass_no, secrets.token_hex(6), groups.ids)
        if not _CLAIM(self.store.r, [key], [claim.pass_no, claim.token, *claim.ids]):
            return None
        if groups.stale:  # groups gone from the candidates: their claims can go too
            self.store.r.hdel(key, *groups.stale)
        return claim


_CLAIM = Lua("claim", "orchestrator")


def _within_budget(batch: Batch, recipe: Recipe) -> Batch:
    """The batch's leading groups whose sequences hold at most ``tokens.max_tokens`` tokens
    (at least one group); the rest are left for later draws (unclaimed)."""
    g = batch.groups
    assert g is not None and recipe.tokens is not None
    prompts, responses = batch.fields["prompt_ids"], batch.fields["response_ids"]
    segs = segments(prompts, responses, g.trajectory, recipe.tokens.mode)
    tokens = sequence_tokens(prompts, responses, segs)
    per_group = np.bincount(g.group[[s[0] for s in segs]], tokens, minlength=len(g.ids))
    limit = recipe.tokens.max_tokens
    assert limit is not None  # a tokens section sets it
    keep = max(1, int(np.searchsorted(np.cumsum(per_group), limit, "right")))
    if keep == len(g.ids):
        return batch
    rows = np.flatnonzero(g.group < keep)
    n = len(rows)
    groups = Groups(g.group[:n], g.trajectory[:n], g.returns[:n], g.ids[:keep], g.pass_no, g.stale)
    return batch.take(rows, groups)


def _same(a: Recipe, b: Recipe) -> bool:
    """Equal but for the version and the live params (passed on every draw)."""
    return same_recipe(a, b, ignore=("version", "params"))
