"""Reading a shard's change log from a reader's position, a page at a time.

A page is two commands queued together: a plain ``XRANGE`` of the entries after the
position, then ``lua/log_since.lua``, which tells whether any entry after it is gone
(trimmed or deleted: the reader must rebuild). The entries do not pass through Lua: there a
page of 1,000 cost Redis ~3.8 ms (the reply converted to Lua tables and back), the plain
``XRANGE`` ~0.65 ms (docs/benchmarks.md, Eviction). The check after the read needs no
transaction: the counts it compares only grow.

A reader that expects nothing new (:class:`~orchestrator.sampling.fetch.LogChecked` on a
quiet store) reads one command instead: ``XRANGE`` from its last entry, inclusive. On a
quiet log the reply is that one entry (what ``XREVRANGE + - COUNT 1`` returned before:
the same cost); otherwise it is a page whose first entry proves that no entry after the
position is gone, so a sync applies it (:class:`LogRead`) instead of reading it again.

A sync queues ``lua/reread.lua`` per shard after its pages: it reads the log after the
position again and the slots its ``seq``/``n`` entries name (:func:`reread_args`), so the
re-read of committed slots needs no round trip of its own (:class:`~orchestrator.
sampling.index.SamplingIndex`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.store.layout import (
    META_CHUNK_SLOTS,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    payload_chunk_slots,
)
from claw_tasks.store.scripts import Lua
from orchestrator.sampling.bulk import pack, pack_args

LOG_SINCE = Lua("log_since", "orchestrator")
REREAD = Lua("reread", "orchestrator")
REREAD_ENTRIES, REREAD_SLOTS = 64, 16_384
"""Most entries and slots per shard that a page's own round trip re-reads (``reread.lua``);
past them the reader reads the slots in a round trip of their own."""


def page_commands(key: str, last: str, seen: int, page: int) -> list[list[Any]]:
    """The commands reading up to ``page`` entries of the log ``key`` after the entry
    ``last`` (``'0-0'``: from the start), ``seen`` being the entries the log had added up
    to and including it; queue them in this order, then pair their replies with
    :func:`page_replies`."""
    return [page_xrange(key, last, page), ["EVALSHA", LOG_SINCE.sha, 1, key, last, seen]]


def page_xrange(key: str, last: str, page: int) -> list[Any]:
    """A page's read alone: up to ``page`` entries of the log ``key`` after ``last``
    (a sync's round trip checks for lost entries in ``reread.lua``)."""
    return ["XRANGE", key, f"({last}", "+", "COUNT", page]


Entry = tuple[bytes, dict[bytes, bytes]]


def page_replies(replies: Sequence[Any]) -> list[tuple[bool, list[Entry]]]:
    """``(lost, entries)`` per page from the replies of the commands of
    :func:`page_commands`, queued one page after the other; an entry is its id and its
    fields (redis-py parses an ``XRANGE`` reply so, a raw reader leaves them flat)."""
    return [
        (bool(int(replies[i + 1])), [(eid, _fields(kv)) for eid, kv in replies[i]])
        for i in range(0, len(replies), 2)
    ]


@dataclass(frozen=True)
class LogRead:
    """Change-log pages a reader already read (a fetch's tail), one per shard, from the
    positions ``last``/``seen``: a sync from the same positions applies them instead of
    reading them again (one round trip fewer)."""

    last: list[str]
    seen: list[int]
    pages: list[tuple[bool, list[Entry]]]

    def at(self, last: Sequence[str], seen: Sequence[int]) -> list[tuple[bool, list[Entry]]] | None:
        """The pages, if they were read from exactly these positions."""
        return self.pages if list(last) == self.last and list(seen) == self.seen else None


def from_last_command(key: str, last: str, page: int) -> list[Any]:
    """The command reading the entry ``last`` of the log ``key`` and up to ``page``
    entries after it: the quiet check of :class:`~orchestrator.sampling.fetch.LogChecked`
    (:func:`from_last_page` reads its reply)."""
    return ["XRANGE", key, last, "+", "COUNT", page + 1]


def from_last_page(reply: Sequence[Any], last: str) -> tuple[bool, list[Entry] | None]:
    """Of a :func:`from_last_command` reply: whether the log has no entry after ``last``,
    and the entries after it when they are known to be all of them up to the page
    (``last`` is still in the log: logs are only trimmed from the head, never deleted
    from, so no entry after it is gone); None when ``last`` is gone (the sync decides)."""
    if not reply:
        return last == "0-0", [] if last == "0-0" else None
    entries = [(eid, _fields(kv)) for eid, kv in reply]
    if entries[0][0].decode() != last:
        return False, None
    return len(entries) == 1, entries[1:]


def slot_runs(inserts: list[tuple[int, int]], cap: int, chunk: int) -> list[tuple[int, int]]:
    """Slot runs [start, stop) of a ring of ``cap`` slots covered by inserts (seq0, n):
    merged, split at chunks of ``chunk`` slots."""
    spans = []
    for seq0, n in inserts:
        start, n = (seq0 - 1) % cap, min(n, cap)
        spans += [(start, start + n)] if start + n <= cap else [(start, cap), (0, start + n - cap)]
    merged: list[list[int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    runs = []
    for start, stop in merged:
        while start < stop:
            end = min(stop, (start // chunk + 1) * chunk)
            runs.append((start, end))
            start = end
    return runs


def reread_args(head: list[Any], cols: list[str], columns: dict[str, np.ndarray]) -> list[Any]:
    """``reread.lua``'s arguments: ``head`` (shard prefix, cap, last entry id, entries
    seen), the limits,
    then each of ``cols`` as stored (its key base, row bytes and slots per chunk; a run
    column's row bytes are 0)."""
    args = [*head, REREAD_ENTRIES, REREAD_SLOTS]
    for col in cols:
        if col in RUN_COLUMNS:  # row bytes 0: the script returns the blocks' run tables
            args += [f"mr:{col}", 0, RUN_CHUNK_SLOTS]
            continue
        size = columns[col].itemsize
        chunk = payload_chunk_slots(size) if col.startswith("f:") else META_CHUNK_SLOTS
        args += [col if col.startswith("f:") else f"m:{col}", size, chunk]
    return args


def sync_replies(
    replies: Sequence[Any], n_shards: int
) -> tuple[list[tuple[bool, list[Entry]]], Any, list[Any]]:
    """Of a sync's round trip (per shard :func:`page_xrange`, the config ``GET``, per shard
    ``reread.lua``): ``(lost, entries)`` per shard, the config, ``reread.lua``'s replies."""
    xranges, config_raw, spans = replies[:n_shards], replies[n_shards], replies[n_shards + 1 :]
    pages = [
        (bool(int(span[0])), [(eid, _fields(kv)) for eid, kv in xr])
        for xr, span in zip(xranges, spans, strict=True)
    ]
    return pages, config_raw, list(spans)


class PackedSync:
    """A sync's round trip packed as RESP (sent by a
    :class:`~orchestrator.sampling.bulk.BulkReader`): per shard its page
    (:func:`page_xrange`), then the config ``GET``, then per shard ``reread.lua``
    (:func:`reread_args`), whose column arguments (~50 of them) are packed once per column
    set: through a redis-py pipeline the round trip's packing and parsing cost this process
    more than Redis's work on it."""

    def __init__(self) -> None:
        self._tails: dict[tuple[Any, ...], bytes] = {}

    def blob(
        self,
        pages: Sequence[tuple[str, str, int]],
        config_key: str,
        rereads: Sequence[tuple[Sequence[str], str, int, str, int]],
        cols: list[str],
        columns: dict[str, np.ndarray],
    ) -> bytes:
        """``pages``: (log key, last, page size) per shard; ``rereads``: (keys, shard
        prefix, cap, last, seen) per shard; ``cols``: the columns ``reread.lua`` reads, of
        ``columns``."""
        sig = tuple((c, columns[c].itemsize) for c in cols)
        tail = self._tails.get(sig)
        if tail is None:
            tail = pack_args(reread_args([], cols, columns))
            self._tails = {sig: tail}
        n_tail = 2 + 3 * len(cols)
        out = [pack(page_xrange(*page)) for page in pages]
        out.append(pack(["GET", config_key]))
        for keys, prefix, cap, last, seen in rereads:
            args = ["EVALSHA", REREAD.sha, len(keys), *keys, prefix, cap, last, seen]
            out += [b"*%d\r\n" % (len(args) + n_tail), pack_args(args), tail]
        return b"".join(out)


def _fields(kv: Any) -> dict[bytes, bytes]:
    return kv if isinstance(kv, dict) else dict(zip(kv[::2], kv[1::2], strict=True))
