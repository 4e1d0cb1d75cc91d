"""Direct, synchronous sampling by recipe: :func:`sample` and :func:`update_priorities`.

Each process keeps one session per namespace: its
:class:`~orchestrator.sampling.index.SamplingIndex`, one
:class:`~orchestrator.sampling.samplers.RecipeSampler` per recipe (replaced when the recipe
changes in more than ``version`` and ``params``) and the string caches. A call syncs the
index from the change logs, refreshes the samplers with the changed rows, draws the rows,
and reads their payloads with one pipelined round trip (:mod:`orchestrator.sampling.fetch`).
A drawn row whose slot was reused between the sync and the read makes the batch be drawn
again: a batch never holds a step that is gone.

Batch fields, in the recipe's order:

- payload fields (``obs``, ``action``, …): as stored; ragged fields as lists of arrays;
- ``next_obs``: the ``next_obs`` of the n-step bootstrap row (the next step's ``obs`` or
  the one stored with the step); zeros where the episode terminated without one;
- ``reward``: the step's reward, or with ``n_step > 1`` the n-step return
  ``sum_{k<m} gamma^k r_{t+k}``; then ``discount`` (``gamma^m``) and ``done``
  (terminated within the m steps) are added: the target is
  ``reward + discount * (1 - done) * V(next_obs)``;
- ``terminated``, ``truncated``: the step's own flags; ``info``: a dict per row;
- metadata keys (``step_index``, ``task_id``, ``tags.<name>``, …): from the index, strings
  decoded into object arrays (None = missing).

With ``frame_stack`` k > 1, ``obs`` and ``next_obs`` are stacks of the step's k newest
frames (:mod:`orchestrator.transforms.framestack` has the layout); each frame is read once.

With ``sequence_length`` L > 1 each field has shape ``(B, L, …)`` (lists nest ``[B][L]``):
windows of consecutive steps of one episode. ``ids``, ``weights`` and ``source_index`` are
per drawn row (a window's first step), the rows priorities apply to.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from claw_tasks.codec import unpackb
from claw_tasks.codecs.delta import KeyFrameGone
from claw_tasks.connect import identity, redis_client
from claw_tasks.lru import LRU
from claw_tasks.schema import FieldSpec
from claw_tasks.settings import load_settings
from claw_tasks.store import Store
from claw_tasks.store.compressed import decode_stored
from claw_tasks.store.layout import EXPLICIT_NEXT
from claw_tasks.store.scripts import Lua
from claw_tasks.where import lookup
from orchestrator.recipe.model import Recipe, RecipeLike, as_recipe, same_recipe
from orchestrator.sampling.fetch import (
    Fetcher,
    Read,
    explicit_next_obs_read,
    info_read,
    payload_read,
)
from orchestrator.sampling.groups import Claims, Groups, claims_key
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.samplers import Draw, InsufficientData, RecipeSampler
from orchestrator.sampling.sequences import follow, n_step, windows
from orchestrator.sampling.shared import SharedIndex, make_index
from orchestrator.sampling.strings import Strings
from orchestrator.sampling.turns import segments, sequence_tokens
from orchestrator.transforms.framestack import stack_frames

_ATTEMPTS = 8  # draws per call before giving up on rows overwritten under us


class StoreChangingError(RuntimeError):
    """Every draw of a call hit rows that were overwritten or evicted before their payloads
    were read (or groups another worker claimed): the batch is refused, never returned
    with a step that is gone."""


@dataclass(frozen=True)
class SampledBatch:
    """One batch of a recipe (see the module docstring for its fields)."""

    fields: dict[str, Any]
    ids: np.ndarray  # int64 (B,): the drawn steps
    weights: np.ndarray  # float32 (B,): importance weights (1 but for priority sources)
    source_index: np.ndarray  # int16 (B,): index into ``sources``
    sources: tuple[str, ...]
    recipe_version: int
    groups: Groups | None = None  # group recipes: each row's group and trajectory

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def sample(
    namespace_or_store: str | Store,
    recipe: RecipeLike,
    *,
    redis_url: str | None = None,
    rng: np.random.Generator | None = None,
    params: Mapping[str, Any] | None = None,
    index: SamplingIndex | None = None,
) -> SampledBatch:
    """Draw one batch of ``recipe`` (a :class:`Recipe`, its dict form or a YAML path, as
    ``BatchClient.register`` takes) from a namespace.

    ``redis_url`` defaults to ``CLAW_REDIS_URL``; ``rng`` to the recipe's own stream (seeded
    with ``recipe.seed``); ``params`` override the recipe's live params; ``index`` replaces
    the process's cached index of the namespace. Raises
    :class:`~orchestrator.sampling.samplers.InsufficientData` when a source cannot fill its rows.
    """
    recipe = as_recipe(recipe)
    session = _session(namespace_or_store, redis_url, index)
    with session.lock:
        return session.sample(recipe, rng, params)


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
# Per process: a client per Redis URL (few), and, for the most recently used
# ``namespace_cache_size`` namespaces, their ``Store`` and sampling session (the index).
_lock = threading.Lock()
_clients: dict[tuple[str, int], redis.Redis] = {}
_cache_size = load_settings().namespace_cache_size
stores: LRU[tuple[Any, ...], Store] = LRU(_cache_size)  # (url, namespace, pid)
sessions: LRU[tuple[Any, ...], _Session] = LRU(_cache_size)  # (server..., namespace, pid)


def forget_namespace(namespace: str) -> None:
    """Drop this process's store and sampling session (index, samplers, string caches) of
    ``namespace`` (call when it is deleted: a namespace made again starts cold)."""
    stores.drop(lambda key: key[1] == namespace)
    for session in sessions.pop_where(lambda key: key[-2] == namespace):
        if isinstance(session.index, SharedIndex):  # every process's next sync rebuilds
            session.index.close(invalidate=True)


def _store(target: str | Store, redis_url: str | None) -> Store:
    if isinstance(target, Store):
        return target
    url = redis_url or load_settings().redis_url
    pid = os.getpid()
    with _lock:
        client = _clients.get((url, pid))
        if client is None:
            client = _clients[url, pid] = redis_client(url)
    return stores.get((url, target, pid), lambda: Store(client, target))


def _session(target: str | Store, redis_url: str | None, index: SamplingIndex | None) -> _Session:
    if index is not None:
        with _lock:
            if "session" not in index.attached:
                index.attached["session"] = _Session(index)
            return index.attached["session"]
    store = _store(target, redis_url)
    key = (*identity(store.r), store.namespace)
    key += (os.getpid(),)  # a forked child builds its own (own locks and random streams)
    return sessions.get(key, lambda: _Session(make_index(store)))


@dataclass
class _Bound:
    recipe: Recipe
    sampler: RecipeSampler
    rng: np.random.Generator


class _Session:
    """A namespace's index and the samplers bound to it."""

    def __init__(self, index: SamplingIndex) -> None:
        self.index, self.store = index, index.store
        self.lock = threading.Lock()
        self.strings = Strings(self.store, index)
        self.fetch = Fetcher(self.store, index.cap)
        self.bound: dict[str, _Bound] = {}
        index.subscribe(self._changed)

    def _changed(self, rows: np.ndarray | None) -> None:
        self.strings.observe(rows)
        if rows is None or len(rows):
            for b in self.bound.values():
                b.sampler.refresh(self.index.columns, rows)

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
        b = self.bound[recipe.name] = _Bound(recipe, sampler, np.random.default_rng(recipe.seed))
        return b

    def sample(
        self,
        recipe: Recipe,
        rng: np.random.Generator | None,
        params: Mapping[str, Any] | None,
    ) -> SampledBatch:
        live = {**recipe.params, **(params or {})}
        once = recipe.grouped and any(s.sampler.once for s in recipe.sources)
        key = claims_key(self.store.keys.base, recipe.name)
        try:
            return self._sample(recipe, rng, live, once, key)
        finally:
            self.index.release()  # a shared index: other processes may write it again

    def _sample(
        self,
        recipe: Recipe,
        rng: np.random.Generator | None,
        live: dict[str, Any],
        once: bool,
        key: str,
    ) -> SampledBatch:
        for _ in range(_ATTEMPTS):
            self.index.sync()
            b = self.bind(recipe)
            claims = Claims.from_hash(self.store.r.hgetall(key)) if once else None
            draw = b.sampler.sample(
                self.index.columns, b.rng if rng is None else rng, live, claims=claims
            )
            batch = _Assembly(self, recipe, draw).run()
            if batch is None:
                continue
            if recipe.tokens is not None and recipe.tokens.max_tokens and batch.groups:
                batch = _within_budget(batch, recipe)
            if not once or self._claim(key, batch.groups):  # type: ignore[arg-type]
                return batch
        raise StoreChangingError(
            f"recipe {recipe.name!r}: {_ATTEMPTS} draws in a row hit steps overwritten or "
            "evicted before they were read, or groups claimed by another worker; the "
            "namespace's capacity is too small for its ingest rate, an eviction is removing "
            "many of the steps drawn (try again), or too many prefetch workers share too few "
            "groups"
        )

    def _claim(self, key: str, groups: Groups) -> bool:
        if not _CLAIM(self.store.r, [key], [groups.pass_no, *groups.ids]):
            return False
        if groups.stale:  # groups gone from the candidates: their claims can go too
            self.store.r.hdel(key, *groups.stale)
        return True


