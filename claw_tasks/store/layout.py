"""Key names and the fixed-width column layout of the Redis store."""

from __future__ import annotations

import numpy as np

from claw_tasks.format.names import check_namespace
from claw_tasks.format.schema import Schema, tag_name
from claw_tasks.format.stepmeta import episode_code

# Metadata columns: name -> dtype. Zero bytes always mean "missing".
META: dict[str, np.dtype] = {
    "id": np.dtype("<i8"),
    "episode": np.dtype("<i8"),
    "step_index": np.dtype("<i4"),
    "agent_id": np.dtype("<i4"),
    "task_id": np.dtype("<i4"),
    "skill_tag": np.dtype("<i4"),
    "reward_source": np.dtype("<i4"),
    "quality": np.dtype("<i4"),
    "policy_version": np.dtype("<i4"),
    "timestamp": np.dtype("<f8"),
    "reward": np.dtype("<f4"),
    "priority": np.dtype("<f4"),
    "next": np.dtype("<i4"),
    "flags": np.dtype("u1"),
}
STR_TAG_DTYPE = np.dtype("<i4")
EPISODE_INDEX_ENTRY = np.dtype([("step_index", "<i4"), ("id", "<i8")])
"""One step in a shard's ``eptraj`` hash (episode code -> these entries, appended at commit
when the namespace has ``episode_index``): what ``Store.trajectory_ids`` reads."""
NUM_TAG_DTYPE = np.dtype("<f8")

# 16376 slots: a chunk of 1-, 4- or 8-byte items plus its sds header stays just inside a
# jemalloc size class (16 KiB, 64 KiB, 128 KiB); 16384 would round up by 25 %.
META_CHUNK_SLOTS = 16376
PAYLOAD_CHUNK_BYTES = 1024 * 1024 - 64  # chunks stay inside one jemalloc size class
SPARSE_CHUNK_SLOTS = 4096

# Run-table columns: one value per commit (every row of a commit has the same ``timestamp``),
# stored as runs instead of per slot: per block of ``RUN_CHUNK_SLOTS`` slots, a string of
# ``RUN_ENTRY`` records sorted by slot; a record's value holds from its slot (relative to
# the block) to the next record's. Slots before a block's first record (or in a block with
# no key) read as zero, like a missing metadata chunk. commit.lua splices the runs.
RUN_COLUMNS = frozenset({"timestamp"})
RUN_CHUNK_SLOTS = 1024  # a splice rewrites at most 1024 records (10 KiB)
RUN_ENTRY = np.dtype([("slot", "<u2"), ("value", "<f8")])  # packed: 10 bytes


def meta_spans(cap: int) -> list[tuple[int, int]]:
    """Slots ``[start, stop)`` of each metadata chunk of a shard of ``cap`` slots: the
    unit a pass over a namespace's metadata walks (one key per column)."""
    return [(c, min(cap, c + META_CHUNK_SLOTS)) for c in range(0, cap, META_CHUNK_SLOTS)]


def meta_chunk_of(slots: np.ndarray) -> np.ndarray:
    """The metadata chunk (an index into :func:`meta_spans`) of each of ``slots``."""
    return np.asarray(slots) // META_CHUNK_SLOTS


