"""``claw.maintenance.quality``: data-quality statistics of every namespace (beat, 30 s).

Per field, over the live steps: count of finite values, NaN and inf counts, min, max,
mean, std and a fixed-bin histogram. The fields are the numeric metadata (``reward``,
``priority``, ``step_index``, numeric tags; NaN there means "unset" and is not counted)
and every uncompressed, fixed-shape numeric payload field of at most ``MAX_ITEMS`` values
a row (all its values together); images, ragged and compressed fields are left out (their
bytes would be read and decoded on every pass).

Incremental: the statistics are kept per metadata chunk (``meta_spans``: slots of a
shard) in ``claw:{ns}:quality`` (``c:<shard>:<chunk>``, msgpack) and combined (Chan et
al.'s merge of count, mean and M2; min of mins...). A pass recomputes only the chunks whose
rows changed since this process's last pass (a listener on the maintenance index collects
them from every sync; a cold index means every chunk), reading their payload slots with
one GETRANGE a payload chunk. Histogram edges are fixed per field when it is first seen
(its range then, 32 bins, plus an underflow and an overflow bin), so chunk histograms add
up; ``reset_edges`` starts them over.

Counts per ``task_id``/``skill_tag``/``agent_id``/``reward_source`` and the windows (steps
and reward statistics of the steps committed in each of the last ``WINDOWS`` windows of
``WINDOW_S``) come from the index's columns on every pass: numpy over the whole namespace,
no Redis read. ``summary`` (msgpack) is what readers use: ``claw stats --quality``,
``claw metrics`` and the inspector's quality page.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.schema import FieldSpec, tag_column
from claw_tasks.store import Store, meta_chunk_of, meta_spans
from claw_tasks.store.scan import read_fixed
from claw_tasks.worker.app import app
from claw_tasks.worker.context import forget
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.sampling.index import SamplingIndex
from orchestrator.sampling.strings import Strings

MAX_ITEMS = 1024
"""Payload fields with more values a row (images) are not tracked."""
BINS = 32
WINDOW_S = 300.0
WINDOWS = 12
"""Steps per category and reward statistics are kept for the last 12 windows of 5 min:
``recent`` is the newest window, ``trailing`` the 11 before it."""
KEYS = ("task_id", "skill_tag", "agent_id", "reward_source")
META_FIELDS = ("reward", "priority", "step_index")
UNSET_IS_NAN = ("priority",)  # and numeric tags: NaN there is a missing value


def quality_key(store: Store) -> str:
    return store.owned_key("quality")


@dataclass
class Moments:
    """One field's statistics over some rows (``hist``: underflow, BINS bins, overflow)."""

    n: int = 0
    nan: int = 0
    inf: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    mean: float = 0.0
    m2: float = 0.0
    hist: list[int] = field(default_factory=lambda: [0] * (BINS + 2))

    @classmethod
    def of(cls, values: np.ndarray, edges: tuple[float, float] | None, missing: bool) -> Moments:
        v = np.asarray(values, np.float64).ravel()
        finite = np.isfinite(v)
        nan = np.isnan(v)
        out = cls(nan=0 if missing else int(nan.sum()), inf=int((~finite & ~nan).sum()))
        f = v[finite]
        out.n = len(f)
        if out.n:
            out.lo, out.hi = float(f.min()), float(f.max())
            out.mean = float(f.mean())
            out.m2 = float(((f - out.mean) ** 2).sum())
        if edges is not None:
            out.hist = histogram(f, edges)
        return out

    def merge(self, o: Moments) -> None:
        if o.n:
            n = self.n + o.n
            delta = o.mean - self.mean
            self.mean += delta * o.n / n
            self.m2 += o.m2 + delta * delta * self.n * o.n / n
            self.n = n
            self.lo, self.hi = min(self.lo, o.lo), max(self.hi, o.hi)
        self.nan += o.nan
        self.inf += o.inf
        self.hist = [a + b for a, b in zip(self.hist, o.hist, strict=True)]

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else math.nan

    def to_list(self) -> list[Any]:
        return [self.n, self.nan, self.inf, self.lo, self.hi, self.mean, self.m2, self.hist]

    @classmethod
    def from_list(cls, v: list[Any]) -> Moments:
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], v[6], list(v[7]))

    def to_json(self) -> dict[str, Any]:
        ok = self.n > 0
        return {
            "count": self.n,
            "nan": self.nan,
            "inf": self.inf,
            "min": self.lo if ok else None,
            "max": self.hi if ok else None,
            "mean": self.mean if ok else None,
            "std": self.std if ok else None,
            "hist": self.hist,
        }


