"""Restore: archive files back into a namespace, bit-exact, through the store's writer.

Steps get new ids; the id each had when archived is kept as the numeric tag ``orig_id``
(kept as it is when already there: an archive of a restore names the first id), episode
ids stay what they were. Commit timestamps, priorities and curation labels are the
archived ones. Each batch has an id derived from the file's checksum, so a restore run
again after a failure replays what it had committed instead of storing it twice.
Compressed fields come back as the frames archived (checked as ingest checks a producer's
frames, then stored as they are); ``delta`` rows, archived decoded, are encoded again.
Then the archive's snapshots (``_snapshots/``) come back, laid over the new ids
(:func:`orchestrator.maintenance.snapshots.restore_snapshots`): which archived id became
which new one is kept while the files are restored, only when there are snapshots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Placed
from claw_tasks.format.schema import Schema
from claw_tasks.store import Store
from claw_tasks.store.config import DEFAULT_CAPACITY
from orchestrator.maintenance.archive_files import MANIFEST, Manifest, drop_cached
from orchestrator.maintenance.snapshots import (
    RestoredSnapshot,
    archived_snapshots,
    restore_snapshots,
)
from orchestrator.maintenance.steptable import (
    TAG_PREFIX,
    batch_problem,
    from_table,
    table_meta,
    to_batch,
)

ORIG_ID = "orig_id"
BATCH_ROWS = 1 << 16
BATCH_BYTES = 64 * 1024 * 1024

Progress = Callable[[int, int], None]  # (rows restored, bytes read) since the last call


class ArchiveError(ValueError):
    """An archive directory is missing, ambiguous or damaged."""


def find_archive(path: Path | str) -> Path:
    """The namespace directory (holding ``_manifest.json``) that ``path`` names: itself,
    or the one ``ns=<namespace>`` directory under it."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    found = sorted(p for p in path.glob("ns=*") if (p / MANIFEST).exists())
    if len(found) == 1:
        return found[0]
    if not found:
        raise ArchiveError(f"no Claw archive in {path} (no {MANIFEST} in it or in ns=*/)")
    names = ", ".join(p.name for p in found)
    raise ArchiveError(f"{path} holds several archives ({names}): name one, e.g. {found[0]}")


@dataclass
class RestoreResult:
    namespace: str
    rows: int = 0
    files: int = 0
    replayed: int = 0  # rows an earlier run of the same restore had committed already
    expired: int = 0  # rows past the namespace's capacity (the ring passed them)
    snapshots: list[RestoredSnapshot] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "snapshots": [s.to_json() for s in self.snapshots]}


