"""Range reads: every stored column of a run of consecutive sequence numbers of one shard,
chunk-wise (GETRANGE over column chunks, HGETALL/HMGET over sparse hashes). Archival reads
a namespace this way, one bounded run at a time, never the whole of it at once.

A compressed field comes back as the frames the store holds (:class:`Encoded`: no decode,
so an archive keeps them bit for bit), but for ``delta``: its frames name other steps' ids
(their keys), which a restore does not keep, so those are decoded here."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from claw_tasks.codecs import CodecFrames
from claw_tasks.format.arrays import unpackb
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import FieldSpec, tag_column
from claw_tasks.format.stepmeta import EXPLICIT_NEXT
from claw_tasks.store.compressed import decode_stored
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import (
    META,
    META_CHUNK_SLOTS,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    SPARSE_CHUNK_SLOTS,
    column_dtype,
    expand_runs,
    payload_chunk_slots,
    run_blocks,
)
from claw_tasks.store.reader import decode_meta


def run_slots(store: StoreCore, seq_lo: int, n: int) -> int:
    """The first slot of the run ``seq_lo .. seq_lo + n - 1``; the run must not wrap."""
    cap = store.config().cap
    slot0 = (seq_lo - 1) % cap
    if n < 0 or slot0 + n > cap:
        raise ValueError(f"a run of {n} slots from slot {slot0} wraps the ring of {cap}")
    return slot0


def _pieces(slot0: int, n: int, chunk_slots: int) -> list[tuple[int, int, int]]:
    """(chunk, first slot in the chunk, slots) for each chunk the run touches."""
    out, s, end = [], slot0, slot0 + n
    while s < end:
        chunk, inchunk = divmod(s, chunk_slots)
        take = min(end - s, chunk_slots - inchunk)
        out.append((chunk, inchunk, take))
        s += take
    return out


def read_meta_run(
    store: StoreCore, shard: int, seq_lo: int, n: int, cols: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """Metadata columns (floats decoded) of ``n`` slots from ``seq_lo``'s, plus ``alive``,
    in one pipelined round trip. Which step a slot holds is in its ``id``."""
    slot0 = run_slots(store, seq_lo, n)
    schema = store.config().schema
    if cols is None:
        cols = [*META, *(tag_column(t) for t in (schema.tags if schema else {}))]
    pieces = _pieces(slot0, n, META_CHUNK_SLOTS)
    blocks = run_blocks(slot0, slot0 + n)
    with store.r.pipeline(transaction=False) as pipe:
        for col in cols:
            if col in RUN_COLUMNS:
                for block in blocks:
                    pipe.get(store.layout_keys.runs(shard, col, block))
                continue
            size = column_dtype(col, schema).itemsize
            for chunk, inchunk, take in pieces:
                key = store.layout_keys.meta(shard, col, chunk)
                pipe.getrange(key, inchunk * size, (inchunk + take) * size - 1)
        b0, b1 = slot0 // 8, (slot0 + n - 1) // 8 if n else slot0 // 8
        pipe.getrange(store.layout_keys.shard_key(shard, "alive"), b0, b1)
        replies = pipe.execute()
    out: dict[str, np.ndarray] = {}
    i = 0
    for col in cols:
        dtype = column_dtype(col, schema)
        if col in RUN_COLUMNS:
            off = slot0 - blocks.start * RUN_CHUNK_SLOTS
            at = slice(off, off + n)
            out[col] = expand_runs(replies[i : i + len(blocks)], at, dtype)
            i += len(blocks)
            continue
        parts = replies[i : i + len(pieces)]
        i += len(pieces)
        sizes = [take * dtype.itemsize for _, _, take in pieces]
        raw = b"".join(p.ljust(size, b"\0") for p, size in zip(parts, sizes, strict=True))
        out[col] = decode_meta(col, np.frombuffer(raw, dtype).copy(), schema)
    bits = np.unpackbits(np.frombuffer(replies[-1].ljust(b1 - b0 + 1, b"\0"), np.uint8))
    out["alive"] = bits[slot0 - b0 * 8 : slot0 - b0 * 8 + n].astype(bool)
    return out


GetRanges = Callable[[list[tuple[str, int, int]], memoryview], None]
"""A bulk reader's GETRANGEs: ``(key, start, end)`` each (inclusive ends), their replies
written back to back into the buffer (a short reply zero-padded)."""


def read_fixed_into(
    store: StoreCore, shard: int, seq_lo: int, n: int, name: str, getranges: GetRanges
) -> np.ndarray:
    """Fixed-shape field ``name`` of the run of ``n`` slots from ``seq_lo``'s, read by
    ``getranges`` (a bulk reader filling the array in place, no copy per reply)."""
    schema = store.config().schema
    assert schema is not None
    spec = schema.fields[name]
    arr = np.empty((n, *spec.shape), spec.dtype)
    ranges = _slot_ranges(store, shard, run_slots(store, seq_lo, n), n, name)
    getranges(ranges, memoryview(arr.reshape(-1).view(np.uint8)))
    return arr


def _slot_ranges(
    store: StoreCore, shard: int, slot0: int, n: int, name: str
) -> list[tuple[str, int, int]]:
    schema = store.config().schema
    assert schema is not None
    size = schema.fields[name].row_bytes
    return [
        (store.layout_keys.field(shard, name, chunk), inchunk * size, (inchunk + take) * size - 1)
        for chunk, inchunk, take in _pieces(slot0, n, payload_chunk_slots(size))
    ]


def _queue_fixed(pipe: Any, ranges: list[tuple[str, int, int]]) -> int:
    for key, start, end in ranges:
        pipe.getrange(key, start, end)
    return len(ranges)


def _fixed(got: list[bytes], n: int, spec: FieldSpec) -> np.ndarray:
    """A fixed-shape field's ``n`` consecutive slots from its GETRANGE replies."""
    raw = b"".join(got).ljust(n * spec.row_bytes, b"\0")
    return np.frombuffer(raw, np.dtype(spec.dtype)).reshape(n, *spec.shape)


