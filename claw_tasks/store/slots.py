"""What the read path reads of slots, as commands queued on a
:class:`~claw_tasks.connection.resp.Commands`, each with the decoder that turns its replies
into arrays: the caller runs its reads of every kind in one round trip and never sees a
key or a chunk size. Functions over a :class:`~claw_tasks.store.core.StoreCore`.

- payload rows at global rows (``shard * cap + slot``): :class:`Read` says which field
  (:func:`payload_read`, :func:`explicit_next_obs_read`, :func:`info_read`);
  :func:`queue_plain` reads one by client commands (big rows, hashes), :func:`queue_checked`
  a shard's small rows inside ``lua/fetch.lua`` after checking that its slots still hold
  the steps expected;
- metadata columns, payload columns and alive flags of slot spans (:func:`queue_spans`,
  :func:`spans_of_reread`: what a sync re-reads) and whole payload columns of a shard
  (:func:`payload_columns`);
- names of dictionary codes (:func:`name_lookups`: episode names live with their shard).

Columns are named as the sampling index names them: the metadata columns of
:data:`~claw_tasks.store.layout.META` and tags (``t:<tag>``), and ``f:<field>`` for a
payload field's fixed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np

from claw_tasks.connection.resp import Commands, Reply
from claw_tasks.format.schema import FieldSpec, Schema, tag_column
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import (
    META,
    META_CHUNK_SLOTS,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    SPARSE_CHUNK_SLOTS,
    expand_runs,
    payload_chunk_slots,
    run_blocks,
)
from claw_tasks.store.scripts import Lua

FETCH = Lua("fetch")
PLAIN_ROW_BYTES = 2048
"""Fixed rows of at least this many bytes are read by plain commands, not in Lua: a Lua
``redis.call`` costs ~1 µs where a client command costs several, but Lua strings cost
~2 ms per MB."""


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

    @property
    def column(self) -> str | None:
        """The sampling index's name of the column this reads (``f:<field>``: a fixed
        payload field, which the index may mirror); None for a hash read."""
        return self.base if self.kind == "f" else None

    def family(self) -> tuple[Any, ...]:
        """Reads of one family read the same keys: merged, their rows are read once."""
        return (self.kind, self.base, self.size, self.chunk, self.plain)

    def with_rows(self, rows: np.ndarray) -> Read:
        """This family's read of ``rows`` (sorted, unique), placed nowhere."""
        return Read(self.kind, self.base, self.size, self.chunk, rows, self.plain)


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


def queue_plain(batch: Commands, core: StoreCore, cap: int, read: Read) -> Reply:
    """``read`` (rows sorted and unique) by client commands: a fixed read as one GETRANGE
    per run of consecutive slots in one chunk, its reply uint8 ``(rows, size)`` (or, when
    the commands went through redis-py, :class:`Rows` indexed as such); a hash
    read as one HMGET per hash (a command per row costs the client ~5 µs to pack and
    parse: a batch's compressed frames are hundreds), its reply a value (or None) per
    row."""
    shard, slot = read.rows // cap, read.rows % cap
    chunk = slot // read.chunk
    same_key = (np.diff(chunk) == 0) & (np.diff(shard) == 0)
    prefix = core.layout_keys.shard
    if read.kind == "h":  # rows are sorted: each hash's rows are one stretch
        cut = np.flatnonzero(~same_key) + 1
        starts, stops = np.concatenate([[0], cut]).tolist(), [*cut.tolist(), len(read.rows)]
        slots = slot.tolist()
        hmgets = [
            ["HMGET", f"{prefix(int(shard[s]))}{read.base}:{chunk[s]}", *slots[s:e]]
            for s, e in zip(starts, stops, strict=True)
            if e > s
        ]
        return batch.add_all(hmgets, lambda replies: [v for r in replies for v in r])
    cut = np.flatnonzero((np.diff(read.rows) != 1) | ~same_key) + 1
    starts, stops = np.concatenate([[0], cut]).tolist(), [*cut.tolist(), len(read.rows)]
    ranges = []
    for s, e in zip(starts, stops, strict=True):
        if e > s:
            off = int(slot[s] % read.chunk) * read.size
            key = f"{prefix(int(shard[s]))}{read.base}:{chunk[s]}"
            ranges.append((key, off, off + (e - s) * read.size - 1))
    size = read.size
    return batch.into(
        ranges,
        len(read.rows) * size,
        lambda buf: buf.reshape(-1, size),
        each=lambda raws: Rows(raws, ranges, size),
    )


