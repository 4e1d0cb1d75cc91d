"""The sampling index: a numpy mirror of one namespace's metadata columns.

``columns`` maps every metadata column (``id``, ``episode``, …, ``t:<tag>``, see
:mod:`claw_tasks.where`) and ``alive`` to one array over the global rows
``shard * cap + slot``, priorities and numeric tags decoded (NaN = unset). Redis stays the
only source of truth: the index is built cold from the shards' columns and alive flags,
then kept current from the shards' change logs, read through the store
(:mod:`claw_tasks.store.changes`, :mod:`claw_tasks.store.slots`):

- events with ``seq``/``n`` (``ins``: a committed slot range; ``evict``: slots freed for
  a ring overwrite): the range is read again, every column plus its alive bits, so an
  overwritten step's row is replaced whole: by ``lua/reread.lua``, queued after the
  page's reads in the same round trip (it reads the log again itself and the slots its
  entries name, atomically), or, past its limits or for pages a fetch read, by plain
  reads in a round trip of their own; ``links`` (``next``
  distances a commit set on older rows) are applied directly;
- events with ``col``/``ids``/``values`` (``prio``, ``cur``): applied from the payload to
  the rows that still hold those ids; ``evict`` events with ``ids`` (retention, manual
  eviction) clear those rows' alive flags; ``forget`` events (pruned dictionary codes)
  are collected in ``forgotten`` for the string caches;
- anything else, a log that lost entries the index had not applied yet (trimmed past it:
  the index counts the entries it applied against the log's ``entries-added``), or an
  error half-way through a sync: the index is rebuilt cold.

A new free tag in the schema adds its column, read whole from Redis.

Small raw payload fields are mirrored too (``f:<field>``, one ``V<row bytes>`` item per
row: fixed shape, no codec, at most ``payload_bytes`` a row; ``CLAW_INDEX_PAYLOAD_BYTES``):
a step's payload never changes while it lives, so the same log entries keep them current,
and a batch of them (``next_obs``, frame stacks, windows) is gathered from memory
(:class:`~orchestrator.sampling.fetch.LogChecked`). 256 rows of float32[8] read by
``fetch.lua`` cost Redis ~8.4M instructions (a ``redis.call`` each); mirrored, ~40 bytes
a slot more in memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.connection.resp import Commands, RoundTrips
from claw_tasks.format.schema import Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceConfig, Store, column_dtype, decode_meta
from claw_tasks.store.changes import (
    REREAD,
    Event,
    Page,
    Sync,
    SyncReads,
    event,
    positions,
    queue_config,
)
from claw_tasks.store.slots import (
    Span,
    metadata_columns,
    payload_columns,
    queue_spans,
)
from orchestrator.sampling.candidates import unique

LOG_PAGE = 1_000
"""Change-log entries read per shard and round trip (a page stays a short Redis call even
after a large eviction)."""


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_heap() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``). A cold build
    reads thousands of 64 KiB chunk replies; freed, they stay in the heap of a process
    that lives for days (measured ~250 MB at 10M steps: ``bench/indexmem.py``)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@dataclass(frozen=True)
class LogRead:
    """Change-log pages a reader already read (a fetch's tail), one per shard, from the
    positions ``last``/``seen``: a sync from the same positions applies them instead of
    reading them again (one round trip fewer)."""

    last: list[str]
    seen: list[int]
    pages: list[Page]

    def at(self, last: Sequence[str], seen: Sequence[int]) -> list[Page] | None:
        """The pages, if they were read from exactly these positions."""
        return self.pages if list(last) == self.last and list(seen) == self.seen else None


class RebuildNeeded(Exception):
    """The change log cannot be applied incrementally: raised while applying it (by the
    index, or by a subclass's :meth:`SamplingIndex.check_config`), :meth:`apply_logs`
    rebuilds the columns cold."""


class SamplingIndex:
    """The metadata columns of ``store``'s namespace, current as of the last :meth:`sync`.

    For subclasses that keep the columns elsewhere (:class:`~orchestrator.sampling.shared.
    SharedIndex`: shared memory, written by one process at a time): :meth:`apply_logs`
    brings ``columns`` up to date without telling anyone, :meth:`notify` tells the
    listeners, :meth:`rebuild` and :meth:`check_config` may be overridden, and
    ``log_last``/``log_seen`` (per shard: the last change-log entry applied and the
    entries the log had added up to it) and ``config_raw`` are the state to persist
    with the columns.
    """

    def __init__(self, store: Store, payload_bytes: int | None = None) -> None:
        cfg = store.config(refresh=True)
        self.store = store
        self.payload_bytes = (
            get_settings().index_payload_bytes if payload_bytes is None else payload_bytes
        )
        """Payload fields of at most this many bytes a row are mirrored (0: none)."""
        self.n_shards, self.cap = cfg.n_shards, cfg.cap
        self.schema: Schema | None = cfg.schema
        self.columns: dict[str, np.ndarray] = {}
        self.log_last = ["0-0"] * self.n_shards  # last change-log entry applied, per shard
        self.log_seen = [0] * self.n_shards  # entries the log had added up to that one
        self.config_raw: bytes | None = None
        self.attached: dict[str, Any] = {}
        """State kept with the index by code that samples from it (lives as long as it)."""
        self._listeners: list[Callable[[np.ndarray | None], None]] = []
        self.forgotten: dict[str, set[int]] = {}
        """Dictionary codes pruned (``forget`` events) during the last :meth:`sync`, by
        column: string caches drop them (a pruned code is never reused)."""
        self.live_change = 0
        """Alive flags set minus cleared by the writes since the last apply (exact)."""
        self.live_delta: int | None = None
        """While :meth:`sync` calls the listeners: the change in live steps it made
        (exact; None after a rebuild, and for a subclass whose columns other processes
        write): a listener's count of live steps stays current without a count of the
        whole column."""
        self.round_trips = RoundTrips(store.r, [REREAD])
        """The sync's round trips (on a connection of the index's own where it can)."""
        self._sync = SyncReads(store, self.cap)

    def subscribe(self, listener: Callable[[np.ndarray | None], None]) -> None:
        """Call ``listener`` with what every later :meth:`sync` returns (e.g. a sampler's
        ``refresh``), whoever calls it."""
        self._listeners.append(listener)

    def rebuild(self) -> None:
        """Read every column of every shard from Redis (a cold start)."""
        self.columns = {}
        # The log positions are taken first: whatever commits after them is replayed.
        last, seen, raw = positions(self.store, self.n_shards)
        cfg = self.store.config(refresh=raw is None, raw=raw)  # None: raises, no namespace
        self.schema, self.config_raw = cfg.schema, None
        cols = self.all_columns()
        parts = [self.read_columns(s, cols) for s in range(self.n_shards)]
        self.columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        self.log_last, self.log_seen = last, seen
        del parts
        release_heap()

    def sync(self, read: LogRead | None = None, current: bool = False) -> np.ndarray | None:
        """Apply the change logs since the last call. Returns the global rows whose metadata
        changed (sorted, unique), or None when the index was (re)built from scratch.

        ``read``: log pages a fetch of this call already read; applied instead of reading
        them again when they start at the index's positions (:meth:`apply_logs`).
        ``current``: the columns must hold every change logged before the call (a
        process's own index always does; a shared one may otherwise lag a moment)."""
        rows = self.apply_logs(read)
        self.live_delta = None if rows is None else self.live_change
        try:
            self.notify(rows)
        finally:
            self.live_delta = None
        return rows

    def notify(self, rows: np.ndarray | None) -> None:
        """Call the listeners with what a sync returned."""
        for listener in self._listeners:
            listener(rows)

    def release(self) -> None:
        """Done reading the columns until the next :meth:`sync` (a process's own index
        holds nothing; :class:`~orchestrator.sampling.shared.SharedIndex` lets other
        processes write again)."""

    def hold(self) -> bool:
        """Hold the columns as of the last sync, without reading the change logs, until
        :meth:`release`; ``log_last``/``log_seen`` are their positions. False when there
        are none to hold (never synced, or a failed sync): :meth:`sync` first.

        A reader that checks the logs after its reads (:class:`~orchestrator.sampling.
        fetch.LogChecked`) then needs no round trip of its own for the sync."""
        return bool(self.columns)

    def touched(self, replies: list[Any]) -> np.ndarray | None:
        """The global rows whose step may have changed (slots reused or freed, steps
        evicted) by the change-log pages ``replies`` (``(lost, entries)`` per shard, read
        from this index's positions: :mod:`~claw_tasks.store.changes`); None when
        they cannot tell (entries lost, a full page, an event this index does not know)."""
        rows = []
        for shard, (lost, entries) in enumerate(replies):
            if lost or len(entries) >= LOG_PAGE:
                return None
            for _, fields in entries:
                e = event(fields, links=False)
                if e.kind == "slots":
                    rows.append(self._rows(shard, np.arange(e.seq, e.seq + min(e.n, self.cap))))
                elif e.kind == "evicted":
                    rows.append(self._rows(shard, e.ids // self.n_shards))
                elif e.kind == "unknown":
                    return None
                # column updates and pruned codes leave every step in place
        return np.concatenate(rows) if rows else np.zeros(0, np.int64)

    def apply_logs(self, read: LogRead | None = None) -> np.ndarray | None:
        """Apply the change logs to ``columns`` (cold when empty or when the logs cannot be
        applied) without calling the listeners: what :meth:`sync` returns. A failure
        half-way empties ``columns``: the next call starts cold.

        The first page is ``read``'s when it was read from the index's positions (a
        fetch's tail: the entries a sync would read, read a moment earlier; whatever came
        after them is read by the fetch that checks the next draw)."""
        self.forgotten, self.live_change = {}, 0
        if not self.columns:
            self.rebuild()
            return None
        changed: list[np.ndarray] = []
        pages = None if read is None else read.at(self.log_last, self.log_seen)
        try:
            while self._apply_page(changed, pages):
                pages = None
        except RebuildNeeded:
            self.rebuild()
            return None
        except BaseException:
            self.columns = {}  # half applied: the next sync starts cold
            raise
        return unique(np.concatenate(changed)) if changed else np.zeros(0, np.int64)

    # ---- change log ---------------------------------------------------------------------
    def _apply_page(self, changed: list[np.ndarray], pages: list[Page] | None = None) -> bool:
        """Apply up to LOG_PAGE entries per shard (``pages``, if given: read already);
        True if a shard may have more."""
        sync: Sync | None = None
        if pages is None:  # the pages, the config, the slots they name: one round trip
            batch = Commands()
            cols = self._reread_columns()
            read = self._sync.queue(batch, self.log_last, self.log_seen, LOG_PAGE, cols)
            self.round_trips.run(batch)
            sync = read.value
            pages = sync.pages
        if any(lost for lost, _ in pages):
            raise RebuildNeeded
        inserted: dict[int, list[tuple[int, int]]] = {}
        for shard, (_, entries) in enumerate(pages):
            for _, fields in entries:
                e = event(fields)
                if e.kind == "slots":
                    inserted.setdefault(shard, []).append((e.seq, e.n))
                    changed.append(self._links(shard, e))
                elif e.kind == "column":
                    changed.append(self._set(shard, e))
                elif e.kind == "evicted":
                    changed.append(self._evicted(shard, e))
                elif e.kind == "forgotten":  # dict pruning (no codes: nothing pruned)
                    if len(e.codes):
                        self.forgotten.setdefault(e.col, set()).update(e.codes.tolist())
                else:
                    raise RebuildNeeded
        if inserted:
            changed.extend(self._reread(inserted, sync))
        for shard, (_, entries) in enumerate(pages):
            if entries:
                self.log_last[shard] = entries[-1][0].decode()
                self.log_seen[shard] += len(entries)
        return any(len(entries) >= LOG_PAGE for _, entries in pages)

    def _reread_columns(self) -> dict[str, np.dtype]:
        """The columns a sync reads again for the slots it is told of, as stored: the
        metadata columns, then the payload ones."""
        cols = [c for c in self.columns if c != "alive"]
        payload = [c for c in cols if c.startswith("f:")]
        meta = [c for c in cols if not c.startswith("f:")]
        return {c: column_dtype(c, self.schema) for c in meta + payload}

    def _reread(
        self, inserted: dict[int, list[tuple[int, int]]], sync: Sync | None
    ) -> list[np.ndarray]:
        """Read the slots that inserts took (per shard ``(seq0, n)``) again, every column
        and the alive flags, so an overwritten step's row is replaced whole: from what
        ``sync``'s round trip read, for each shard it covered; the others in one round
        trip (with the config, for new tags). Returns the rows read."""
        spans: list[Span] = []
        config = None if sync is None else sync.config
        for shard in list(inserted):
            got = None if sync is None else sync.spans[shard]
            if got is not None:
                spans += got
                del inserted[shard]
        if inserted:  # past reread.lua's limits, or pages a fetch read
            batch = Commands()
            read_config = queue_config(batch, self.store)
            read = queue_spans(batch, self.store, self.cap, inserted, self._reread_columns())
            self.round_trips.run(batch)
            spans, config = spans + read.value, read_config.value
        changed = []
        for span in spans:
            base = span.shard * self.cap
            for col, values in span.values.items():
                self._put(base + span.start, base + span.stop, col, values)
            if "alive" in span.values:
                changed.append(np.arange(base + span.start, base + span.stop, dtype=np.int64))
        self.check_config(config)
        return changed

    def _put(self, start: int, stop: int, col: str, values: np.ndarray) -> None:
        """Rows [start, stop) of column ``col`` from their stored values."""
        dest = self.columns[col][start:stop]
        if col == "alive":
            self.live_change += int(np.count_nonzero(values)) - int(np.count_nonzero(dest))
            dest[:] = values
        elif col.startswith("f:"):
            dest[:] = values
        else:
            dest[:] = decode_meta(col, values, self.schema)

    def _rows(self, shard: int, seqs: np.ndarray) -> np.ndarray:
        return shard * self.cap + (seqs - 1) % self.cap

    def _set(self, shard: int, e: Event) -> np.ndarray:
        """A column update (priority, curation) on the rows that still hold its ids."""
        if e.col not in self.columns:
            raise RebuildNeeded
        values = decode_meta(
            e.col, np.frombuffer(e.values, column_dtype(e.col, self.schema)), self.schema
        )
        rows = self._rows(shard, e.ids // self.n_shards)
        held = self.columns["id"][rows] == e.ids
        rows = rows[held]
        self.columns[e.col][rows] = values[held]
        return rows

    def _evicted(self, shard: int, e: Event) -> np.ndarray:
        """Steps evicted by id (retention, manual): their rows are no longer alive."""
        rows = self._rows(shard, e.ids // self.n_shards)
        rows = rows[self.columns["id"][rows] == e.ids]
        self.live_change -= int(np.count_nonzero(self.columns["alive"][unique(rows)]))
        self.columns["alive"][rows] = False
        return rows

    def _links(self, shard: int, e: Event) -> np.ndarray:
        """``next`` distances a commit set on older rows."""
        seqs, delta = e.links
        if not len(seqs):
            return np.zeros(0, np.int64)
        rows = self._rows(shard, seqs)
        held = self.columns["id"][rows] == seqs * self.n_shards + shard
        self.columns["next"][rows[held]] = delta[held]
        return rows[held]

    def check_config(self, raw: bytes | None) -> None:
        """Called with the namespace config read by every incremental sync that reread
        slots: add the columns of free tags that appeared in the schema, read whole. May
        raise :class:`RebuildNeeded`."""
        if raw is None or raw == self.config_raw:
            return
        cfg = NamespaceConfig.from_bytes(raw, self.store.namespace)
        self.schema, self.config_raw = cfg.schema, raw
        new = [c for c in self.all_columns() if c not in self.columns]
        if not new:
            return
        self.store.config(raw=raw)
        parts = [self.read_columns(s, new) for s in range(self.n_shards)]
        for col in new:
            self.columns[col] = np.concatenate([p[col] for p in parts])

    def payload_fields(self) -> dict[str, int]:
        """The mirrored payload columns (``f:<field>``) and their row bytes."""
        if self.schema is None or self.payload_bytes <= 0:
            return {}
        return {
            f"f:{name}": spec.row_bytes
            for name, spec in self.schema.fields.items()
            if spec.codec is None and not spec.ragged and spec.row_bytes <= self.payload_bytes
        }

    def all_columns(self) -> list[str]:
        """Every column the index keeps for the schema it knows (``alive`` aside)."""
        return [*metadata_columns(self.schema), *self.payload_fields()]

    def read_columns(self, shard: int, cols: list[str]) -> dict[str, np.ndarray]:
        """Whole columns of one shard (length ``cap``) from Redis, and ``alive``."""
        payload = {c: column_dtype(c, self.schema) for c in cols if c.startswith("f:")}
        out = self.store.meta_columns(shard, [c for c in cols if not c.startswith("f:")])
        if payload:
            out.update(payload_columns(self.store, shard, self.cap, payload))
        return out