def histogram(finite: np.ndarray, edges: tuple[float, float]) -> list[int]:
    """Counts of ``finite`` values: below ``lo``, BINS equal bins over [lo, hi] (as
    ``np.histogram`` bins them), above ``hi``."""
    lo, hi = edges
    inside = (finite >= lo) & (finite <= hi)
    bins = np.histogram(finite[inside], BINS, (lo, hi))[0]
    return [int((finite < lo).sum()), *bins.tolist(), int((finite > hi).sum())]


def bin_edges(lo: float, hi: float) -> tuple[float, float]:
    """Edges for a field first seen with values in [lo, hi] (a constant gets width 1)."""
    return (lo, hi) if hi > lo else (lo - 0.5, lo + 0.5)


def tracked_fields(schema: Any) -> dict[str, FieldSpec]:
    """The payload fields a pass reads (see the module docstring)."""
    out = {}
    for name, spec in (schema.fields if schema else {}).items():
        kind = np.dtype(spec.dtype).kind if spec.dtype is not None else ""
        numeric = kind != "" and kind in "biuf"
        if numeric and spec.codec is None and not spec.ragged and 0 < spec.row_items <= MAX_ITEMS:
            out[name] = spec
    return out


_DIRTY = "quality.dirty"  # index.attached: global chunks changed since the last pass


def _watch(index: SamplingIndex) -> None:
    """Collect the chunks each sync of ``index`` changes (None: all), from now on."""
    if _DIRTY in index.attached:
        return
    cap = index.cap
    per_shard = len(meta_spans(cap))
    index.attached[_DIRTY] = None

    def changed(rows: np.ndarray | None) -> None:
        seen = index.attached[_DIRTY]
        if rows is None or seen is None:
            index.attached[_DIRTY] = None
        elif len(rows):
            shard, slot = rows // cap, rows % cap
            seen.update(np.unique(shard * per_shard + meta_chunk_of(slot)).tolist())

    index.subscribe(changed)


def _signature(ids: np.ndarray) -> bytes:
    """Which steps a chunk's live rows hold: their payload statistics stand while it does
    (a priority or label change leaves it; an insert or eviction changes it)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, "<i8").tobytes(), digest_size=16).digest()


def quality_namespace(store: Store, now: float | None = None) -> dict[str, Any]:
    """One pass over ``store``'s namespace; returns (and stores) the summary."""
    cfg = store.config(refresh=True)
    index, strings = synced_index(store)
    _watch(index)
    index.sync()
    now = time.time() if now is None else now
    key = quality_key(store)
    spans = meta_spans(index.cap)
    cap, per_shard = index.cap, len(spans)
    n_chunks = per_shard * cfg.n_shards
    dirty = index.attached[_DIRTY]
    todo = list(range(n_chunks)) if dirty is None else sorted(dirty)
    index.attached[_DIRTY] = set()
    stored = store.r.hget(key, "edges")
    edges: dict[str, tuple[float, float]] = {
        k: tuple(v) for k, v in (unpackb(stored) if stored else {}).items()
    }
    payload = tracked_fields(cfg.schema)
    tags = cfg.schema.tags if cfg.schema else {}
    meta = [*META_FIELDS, *(tag_column(t) for t, kind in tags.items() if kind == "num")]
    names = [*meta, *payload]
    cols, alive = index.columns, index.columns["alive"]
    before = store.r.hmget(key, [_chunk_field(g, per_shard) for g in todo]) if todo else []
    values: dict[int, dict[str, np.ndarray]] = {}
    kept: dict[int, dict[str, Any]] = {}  # chunk -> payload statistics that still stand
    sigs: dict[int, bytes] = {}
    for g, old in zip(todo, before, strict=True):
        shard, c = divmod(g, per_shard)
        start, stop = spans[c]
        base = shard * cap
        rows = base + start + np.flatnonzero(alive[base + start : base + stop])
        got = {f: cols[f][rows] for f in meta if f in cols}
        sigs[g] = _signature(cols["id"][rows])
        prev = unpackb(old) if old else {}
        if prev.get("sig") == sigs[g] and set(payload) <= set(prev.get("fields", {})):
            kept[g] = {f: prev["fields"][f] for f in payload}
        elif payload and len(rows):
            got |= _payload(store, shard, start, stop, rows - base - start, payload)
        values[g] = got
    for f in names:  # edges for fields seen for the first time, from this pass's range
        if f in edges:
            continue
        finite = [v[f][np.isfinite(v[f])] for v in values.values() if f in v]
        finite = [x for x in finite if len(x)]
        if finite:
            lo, hi = min(float(x.min()) for x in finite), max(float(x.max()) for x in finite)
            edges[f] = bin_edges(lo, hi)
    with store.r.pipeline(transaction=False) as pipe:
        for g, got in values.items():
            doc = {
                f: Moments.of(v, edges.get(f), f in UNSET_IS_NAN or f.startswith("t:")).to_list()
                for f, v in got.items()
            }
            doc |= kept.get(g, {})
            pipe.hset(key, _chunk_field(g, per_shard), packb({"sig": sigs[g], "fields": doc}))
        pipe.hset(key, "edges", packb({k: list(v) for k, v in edges.items()}))
        pipe.execute()
    chunks = store.r.hmget(key, [_chunk_field(g, per_shard) for g in range(n_chunks)])
    fields: dict[str, Moments] = {}
    for raw in chunks:
        for f, v in (unpackb(raw)["fields"] if raw else {}).items():
            if f in names:
                fields.setdefault(f, Moments()).merge(Moments.from_list(v))
    summary = {
        "at": now,
        "steps": int(alive.sum()),
        "window_s": WINDOW_S,
        "fields": {f: {**m.to_json(), "edges": list(edges.get(f, ()))} for f, m in fields.items()},
        "untracked": sorted(set(cfg.schema.fields if cfg.schema else {}) - set(payload)),
        **_categories(store, index, strings, now),
    }
    store.r.hset(key, "summary", packb(summary))
    return summary