class Rows:
    """Fixed rows of ``size`` bytes as views of redis-py's replies to GETRANGEs of
    ``ranges`` (a short reply padded with zeros): ``rows[k]`` copies the rows ``k`` once,
    into a new uint8 ``(len(k), size)`` array."""

    def __init__(self, raws: list[bytes], ranges: list[tuple[str, int, int]], size: int) -> None:
        self.size, self.rows = size, []
        for raw, (_, start, end) in zip(raws, ranges, strict=True):
            if len(raw) < end - start + 1:  # a key not written (yet) that far
                raw = raw + bytes(end - start + 1 - len(raw))
            self.rows += list(np.frombuffer(raw, np.uint8).reshape(-1, size))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: np.ndarray) -> np.ndarray:
        out = np.empty((len(k), self.size), np.uint8)
        for i, j in enumerate(k.tolist()):
            out[i] = self.rows[j]
        return out


def queue_checked(
    batch: Commands,
    core: StoreCore,
    cap: int,
    shard: int,
    check: tuple[int, np.ndarray],
    reads: Sequence[Read],
) -> Reply:
    """``lua/fetch.lua`` on ``shard``: ``check`` is (the smallest seq of the steps to check,
    their slots); then the slots of ``reads`` (rows sorted; their rows of other shards
    ignored) read atomically. Its reply: None when a checked step is gone (its slot
    reused or the step evicted), else per read its rows (a fixed read: their bytes; a
    hash read: a value or None each)."""
    oldest, slots = check
    args: list[Any] = [core.layout_keys.shard(shard), cap, oldest, _msgpacked(slots)]
    for r in reads:
        lo, hi = np.searchsorted(r.rows, [shard * cap, (shard + 1) * cap])
        args += [r.kind, r.base, r.size, r.chunk, _msgpacked(r.rows[lo:hi] % cap)]
    keys = [core.layout_keys.shard_key(shard, "alive"), core.layout_keys.shard_key(shard, "seq")]
    command = ["EVALSHA", FETCH.sha, len(keys), *keys, *args]
    return batch.add(command, lambda reply: None if reply[0] else reply[1:])


def name_lookups(
    core: StoreCore, column: str, codes: Sequence[int], n_shards: int
) -> list[tuple[list[int], list[Any]]]:
    """The commands that read the names of dictionary ``codes`` of ``column``: (codes,
    HMGET) pairs, each command's reply a name (or None) per code. An episode's name lives
    with its shard (code modulo ``n_shards``), any other column's in its dictionary."""
    if column != "episode":
        return [(list(codes), ["HMGET", core.layout_keys.rdict(column), *codes])]
    out = []
    for shard in range(n_shards):
        part = [c for c in codes if c % n_shards == shard]
        if part:
            out.append((part, ["HMGET", core.layout_keys.shard_key(shard, "epname"), *part]))
    return out


class Span(NamedTuple):
    """Slots ``[start, stop)`` of ``shard`` as stored: per column name its rows (stored
    dtype, zeros where nothing is written), ``alive`` their alive flags when read."""

    shard: int
    start: int
    stop: int
    values: dict[str, np.ndarray]


