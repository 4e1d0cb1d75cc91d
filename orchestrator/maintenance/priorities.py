"""``claw.maintenance.priorities``: recompute a namespace's priorities by its rules.

Rules (``Store.set_priority_rules``, the dict form of :class:`Rules`), applied in order:

1. ``scorer``: ``"module:function"``, called with a chunk of live steps as numpy arrays
   (metadata columns, plus the payload ``fields`` it asks for) and ``params``; returns new
   priorities (the "reanalyse with the latest policy" pattern). It must be listed in the
   workers' ``CLAW_SCORERS``: whoever configures a namespace does not choose code for
   workers to import.
2. ``half_life``: age decay, continuous: a step decays from its commit, or from the
   previous pass, by ``0.5 ** (elapsed / half_life)``.
3. ``unsampled_boost``: steps with no priority yet (never updated by a trainer) get
   ``boost * `` the highest priority.
4. ``clamp``: ``[lo, hi]``.
5. ``normalize``: divide by the mean, so priorities average 1 (with a scorer: per chunk).

A pass walks the namespace's metadata chunks with a cursor kept in Redis
(``claw:{ns}:prio``), a few seconds per beat tick, and resumes on the next tick, on any
worker. When it starts the store snapshots the priorities; a write lands only where the
priority still equals the snapshot (``claw_tasks.store.reprioritize``), so a trainer's
update after the pass started wins over the pass.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.durations import DurationError, parse_duration
from claw_tasks.settings import get_settings
from claw_tasks.store import Store, meta_spans
from claw_tasks.store.reprioritize import (
    drop_priority_snapshots,
    snapshot_priorities,
    write_priorities,
)
from claw_tasks.worker.app import app
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.sampling.index import SamplingIndex

TICK_BUDGET_S = 5.0
"""Work per beat tick and namespace; the cursor carries the rest to the next tick."""
Scorer = Callable[[dict[str, np.ndarray], dict[str, Any]], np.ndarray]


class RulesError(ValueError):
    """Priority rules that cannot be applied; the message names the setting."""


@dataclass(frozen=True)
class Rules:
    scorer: str | None = None
    fields: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    half_life: float | None = None
    unsampled_boost: float | None = None
    clamp: tuple[float, float] | None = None
    normalize: bool = False

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Rules:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise RulesError(f"unknown priority rule(s) {sorted(unknown)}")
        d = dict(d)
        if isinstance(d.get("half_life"), str):
            try:
                d["half_life"] = parse_duration(d["half_life"])
            except DurationError as e:
                raise RulesError(f"half_life: {e}") from None
        d["fields"] = tuple(d.get("fields") or ())
        if d.get("clamp") is not None:
            lo, hi = d["clamp"]
            if not 0 <= lo <= hi:
                raise RulesError(f"clamp must be [lo, hi] with 0 <= lo <= hi, got {d['clamp']}")
            d["clamp"] = (float(lo), float(hi))
        rules = cls(**d)
        if rules.half_life is not None and not rules.half_life > 0:
            raise RulesError(f"half_life must be > 0, got {rules.half_life}")
        if rules.scorer is not None and ":" not in rules.scorer:
            raise RulesError(f"scorer {rules.scorer!r}: name it as 'module:function'")
        return rules

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "fields": list(self.fields),
            "params": dict(self.params),
            "clamp": None if self.clamp is None else list(self.clamp),
        }


def load_scorer(name: str, allowed: tuple[str, ...]) -> Scorer:
    """The scorer ``module:function``, if the workers' allowlist names it."""
    if name not in allowed:
        raise RulesError(
            f"scorer {name!r} is not allowed on this worker: add it to CLAW_SCORERS "
            f"(now {', '.join(allowed) or 'empty'})"
        )
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


@dataclass
class Pass:
    """A pass's state, as kept in ``claw:{ns}:prio``."""

    started: float
    previous: float | None  # when the last complete pass started
    cursor: int  # next global chunk (shard * chunks per shard + chunk)
    top: float  # highest priority when the pass started (for the unsampled boost)
    scale: float  # normalisation divisor (built-in rules; 1 with a scorer)

    def to_redis(self) -> dict[str, str]:
        prev = "" if self.previous is None else repr(self.previous)
        return {
            "started": repr(self.started),
            "previous": prev,
            "cursor": str(self.cursor),
            "top": repr(self.top),
            "scale": repr(self.scale),
        }

    @classmethod
    def from_redis(cls, h: Mapping[bytes, bytes]) -> Pass | None:
        if b"cursor" not in h:
            return None
        prev = h.get(b"previous") or b""
        return cls(
            float(h[b"started"]),
            float(prev) if prev else None,
            int(h[b"cursor"]),
            float(h[b"top"]),
            float(h[b"scale"]),
        )


