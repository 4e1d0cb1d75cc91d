"""Read sampled rows' payloads in one pipelined round trip.

Reads of one key family (a field at the drawn rows and at their successors, a window's
steps) are merged into sorted unique rows, so consecutive slots come back in one
GETRANGE. Small rows are read inside ``lua/fetch.lua``, one call per shard: a Lua
``redis.call`` costs ~1 µs where a client command costs several. Big rows (and ragged
ones) are plain pipelined GETRANGE / HGET commands: Lua strings cost ~2 ms per MB.

Every shard's script call first checks that the rows still hold the steps the index
expects: the shard's seq has not gone a whole ring past the oldest of them (a slot is
reused only then) and their alive bits are set (evictions clear them). It runs after the
plain reads of the same pipeline, so it validates them too: a writer allocates (seq up,
alive bits cleared) before it writes a slot's payload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from claw_tasks.format.schema import FieldSpec
from claw_tasks.store import Store
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS, payload_chunk_slots
from claw_tasks.store.scripts import Lua, execute
from orchestrator.sampling.bulk import BulkReader

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
        cap = self.cap
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
        in_lua = [m for m in merged if not m.plain]
        shards = np.unique(np.concatenate([check // cap, *(m.rows // cap for m in merged)]))
        seqs = expect // self._n_shards
        # Big fixed rows straight into buffers, before the pipeline: its script calls then
        # validate them, as they validate the plain reads queued ahead of them.
        bulk = self._bulk_reads([m for m in merged if m.plain and m.kind == "f"])
        plain = [self._plain_commands(m) for m in merged if m.plain and id(m) not in bulk]

        def queue(pipe: Any) -> None:
            for commands, _ in plain:
                for name, args in commands:
                    getattr(pipe, name)(*args)
            for shard in shards.tolist():
                on = check // cap == shard
                oldest = int(seqs[on].min()) if on.any() else 1 << 52
                args: list[Any] = [
                    self.store.keys.shard(shard),
                    cap,
                    oldest,
                    _pack(check[on] % cap),
                ]
                for m in in_lua:
                    lo, hi = np.searchsorted(m.rows, [shard * cap, (shard + 1) * cap])
                    args += [m.kind, m.base, m.size, m.chunk, _pack(m.rows[lo:hi] % cap)]
                keys = [self.store.keys.shard_key(shard, k) for k in ("alive", "seq")]
                self._script.queue(pipe, keys, args)
            for lookup in lookups:
                lookup(pipe)

        replies = execute(self.store.r, [self._script], queue)
        n_plain = sum(len(runs) for _, runs in plain)
        per_shard = replies[n_plain : n_plain + len(shards)]
        if any(reply[0] for reply in per_shard):
            return None
        got, plain_at, lua_at, runs_of = [], 0, 1, iter(runs for _, runs in plain)
        for m in merged:
            if id(m) in bulk:
                got.append(bulk[id(m)])
            elif m.plain:
                runs = next(runs_of)
                got.append(_plain_result(m, runs, replies[plain_at : plain_at + len(runs)]))
                plain_at += len(runs)
            else:
                parts = [reply[lua_at] for reply in per_shard]  # shards in order: rows in order
                got.append(_joined(m, parts))
                lua_at += 1
        out: list[Any] = [None] * len(reads)
        for m, res, (members, inv) in zip(merged, got, inverse, strict=True):
            start = 0
            for j in members:
                k = inv[start : start + len(reads[j].rows)]
                start += len(k)
                if m.kind == "h":
                    out[j] = [res[x] for x in k.tolist()]
                elif m.plain and id(m) not in bulk:
                    out[j] = _gather_rows(reads[j], res, k)
                else:
                    out[j] = _placed(reads[j], res[k])
        return out, replies[n_plain + len(shards) :]

    def _bulk_reads(self, fixed: list[Read]) -> dict[int, np.ndarray]:
        """Read the fixed reads ``fixed`` through the bulk reader, if there is one: by id of
        the read, its rows as uint8 ``(rows, size)``."""
        if self._bulk is None or not fixed:
            return {}
        commands = [self._plain_commands(m)[0] for m in fixed]
        sizes = [len(m.rows) * m.size for m in fixed]
        buf = np.empty(sum(sizes), np.uint8)
        self._bulk.getranges([args for c in commands for _, args in c], memoryview(buf))
        bounds = np.cumsum([0, *sizes]).tolist()
        return {
            id(m): buf[lo:hi].reshape(-1, m.size)
            for m, lo, hi in zip(fixed, bounds, bounds[1:], strict=False)
        }

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


def _pack(slots: np.ndarray) -> bytes:
    return msgpack.packb(slots.tolist())


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
