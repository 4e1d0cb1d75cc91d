"""Assembling a drawn batch: the reads its fields need, in one fetch, and how the results
become a :class:`~orchestrator.sampling.batch.Batch` (what each field holds is in
:mod:`orchestrator.sampling.sample`'s docstring). Compressed fields are decoded here, in
the sampling process, before any augmentation; a compressed fixed-shape ``obs`` frame is
decoded once per batch however many of its fields and stacks hold it
(:class:`SharedFrames`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from claw_tasks.codecs.delta import KeyFrameGone
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.schema import FieldSpec
from claw_tasks.format.stepmeta import EXPLICIT_NEXT
from claw_tasks.store import Store
from claw_tasks.store.compressed import decode_stored
from claw_tasks.store.slots import (
    Read,
    explicit_next_obs_read,
    info_read,
    name_lookups,
    payload_read,
)
from claw_tasks.where import lookup
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import unique
from orchestrator.sampling.fetch import Fetcher, LogChecked
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.samplers import Draw
from orchestrator.sampling.sequences import follow, n_step, windows
from orchestrator.sampling.stacks import Predecessors
from orchestrator.sampling.strings import Strings
from orchestrator.transforms.framestack import stack_frames

Finish = Callable[[list[Any]], Any]
Picks = Callable[[list[Any]], tuple[np.ndarray, np.ndarray]]
"""From the read results: a batch's distinct decoded frames, and which of them each
position holds."""
NO_FRAME = -1
"""A :class:`SharedFrames` key: no frame (zeros)."""


class SharedFrames:
    """A batch's compressed ``obs`` frames, each distinct one decoded once: a step's frame is
    in the stacks of the k steps from it on, in its predecessor's ``next_obs``, and drawn
    rows repeat. Frames are keyed by where they are stored: a global row (its
    ``obs``), ``-2 - row`` (the explicit ``next_obs`` stored with that row), or
    :data:`NO_FRAME`. Decoding is deterministic, so the result is what decoding every
    position would give."""

    def __init__(self, store: Store, spec: FieldSpec) -> None:
        self.store, self.spec = store, spec
        self.parts: list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]] = []
        self._done: tuple[np.ndarray, list[np.ndarray]] | None = None

    def add(self, keys: np.ndarray, reads: list[tuple[int, np.ndarray]]) -> Picks:
        """Positions of frames ``keys``, whose bytes are the results of read ``i`` at
        ``positions``, for each ``(i, positions)`` of ``reads`` (others: no frame)."""
        part = len(self.parts)
        self.parts.append((np.asarray(keys, np.int64), reads))
        return lambda res: self._picks(res, part)

    def _picks(self, res: list[Any], part: int) -> tuple[np.ndarray, np.ndarray]:
        if self._done is None:
            self._done = self._decode(res)
        rows, index = self._done
        return rows, index[part]

    def _decode(self, res: list[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
        keys = np.concatenate([k for k, _ in self.parts])
        _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        order = np.argsort(first)  # in order of first use: unshared rows stay in place
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, inv = first[order], rank[inv.reshape(-1)]
        frames: list[Any] = [b""] * len(keys)
        start = 0
        for k, reads in self.parts:
            for i, positions in reads:
                for p, b in zip((positions + start).tolist(), res[i], strict=True):
                    frames[p] = b
            start += len(k)
        rows = decode_stored(self.store, "obs", self.spec, [frames[j] for j in first.tolist()])
        bounds = np.cumsum([0, *(len(k) for k, _ in self.parts)]).tolist()
        return rows, [inv[lo:hi] for lo, hi in itertools.pairwise(bounds)]


class Reader(Protocol):
    """What an assembly reads with: the index the rows were drawn from (its columns are
    current until the batch is read), its store, string cache and payload fetcher (the
    sampling session of :mod:`orchestrator.sampling.sample`)."""

    # Read-only (properties): a reader's attributes may be narrower than these types.
    @property
    def index(self) -> SamplingIndex: ...
    @property
    def store(self) -> Store: ...
    @property
    def strings(self) -> Strings: ...
    @property
    def fetch(self) -> Fetcher | LogChecked: ...  # LogChecked: also checks the change log


class Assembly:
    """The reads a draw needs, and how their results become the batch's fields.
    ``stacks``: the recipe sampler's frame predecessors (``frame_stack > 1`` only).
    ``extra``: label -> (payload field, rows): that field at other rows too, read and
    checked in the same fetch, as the batch's field ``label`` (a joint batch's state).
    ``columns``: what the rows were drawn from when not the index's own (a recipe ``as_of``
    a snapshot: its labels, priorities and tags), so the batch's metadata is what the
    sampler saw."""

    def __init__(
        self,
        session: Reader,
        recipe: Recipe,
        draw: Draw,
        stacks: Predecessors | None = None,
        extra: Mapping[str, tuple[str, np.ndarray]] | None = None,
        columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.s, self.recipe, self.draw = session, recipe, draw
        self.extra = dict(extra or {})
        cols = session.index.columns if columns is None else columns
        cap = session.index.cap
        self.cols, self.cap = cols, cap
        length = recipe.sequence_length
        b = len(draw.rows)  # a group draw has as many rows as its groups have steps
        self.shape = (b, length) if length > 1 else (b,)
        self.rows = windows(cols, draw.rows, length, cap).ravel() if length > 1 else draw.rows
        self.reads: list[Read] = []
        self.check = [self.rows]
        self.lookups: list[tuple[str, list[int], list[Any]]] = []
        """Names of codes to look up in the fetch: (column, codes, command)."""
        self.stacks = stacks
        schema = session.index.schema
        obs = None if schema is None else schema.fields.get("obs")
        fixed = obs is not None and obs.codec is not None and not obs.ragged
        self.frames = SharedFrames(session.store, obs) if fixed else None  # type: ignore[arg-type]  # fixed: obs is set

    def run(self) -> Batch | None:
        recipe, cols, rows = self.recipe, self.cols, self.rows
        extra: dict[str, Finish] = {}
        reward, boot = cols["reward"][rows], rows
        if recipe.n_step > 1:
            ns = n_step(cols, rows, recipe.n_step, recipe.gamma, self.cap)
            reward, boot = ns.returns, ns.bootstrap
            self.check.append(boot)
            discount, done, cut = ns.discount.astype(np.float32), ns.done, ns.end_truncated
            extra = {
                "discount": lambda _: self._shaped(discount),
                "done": lambda _: self._shaped(done),
                "end_truncated": lambda _: self._shaped(cut),
            }
        finish = {name: self._plan(name, reward, boot) for name in recipe.fields}
        finish.update(extra)
        for label, (name, at) in self.extra.items():
            finish[label] = self._plan_payload(name, at)
        check = unique(np.concatenate(self.check))
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
        return Batch.drawn(
            fields,
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
        fields = self.s.index.schema.fields  # type: ignore[union-attr]  # rows were drawn: the namespace has a schema
        k = self.recipe.frame_stack
        ndim = len(fields["obs"].shape) if "obs" in fields else 0
        if name == "obs" and k > 1:
            if self.frames is not None:
                chain = self._shared_frames(rows, k)

                def stacks(res: list[Any]) -> Any:
                    frames, index = chain(res)
                    return stack_frames(frames, ndim, index)

                return stacks
            frames = self._plan_frames(fields["obs"], rows, k)
            return lambda res: stack_frames(frames(res), ndim)
        if name == "obs" and self.frames is not None:
            i = self._read(payload_read(name, fields[name], rows))
            return self._shape_picks(self.frames.add(rows, [(i, np.arange(len(rows)))]))
        if name in fields:
            spec = fields[name]
            i = self._read(payload_read(name, spec, rows))
            return lambda res: self._decode(spec, res[i], stored=name)
        if name == "next_obs" and k > 1 and self.frames is not None:
            older = self._shared_frames(boot, k - 1)
            last = self._shared_next_obs(boot)

            def stacked(res: list[Any]) -> Any:
                (rows, a), (_, b) = older(res), last(res)
                return stack_frames(rows, ndim, np.concatenate([a, b[:, None]], axis=1))

            return stacked
        if name == "next_obs" and k > 1:  # boot's newest k - 1 frames, then its next_obs
            older = self._plan_frames(fields["obs"], boot, k - 1)
            last = self._plan_next_obs(fields["obs"], boot)
            return lambda res: stack_frames(
                np.concatenate([older(res), last(res)[:, None]], axis=1),
                len(fields["obs"].shape),
            )
        if name == "next_obs" and self.frames is not None:
            return self._shape_picks(self._shared_next_obs(boot))
        if name == "next_obs":
            return self._plan_next_obs(fields["obs"], boot)
        if name == "reward":
            return lambda _: self._shaped(reward.astype(np.float32))
        if name == "info":
            i = self._read(info_read(rows))
            return lambda res: self._nested([unpackb(b) if b else {} for b in res[i]])
        key = lookup(name, self.s.index.schema.tags)  # type: ignore[union-attr]  # rows were drawn: the namespace has a schema
        values = cols[key.column][rows]
        if key.kind == "flag":
            return lambda _: self._shaped(((values & key.bit) != 0) == key.when_set)
        if key.kind == "num":
            return lambda _: self._shaped(values)
        self._lookup(key.column, values)
        return lambda _: self._shaped(self.s.strings.decode(key.column, values))

    def _plan_payload(self, name: str, rows: np.ndarray) -> Finish:
        """Payload field ``name`` at ``rows`` (checked with the batch's rows)."""
        spec = self.s.index.schema.fields[name]  # type: ignore[union-attr]  # rows were drawn: the namespace has a schema
        self.check.append(rows)
        i = self._read(payload_read(name, spec, rows))
        if spec.ragged:
            dtype, tail = np.dtype(spec.dtype), spec.shape[1:]
            if spec.codec is not None:
                return lambda res: decode_stored(self.s.store, name, spec, res[i])
            return lambda res: [np.frombuffer(b or b"", dtype).reshape(-1, *tail) for b in res[i]]
        return lambda res: self._decode(spec, res[i], (len(rows),), stored=name)

    def _plan_frames(self, spec: FieldSpec, rows: np.ndarray, k: int) -> Finish:
        """``(B, k, *shape)``: each row's k newest ``obs`` frames, oldest first, zeros
        before its episode's first step (:mod:`orchestrator.sampling.stacks`)."""
        assert self.stacks is not None
        chain = self.stacks.chain(self.cols, rows, k).ravel()
        have = chain >= 0
        self.check.append(chain[have])
        at = None if have.all() else np.flatnonzero(have)
        i = self._read(payload_read("obs", spec, chain[have], at, len(chain)))
        return lambda res: self._decode(spec, res[i], (len(rows), k))

    def _shared_frames(self, rows: np.ndarray, k: int) -> Picks:
        """:meth:`_plan_frames` of a compressed ``obs``: which frame each stack position
        holds, ``(B, k)``."""
        assert self.stacks is not None and self.frames is not None
        chain = self.stacks.chain(self.cols, rows, k)
        have = chain >= 0
        self.check.append(chain[have])
        spec = self.frames.spec
        i = self._read(payload_read("obs", spec, chain[have]))
        keys = np.where(have, chain, NO_FRAME).ravel()
        picks = self.frames.add(keys, [(i, np.flatnonzero(have.ravel()))])

        def stacks(res: list[Any]) -> tuple[np.ndarray, np.ndarray]:
            frames, index = picks(res)
            return frames, index.reshape(len(rows), k)

        return stacks

    def _shared_next_obs(self, boot: np.ndarray) -> Picks:
        """:meth:`_plan_next_obs` of a compressed ``obs``: the frame of each row's
        ``next_obs`` (the successor's obs, the explicit one, or none)."""
        assert self.frames is not None
        nxt = follow(self.cols, boot, self.cap)
        explicit = (self.cols["flags"][boot] & EXPLICIT_NEXT) != 0
        linked = (nxt >= 0) & ~explicit
        self.check.append(nxt[linked])
        spec = self.frames.spec
        i = self._read(payload_read("obs", spec, nxt[linked]))
        j = self._read(explicit_next_obs_read(spec, boot[explicit]))
        keys = np.where(linked, nxt, np.where(explicit, -2 - boot, NO_FRAME))
        return self.frames.add(keys, [(i, np.flatnonzero(linked)), (j, np.flatnonzero(explicit))])

    def _shape_picks(self, picks: Picks) -> Finish:
        """One frame per row as the batch's field: ``(*self.shape, *frame)``."""

        def finish(res: list[Any]) -> Any:
            frames, index = picks(res)
            lo = int(index[0]) if len(index) else 0
            if (index == np.arange(lo, lo + len(index))).all():
                got = frames[lo : lo + len(index)]  # none of them shared: a view
            else:
                got = np.take(frames, index, axis=0)
            return got.reshape(*self.shape, *frames.shape[1:])

        return finish

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
        """Queue the names of codes not cached yet on the fetch."""
        missing = self.s.strings.missing(column, codes)
        if missing:
            found = name_lookups(self.s.store, column, missing, self.s.index.n_shards)
            self.lookups += [(column, part, command) for part, command in found]