def run_blocks(start: int, stop: int) -> range:
    """The run-table blocks that slots ``[start, stop)`` of a shard fall in."""
    return range(start // RUN_CHUNK_SLOTS, -(-stop // RUN_CHUNK_SLOTS) if stop > start else 0)


def expand_runs(tables: list[bytes | None], at: np.ndarray | slice, dtype: np.dtype) -> np.ndarray:
    """Values at positions ``at`` (an array, or a slice of them: a range is the runs
    repeated, no search) of consecutive blocks' run tables (None or empty: no key):
    position ``j * RUN_CHUNK_SLOTS + s`` is slot ``s`` of ``tables[j]``'s block, zero
    before its first record."""
    if len(tables) == 1 and isinstance(at, slice):  # one block's slots (a sync's span)
        return _one_block(tables[0] or b"", at, dtype)
    raws = [raw or b"" for raw in tables]
    rec = np.frombuffer(b"".join(raws), RUN_ENTRY)
    counts = np.array([len(raw) // RUN_ENTRY.itemsize for raw in raws], np.int64)
    nb, cum = len(raws), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    opens = cum[:-1] + np.arange(nb)  # where each block's zero record goes: before its own
    mine = np.ones(nb + len(rec), bool)
    mine[opens] = False
    starts = np.repeat(np.arange(nb, dtype=np.int64) * RUN_CHUNK_SLOTS, counts + 1)
    starts[mine] += rec["slot"]
    values = np.zeros(nb + len(rec), dtype)
    values[mine] = rec["value"]
    if isinstance(at, slice):
        lengths = np.diff(np.append(starts, nb * RUN_CHUNK_SLOTS))
        return np.repeat(values, lengths)[at]
    return values[np.searchsorted(starts, np.asarray(at, np.int64), side="right") - 1]


def _one_block(raw: bytes, at: slice, dtype: np.dtype) -> np.ndarray:
    """:func:`expand_runs` of one table at a slice of its slots: the record at or before
    each slot (5 numpy calls, where the general case makes ~20)."""
    slots = np.arange(RUN_CHUNK_SLOTS)[at]
    rec = np.frombuffer(raw, RUN_ENTRY)
    i = np.searchsorted(rec["slot"], slots, side="right") - 1
    return np.where(i >= 0, rec["value"][np.maximum(i, 0)] if len(rec) else 0, 0).astype(dtype)


def runs_of(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row, value) of each run of equal consecutive ``values``."""
    values = np.asarray(values)
    if not len(values):
        return np.zeros(0, np.int64), values
    first = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return first, values[first]


_F4_NAN = np.frombuffer(np.float32(np.nan).tobytes(), np.uint32)[0]
_F8_NAN = np.frombuffer(np.float64(np.nan).tobytes(), np.uint64)[0]


def nan_xor(values: np.ndarray) -> np.ndarray:
    """Encode/decode floats so that zero bytes read as NaN (the operation is its own inverse)."""
    if values.dtype == np.float32:
        return (values.view(np.uint32) ^ _F4_NAN).view(np.float32)
    return (values.astype(np.float64).view(np.uint64) ^ _F8_NAN).view(np.float64)


def payload_chunk_slots(row_bytes: int) -> int:
    """Slots per payload chunk: just under 1 MiB (one jemalloc size class)."""
    return max(1, PAYLOAD_CHUNK_BYTES // max(1, row_bytes))


def column_dtype(col: str, schema: Schema | None) -> np.dtype:
    """How column ``col`` is stored: a fixed column of :data:`META`, a tag column of
    ``schema`` (string codes or NaN-xor floats), or ``f:<field>``, a payload field's fixed
    rows (``V<row bytes>``). KeyError for any other."""
    if col in META:
        return META[col]
    if col.startswith("f:") and schema is not None:
        return np.dtype(f"V{schema.fields[col[2:]].row_bytes}")
    tag = tag_name(col)
    kind = schema.tags.get(tag) if schema and tag is not None else None
    if kind is None:
        raise KeyError(f"unknown metadata column {col!r}")
    return STR_TAG_DTYPE if kind == "str" else NUM_TAG_DTYPE


def row_episode_codes(values: list[str], index: np.ndarray) -> np.ndarray:
    """Per-row episode codes of a batch's episode column (vocabulary + index); a step's
    shard is its code modulo the namespace's shard count."""
    return np.array([episode_code(v) for v in values], np.int64)[index]


STORE_NAMES = frozenset({"config", "dead", "outcomes", "audit", "snapshots"})
"""Namespace-level keys of the store (``Keys``): no owned key takes these names."""
STORE_PREFIXES = ("dict:", "rdict:", "dpend:", "done:", "stage:", "dl:")
"""Families of namespace-level store keys: no owned key starts with these."""
ARRAYS_PREFIX = "vx:"
"""Shard-level keys of slot arrays (``arrays.SlotArrays``): ``vx:<name>:<kind>:<chunk>``."""


def check_owned_name(name: str) -> str:
    """``name`` if an owned key may take it; ValueError for the store's own names (or an
    empty one), so an owned key never reaches the store's keys."""
    if not name or name in STORE_NAMES or name.startswith(STORE_PREFIXES):
        raise ValueError(f"{name!r} is the store's key name, not one the orchestrator owns")
    return name


class Keys:
    """Key names of one namespace. Shard keys share the hash tag ``{ns:shard}``."""

    def __init__(self, namespace: str) -> None:
        check_namespace(namespace)
        self.ns = namespace
        self.base = f"claw:{{{namespace}}}:"

    @property
    def config(self) -> str:
        return self.base + "config"

    @property
    def dead(self) -> str:
        return self.base + "dead"

    @property
    def outcomes(self) -> str:
        """Ingest outcome counters (hash): messages committed, partial, rejected, dead letters."""
        return self.base + "outcomes"

    @property
    def audit(self) -> str:
        """Stream of people's writes (curation, recipe edits): who, when, what."""
        return self.base + "audit"

    @property
    def snapshots(self) -> str:
        """Hash: snapshot name -> its header (msgpack; ``store/snapshots.py``)."""
        return self.base + "snapshots"

    def snapshot(self, shard: int, name: str) -> str:
        """Hash: one shard's part of a snapshot (its mutable columns, zstd)."""
        return f"{self.shard(shard)}snap:{name}"

    def dict(self, column: str) -> str:
        return f"{self.base}dict:{column}"

    def rdict(self, column: str) -> str:
        return f"{self.base}rdict:{column}"

    def dpend(self, column: str) -> str:
        """Dictionary entries marked for pruning: string -> ``code:marked_at``; an encode of
        the string revives it with the same code (``dict.lua``)."""
        return f"{self.base}dpend:{column}"

    def stage(self, batch_id: str) -> str:
        """Claim-check value; in shard 0's slot so a single-shard commit can copy from it."""
        return f"{self.shard(0)}stage:{batch_id}"

    def done(self, batch_id: str) -> str:
        return f"{self.base}done:{batch_id}"

    def shard(self, shard: int) -> str:
        """Prefix of one shard's keys."""
        return f"claw:{{{self.ns}:{shard}}}:"

    def shard_key(self, shard: int, name: str) -> str:
        return self.shard(shard) + name

    def archived(self, shard: int) -> str:
        """Archive watermark of a shard: an integer seq; every step of the shard with
        ``seq <= watermark`` (id = seq * n_shards + shard) is in the archive, or was never
        committed. Written only after the archive files holding those steps are durable;
        eviction with ``--archive-before-evict`` removes no step above it."""
        return self.shard_key(shard, "archived")

    def meta(self, shard: int, col: str, chunk: int) -> str:
        return f"{self.shard(shard)}m:{col}:{chunk}"

    def runs(self, shard: int, col: str, block: int) -> str:
        """Run table of a :data:`RUN_COLUMNS` column over one block of ``RUN_CHUNK_SLOTS``."""
        return f"{self.shard(shard)}mr:{col}:{block}"

    def field(self, shard: int, name: str, chunk: int) -> str:
        return f"{self.shard(shard)}f:{name}:{chunk}"

    def ragged(self, shard: int, name: str, chunk: int) -> str:
        return f"{self.shard(shard)}r:{name}:{chunk}"

    def compressed(self, shard: int, name: str, chunk: int) -> str:
        """A compressed field's frames (hash: slot -> frame), ``SPARSE_CHUNK_SLOTS`` a key."""
        return f"{self.shard(shard)}z:{name}:{chunk}"

    def sparse(self, shard: int, kind: str, chunk: int) -> str:
        """``kind`` is ``nx`` (explicit next_obs) or ``info``."""
        return f"{self.shard(shard)}{kind}:{chunk}"