def restore(
    archive: Path | str,
    store: Store,
    *,
    capacity: int | None = None,
    n_shards: int | None = None,
    progress: Progress | None = None,
    with_snapshots: bool = True,
) -> RestoreResult:
    """Restore every file of an archive into ``store``'s namespace (created when missing:
    large enough for the archive, with its shard count and spaces), then its snapshots
    (unless not ``with_snapshots``)."""
    ns_dir = find_archive(archive)
    manifest = Manifest.load(ns_dir)
    assert manifest is not None
    tell = progress or (lambda rows, nbytes: None)
    if not store.exists():
        schema = None if manifest.schema is None else _with_orig_id(manifest.schema)
        store.create(
            capacity or max(DEFAULT_CAPACITY, manifest.rows),
            n_shards or manifest.n_shards,
            schema,
        )
    if manifest.spaces and not store.config(refresh=True).spaces:
        store.set_spaces(manifest.spaces["observation"], manifest.spaces["action"])
    result = RestoreResult(store.namespace)
    snapshots = archived_snapshots(ns_dir) if with_snapshots else []
    ids: list[tuple[np.ndarray, np.ndarray]] | None = [] if snapshots else None
    entries = sorted(manifest.files, key=lambda f: (f["shard"], f["seq_lo"]))
    # The next file is read, checksummed and decoded (a thread, without the GIL for the
    # most part) while this one is written to Redis: two files in memory at most.
    with ThreadPoolExecutor(1, thread_name_prefix="claw-restore-read") as reads:
        ahead = reads.submit(read_verified, ns_dir, entries[0]) if entries else None
        try:
            for at, entry in enumerate(entries):
                assert ahead is not None
                table = ahead.result()
                more = at + 1 < len(entries)
                ahead = reads.submit(read_verified, ns_dir, entries[at + 1]) if more else None
                step = max(1, min(BATCH_ROWS, BATCH_BYTES * table.num_rows // max(1, table.nbytes)))
                for i, start in enumerate(range(0, table.num_rows, step)):
                    part = table.slice(start, step)
                    _restore_part(store, part, f"restore-{entry['sha256'][:24]}-{i}", result, ids)
                    tell(part.num_rows, part.nbytes)
                result.files += 1
        finally:
            if ahead is not None:
                ahead.cancel()
    if snapshots and ids is not None:
        cat = np.concatenate
        old = cat([o for o, _ in ids]) if ids else np.zeros(0, np.int64)
        new = cat([n for _, n in ids]) if ids else np.zeros(0, np.int64)
        result.snapshots = restore_snapshots(store, snapshots, old, new)
    return result


def create_scratch(ns_dir: Path, store: Store, capacity: int) -> None:
    """Create ``store``'s namespace to restore files of the archive ``ns_dir`` into (one
    shard of ``capacity`` slots, the archive's schema): a new namespace only
    (NamespaceError when it exists or was just dropped), so dropping it afterwards never
    touches another's data."""
    manifest = Manifest.load(ns_dir)
    if manifest is None:
        raise ArchiveError(f"no Claw archive in {ns_dir} (no {MANIFEST})")
    schema = None if manifest.schema is None else _with_orig_id(manifest.schema)
    store.create(capacity, 1, schema, new=True)


def restore_files(
    ns_dir: Path, store: Store, files: list[dict[str, Any]]
) -> tuple[np.ndarray, np.ndarray]:
    """Restore some files of an archive (``ns_dir``: its namespace directory; ``files``:
    manifest entries) into ``store``'s namespace (made by :func:`create_scratch`), without
    the snapshots; returns each row's archived id and its new id (-1: not stored)."""
    result, ids = RestoreResult(store.namespace), []
    for entry in sorted(files, key=lambda f: (f["shard"], f["seq_lo"])):
        table = read_verified(ns_dir, entry)
        step = max(1, min(BATCH_ROWS, BATCH_BYTES * table.num_rows // max(1, table.nbytes)))
        for i, start in enumerate(range(0, table.num_rows, step)):
            batch_id = f"restore-{entry['sha256'][:24]}-{i}"
            _restore_part(store, table.slice(start, step), batch_id, result, ids)
    cat = np.concatenate
    old = cat([o for o, _ in ids]) if ids else np.zeros(0, np.int64)
    new = cat([n for _, n in ids]) if ids else np.zeros(0, np.int64)
    return old, new


def _with_orig_id(schema: dict[str, Any]) -> Schema:
    s = Schema.from_dict(schema)
    return s if ORIG_ID in s.tags else Schema(fields=s.fields, tags={**s.tags, ORIG_ID: "num"})


def read_verified(ns_dir: Path, entry: dict[str, Any]) -> pa.Table:
    path = ns_dir / entry["path"]
    if not path.exists():
        raise ArchiveError(f"{path} is in the manifest but missing")
    with open(path, "rb") as f:
        data = f.read()
        drop_cached(f.fileno())
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise ArchiveError(
            f"{path}: SHA-256 {digest} does not match the manifest's {entry['sha256']} "
            "(the file is damaged or was replaced)"
        )
    table = pq.read_table(pa.BufferReader(data))
    if table.num_rows != entry["rows"]:
        raise ArchiveError(f"{path}: {table.num_rows} rows, the manifest says {entry['rows']}")
    return table


def _restore_part(
    store: Store,
    table: pa.Table,
    batch_id: str,
    result: RestoreResult,
    ids_seen: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> None:
    try:
        rows = from_table(table)
    except (KeyError, ValueError, TypeError, pa.ArrowException) as e:
        raise ArchiveError(f"batch {batch_id}: not a readable Claw archive table ({e})") from None
    if TAG_PREFIX + ORIG_ID not in rows.nums:
        rows = replace(rows, nums={**rows.nums, TAG_PREFIX + ORIG_ID: rows.id.astype(np.float64)})
    schema = Schema.from_dict(table_meta(table.schema)["schema"])
    batch = to_batch(rows, schema, batch_id)
    problem = batch_problem(batch)
    if problem:
        raise ArchiveError(f"batch {batch_id}: {problem}")
    ids = _commit_in_place(store, batch, rows.timestamp, result)
    if ids_seen is not None:  # archived id -> new id, for the snapshots
        ids_seen.append((rows.id.astype(np.int64), ids))
    stored = ids >= 0
    quality = rows.strs["quality"]
    for code, value in enumerate(quality.values):
        sel = stored & (quality.index == code)
        if sel.any():
            store.curate(ids[sel], quality=value)
    untrainable = stored & ~rows.trainable
    if untrainable.any():
        store.curate(ids[untrainable], trainable=False)


def _commit_in_place(
    store: Store, batch: StepBatch, timestamps: np.ndarray, result: RestoreResult
) -> np.ndarray:
    """Commit per shard, fixed-shape payloads written in place first (pipelined SETRANGE
    into freshly allocated slots, as the Ingestor does for large batches: copying them
    through the commit script's arguments runs at a fraction of the speed). Returns the
    id of each row (-1: not stored)."""
    schema = store.ensure_schema(batch.schema())
    fixed = {  # compressed fields are frames in hashes: the commit stores them as they are
        k: spec for k, spec in schema.fields.items() if not spec.ragged and spec.codec is None
    }
    shards = store.shards_of(batch)
    ids = np.full(batch.n, -1, np.int64)
    for shard in np.unique(shards).tolist():
        rows = np.flatnonzero(shards == shard)
        part = batch if len(rows) == batch.n else batch.take(rows)
        part.batch_id = f"{batch.batch_id}.s{shard}"
        sizes = {k: spec.row_bytes for k, spec in fixed.items()}
        seq0, state = store.allocate(shard, part.batch_id, part.n, sizes)
        if state in ("new", "alloc"):  # not committed yet (a replay finds "done")
            store.place(shard, seq0, {k: part.fields[k] for k in fixed})
        part.fields = dict(part.fields)
        for k, spec in fixed.items():
            part.fields[k] = Placed(np.dtype(spec.dtype), (part.n, *spec.shape))
        res = store.commit(part, now=timestamps[rows])
        ids[rows] = res.ids
        result.rows += res.committed
        result.replayed += res.replayed
        result.expired += res.expired
    return ids
