"""Lineage: which steps went into which trainer update, and back.

A trainer declares the policy (or update) version a batch trains (``BatchClient.pop(...,
policy_version=v)``, or ``BatchClient.trained(batch, v)`` for a batch popped earlier, as a
read-ahead does); the client appends one entry per batch to the namespace's stream
``claw:{ns}:lineage`` in the pipeline of its next pop (no round trip of its own; ``close``
and ``flush_lineage`` send what is left). An entry holds:

- ``r``, ``rv``: the recipe and its version (what drew the batch, with which params);
- ``p``: the declared version (text; ``""`` when none was declared);
- ``n``, ``d``: rows, and a digest of the ids in batch order (blake2b, 8 bytes);
- ``ids``: the batch's step ids, sorted: the first as 8 bytes, then the gaps between them
  in the narrowest of 1, 2, 4 or 8 bytes that holds the largest (a batch draws with
  replacement: repeats are kept, gap 0). 256 ids of 1M are 2 bytes each; zstd was larger
  and took twice the trainer's time (docs/benchmarks.md). A step id is never
  reused, so the ids name the data for as long as the log keeps the entry, evicted or not;
- ``t``: the time;
- what replays the batch (``claw replay``, :mod:`orchestrator.inspect.replay`), each only
  when the batch has it: ``o``, the rank of each row's id among the sorted ``ids`` in
  batch order (the narrowest width; left out when the batch is in id order); ``w``, the
  importance weights (one float32 when all equal, else byte planes under zstd); ``x``, the
  rows' source indexes (left out when all 0); ``s``, the seed its augmentation drew from;
  ``rd``, the content address of the recipe version
  (:func:`~orchestrator.recipe.model.recipe_digest`), whose definition the registry keeps
  while the log names it.

The log is capped at ``CLAW_LINEAGE_MAXLEN`` entries (``XADD MAXLEN ~``: the oldest go
first). :meth:`LineageLog.trained` answers "which data trained policy v",
:meth:`LineageLog.policies` "which policies trained on these steps" (an episode's steps
come from the sampling index, which knows the ids of evicted steps whose slots were not
reused), from the index the beat keeps (:mod:`orchestrator.delivery.lineage_index`: the
segments' tables, then only the blocks of the steps asked for or the policy's entries)
and the tail of the log it has not indexed yet. Cost per batch and per query:
docs/benchmarks.md, "Lineage".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import redis
import zstandard

from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.delivery.lineage_index import (
    BuildReport,
    LineageIndex,
    Segment,
    decode_ids,
    encode_ids,
    encode_sorted,
    narrowest,
)

__all__ = [
    "Entry",
    "LineageLog",
    "Replayable",
    "Served",
    "Traced",
    "decode_ids",
    "digest",
    "encode_ids",
    "lineage_key",
    "read_entry",
    "record",
]

PAGE = 1_000
"""Entries read per round trip by a query."""


def lineage_key(store: Store) -> str:
    return store.owned_key("lineage")


class Traced(Protocol):
    """What a lineage entry names of a batch: its recipe version and step ids (a
    :class:`~orchestrator.sampling.batch.Batch`, or a part of one an adapter served).
    What replays it is read when the object has it: ``weights``, ``source_index``,
    ``seed`` and ``recipe_digest`` (a popped batch's; a part has no seed)."""

    @property
    def recipe_version(self) -> int: ...

    @property
    def ids(self) -> np.ndarray: ...


class Served(NamedTuple):
    """A :class:`Traced` kept without the batch's arrays (an adapter's served part; a
    named tuple: made for every part served, at a third of a frozen dataclass's cost)."""

    recipe_version: int
    ids: np.ndarray
    weights: np.ndarray | None = None
    seed: int | None = None
    recipe_digest: str | None = None
    source_index: np.ndarray | None = None


@dataclass(frozen=True)
class Replayable:
    """What an entry records to replay its batch (each None when the batch had none)."""

    weights: np.ndarray | None = None
    source_index: np.ndarray | None = None
    seed: int | None = None
    recipe_digest: str | None = None

    @classmethod
    def of(cls, batch: Traced) -> Replayable:
        """What ``batch`` has of it, its arrays copied: the entry is encoded later (with
        the next pop), and a trainer may scale a batch's weights in place meanwhile."""
        weights = getattr(batch, "weights", None)
        source_index = getattr(batch, "source_index", None)
        return cls(
            None if weights is None else np.array(weights),
            None if source_index is None else np.array(source_index),
            getattr(batch, "seed", None),
            getattr(batch, "recipe_digest", None),
        )


def digest(ids: np.ndarray) -> str:
    """A batch's ids in its own order, hashed: a batch popped twice has one digest."""
    return hashlib.blake2b(np.asarray(ids, "<i8").tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One popped batch in the log."""

    entry_id: str
    recipe: str
    recipe_version: int
    policy: str
    rows: int
    digest: str
    at: float
    ids: np.ndarray  # sorted, repeats kept
    order: np.ndarray | None = None  # each row's index into ``ids``; None: in id order
    weights: np.ndarray | None = None  # float32 per row, batch order
    source_index: np.ndarray | None = None  # per row; None: all 0
    seed: int | None = None
    recipe_digest: str | None = None

    @property
    def batch_ids(self) -> np.ndarray:
        """The step ids in the order the trainer got the rows."""
        return self.ids if self.order is None else self.ids[self.order]

    def to_json(self, with_ids: bool = False) -> dict[str, Any]:
        out = {
            "entry": self.entry_id,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "policy": self.policy,
            "rows": self.rows,
            "digest": self.digest,
            "at": self.at,
            "seed": self.seed,
            "recipe_digest": self.recipe_digest,
        }
        if with_ids:
            out["ids"] = self.batch_ids.tolist()
        return out


def record(
    recipe: str,
    recipe_version: int,
    policy: Any,
    ids: np.ndarray,
    now: float | None = None,
    replay: Replayable | None = None,
) -> dict[str, bytes | str]:
    """The fields of one entry (what ``XADD`` sends); ``replay``: what replays the batch."""
    ids = np.asarray(ids, np.int64)
    n = len(ids)
    perm = None if replay is None or n < 2 else np.argsort(ids)  # any order of repeats
    fields: dict[str, bytes | str] = {
        "r": recipe,
        "rv": str(int(recipe_version)),
        "p": "" if policy is None else str(policy),
        "n": str(n),
        "d": digest(ids),
        "ids": encode_ids(ids) if perm is None else encode_sorted(ids[perm]),
        "t": f"{time.time() if now is None else now:.3f}",
    }
    if replay is None:
        return fields
    if perm is not None and (perm[1:] < perm[:-1]).any():  # not in id order already
        rank = np.empty(n, narrowest(n - 1))
        rank[perm] = np.arange(n, dtype=rank.dtype)
        fields["o"] = rank.tobytes()
    if replay.weights is not None and len(ids):
        fields["w"] = encode_weights(replay.weights)
    if replay.source_index is not None and len(ids) and np.any(replay.source_index):
        si = np.asarray(replay.source_index, np.int64)
        fields["x"] = si.astype(narrowest(int(si.max()))).tobytes()
    if replay.seed is not None:
        fields["s"] = str(int(replay.seed))
    if replay.recipe_digest is not None:
        fields["rd"] = replay.recipe_digest
    return fields


_ZSTD = zstandard.ZstdCompressor(level=-1)  # the size of level 1 (measured), faster
_UNZSTD = zstandard.ZstdDecompressor()


def encode_weights(weights: np.ndarray) -> bytes:
    """float32 weights: ``c`` and the one value when all are equal, else ``z`` and their
    four byte planes under zstd (the exponent bytes compress; the mantissas do not: 256
    prioritized weights take ~850 bytes of 1,024; docs/replay.md, "Cost")."""
    w = np.ascontiguousarray(weights, "<f4")
    bits = w.view("<u4")
    if (bits == bits[0]).all():  # all equal, bit for bit (0.0 and -0.0 differ)
        return b"c" + w[:1].tobytes()
    planes = w.view(np.uint8).reshape(-1, 4).T.tobytes()
    return b"z" + _ZSTD.compress(planes)


def decode_weights(raw: bytes, n: int) -> np.ndarray:
    """The ``n`` weights of :func:`encode_weights`."""
    if raw[:1] == b"c":
        return np.full(n, np.frombuffer(raw, "<f4", 1, 1)[0], np.float32)
    planes = np.frombuffer(_UNZSTD.decompress(raw[1:], max_output_size=4 * n), np.uint8)
    return planes.reshape(4, n).T.copy().view("<f4").reshape(n)


class LineageLog:
    """A namespace's lineage stream: appends (queued on a caller's pipeline), its index
    (:meth:`build_index`, run by the beat) and queries."""

    def __init__(
        self, store: Store, maxlen: int | None = None, index: LineageIndex | None = None
    ) -> None:
        self.store, self.r = store, store.r
        self.key = lineage_key(store)
        self.maxlen = get_settings().lineage_maxlen if maxlen is None else maxlen
        self.index = LineageIndex(self.r, self.key) if index is None else index

    def queue(self, pipe: redis.client.Pipeline, fields: dict[str, bytes | str]) -> None:
        pipe.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]  # redis-py's stubs want str keys; bytes are sent as they are

    def build_index(self, *, force: bool = False) -> BuildReport:
        """Index what the log holds past the index (the beat's pass; ``force``: the tail
        too, however short)."""
        return self.index.build(force=force)

    def entries(self, start: str = "-", end: str = "+") -> Iterator[Entry]:
        """Every entry from ``start`` to ``end`` (stream ids), oldest first."""
        low = start
        while True:
            page = self.r.xrange(self.key, low, end, count=PAGE)
            for entry_id, kv in page:
                yield read_entry(entry_id, kv)
            if len(page) < PAGE:
                return
            low = "(" + page[-1][0].decode()

    def trained(self, policy: Any) -> list[Entry]:
        """The batches declared as training ``policy``, oldest first: the index's
        segments that hold it, their entries of it read by stream id, then the tail."""
        want = str(policy)
        segments, wm, _ = self.index.state()  # trimmed entries: not found by id
        having = [(s, c) for s in segments if (c := s.code(want)) is not None]
        sids = self.index.sids([s for s, _ in having])
        out = []
        for (seg, code), ids in zip(having, sids, strict=True):
            entries = np.flatnonzero(seg.pol == code)
            out += [read_entry(i, kv) for i, kv in self.index.fetch(ids, entries)]
        raw = want.encode()
        for page in self.index.tail(wm, PAGE):  # the policy is compared before any decoding
            out += [read_entry(i, kv) for i, kv in page if kv.get(b"p") == raw]
        return out

    def policies(self, ids: np.ndarray) -> dict[int, dict[str, int]]:
        """Per step id: the policies that trained on it, with how many of its rows each."""
        ids = np.unique(np.asarray(ids, np.int64))
        out: dict[int, dict[str, int]] = {int(i): {} for i in ids}
        if not len(ids):
            return out
        segments, wm, head = self.index.state()
        for seg, rows in zip(segments, self.index.postings(segments, ids), strict=True):
            kept = _kept(seg, self.index, head)
            sel = slice(None) if kept is None else kept[rows.entries]
            _count(out, rows.ids[sel], seg.pol[rows.entries[sel]], seg.policies)
        for raw in self.index.tail(wm, PAGE):
            page = [read_entry(i, kv) for i, kv in raw]
            _count_page(page, ids, out)
        return out

    def counts(self) -> dict[str, int]:
        """Batches per declared policy (``""``: undeclared) in the log."""
        segments, wm, head = self.index.state()
        out: dict[str, int] = {}
        for seg in segments:
            kept = _kept(seg, self.index, head)
            batches = (
                seg.batches
                if kept is None
                else np.bincount(seg.pol[kept], minlength=len(seg.policies)).tolist()
            )
            for p, n in zip(seg.policies, batches, strict=True):
                if n:
                    out[p] = out.get(p, 0) + n
        for page in self.index.tail(wm, PAGE):
            for _, kv in page:
                p = kv.get(b"p", b"").decode(errors="replace")
                out[p] = out.get(p, 0) + 1
        return out

    def recipe_digests(self) -> set[str]:
        """The recipe versions (digests) the log's entries name: the segments' tables
        (the oldest one's trimmed entries count too) and the tail."""
        segments, wm, _ = self.index.state()
        out = {d for seg in segments for d in seg.recipes}
        for page in self.index.tail(wm, PAGE):
            out.update(kv[b"rd"].decode() for _, kv in page if b"rd" in kv)
        return out

    def replayable(self, policy: Any = None, start: str = "-", end: str = "+") -> Iterator[Entry]:
        """The entries to replay: those declared as training ``policy`` (oldest first), or
        every entry from ``start`` to ``end`` (stream ids) when no policy is named, read a
        page at a time (a range may be the whole log)."""
        return iter(self.trained(policy)) if policy is not None else self.entries(start, end)

    def length(self) -> int:
        return int(self.r.xlen(self.key))


def _kept(seg: Segment, index: LineageIndex, head: tuple[int, int] | None) -> np.ndarray | None:
    """Which of a segment's entries the log still holds (``head``: its first stream id);
    None: all of them (only the oldest segment can be partly trimmed)."""
    if head is None or seg.first >= head:
        return None
    sids = index.sids([seg])[0]
    return (sids["ms"] > head[0]) | ((sids["ms"] == head[0]) & (sids["seq"] >= head[1]))


def _count(
    out: dict[int, dict[str, int]], steps: np.ndarray, codes: np.ndarray, names: list[str]
) -> None:
    """Add one row per (step, policy code) pair to ``out``."""
    if not len(steps):
        return
    pairs, n = np.unique(np.stack([steps, codes]), axis=1, return_counts=True)
    for (step, code), k in zip(pairs.T.tolist(), n.tolist(), strict=True):
        seen = out[step]
        seen[names[code]] = seen.get(names[code], 0) + k


def _count_page(page: list[Entry], ids: np.ndarray, out: dict[int, dict[str, int]]) -> None:
    """Add ``page``'s rows of ``ids`` to ``out`` (one ``isin`` over the page's rows)."""
    if not page:
        return
    rows = np.concatenate([e.ids for e in page])
    owner = np.repeat(np.arange(len(page)), [len(e.ids) for e in page])
    hit = np.flatnonzero(np.isin(rows, ids))
    for step, k in zip(rows[hit].tolist(), owner[hit].tolist(), strict=True):
        seen = out[step]
        seen[page[k].policy] = seen.get(page[k].policy, 0) + 1


def read_entry(entry_id: bytes, kv: dict[bytes, bytes]) -> Entry:
    """One entry as ``XRANGE`` gives it back (the fields of :func:`record`)."""
    n = int(kv[b"n"])
    width = narrowest(max(n - 1, 0))
    order = None if b"o" not in kv else np.frombuffer(kv[b"o"], width).astype(np.int64)
    weights = None if b"w" not in kv else decode_weights(kv[b"w"], n)
    x = kv.get(b"x")
    source_index = None if x is None else _source_index(x, n)
    seed = None if b"s" not in kv else int(kv[b"s"])
    rd = None if b"rd" not in kv else kv[b"rd"].decode()
    return Entry(
        entry_id.decode(),
        kv[b"r"].decode(),
        int(kv[b"rv"]),
        kv[b"p"].decode(),
        n,
        kv[b"d"].decode(),
        float(kv[b"t"]),
        decode_ids(kv[b"ids"]),
        order,
        weights,
        source_index,
        seed,
        rd,
    )


def _source_index(raw: bytes, n: int) -> np.ndarray:
    """The rows' source indexes of an entry's ``x`` (its width: its length over ``n``)."""
    width = next(w for w in (np.dtype("u1"), np.dtype("<u2")) if w.itemsize * n == len(raw))
    return np.frombuffer(raw, width).astype(np.int16)