_CLAIM = Lua("claim", "orchestrator")


def _within_budget(batch: SampledBatch, recipe: Recipe) -> SampledBatch:
    """The batch's leading groups whose sequences hold at most ``tokens.max_tokens`` tokens
    (at least one group); the rest are left for later draws (unclaimed)."""
    g = batch.groups
    assert g is not None and recipe.tokens is not None
    prompts, responses = batch.fields["prompt_ids"], batch.fields["response_ids"]
    segs = segments(prompts, responses, g.trajectory, recipe.tokens.mode)
    tokens = sequence_tokens(prompts, responses, segs)
    per_group = np.bincount(g.group[[s[0] for s in segs]], tokens, minlength=len(g.ids))
    keep = max(1, int(np.searchsorted(np.cumsum(per_group), recipe.tokens.max_tokens, "right")))
    if keep == len(g.ids):
        return batch
    rows = np.flatnonzero(g.group < keep)
    n = len(rows)
    fields = {
        k: (v[rows] if isinstance(v, np.ndarray) else [v[i] for i in rows.tolist()])
        for k, v in batch.fields.items()
    }
    groups = Groups(g.group[:n], g.trajectory[:n], g.returns[:n], g.ids[:keep], g.pass_no, g.stale)
    return SampledBatch(
        fields, batch.ids[:n], batch.weights[:n], batch.source_index[:n], batch.sources,
        batch.recipe_version, groups,
    )  # fmt: skip


