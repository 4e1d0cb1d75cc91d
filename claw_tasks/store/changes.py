"""Reading the shards' change logs from a reader's position, a page at a time: the
commands, queued on a :class:`~claw_tasks.connection.resp.Commands` with their decoders, and
what they return (entries, losses, the slots the entries name, read again).

A page is two commands queued together: a plain ``XRANGE`` of the entries after the
position, then ``lua/log_since.lua``, which tells whether any entry after it is gone
(trimmed or deleted: the reader must rebuild). The entries do not pass through Lua: there a
page of 1,000 cost Redis ~3.8 ms (the reply converted to Lua tables and back), the plain
``XRANGE`` ~0.65 ms (docs/benchmarks.md, Eviction). The check after the read needs no
transaction: the counts it compares only grow.

A reader that expects nothing new reads one command instead (:func:`queue_newest`):
``XRANGE`` from its last entry, inclusive. On a quiet log the reply is that one entry;
otherwise it is a page whose first entry proves that no entry after the position is gone.

A sync (:class:`SyncReads`) queues per shard its page's ``XRANGE``, the config, then per
shard ``lua/reread.lua``, which checks for lost entries, reads the log after the position
again and the slots its ``seq``/``n`` entries name (:mod:`claw_tasks.store.slots`), so the
re-read of committed slots needs no round trip of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from claw_tasks.connection.resp import Commands, Packed, Reply, pack_args
from claw_tasks.store.core import StoreCore
from claw_tasks.store.scripts import Lua
from claw_tasks.store.slots import Span, reread_columns, spans_of_reread

LOG_SINCE = Lua("log_since")
REREAD = Lua("reread")
REREAD_ENTRIES, REREAD_SLOTS = 64, 16_384
"""Most entries and slots per shard that a page's own round trip re-reads (``reread.lua``);
past them the reader reads the slots in a round trip of its own."""

Entry = tuple[bytes, dict[bytes, bytes]]
Page = tuple[bool, list[Entry]]
"""Whether entries after the reader's position were lost, and the entries read."""


class Event(NamedTuple):
    """A step-data change-log entry, decoded. ``kind``:

    - ``'slots'``: slots taken by a commit or freed for a ring overwrite, ``n`` of them
      from the step ``seq`` on; ``links``: the ``next`` distances the commit set on older
      steps (seqs, distances);
    - ``'column'``: column ``col`` set to ``values`` (stored bytes) on the steps ``ids``
      that still hold their slots (priorities, curation);
    - ``'evicted'``: the steps ``ids`` evicted (retention, manual);
    - ``'forgotten'``: dictionary ``codes`` of ``col`` pruned (never reused);
    - ``'unknown'``: anything else (a reader rebuilds)."""

    kind: str
    seq: int = 0
    n: int = 0
    col: str = ""
    ids: np.ndarray | None = None
    values: bytes = b""
    codes: np.ndarray | None = None
    links: tuple[np.ndarray, np.ndarray] | None = None


_NO_LINKS = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def event(fields: dict[bytes, bytes], links: bool = True) -> Event:
    """The change-log entry of ``fields`` (an entry's fields, as a page holds them);
    ``links`` False leaves a slot range's ``links`` None (a reader that only asks which
    slots changed does not parse them)."""
    if b"seq" in fields and b"n" in fields:  # ins, evict: a slot range
        if not links:
            return Event("slots", int(fields[b"seq"]), int(fields[b"n"]))
        raw = fields.get(b"links", b"")
        if raw:  # seq:delta,...
            pairs = np.array(raw.replace(b":", b",").split(b","), np.int64).reshape(-1, 2)
            return Event(
                "slots", int(fields[b"seq"]), int(fields[b"n"]), links=(pairs[:, 0], pairs[:, 1])
            )
        return Event("slots", int(fields[b"seq"]), int(fields[b"n"]), links=_NO_LINKS)
    if b"col" in fields and b"ids" in fields and b"values" in fields:
        ids = np.frombuffer(fields[b"ids"], "<i8")
        return Event("column", col=fields[b"col"].decode(), ids=ids, values=fields[b"values"])
    op = fields.get(b"op")
    if op == b"evict" and b"ids" in fields:
        return Event("evicted", ids=np.frombuffer(fields[b"ids"], "<i8"))
    if op == b"forget":  # codes of a column pruned: none, or of no column, prune nothing
        codes = np.frombuffer(fields.get(b"codes", b""), "<i4")
        return Event("forgotten", col=fields.get(b"col", b"").decode(), codes=codes)
    return Event("unknown")


def page_commands(key: str, last: str, seen: int, page: int) -> list[list[Any]]:
    """The commands reading up to ``page`` entries of the log ``key`` after the entry
    ``last`` (``'0-0'``: from the start), ``seen`` being the entries the log had added up
    to and including it; queue them in this order, then pair their replies with
    :func:`page_replies`."""
    return [_xrange(key, last, page), ["EVALSHA", LOG_SINCE.sha, 1, key, last, seen]]


def page_replies(replies: Sequence[Any]) -> list[Page]:
    """``(lost, entries)`` per page from the replies of the commands of
    :func:`page_commands`, queued one page after the other; an entry is its id and its
    fields (redis-py parses an ``XRANGE`` reply so, a raw reader leaves them flat)."""
    return [
        (bool(int(replies[i + 1])), [(eid, _fields(kv)) for eid, kv in replies[i]])
        for i in range(0, len(replies), 2)
    ]


