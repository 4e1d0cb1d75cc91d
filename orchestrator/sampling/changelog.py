"""Reading a shard's change log from a reader's position, a page at a time.

A page is two commands queued together: a plain ``XRANGE`` of the entries after the
position, then ``lua/log_since.lua``, which tells whether any entry after it is gone
(trimmed or deleted: the reader must rebuild). The entries do not pass through Lua: there a
page of 1,000 cost Redis ~3.8 ms (the reply converted to Lua tables and back), the plain
``XRANGE`` ~0.65 ms (docs/benchmarks.md, Eviction). The check after the read needs no
transaction: the counts it compares only grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from claw_tasks.store.scripts import Lua

LOG_SINCE = Lua("log_since", "orchestrator")


def page_commands(key: str, last: str, seen: int, page: int) -> list[list[Any]]:
    """The commands reading up to ``page`` entries of the log ``key`` after the entry
    ``last`` (``'0-0'``: from the start), ``seen`` being the entries the log had added up
    to and including it; queue them in this order, then pair their replies with
    :func:`page_replies`."""
    return [
        ["XRANGE", key, f"({last}", "+", "COUNT", page],
        ["EVALSHA", LOG_SINCE.sha, 1, key, last, seen],
    ]


Entry = tuple[bytes, dict[bytes, bytes]]


def page_replies(replies: Sequence[Any]) -> list[tuple[bool, list[Entry]]]:
    """``(lost, entries)`` per page from the replies of the commands of
    :func:`page_commands`, queued one page after the other; an entry is its id and its
    fields (redis-py parses an ``XRANGE`` reply so, a raw reader leaves them flat)."""
    return [
        (bool(int(replies[i + 1])), [(eid, _fields(kv)) for eid, kv in replies[i]])
        for i in range(0, len(replies), 2)
    ]


def _fields(kv: Any) -> dict[bytes, bytes]:
    return kv if isinstance(kv, dict) else dict(zip(kv[::2], kv[1::2], strict=True))