class Recompute:
    """One namespace's recomputation: start, advance or finish its pass."""

    def __init__(self, store: Store, rules: Rules, allowed: tuple[str, ...] = ()) -> None:
        self.store, self.rules = store, rules
        self.scorer = None if rules.scorer is None else load_scorer(rules.scorer, allowed)
        self.key = store.owned_key("prio")

    def run(
        self,
        budget_s: float = TICK_BUDGET_S,
        max_chunks: int | None = None,
        now: float | None = None,
    ) -> dict[str, Any]:
        """Advance the pass (starting one if none is under way) for up to ``budget_s`` or
        ``max_chunks`` chunks. Returns steps written and whether the pass finished."""
        index, _ = synced_index(self.store)
        now = time.time() if now is None else now
        state = Pass.from_redis(self.store.r.hgetall(self.key))
        if state is None:
            state = self._start(index, now)
        per_shard = len(meta_spans(index.cap))
        total = per_shard * index.n_shards
        deadline, written, chunks = time.monotonic() + budget_s, 0, 0
        while state.cursor < total and time.monotonic() < deadline:
            if max_chunks is not None and chunks >= max_chunks:
                break
            shard, chunk = divmod(state.cursor, per_shard)
            written += self._chunk(index, state, shard, chunk, now)
            state.cursor += 1
            chunks += 1
            self.store.r.hset(self.key, "cursor", state.cursor)
        finished = state.cursor >= total
        if finished:
            self._finish(state)
        return {"written": written, "finished": finished}

    def _start(self, index: SamplingIndex, now: float) -> Pass:
        old = self.store.r.hget(self.key, "last")
        prio = index.columns["priority"][index.columns["alive"]]
        top = float(np.nanmax(prio)) if np.isfinite(prio).any() else 1.0
        state = Pass(now, float(old) if old else None, 0, top, 1.0)
        if self.rules.normalize and self.scorer is None:
            rows = np.flatnonzero(index.columns["alive"])
            new = self._rules(index, rows, index.columns["priority"][rows], state, now)
            mean = float(np.nanmean(new)) if np.isfinite(new).any() else 0.0
            state.scale = mean if mean > 0 else 1.0
        snapshot_priorities(self.store, lambda pipe: pipe.hset(self.key, mapping=state.to_redis()))
        return state

    def _finish(self, state: Pass) -> None:
        def also(pipe: Any) -> None:
            pipe.delete(self.key)
            pipe.hset(self.key, "last", repr(state.started))

        drop_priority_snapshots(self.store, also)

    def _chunk(self, index: SamplingIndex, state: Pass, shard: int, chunk: int, now: float) -> int:
        cap, cols = index.cap, index.columns
        first, stop = meta_spans(cap)[chunk]
        rows = (
            shard * cap
            + first
            + np.flatnonzero(cols["alive"][shard * cap + first : shard * cap + stop])
        )
        if not len(rows):
            return 0
        old = cols["priority"][rows].astype(np.float32)
        if self.scorer is not None:
            new = self._score(index, rows)
            new = self._rules(index, rows, new, state, now)
        else:
            new = self._rules(index, rows, old.astype(np.float64), state, now)
        new = np.where(np.isnan(new), np.nan, np.maximum(new, 0)).astype(np.float32)
        if not np.all(np.isfinite(new) | np.isnan(old)):
            raise ValueError(f"scorer {self.rules.scorer}: returned non-finite priorities")
        changed = old.view(np.uint32) != new.view(np.uint32)  # bit for bit, NaN included
        if not changed.any():
            return 0
        rows = rows[changed]
        return write_priorities(
            self.store, shard, chunk, rows % cap, cols["id"][rows], old[changed], new[changed]
        )

    def _score(self, index: SamplingIndex, rows: np.ndarray) -> np.ndarray:
        cols, cap = index.columns, index.cap
        chunk = {name: col[rows] for name, col in cols.items() if name != "alive"}
        if self.rules.fields:
            shards, slots = rows // cap, rows % cap
            chunk.update(self.store.read_fields(shards, slots, list(self.rules.fields)))
        scores = np.asarray(self.scorer(chunk, dict(self.rules.params)), np.float64)  # type: ignore[misc]  # the scorer registry is typed loosely; it returns arrays
        if scores.shape != (len(rows),):
            raise ValueError(
                f"scorer {self.rules.scorer}: returned shape {scores.shape} for {len(rows)} steps"
            )
        return scores

    def _rules(
        self, index: SamplingIndex, rows: np.ndarray, p: np.ndarray, state: Pass, now: float
    ) -> np.ndarray:
        r, p = self.rules, np.array(p, np.float64)
        if r.half_life is not None:
            since = index.columns["timestamp"][rows]
            if state.previous is not None:
                since = np.maximum(since, state.previous)
            p *= 0.5 ** (np.maximum(now - since, 0) / r.half_life)
        if r.unsampled_boost is not None:
            p = np.where(np.isnan(p), r.unsampled_boost * state.top, p)
        if r.clamp is not None:
            p = np.clip(p, *r.clamp)
        if r.normalize:
            if self.scorer is not None:
                mean = float(np.nanmean(p)) if np.isfinite(p).any() else 0.0
                p /= mean if mean > 0 else 1.0
            else:
                p /= state.scale
        return p


@app.task(name="claw.maintenance.priorities", acks_late=False, ignore_result=True)
def priorities() -> dict[str, Any]:
    """Advance every namespace's recomputation pass; raise (FAILED in Flower) on failures."""

    def work(store: Store) -> Any:
        raw = store.config(refresh=True).priorities
        return Recompute(store, Rules.of(raw), get_settings().scorers).run() if raw else None

    return each_namespace("priority recomputation", work)
