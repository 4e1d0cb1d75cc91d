"""A namespace's mutable state over its global rows (``shard * cap + slot``, the sampling
index's rows) and what compares it: pure data, no Redis. :mod:`claw_tasks.store.snapshots`
reads and writes it; the read path (``claw diff``, as-of sampling, a restore's
snapshots) compares and moves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.store.layout import STR_TAG_DTYPE


@dataclass
class Labels:
    """A namespace's mutable state at one moment, over the global rows ``shard * cap +
    slot``: which rows held a live step (``alive``, with the id each held: :attr:`ids`),
    and their trainable bit, quality codes, stored priorities (raw bits: NaN-xor, zero =
    unset) and free tags (as stored). ``strings``: column -> code -> string."""

    n_shards: int
    cap: int
    seqs: tuple[int, ...]
    alive: np.ndarray
    untrainable: np.ndarray
    quality: np.ndarray
    priority: np.ndarray
    tags: dict[str, np.ndarray]
    strings: dict[str, dict[int, str]]

    @property
    def ids(self) -> np.ndarray:
        """The id of the step each row held (0 where none was ever allocated)."""
        out = np.zeros(self.n_shards * self.cap, np.int64)
        slots = np.arange(self.cap, dtype=np.int64)
        for shard, seq in enumerate(self.seqs):
            q = seq - (seq - 1 - slots) % self.cap
            out[shard * self.cap : (shard + 1) * self.cap] = np.where(
                q >= 1, q * self.n_shards + shard, 0
            )
        return out

    def same_steps(self, other: Labels) -> np.ndarray:
        """Rows holding the same live step in both."""
        return self.alive & other.alive & (self.ids == other.ids)


@dataclass(frozen=True)
class Diff:
    """What changed from one state to another (steps counted once each)."""

    added: int  # live in the second, not in the first
    evicted: int  # live in the first, gone in the second
    kept: int  # live in both
    untrainable: int  # of the kept: made untrainable
    trainable: int  # of the kept: made trainable again
    quality: int  # of the kept: another quality
    priority: int  # of the kept: another priority (bit for bit)
    tags: dict[str, int]  # of the kept, per tag: another value

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def diff(a: Labels, b: Labels, rows: np.ndarray | None = None) -> Diff:
    """What changed from ``a`` to ``b``; ``rows`` (bool per row) restricts the count."""
    sel = np.ones(len(a.alive), bool) if rows is None else rows
    both = a.same_steps(b)
    same = both & sel
    tags = {}
    for col in sorted(set(a.tags) | set(b.tags)):
        va, vb = a.tags.get(col), b.tags.get(col)
        if va is None or vb is None:
            v = vb if va is None else va
            tags[col] = int((same & (v.view(f"u{v.itemsize}") != 0)).sum())
        else:
            tags[col] = int((same & (va != vb)).sum())
    return Diff(
        added=int((b.alive & ~both & sel).sum()),
        evicted=int((a.alive & ~both & sel).sum()),
        kept=int(same.sum()),
        untrainable=int((same & ~a.untrainable & b.untrainable).sum()),
        trainable=int((same & a.untrainable & ~b.untrainable).sum()),
        quality=int((same & (a.quality != b.quality)).sum()),
        priority=int((same & (a.priority != b.priority)).sum()),
        tags=tags,
    )


def moved(old: Labels, old_ids: np.ndarray, new_ids: np.ndarray, now: Labels) -> tuple[Labels, int]:
    """``old`` (a snapshot of another namespace, e.g. an archived one) laid over ``now``'s
    layout: each of its steps that the pair ``old_ids -> new_ids`` maps to a step live in
    ``now`` (a restore's ids) keeps its labels, priority and tags at its new row; the
    rest are missing (not archived, past the new ring, ...), counted. String columns keep
    ``old``'s codes with ``old``'s strings (a rollback or ``as_of`` re-encodes them); a
    numeric tag ``old`` lacks takes ``now``'s values (``orig_id``, written by the
    restore), a string one stays unset. Returns the state and the missing count."""
    have = np.flatnonzero(old.alive)
    ids = old.ids[have]
    order = np.argsort(old_ids, kind="stable")
    keys, vals = old_ids[order], new_ids[order]
    at = np.clip(np.searchsorted(keys, ids), 0, max(len(keys) - 1, 0))
    found = (keys[at] == ids) & (vals[at] >= 0) if len(keys) else np.zeros(len(ids), bool)
    new = vals[at[found]] if len(keys) else np.zeros(0, np.int64)
    seq = new // now.n_shards
    rows = (new % now.n_shards) * now.cap + (seq - 1) % now.cap
    live = now.alive[rows] & (now.ids[rows] == new)
    src, rows = have[found][live], rows[live]
    size = now.n_shards * now.cap

    def laid(values: np.ndarray) -> np.ndarray:
        out = np.zeros(size, values.dtype)
        out[rows] = values[src]
        return out

    alive = np.zeros(size, bool)
    alive[rows] = True
    tags = {}
    for col, cur in now.tags.items():
        if col in old.tags:
            tags[col] = laid(old.tags[col].astype(cur.dtype))
        elif cur.dtype != STR_TAG_DTYPE:
            tags[col] = np.where(alive, cur, 0).astype(cur.dtype)
        else:
            tags[col] = np.zeros_like(cur)
    strings = {c: dict(v) for c, v in old.strings.items() if c == "quality" or c in old.tags}
    labels = Labels(
        now.n_shards,
        now.cap,
        now.seqs,
        alive,
        laid(old.untrainable),
        laid(old.quality),
        laid(old.priority),
        tags,
        strings,
    )
    return labels, int(len(ids) - len(rows))
