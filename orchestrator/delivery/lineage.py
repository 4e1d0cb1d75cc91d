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
- ``t``: the time.

The log is capped at ``CLAW_LINEAGE_MAXLEN`` entries (``XADD MAXLEN ~``: the oldest go
first). Queries read it whole, a page at a time: :meth:`LineageLog.trained` answers "which
data trained policy v", :meth:`LineageLog.policies` "which policies trained on these
steps" (an episode's steps come from the sampling index, which knows the ids of evicted
steps whose slots were not reused). Cost per batch: docs/benchmarks.md, "Lineage".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from claw_tasks.settings import get_settings
from claw_tasks.store import Store

PAGE = 1_000
"""Entries read per round trip by a query."""
_WIDTHS = ((np.dtype("u1"), 2**8), (np.dtype("<u2"), 2**16), (np.dtype("<u4"), 2**32))
_WIDE = np.dtype("<i8")


def lineage_key(store: Store) -> str:
    return f"{store.keys.base}lineage"


def encode_ids(ids: np.ndarray) -> bytes:
    """The ids, sorted: a width byte, the first id (8 bytes), the gaps at that width."""
    s = np.sort(np.asarray(ids, np.int64))
    if not len(s):
        return b""
    gaps = np.diff(s)
    top = int(gaps.max()) if len(gaps) else 0
    width = next((w for w, end in _WIDTHS if top < end), _WIDE)
    return bytes([width.itemsize]) + s[:1].astype("<i8").tobytes() + gaps.astype(width).tobytes()


def decode_ids(raw: bytes) -> np.ndarray:
    """The sorted ids of :func:`encode_ids`."""
    if not raw:
        return np.zeros(0, np.int64)
    width = next((w for w, _ in _WIDTHS if w.itemsize == raw[0]), _WIDE)
    first = np.frombuffer(raw, "<i8", 1, 1)
    gaps = np.frombuffer(raw, width, offset=9).astype(np.int64)
    return np.concatenate([first, first[0] + np.cumsum(gaps)])


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

    def to_json(self, with_ids: bool = False) -> dict[str, Any]:
        out = {
            "entry": self.entry_id,
            "recipe": self.recipe,
            "recipe_version": self.recipe_version,
            "policy": self.policy,
            "rows": self.rows,
            "digest": self.digest,
            "at": self.at,
        }
        if with_ids:
            out["ids"] = self.ids.tolist()
        return out


def record(
    recipe: str, recipe_version: int, policy: Any, ids: np.ndarray, now: float | None = None
) -> dict[str, bytes | str]:
    """The fields of one entry (what ``XADD`` sends)."""
    ids = np.asarray(ids, np.int64)
    return {
        "r": recipe,
        "rv": str(int(recipe_version)),
        "p": "" if policy is None else str(policy),
        "n": str(len(ids)),
        "d": digest(ids),
        "ids": encode_ids(ids),
        "t": f"{time.time() if now is None else now:.3f}",
    }


class LineageLog:
    """A namespace's lineage stream: appends (queued on a caller's pipeline) and queries."""

    def __init__(self, store: Store, maxlen: int | None = None) -> None:
        self.store, self.r = store, store.r
        self.key = lineage_key(store)
        self.maxlen = get_settings().lineage_maxlen if maxlen is None else maxlen

    def queue(self, pipe: redis.client.Pipeline, fields: dict[str, bytes | str]) -> None:
        pipe.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]

    def entries(self, start: str = "-", end: str = "+") -> Iterator[Entry]:
        """Every entry from ``start`` to ``end`` (stream ids), oldest first."""
        low = start
        while True:
            page = self.r.xrange(self.key, low, end, count=PAGE)
            for entry_id, kv in page:
                yield _entry(entry_id, kv)
            if len(page) < PAGE:
                return
            low = "(" + page[-1][0].decode()

    def trained(self, policy: Any) -> list[Entry]:
        """The batches declared as training ``policy``, oldest first."""
        want = str(policy).encode()
        out = []
        low = "-"
        while True:  # the policy field is compared before any ids are decoded
            page = self.r.xrange(self.key, low, "+", count=PAGE)
            out += [_entry(i, kv) for i, kv in page if kv.get(b"p") == want]
            if len(page) < PAGE:
                return out
            low = "(" + page[-1][0].decode()

    def policies(self, ids: np.ndarray) -> dict[int, dict[str, int]]:
        """Per step id: the policies that trained on it, with how many of its rows each."""
        ids = np.unique(np.asarray(ids, np.int64))
        out: dict[int, dict[str, int]] = {int(i): {} for i in ids}
        if not len(ids):
            return out
        page: list[Entry] = []
        for e in self.entries():
            page.append(e)
            if len(page) == PAGE:
                _count_page(page, ids, out)
                page = []
        _count_page(page, ids, out)
        return out

    def length(self) -> int:
        return int(self.r.xlen(self.key))


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


def _entry(entry_id: bytes, kv: dict[bytes, bytes]) -> Entry:
    return Entry(
        entry_id.decode(),
        kv[b"r"].decode(),
        int(kv[b"rv"]),
        kv[b"p"].decode(),
        int(kv[b"n"]),
        kv[b"d"].decode(),
        float(kv[b"t"]),
        decode_ids(kv[b"ids"]),
    )