def _chunk_field(g: int, per_shard: int) -> str:
    return f"c:{g // per_shard}:{g % per_shard}"


def _payload(
    store: Store, shard: int, start: int, stop: int, rows: np.ndarray, fields: dict[str, FieldSpec]
) -> dict[str, np.ndarray]:
    """The live ``rows`` (positions in slots [start, stop)) of each field, flattened."""
    got = read_fixed(store, shard, start, stop, list(fields))
    return {name: arr.reshape(stop - start, -1)[rows].ravel() for name, arr in got.items()}


def _categories(store: Store, index: SamplingIndex, strings: Strings, now: float) -> dict[str, Any]:
    """Live steps per category value; per window, steps per value and reward statistics."""
    cols = index.columns
    alive = cols["alive"]
    ts = cols["timestamp"][alive]
    age = np.floor((now - ts) / WINDOW_S).astype(np.int64)  # 0: the newest window
    inwin = (age >= 0) & (age < WINDOWS)
    counts: dict[str, dict[str, int]] = {}
    windows: dict[str, dict[str, list[int]]] = {}
    for key in KEYS:
        codes = cols[key][alive]
        uniq, inverse = np.unique(codes, return_inverse=True)
        names = store.decode_codes(key, uniq.tolist())
        label = ["" if n is None else n for n in names]
        per = np.bincount(inverse, minlength=len(uniq))
        counts[key] = {label[i]: int(per[i]) for i in range(len(uniq))}
        grid = np.zeros((len(uniq), WINDOWS), np.int64)
        np.add.at(grid, (inverse[inwin], age[inwin]), 1)
        windows[key] = {label[i]: grid[i].tolist() for i in range(len(uniq))}
    reward = cols["reward"][alive].astype(np.float64)
    rw = []
    for w in range(WINDOWS):
        r = reward[inwin & (age == w)]
        rw.append(
            {
                "count": len(r),
                "mean": float(r.mean()) if len(r) else None,
                "std": float(r.std()) if len(r) else None,
            }
        )
    trailing = reward[inwin & (age > 0)]
    return {
        "counts": counts,
        "windows": windows,  # [newest window, ..., oldest]
        "rewards": rw,
        "reward_trailing": {
            "count": len(trailing),
            "mean": float(trailing.mean()) if len(trailing) else None,
            "std": float(trailing.std()) if len(trailing) else None,
        },
    }


def read_quality(store: Store) -> dict[str, Any] | None:
    """The last pass's summary (None before the first)."""
    raw = store.r.hget(quality_key(store), "summary")
    return None if raw is None else unpackb(raw)


def reset_edges(store: Store) -> None:
    """Forget every chunk's statistics and the histogram edges: the next pass starts over
    (edges from the data's range then)."""
    store.r.delete(quality_key(store))
    # this process's maintenance index: the next pass reads every chunk (the data stays,
    # so a shared sampling index stays valid for the other processes)
    forget(store.namespace, dropped=False)


@app.task(name="claw.maintenance.quality", acks_late=False, ignore_result=True)
def quality() -> dict[str, Any]:
    """A quality pass over every namespace with steps; raise (FAILED in Flower) if any
    failed (after the others)."""
    return each_namespace("quality pass", lambda store: quality_namespace(store)["steps"])