def positions(core: StoreCore, n_shards: int) -> tuple[list[str], list[int], bytes | None]:
    """Where a cold reader starts, in one round trip: per shard the last entry of its log
    (``'0-0'``: none) and the entries the log has added, and the config record as stored
    (None: none)."""
    with core.r.pipeline(transaction=False) as pipe:
        for shard in range(n_shards):
            pipe.xinfo_stream(core.layout_keys.shard_key(shard, "log"))
        pipe.get(core.layout_keys.config)
        *infos, raw = pipe.execute(raise_on_error=False)
    tails = [i if isinstance(i, dict) else {} for i in infos]  # an error: no log yet
    last = [t.get("last-generated-id", b"0-0").decode() for t in tails]
    seen = [int(t.get("entries-added", 0)) for t in tails]
    return last, seen, raw if isinstance(raw, bytes) else None


def queue_newest(batch: Commands, core: StoreCore, shard: int, last: str, page: int) -> Reply:
    """The entry ``last`` of ``shard``'s log and up to ``page`` entries after it. Its
    reply: whether the log has no entry after ``last``, and the entries after it when
    they are known to be all of them up to the page (``last`` is still in the log: logs
    are only trimmed from the head, never deleted from, so no entry after it is gone);
    None when ``last`` is gone (the reader's sync decides)."""
    key = core.layout_keys.shard_key(shard, "log")
    return batch.add(["XRANGE", key, last, "+", "COUNT", page + 1], lambda r: _newest(r, last))


def _newest(reply: Sequence[Any], last: str) -> tuple[bool, list[Entry] | None]:
    if not reply:
        return last == "0-0", [] if last == "0-0" else None
    entries = [(eid, _fields(kv)) for eid, kv in reply]
    if entries[0][0].decode() != last:
        return False, None
    return len(entries) == 1, entries[1:]


class Sync(NamedTuple):
    """What a sync's round trip read: per shard its page, the config record as stored,
    and per shard the spans ``reread.lua`` read again (None: past its limits, the reader
    reads that shard's slots itself)."""

    pages: list[Page]
    config: bytes | None
    spans: list[list[Span] | None]


class SyncReads:
    """A sync's round trip: per shard its page, then the config ``GET``, then per shard
    ``reread.lua``, whose column arguments (~50 of them) are packed once per column set:
    through a redis-py pipeline the round trip's packing and parsing cost this process
    more than Redis's work on it."""

    def __init__(self, core: StoreCore, cap: int) -> None:
        self.core, self.cap = core, cap
        self._tail: tuple[tuple[tuple[str, int], ...], bytes] | None = None

    def queue(
        self,
        batch: Commands,
        last: Sequence[str],
        seen: Sequence[int],
        page: int,
        columns: dict[str, np.dtype],
    ) -> Reply:
        """Up to ``page`` entries of each shard's log after ``last``/``seen`` (per shard),
        and the slots they name, ``columns`` of them: its reply a :class:`Sync`."""
        keys = self.core.layout_keys
        names = tuple((c, d.itemsize) for c, d in columns.items())
        if self._tail is None or self._tail[0] != names:
            self._tail = (names, pack_args(self._tail_args(columns)))
        packed_tail = self._tail[1]
        commands: list[Any] = []
        n_tail = 2 + 3 * len(columns)
        for shard, at in enumerate(last):
            commands.append(_xrange(keys.shard_key(shard, "log"), at, page))
        commands.append(["GET", keys.config])
        for shard, (at, n) in enumerate(zip(last, seen, strict=True)):
            shard_keys = [keys.shard_key(shard, "log"), keys.shard_key(shard, "alive")]
            head = ["EVALSHA", REREAD.sha, 2, *shard_keys, keys.shard(shard), self.cap, at, n]
            blob = b"*%d\r\n" % (len(head) + n_tail) + pack_args(head) + packed_tail
            commands.append(Packed(blob, lambda head=head: [*head, *self._tail_args(columns)]))
        n_shards = len(last)

        def decode(replies: list[Any]) -> Sync:
            xranges, config, rereads = (
                replies[:n_shards],
                replies[n_shards],
                replies[n_shards + 1 :],
            )
            pages = [
                (bool(int(r[0])), [(eid, _fields(kv)) for eid, kv in xr])
                for xr, r in zip(xranges, rereads, strict=True)
            ]
            spans = [
                spans_of_reread(r, shard, columns)
                if len(r) >= 2 and int(r[1]) >= len(entries)
                else None
                for shard, (r, (_, entries)) in enumerate(zip(rereads, pages, strict=True))
            ]
            return Sync(pages, config, spans)

        return batch.add_all(commands, decode)

    @staticmethod
    def _tail_args(columns: dict[str, np.dtype]) -> list[Any]:
        """``reread.lua``'s arguments after the shard's own: its limits, the columns."""
        return [REREAD_ENTRIES, REREAD_SLOTS, *reread_columns(columns)]


def queue_config(batch: Commands, core: StoreCore) -> Reply:
    """The namespace's config record as stored (None: none)."""
    return batch.add(["GET", core.layout_keys.config])


def _xrange(key: str, last: str, page: int) -> list[Any]:
    return ["XRANGE", key, f"({last}", "+", "COUNT", page]


def _fields(kv: Any) -> dict[bytes, bytes]:
    return kv if isinstance(kv, dict) else dict(zip(kv[::2], kv[1::2], strict=True))