def queue_spans(
    batch: Commands,
    core: StoreCore,
    cap: int,
    inserted: dict[int, list[tuple[int, int]]],
    columns: dict[str, np.dtype],
) -> Reply:
    """The slots that inserts (per shard, ``(seq0, n)``) took, every one of ``columns``
    and the alive flags, by plain commands: one GETRANGE per column and chunk run (a run
    column: its blocks' run tables). Its reply: the :class:`Span` list (metadata and
    alive split at metadata chunks, each payload column at its own)."""
    keys = core.layout_keys
    meta = {c: d for c, d in columns.items() if not c.startswith("f:")}
    parts: list[tuple[int, int, int, str, np.dtype]] = []  # shard, start, stop, column
    commands: list[list[Any]] = []
    for shard, ins in inserted.items():
        for start, stop in slot_runs(ins, cap, META_CHUNK_SLOTS):
            chunk, off = divmod(start, META_CHUNK_SLOTS)
            for col, dtype in meta.items():
                if col in RUN_COLUMNS:  # the run tables of the blocks the run touches
                    blocks = run_blocks(start, stop)
                    commands += [["GET", keys.runs(shard, col, b)] for b in blocks]
                    parts.append((shard, start, stop, col, dtype))
                    continue
                first, last = off * dtype.itemsize, (off + stop - start) * dtype.itemsize - 1
                commands.append(["GETRANGE", keys.meta(shard, col, chunk), first, last])
                parts.append((shard, start, stop, col, dtype))
            alive = keys.shard_key(shard, "alive")
            commands.append(["GETRANGE", alive, start // 8, (stop - 1) // 8])
            parts.append((shard, start, stop, "alive", np.dtype(bool)))
    for col, dtype in columns.items():
        if col not in meta:
            size = dtype.itemsize
            for shard, ins in inserted.items():
                for start, stop in slot_runs(ins, cap, payload_chunk_slots(size)):
                    chunk, off = divmod(start, payload_chunk_slots(size))
                    key = keys.shard_key(shard, f"{col}:{chunk}")
                    commands.append(["GETRANGE", key, off * size, (off + stop - start) * size - 1])
                    parts.append((shard, start, stop, col, dtype))

    def decode(replies: list[Any]) -> list[Span]:
        spans: dict[tuple[int, int, int], Span] = {}
        i = 0
        for shard, start, stop, col, dtype in parts:
            n = len(run_blocks(start, stop)) if col in RUN_COLUMNS else 1
            span = spans.get((shard, start, stop))
            if span is None:
                span = spans[shard, start, stop] = Span(shard, start, stop, {})
            span.values[col] = _values(col, dtype, start, stop, replies[i : i + n])
            i += n
        return list(spans.values())

    return batch.add_all(commands, decode)


def reread_columns(columns: dict[str, np.dtype]) -> list[Any]:
    """``lua/reread.lua``'s column arguments: per column its key base, row bytes and slots
    per chunk (a run column's row bytes are 0: the script returns its blocks' run
    tables)."""
    args: list[Any] = []
    for col, dtype in columns.items():
        if col in RUN_COLUMNS:
            args += [f"mr:{col}", 0, RUN_CHUNK_SLOTS]
        elif col.startswith("f:"):
            args += [col, dtype.itemsize, payload_chunk_slots(dtype.itemsize)]
        else:
            args += [f"m:{col}", dtype.itemsize, META_CHUNK_SLOTS]
    return args


def spans_of_reread(reply: Sequence[Any], shard: int, columns: dict[str, np.dtype]) -> list[Span]:
    """The spans in a ``lua/reread.lua`` reply (read with :func:`reread_columns` of
    ``columns``): per merged span its start, stop, each column's rows, the alive bytes."""
    spans, width = [], len(columns) + 3
    for at in range(2, len(reply), width):
        start, stop = int(reply[at]), int(reply[at + 1])
        raws = reply[at + 2 : at + width]
        values = {
            col: _values(col, dtype, start, stop, raw if col in RUN_COLUMNS else [raw])
            for (col, dtype), raw in zip(columns.items(), raws[:-1], strict=True)
        }
        values["alive"] = _values("alive", np.dtype(bool), start, stop, [raws[-1]])
        spans.append(Span(shard, start, stop, values))
    return spans


def _values(col: str, dtype: np.dtype, start: int, stop: int, raws: list[Any]) -> np.ndarray:
    """Rows ``[start, stop)`` of ``col`` from its stored replies: the run tables of its
    blocks (a run column), the alive bitmap's bytes ``start // 8 ..``, or its rows' bytes
    (short: zeros after them)."""
    n = stop - start
    if col in RUN_COLUMNS:
        off = run_blocks(start, stop).start * RUN_CHUNK_SLOTS
        return expand_runs(list(raws), slice(start - off, stop - off), dtype)
    raw = raws[0] or b""
    if col == "alive":
        bits = np.unpackbits(np.frombuffer(raw, np.uint8))[start % 8 : start % 8 + n]
        out = np.zeros(n, bool)
        out[: len(bits)] = bits.astype(bool)
        return out
    if len(raw) == n * dtype.itemsize:
        return np.frombuffer(raw, dtype)
    out = np.zeros(n, dtype)
    out.view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def payload_columns(
    core: StoreCore, shard: int, cap: int, columns: dict[str, np.dtype]
) -> dict[str, np.ndarray]:
    """Whole payload columns (``f:<field>``, ``V<row bytes>``) of ``shard``, ``cap`` rows
    each (zeros where nothing is written), in one round trip."""
    plan = []
    with core.r.pipeline(transaction=False) as pipe:
        for col, dtype in columns.items():
            per_chunk = payload_chunk_slots(dtype.itemsize)
            for chunk in range(-(-cap // per_chunk)):
                pipe.get(core.layout_keys.shard_key(shard, f"{col}:{chunk}"))
                plan.append((col, dtype.itemsize, chunk * per_chunk))
        replies = pipe.execute()
    out = {col: np.zeros(cap, dtype) for col, dtype in columns.items()}
    for (col, size, slot0), raw in zip(plan, replies, strict=True):
        if raw:
            n = min(len(raw) // size, cap - slot0)
            out[col].view(np.uint8)[slot0 * size : (slot0 + n) * size] = np.frombuffer(
                raw, np.uint8, n * size
            )
    return out


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


def _msgpacked(slots: np.ndarray) -> bytes:
    return msgpack.packb(slots.tolist())


def metadata_columns(schema: Schema | None) -> list[str]:
    """The metadata columns of a namespace of ``schema`` (None: no step yet): the fixed
    ones, then a column per free tag."""
    return [*META, *(tag_column(t) for t in (schema.tags if schema else {}))]