def read_fixed(
    store: StoreCore, shard: int, start: int, stop: int, names: Sequence[str]
) -> dict[str, np.ndarray]:
    """Fixed-shape payload fields ``names`` of slots ``[start, stop)`` of ``shard`` (each
    an array of ``stop - start`` rows; unwritten slots read as zeros), one round trip."""
    schema = store.config().schema
    assert schema is not None
    with store.r.pipeline(transaction=False) as pipe:
        counts = [
            _queue_fixed(pipe, _slot_ranges(store, shard, start, stop - start, name))
            for name in names
        ]
        replies = pipe.execute()
    out, at = {}, 0
    for name, count in zip(names, counts, strict=True):
        out[name] = _fixed(replies[at : at + count], stop - start, schema.fields[name])
        at += count
    return out


def read_payload_run(
    store: StoreCore,
    shard: int,
    seq_lo: int,
    n: int,
    rows: np.ndarray,
    flags: np.ndarray,
    skip: Collection[str] = (),
) -> tuple[dict[str, Any], dict[int, np.ndarray], dict[int, dict[str, Any]]]:
    """Payload of ``rows`` (sorted positions in the run of ``n`` slots from ``seq_lo``'s),
    in one pipelined round trip: fixed fields as arrays, ragged ones as lists of arrays,
    compressed ones as stored (see the module docstring); the explicit ``next_obs`` (a frame
    of a compressed obs) and the ``info`` of the rows that have one, by position in
    ``rows``. ``flags`` (the run's column) says which steps have an explicit next_obs.
    Fields in ``skip`` are not read (the caller reads them another way)."""
    slot0 = run_slots(store, seq_lo, n)
    schema = store.config().schema
    if schema is None:
        raise ValueError(f"namespace {store.namespace!r} has no schema yet")
    wanted = {k: v for k, v in schema.fields.items() if k not in skip}
    rows = np.asarray(rows, np.int64)
    slots = (slot0 + rows).tolist()
    nx_at = np.flatnonzero((flags[rows] & EXPLICIT_NEXT) != 0).tolist()
    by_chunk: dict[int, list[int]] = {}
    for s in slots:
        by_chunk.setdefault(s // SPARSE_CHUNK_SLOTS, []).append(s)
    k = store.layout_keys
    with store.r.pipeline(transaction=False) as pipe:
        counts = []
        for name, spec in wanted.items():
            if spec.codec is not None:  # a frame in every slot: the run's, by HMGET
                for c, at in by_chunk.items():
                    pipe.hmget(k.compressed(shard, name, c), at)
            elif spec.ragged:
                for c in by_chunk:
                    pipe.hgetall(k.ragged(shard, name, c))
            else:
                counts.append(_queue_fixed(pipe, _slot_ranges(store, shard, slot0, n, name)))
                continue
            counts.append(len(by_chunk))
        for i in nx_at:
            pipe.hget(k.sparse(shard, "nx", slots[i] // SPARSE_CHUNK_SLOTS), slots[i])
        for c in by_chunk:
            pipe.hgetall(k.sparse(shard, "info", c))
        replies = pipe.execute()
    fields: dict[str, Any] = {}
    at = 0
    for (name, spec), count in zip(wanted.items(), counts, strict=True):
        got, at = replies[at : at + count], at + count
        if spec.codec is not None:
            frames = [f or b"" for part in got for f in part]  # chunks in order: slots too
            fields[name] = _stored_frames(store, name, spec, frames)
        elif spec.ragged:
            found, tail = _by_slot(got), spec.shape[1:]
            fields[name] = [
                np.frombuffer(found.get(s, b""), spec.dtype).reshape(-1, *tail) for s in slots
            ]
        else:
            arr = _fixed(got, n, spec)
            fields[name] = arr if len(rows) == n else arr[rows]
    obs = schema.fields.get("obs")
    nx = zip(nx_at, replies[at : at + len(nx_at)], strict=True)
    next_obs = {} if obs is None else {i: _next_obs(store, obs, r or b"") for i, r in nx}
    found = _by_slot(replies[at + len(nx_at) :])
    pos = {s: i for i, s in enumerate(slots)}
    info = {pos[s]: unpackb(v) for s, v in found.items() if s in pos}
    return fields, next_obs, info


def _next_obs(store: StoreCore, obs: FieldSpec, raw: bytes) -> Any:
    """An explicit ``next_obs`` as stored: a frame of a compressed obs, else an array."""
    if obs.codec is not None:
        got = _stored_frames(store, "obs", obs, [raw])
        return bytes(got.frames[0]) if isinstance(got, Encoded) else got[0]
    arr = np.frombuffer(raw, np.dtype(obs.dtype))
    return arr.reshape((-1, *obs.shape[1:]) if obs.ragged else obs.shape)


def _stored_frames(store: StoreCore, name: str, spec: FieldSpec, frames: list[bytes]) -> Any:
    """A compressed field's frames as stored (``Encoded``), or ``delta`` rows decoded (an
    array, a list for a ragged field): see the module docstring."""
    assert spec.codec is not None
    if spec.codec.name == "delta":
        return decode_stored(store, name, spec, frames)
    shape = (len(frames), *spec.shape)
    return Encoded(spec.codec, np.dtype(spec.dtype), shape, CodecFrames.of(frames))


def _by_slot(hashes: list[dict[bytes, bytes]]) -> dict[int, bytes]:
    """Sparse hash chunks merged: slot -> value."""
    return {int(f): v for h in hashes for f, v in h.items()}
