"""Read sampled rows' payloads in one round trip.

Reads of one key family (a field at the drawn rows and at their successors, a window's
steps) are merged into sorted unique rows, so consecutive slots come back in one read.
Small rows are read inside ``lua/fetch.lua``, one call per shard; big rows (and ragged
ones) by plain commands (:mod:`claw_tasks.store.slots`). Each command is queued on one
:class:`~claw_tasks.connection.resp.Commands` with the decoder of its reply, and they
go in one round trip (:class:`~claw_tasks.connection.resp.RoundTrips`).

Checks: a sampling session's fetch (:class:`LogChecked`) reads the shards' change logs
after every read of the round trip: every write that changes a slot logs an entry before
or with the change, so entries after the index's positions that touch none of the rows
prove the reads current (and none at all prove the whole draw current). Without an index
position (:meth:`Fetcher.__call__`), each shard's script call checks the rows the caller
expects: the shard's seq has not gone a whole ring past the oldest of them (a slot is
reused only then) and their alive bits are set (evictions clear them); it runs after the
plain reads of the same round trip, so it validates them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from claw_tasks.connection.resp import Commands, RoundTrips
from claw_tasks.store import Store
from claw_tasks.store.changes import queue_newest
from claw_tasks.store.slots import FETCH, Read, queue_checked, queue_plain
from orchestrator.sampling.candidates import unique
from orchestrator.sampling.index import LOG_PAGE, LogRead, SamplingIndex

Tail = Callable[[Commands], Any]
"""Queues commands after every read of a fetch's round trip; what it returns (replies) the
fetch gives back once the batch ran."""


class Fetcher:
    """Reads rows of one namespace; ``cap`` is the slots per shard."""

    def __init__(self, store: Store, cap: int) -> None:
        self.store, self.cap = store, cap
        self._n_shards = store.config().n_shards
        self.round_trips = RoundTrips(store.r, [FETCH])

    def __call__(
        self,
        check: np.ndarray,
        expect: np.ndarray,
        reads: Sequence[Read],
        lookups: Sequence[Sequence[Any]] = (),
    ) -> tuple[list[Any], list[Any]] | None:
        """Results of ``reads`` in row order (a fixed read: uint8 ``(rows, size)``; a hash
        read: a list of bytes or None) and the replies of the read-only commands
        ``lookups``; None when a row of ``check`` no longer holds its step id in
        ``expect``."""
        got = self._fetch(check, expect, reads, lookups, None)
        if got is None:
            return None
        out, replies, _ = got
        return out, replies

    def since(
        self, reads: Sequence[Read], lookups: Sequence[Sequence[Any]], tail: Tail
    ) -> tuple[list[Any], list[Any], Any]:
        """Results of ``reads`` and the replies of ``lookups``, as :meth:`__call__` gives
        them, but unchecked; and what ``tail`` queued after every read in the same round
        trip (the change-log reads that check them: :class:`LogChecked`)."""
        got = self._fetch(np.zeros(0, np.int64), None, reads, lookups, tail)
        assert got is not None
        return got

    def _fetch(
        self,
        check: np.ndarray,
        expect: np.ndarray | None,
        reads: Sequence[Read],
        lookups: Sequence[Sequence[Any]],
        tail: Tail | None,
    ) -> tuple[list[Any], list[Any], Any] | None:
        cap, batch = self.cap, Commands()
        merged, places = _merged(reads)
        # In order: the plain reads, the scripts per shard (their reads and checks, after
        # every plain read: a writer frees a slot before it rewrites it), the tail, the
        # lookups.
        plain = {i: queue_plain(batch, self.store, cap, m) for i, m in enumerate(merged) if m.plain}
        in_lua = [m for m in merged if not m.plain]
        if tail is None:  # every shard holding a row to check or read
            parts = [check // cap, *(m.rows // cap for m in merged)]
        else:  # only shards with rows read in Lua (the logs check the rows)
            parts = [m.rows // cap for m in in_lua]
        shards = unique(np.concatenate(parts)).tolist() if parts else []
        seqs = None if expect is None else expect // self._n_shards
        checked = []
        for shard in shards:
            on = check // cap == shard
            oldest = int(seqs[on].min()) if seqs is not None and on.any() else 1 << 52
            ask = (oldest, check[on] % cap)
            checked.append(queue_checked(batch, self.store, cap, shard, ask, in_lua))
        logs = None if tail is None else tail(batch)
        looked = [batch.add(command) for command in lookups]
        self.round_trips.run(batch)
        if any(reply.value is None for reply in checked):
            return None
        per_read = iter(zip(*[r.value for r in checked], strict=True) if checked else ())
        results = [
            plain[i].value if m.plain else _joined(m, next(per_read, ()))
            for i, m in enumerate(merged)
        ]
        return _placed_all(reads, results, places), [r.value for r in looked], logs


class LogChecked:
    """A sampling session's fetch (called as :class:`Fetcher` is): the reads and, in the
    same round trip after them, the change logs from the positions of the ``index`` the
    rows were drawn from, instead of per-row seq and alive checks.

    With ``exact`` set (a draw from columns held without a sync, :meth:`SamplingIndex.
    hold`) the batch stands only when no log has an entry after those positions (each log
    is read from the index's last entry on, which proves that no entry after it is gone:
    entries are only ever trimmed from the head, never deleted): the draw is then one
    from the store as it is at the fetch, one round trip in all. Otherwise
    (the columns were synced in this call) it stands unless an entry touched one of the
    checked rows, as the seq and alive checks decided (the logs read the same way; one
    whose last entry the index applied is gone refuses the batch: the sync decides).
    ``quiet`` tells whether the last fetch found the logs without new entries (the caller
    then tries ``exact`` next).
    ``read``: the entries the last fetch read after the positions, when it refused the
    batch (None else): the sync that follows applies them instead of reading them again.

    Fields the index mirrors (``f:<field>`` columns) come from its columns, as of the same
    positions: a batch of only those reads nothing but the logs."""

    def __init__(self, fetcher: Fetcher, index: SamplingIndex) -> None:
        self.fetcher, self.index = fetcher, index
        self.exact = False
        self.quiet = False
        self.read: LogRead | None = None

    def __call__(
        self,
        check: np.ndarray,
        expect: np.ndarray,
        reads: Sequence[Read],
        lookups: Sequence[Sequence[Any]] = (),
    ) -> tuple[list[Any], list[Any]] | None:
        ix, self.read = self.index, None
        last, seen = list(ix.log_last), list(ix.log_seen)

        def tail(batch: Commands) -> list[Any]:
            # Each log from the index's last entry on: the entries after it, all of them
            # (no loss check of its own: log_since.lua's call cost Redis ~25-40 us a shard).
            store = ix.store
            return [queue_newest(batch, store, s, at, LOG_PAGE) for s, at in enumerate(last)]

        mirrored = [r.column in ix.columns for r in reads]
        rest = [r for r, m in zip(reads, mirrored, strict=True) if not m]
        if lookups or any(len(r.rows) for r in rest):
            got, replies, logs = self.fetcher.since(rest, lookups, tail)
        else:  # nothing to read from Redis but the logs (e.g. no explicit next_obs drawn)
            batch = Commands()
            got, replies, logs = [_nothing(r) for r in rest], [], tail(batch)
            self.fetcher.round_trips.run(batch)
        newest = [reply.value for reply in logs]
        self.quiet = all(quiet for quiet, _ in newest)
        if not self.quiet:
            if any(entries is None for _, entries in newest):
                return None  # the index's last entry left the log: the sync decides
            pages = [(False, e or []) for _, e in newest]
            if self.exact or not self._untouched(check, pages):
                self.read = LogRead(last, seen, pages)
                return None
        read = iter(got)
        out = [
            _placed(r, ix.columns[r.base][r.rows].view(np.uint8).reshape(-1, r.size))
            if m
            else next(read)
            for r, m in zip(reads, mirrored, strict=True)
        ]
        return out, replies

    def _untouched(self, check: np.ndarray, logs: list[Any]) -> bool:
        touched = self.index.touched(logs)
        if touched is None:
            return False
        if not len(touched) or not len(check):
            return True
        touched = np.sort(touched)  # a search of each checked row: np.isin sorts both
        at = np.minimum(np.searchsorted(touched, check), len(touched) - 1)
        return not (touched[at] == check).any()


def _merged(reads: Sequence[Read]) -> tuple[list[Read], list[tuple[list[int], np.ndarray]]]:
    """Reads merged by family (:meth:`Read.family`) into sorted unique rows, and per
    merged read its members and where each member's rows are in it."""
    families: dict[tuple[Any, ...], list[int]] = {}
    for j, r in enumerate(reads):
        families.setdefault(r.family(), []).append(j)
    merged, places = [], []
    for members in families.values():
        rows = np.concatenate([reads[j].rows for j in members])
        uniq, inv = np.unique(rows, return_inverse=True)
        merged.append(reads[members[0]].with_rows(uniq))
        places.append((members, inv))
    return merged, places


def _placed_all(
    reads: Sequence[Read], results: list[Any], places: list[tuple[list[int], np.ndarray]]
) -> list[Any]:
    """Each read's result, in its row order, from its merged read's."""
    out: list[Any] = [None] * len(reads)
    for res, (members, inv) in zip(results, places, strict=True):
        start = 0
        for j in members:
            k = inv[start : start + len(reads[j].rows)]
            start += len(k)
            out[j] = (
                [res[x] for x in k.tolist()] if reads[j].kind == "h" else _placed(reads[j], res[k])
            )
    return out


def _nothing(read: Read) -> Any:
    """What :meth:`Fetcher.since` gives for a read of no rows."""
    if read.kind == "h":
        return []
    return _placed(read, np.zeros((0, read.size), np.uint8))


def _joined(m: Read, parts: Sequence[Any]) -> Any:
    if m.kind == "f":
        return np.frombuffer(b"".join(parts), np.uint8).reshape(-1, m.size)
    return [v for part in parts for v in part]


def _placed(read: Read, res: np.ndarray) -> np.ndarray:
    if read.at is None:
        return res
    out = np.zeros((read.n_out, read.size), np.uint8)
    out[read.at] = res
    return out