def _same(a: Recipe, b: Recipe) -> bool:
    """Equal but for the version and the live params (passed on every draw)."""
    return same_recipe(a, b, ignore=("version", "params"))


# ---- assembling a batch --------------------------------------------------------------
Finish = Callable[[list[Any]], Any]


class _Assembly:
    """The reads a draw needs, and how their results become the batch's fields."""

    def __init__(self, session: _Session, recipe: Recipe, draw: Draw) -> None:
        self.s, self.recipe, self.draw = session, recipe, draw
        cols, cap = session.index.columns, session.index.cap
        self.cols, self.cap = cols, cap
        length = recipe.sequence_length
        b = len(draw.rows)  # a group draw has as many rows as its groups have steps
        self.shape = (b, length) if length > 1 else (b,)
        self.rows = windows(cols, draw.rows, length, cap).ravel() if length > 1 else draw.rows
        self.reads: list[Read] = []
        self.check = [self.rows]
        self.lookups: list[tuple[str, list[int], Callable[[Any], None]]] = []
        self.stacks = session.bound[recipe.name].sampler.stacks  # frame_stack > 1 only

    def run(self) -> SampledBatch | None:
        recipe, cols, rows = self.recipe, self.cols, self.rows
        extra: dict[str, Finish] = {}
        reward, boot = cols["reward"][rows], rows
        if recipe.n_step > 1:
            ns = n_step(cols, rows, recipe.n_step, recipe.gamma, self.cap)
            reward, boot = ns.returns, ns.bootstrap
            self.check.append(boot)
            discount, done = ns.discount.astype(np.float32), ns.done
            extra = {
                "discount": lambda _: self._shaped(discount),
                "done": lambda _: self._shaped(done),
            }
        finish = {name: self._plan(name, reward, boot) for name in recipe.fields}
        finish.update(extra)
        check = np.unique(np.concatenate(self.check))
        got = self.s.fetch(
            check, cols["id"][check], self.reads, [lookup for *_, lookup in self.lookups]
        )
        if got is None:
            return None
        results, replies = got
        for (column, codes, _), names in zip(self.lookups, replies, strict=True):
            self.s.strings.learn(column, codes, names)
        try:
            fields = {name: f(results) for name, f in finish.items()}
        except KeyFrameGone:  # the ring passed a delta and its key since the fetch: redraw
            return None
        return SampledBatch(
            fields=fields,
            ids=cols["id"][self.draw.rows],
            weights=self.draw.weights,
            source_index=self.draw.source,
            sources=tuple(s.name for s in recipe.sources),
            recipe_version=recipe.version,
            groups=self.draw.groups,
        )

    def _read(self, read: Read) -> int:
        self.reads.append(read)
        return len(self.reads) - 1

    def _shaped(self, values: np.ndarray) -> np.ndarray:
        return values.reshape(*self.shape, *values.shape[1:])

    def _nested(self, items: list[Any]) -> list[Any]:
        if len(self.shape) == 1:
            return items
        n = self.shape[1]
        return [items[i : i + n] for i in range(0, len(items), n)]

    def _plan(self, name: str, reward: np.ndarray, boot: np.ndarray) -> Finish:
        """Queue what field ``name`` needs; return how to build it from the read results."""
        cols, rows = self.cols, self.rows
        fields = self.s.index.schema.fields  # type: ignore[union-attr]
        k = self.recipe.frame_stack
        if name == "obs" and k > 1:
            frames = self._plan_frames(fields["obs"], rows, k)
            return lambda res: stack_frames(frames(res), len(fields["obs"].shape))
        if name in fields:
            spec = fields[name]
            i = self._read(payload_read(name, spec, rows))
            return lambda res: self._decode(spec, res[i], stored=name)
        if name == "next_obs" and k > 1:  # boot's newest k - 1 frames, then its next_obs
            older = self._plan_frames(fields["obs"], boot, k - 1)
            last = self._plan_next_obs(fields["obs"], boot)
            return lambda res: stack_frames(
                np.concatenate([older(res), last(res)[:, None]], axis=1),
                len(fields["obs"].shape),
            )
        if name == "next_obs":
            return self._plan_next_obs(fields["obs"], boot)
        if name == "reward":
            return lambda _: self._shaped(reward.astype(np.float32))
        if name == "info":
            i = self._read(info_read(rows))
            return lambda res: self._nested([unpackb(b) if b else {} for b in res[i]])
        key = lookup(name, self.s.index.schema.tags)  # type: ignore[union-attr]
        values = cols[key.column][rows]
        if key.kind == "flag":
            return lambda _: self._shaped(((values & key.bit) != 0) == key.when_set)
        if key.kind == "num":
            return lambda _: self._shaped(values)
        self._lookup(key.column, values)
        return lambda _: self._shaped(self.s.strings.decode(key.column, values))

    def _plan_frames(self, spec: FieldSpec, rows: np.ndarray, k: int) -> Finish:
        """``(B, k, *shape)``: each row's k newest ``obs`` frames, oldest first, zeros
        before its episode's first step (:mod:`orchestrator.sampling.stacks`)."""
        assert self.stacks is not None
        chain = self.stacks.chain(self.cols, rows, k).ravel()
        have = chain >= 0
        self.check.append(chain[have])
        at = None if have.all() else np.flatnonzero(have)
        i = self._read(payload_read("obs", spec, chain[have], at, len(chain)))
        if spec.codec is not None:  # frames of the rows that have one; zeros elsewhere

            def frames(res: list[Any]) -> Any:
                out: list[Any] = [b""] * len(chain)
                for p, b in zip(np.flatnonzero(have).tolist(), res[i], strict=True):
                    out[p] = b
                return self._decode(spec, out, (len(rows), k))

            return frames
        return lambda res: self._decode(spec, res[i], (len(rows), k))

    def _plan_next_obs(self, spec: FieldSpec, boot: np.ndarray) -> Finish:
        nxt = follow(self.cols, boot, self.cap)
        explicit = (self.cols["flags"][boot] & EXPLICIT_NEXT) != 0
        linked = (nxt >= 0) & ~explicit
        self.check.append(nxt[linked])
        # Fixed rows land straight at their place in the (B, ...) result, zeros elsewhere.
        sparse = spec.ragged or spec.codec is not None  # one hash entry per row
        at = None if sparse or linked.all() else np.flatnonzero(linked)
        i = self._read(payload_read("obs", spec, nxt[linked], at, len(boot)))
        j = self._read(explicit_next_obs_read(spec, boot[explicit]))

        def finish(res: list[Any]) -> Any:
            if sparse:
                out: list[Any] = [b""] * len(boot)
                for p, b in zip(np.flatnonzero(linked).tolist(), res[i], strict=True):
                    out[p] = b
                for p, b in zip(np.flatnonzero(explicit).tolist(), res[j], strict=True):
                    out[p] = b
                return self._decode(spec, out)
            raw = res[i]  # (B, row_bytes): linked rows in place, zeros elsewhere
            if explicit.any():
                raw[explicit] = np.frombuffer(b"".join(res[j]), np.uint8).reshape(
                    -1, spec.row_bytes
                )
            return self._decode(spec, raw)

        return finish

    def _decode(
        self, spec: FieldSpec, got: Any, shape: tuple[int, ...] | None = None, stored: str = "obs"
    ) -> Any:
        dtype = np.dtype(spec.dtype)
        if spec.codec is not None:  # decoded here, in the fill, before augmentation
            rows = decode_stored(self.s.store, stored, spec, got)
            if spec.ragged:
                return self._nested(rows)
            return rows.reshape(*(shape or self.shape), *spec.shape)
        if spec.ragged:
            tail = spec.shape[1:]
            return self._nested([np.frombuffer(b or b"", dtype).reshape(-1, *tail) for b in got])
        return got.view(dtype).reshape(*(shape or self.shape), *spec.shape)

    def _lookup(self, column: str, codes: np.ndarray) -> None:
        """Queue the names of codes not cached yet on the fetch's pipeline."""
        keys, n_shards = self.s.store.keys, self.s.index.n_shards
        missing = self.s.strings.missing(column, codes)
        if not missing:
            return
        if column != "episode":
            key = keys.rdict(column)
            self.lookups.append((column, missing, lambda p: p.hmget(key, missing)))
            return
        for shard in range(n_shards):  # episode names live with their shard
            part = [c for c in missing if c % n_shards == shard]
            if part:
                key = keys.shard_key(shard, "epname")
                self.lookups.append((column, part, lambda p, k=key, c=part: p.hmget(k, c)))
