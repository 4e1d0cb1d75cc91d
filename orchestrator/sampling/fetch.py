"""Read sampled rows' payloads in one pipelined round trip.

Reads of one key family (a field at the drawn rows and at their successors, a window's
steps) are merged into sorted unique rows, so consecutive slots come back in one
GETRANGE. Small rows are read inside ``lua/fetch.lua``, one call per shard: a Lua
``redis.call`` costs ~1 µs where a client command costs several. Big rows (and ragged
ones) are plain pipelined GETRANGE / HGET commands: Lua strings cost ~2 ms per MB.

Checks: a sampling session's fetch (:class:`LogChecked`) reads the shards' change logs
after every read of the round trip: every write that changes a slot logs an entry before
or with the change, so entries after the index's positions that touch none of the rows
prove the reads current (and none at all prove the whole draw current). Without an index
position (:meth:`Fetcher.__call__`), each shard's script call checks the rows the caller
expects: the shard's seq has not gone a whole ring past the oldest of them (a slot is
reused only then) and their alive bits are set (evictions clear them); it runs after the
plain reads of the same pipeline, so it validates them too.

On a plain TCP or Unix connection the whole fetch is one round trip on the bulk reader's
own connection (:mod:`orchestrator.sampling.bulk`); otherwise one redis-py pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from redis.exceptions import NoScriptError

from claw_tasks.format.schema import FieldSpec
from claw_tasks.store import Store
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS, payload_chunk_slots
from claw_tasks.store.scripts import Lua, execute
from orchestrator.sampling.bulk import BulkReader, pack
from orchestrator.sampling.candidates import unique
from orchestrator.sampling.changelog import (
    LOG_SINCE,
    LogRead,
    from_last_command,
    from_last_page,
)
from orchestrator.sampling.index import LOG_PAGE, SamplingIndex

PLAIN_ROW_BYTES = 2048
"""Fixed rows of at least this many bytes are read by plain commands, not in Lua."""

Lookup = Callable[[Any], None]
"""Queues one command on the pipeline it is given."""


@dataclass(frozen=True)
class Read:
    """One field at global ``rows``: ``kind`` ``'f'`` reads ``size`` bytes per row from the
    chunked strings ``<base>:<chunk>``; ``'h'`` one value per row from the hashes
    ``<base>:<chunk>`` (field = slot). ``plain``: by client commands, not in Lua.

    ``at`` (fixed reads only): row i goes to row ``at[i]`` of a result of ``n_out`` rows,
    zeros elsewhere (e.g. ``next_obs`` where some episodes ended without one)."""

    kind: str
    base: str
    size: int
    chunk: int
    rows: np.ndarray
    plain: bool = False
    at: np.ndarray | None = None
    n_out: int = 0


def payload_read(
    name: str, spec: FieldSpec, rows: np.ndarray, at: np.ndarray | None = None, n_out: int = 0
) -> Read:
    """The payload field ``name`` at ``rows`` (placed at ``at`` of ``n_out`` rows, if given:
    fixed fields only)."""
    if spec.codec is not None:
        return Read("h", f"z:{name}", 0, SPARSE_CHUNK_SLOTS, rows, plain=True)
    if spec.ragged:
        return Read("h", f"r:{name}", 0, SPARSE_CHUNK_SLOTS, rows, plain=True)
    size = spec.row_bytes
    chunk, plain = payload_chunk_slots(size), size >= PLAIN_ROW_BYTES
    return Read("f", f"f:{name}", size, chunk, rows, plain, at, n_out)


def explicit_next_obs_read(obs: FieldSpec, rows: np.ndarray) -> Read:
    """The ``next_obs`` stored with the steps at ``rows`` (raw bytes, or frames of a
    compressed obs)."""
    plain = obs.ragged or obs.codec is not None or obs.row_bytes >= PLAIN_ROW_BYTES
    return Read("h", "nx", 0, SPARSE_CHUNK_SLOTS, rows, plain)


def info_read(rows: np.ndarray) -> Read:
    """The ``info`` dicts at ``rows`` (msgpack; None where empty)."""
    return Read("h", "info", 0, SPARSE_CHUNK_SLOTS, rows)


class Fetcher:
    """Reads rows of one namespace; ``cap`` is the slots per shard."""

    def __init__(self, store: Store, cap: int) -> None:
        self.store, self.cap = store, cap
        self._script = Lua("fetch", "orchestrator")
        self._n_shards = store.config().n_shards
        self._bulk = BulkReader.for_client(store.r)

    def __call__(
        self,
        check: np.ndarray,
        expect: np.ndarray,
        reads: Sequence[Read],
        lookups: Sequence[Lookup] = (),
    ) -> tuple[list[Any], list[Any]] | None:
        """Results of ``reads`` in row order (a fixed read: uint8 ``(rows, size)``; a hash
        read: a list of bytes or None) and the replies of ``lookups``; None when a row of
        ``check`` no longer holds its step id in ``expect``."""
        got = self._fetch(check, expect, reads, lookups, None)
        if got is None:
            return None
        out, replies, _ = got
        return out, replies

    def since(
        self, reads: Sequence[Read], lookups: Sequence[Lookup], tail: Sequence[Sequence[Any]]
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """Results of ``reads`` and the replies of ``lookups``, as :meth:`__call__` gives
        them, but unchecked; and the replies of the commands ``tail``, run after every read
        in the same round trip (the change-log reads that check them: :class:`LogChecked`;
        ``EVALSHA`` of :data:`~orchestrator.sampling.changelog.LOG_SINCE` is loaded on
        NOSCRIPT)."""
        got = self._fetch(np.zeros(0, np.int64), None, reads, lookups, tail)
        assert got is not None
        return got

    def _fetch(
        self,
        check: np.ndarray,
        expect: np.ndarray | None,
        reads: Sequence[Read],
        lookups: Sequence[Lookup],
        since: Sequence[Sequence[Any]] | None,
    ) -> tuple[list[Any], list[Any], list[Any]] | None:
        cap, keys = self.cap, self.store.keys
        families: dict[tuple[Any, ...], list[int]] = {}
        for j, r in enumerate(reads):
            families.setdefault((r.kind, r.base, r.size, r.chunk, r.plain), []).append(j)
        merged, inverse = [], []
        for (kind, base, size, chunk, plain), members in families.items():
            uniq, inv = np.unique(
                np.concatenate([reads[j].rows for j in members]), return_inverse=True
            )
            merged.append(Read(kind, base, size, chunk, uniq, plain))
            inverse.append((members, inv))
        big = [m for m in merged if m.plain and m.kind == "f"]
        in_lua = [m for m in merged if not m.plain]
        # The commands after the big rows, in order: hashes, scripts per shard (their reads
        # and checks, after every plain read: a writer frees a slot before it rewrites
        # it), the change logs (since), the lookups.
        commands: list[list[Any]] = []
        hashes = []
        for m in merged:
            if m.plain and m.kind == "h":
                got, runs = self._plain_commands(m)
                commands += [["HMGET", *args[:1], *args[1]] for _, args in got]
                hashes.append(len(runs))
        n_hash = len(commands)
        if since is None:  # every shard holding a row to check or read
            parts = [check // cap, *(m.rows // cap for m in merged)]
        else:  # only shards with rows read in Lua (the logs check the rows)
            parts = [m.rows // cap for m in in_lua]
        shards = unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        seqs = None if expect is None else expect // self._n_shards
        for shard in shards.tolist():
            on = check // cap == shard
            oldest = int(seqs[on].min()) if seqs is not None and on.any() else 1 << 52
            args: list[Any] = [keys.shard(shard), cap, oldest, _pack(check[on] % cap)]
            for m in in_lua:
                lo, hi = np.searchsorted(m.rows, [shard * cap, (shard + 1) * cap])
                args += [m.kind, m.base, m.size, m.chunk, _pack(m.rows[lo:hi] % cap)]
            shard_keys = [keys.shard_key(shard, k) for k in ("alive", "seq")]
            commands.append(["EVALSHA", self._script.sha, 2, *shard_keys, *args])
        commands += [list(c) for c in since or ()]
        recorder = _Recorder()
        for lookup in lookups:
            lookup(recorder)
        commands += recorder.commands

        ranges = [self._plain_commands(m) for m in big]
        if self._bulk is not None:  # big rows straight into one buffer, the rest after them
            sizes = [len(m.rows) * m.size for m in big]
            buf = np.empty(sum(sizes), np.uint8)
            flat = [args for c, _ in ranges for _, args in c]
            try:
                replies = self._bulk.run(flat, memoryview(buf), commands)
            except NoScriptError:
                self._load_scripts()
                replies = self._bulk.run(flat, memoryview(buf), commands)
            bounds = np.cumsum([0, *sizes]).tolist()
            fixed = [
                buf[lo:hi].reshape(-1, m.size)
                for m, lo, hi in zip(big, bounds, bounds[1:], strict=False)
            ]
        else:

            def queue(pipe: Any) -> None:
                for c, _ in ranges:
                    for _, args in c:
                        pipe.getrange(*args)
                for command in commands:
                    pipe.execute_command(*command)

            replies = execute(self.store.r, [self._script, LOG_SINCE], queue)
            fixed, at = [], 0
            for m, (c, runs) in zip(big, ranges, strict=True):
                fixed.append(_plain_result(m, runs, replies[at : at + len(c)]))
                at += len(c)
            replies = replies[at:]
        per_shard = replies[n_hash : n_hash + len(shards)]
        if any(reply[0] for reply in per_shard):
            return None
        rest = replies[n_hash + len(shards) :]
        logs: list[Any] = []
        if since is not None:
            logs, rest = rest[: len(since)], rest[len(since) :]
        got_of, hash_at, lua_at = iter(fixed), 0, 1
        runs_of = iter(hashes)
        results: list[Any] = []
        for m in merged:
            if m.plain and m.kind == "f":
                results.append(next(got_of))
            elif m.plain:
                n = next(runs_of)
                results.append([v for reply in replies[hash_at : hash_at + n] for v in reply])
                hash_at += n
            else:
                parts = [reply[lua_at] for reply in per_shard]  # shards in order: rows in order
                results.append(_joined(m, parts))
                lua_at += 1
        out: list[Any] = [None] * len(reads)
        for m, res, (members, inv) in zip(merged, results, inverse, strict=True):
            start = 0
            for j in members:
                k = inv[start : start + len(reads[j].rows)]
                start += len(k)
                if m.kind == "h":
                    out[j] = [res[x] for x in k.tolist()]
                elif isinstance(res, list):  # a view per row
                    out[j] = _gather_rows(reads[j], res, k)
                else:
                    out[j] = _placed(reads[j], res[k])
        return out, rest, logs

    def run(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """The replies of read-only ``commands`` in one round trip (``EVALSHA`` of
        :data:`~orchestrator.sampling.changelog.LOG_SINCE` and the fetch script are loaded
        on NOSCRIPT)."""
        if self._bulk is not None:
            blob = b"".join(pack(c) for c in commands)
            try:
                return self._bulk.run_packed(blob, len(commands))
            except NoScriptError:
                self._load_scripts()
                return self._bulk.run_packed(blob, len(commands))

        def queue(pipe: Any) -> None:
            for command in commands:
                pipe.execute_command(*command)

        return execute(self.store.r, [self._script, LOG_SINCE], queue)

    def _load_scripts(self) -> None:
        for script in (self._script, LOG_SINCE):
            self.store.r.script_load(script.source)

    def _plain_commands(self, m: Read) -> tuple[list[tuple[str, tuple[Any, ...]]], np.ndarray]:
        """``m`` as plain commands: one HMGET per hash (a command per row costs the
        client ~5 µs to pack and parse: a batch's compressed frames are hundreds), or one
        GETRANGE per run of consecutive slots in one chunk; and the rows each command
        reads."""
        keys, cap = self.store.keys, self.cap
        shard, slot = m.rows // cap, m.rows % cap
        chunk = slot // m.chunk
        same_key = (np.diff(chunk) == 0) & (np.diff(shard) == 0)
        if m.kind == "h":  # rows are sorted: each hash's rows are one stretch
            starts = np.concatenate([[0], np.flatnonzero(~same_key) + 1])[: len(m.rows)]
            runs = np.diff(np.concatenate([starts, [len(m.rows)]])).astype(np.int64)
            slots = slot.tolist()
            hmget = [
                ("hmget", (keys.shard_key(int(shard[s]), f"{m.base}:{chunk[s]}"), slots[s : s + n]))
                for s, n in zip(starts.tolist(), runs.tolist(), strict=True)
            ]
            return hmget, runs
        cut = np.flatnonzero((np.diff(m.rows) != 1) | ~same_key)
        starts = np.concatenate([[0], cut + 1]).astype(np.int64)[: len(m.rows)]
        runs = np.diff(np.concatenate([starts, [len(m.rows)]]))
        commands = []
        for s, n in zip(starts.tolist(), runs.tolist(), strict=True):
            key = keys.shard_key(int(shard[s]), f"{m.base}:{chunk[s]}")
            off = int(slot[s] % m.chunk) * m.size
            commands.append(("getrange", (key, off, off + n * m.size - 1)))
        return commands, runs


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
        lookups: Sequence[Lookup] = (),
    ) -> tuple[list[Any], list[Any]] | None:
        ix, self.read = self.index, None
        last, seen = list(ix.log_last), list(ix.log_seen)
        logs = [self.index.store.keys.shard_key(s, "log") for s in range(ix.n_shards)]
        # Each log from the index's last entry on: the entries after it, all of them (no
        # loss check of its own: log_since.lua's call cost Redis ~25-40 us a shard).
        tail = [from_last_command(k, at, LOG_PAGE) for k, at in zip(logs, last, strict=True)]
        mirrored = [r.kind == "f" and r.base in ix.columns for r in reads]
        rest = [r for r, m in zip(reads, mirrored, strict=True) if not m]
        if lookups or any(len(r.rows) for r in rest):
            got, replies, tails = self.fetcher.since(rest, lookups, tail)
        else:  # nothing to read from Redis but the logs (e.g. no explicit next_obs drawn)
            got, replies, tails = [_nothing(r) for r in rest], [], self.fetcher.run(tail)
        newest = [from_last_page(reply, at) for reply, at in zip(tails, last, strict=True)]
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


class _Recorder:
    """Stands for a pipeline to the lookups: records the commands they queue."""

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []

    def execute_command(self, *args: Any) -> None:
        self.commands.append(list(args))

    def hmget(self, key: str, fields: Sequence[Any]) -> None:
        self.commands.append(["HMGET", key, *fields])


def _pack(slots: np.ndarray) -> bytes:
    return msgpack.packb(slots.tolist())


def _nothing(read: Read) -> Any:
    """What :meth:`Fetcher.since` gives for a read of no rows."""
    if read.kind == "h":
        return []
    return _placed(read, np.zeros((0, read.size), np.uint8))


def _joined(m: Read, parts: list[Any]) -> Any:
    if m.kind == "f":
        return np.frombuffer(b"".join(parts), np.uint8).reshape(-1, m.size)
    return [v for part in parts for v in part]


def _plain_result(m: Read, runs: np.ndarray, replies: list[Any]) -> Any:
    """Hash reads: a value per row (None: none). Fixed reads: one uint8 view per row into
    the replies (not copied here: :func:`_gather_rows` copies each row once, straight to
    its place)."""
    if m.kind == "h":
        return [value for reply in replies for value in reply]
    rows: list[np.ndarray] = []
    for b, n in zip(replies, runs.tolist(), strict=True):
        if len(b) < n * m.size:  # short (missing key): zeros
            b = bytes(b) + bytes(n * m.size - len(b))
        whole = np.frombuffer(b, np.uint8)
        rows.extend([whole] if n == 1 else whole.reshape(n, m.size))
    return rows


def _gather_rows(read: Read, rows: list[np.ndarray], k: np.ndarray) -> np.ndarray:
    """``read``'s result from per-row views: the rows ``k`` in order (or placed at
    ``read.at``), copied once into a new array."""
    if read.at is None:
        src = [rows[x] for x in k.tolist()]
    else:
        src = [np.zeros(read.size, np.uint8)] * read.n_out
        for d, x in zip(read.at.tolist(), k.tolist(), strict=True):
            src[d] = rows[x]
    out = np.empty((len(src), read.size), np.uint8)
    if src:
        np.concatenate(src, out=out.reshape(-1))
    return out


def _placed(read: Read, res: np.ndarray) -> np.ndarray:
    if read.at is None:
        return res
    out = np.zeros((read.n_out, read.size), np.uint8)
    out[read.at] = res
    return out
