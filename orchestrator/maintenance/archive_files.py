"""The archive directory's files: atomic writes (temp name, fsync, rename, fsync the
directory), the manifest, and the Parquet files with their SHA-256. The layout and the
crash-safety argument are in :mod:`orchestrator.maintenance.archive`."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import mmap
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from claw_tasks.format.schema import Schema
from orchestrator.maintenance.steptable import LIST_MAX_ITEMS, StepRows, keeps_frames, to_table

MANIFEST = "_manifest.json"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path (hidden, in ``path``'s directory) to write; once written: fsync,
    rename onto ``path``, fsync the directory. ``path`` appears complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@dataclass
class Manifest:
    """What an archive directory holds; written after its files, before the watermark."""

    namespace: str
    n_shards: int
    created: float  # the namespace's creation time: a dropped and re-created one differs
    schema: dict[str, Any] | None = None
    spaces: dict[str, str] | None = None
    watermarks: dict[int, int] = field(default_factory=dict)  # shard -> seq reached
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(f["rows"] for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "namespace": self.namespace,
            "n_shards": self.n_shards,
            "created": self.created,
            "schema": self.schema,
            "spaces": self.spaces,
            "rows": self.rows,
            "watermarks": {str(k): v for k, v in sorted(self.watermarks.items())},
            "files": self.files,
        }

    @classmethod
    def load(cls, ns_dir: Path) -> Manifest | None:
        path = ns_dir / MANIFEST
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return cls(
            namespace=d["namespace"],
            n_shards=d["n_shards"],
            created=d["created"],
            schema=d.get("schema"),
            spaces=d.get("spaces"),
            watermarks={int(k): int(v) for k, v in d["watermarks"].items()},
            files=list(d["files"]),
        )

    def save(self, ns_dir: Path) -> None:
        with atomic_path(ns_dir / MANIFEST) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=1))


def namespace_dir(root: Path, namespace: str) -> Path:
    return Path(root) / f"ns={namespace}"


@dataclass
class PendingFile:
    """A Parquet file written to a hidden temp name beside ``path``, not durable yet:
    :meth:`finish` (which another thread may run while the next file is encoded) makes it
    so; :meth:`discard` deletes it. A crash in between leaves only the temp file, which
    the next archive run deletes."""

    path: Path
    tmp: Path
    entry: dict[str, Any] = field(default_factory=dict)  # its manifest entry, but checksum

    def finish(self) -> dict[str, Any]:
        """Checksum, fsync, rename onto ``path``, fsync the directory; the manifest entry.
        The SHA-256 is of the file's bytes as the page cache holds them (mapped, not
        copied): what a reader will get, not what the writer meant to send."""
        try:
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
                    digest = hashlib.sha256(view).hexdigest()  # (without the GIL)
                os.fsync(fd)
                drop_cached(fd)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        return {**self.entry, "bytes": size, "sha256": digest}

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def drop_cached(fd: int) -> None:
    """An archive file out of the page cache (once durable, or read by a restore): it is
    read once, rarely and much later, and ~1 GB a night of cached files would push out
    pages that are read again (and each new file would take fresh memory where it could
    reuse the last one's; on a VM whose memory is backed lazily that alone costs ~4x the
    CPU of the write: docs/benchmarks.md)."""
    if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the cache is the OS's call
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_parquet(
    ns_dir: Path, namespace: str, schema: Schema, shard: int, rows: StepRows, seqs: np.ndarray
) -> list[PendingFile]:
    """Write ``rows`` (of ``shard``, at ``seqs``) as one file per commit date under
    ``ns_dir``, to temp names: each is in place once :meth:`PendingFile.finish` ran."""
    days = np.floor(rows.timestamp / 86400).astype(np.int64)
    out: list[PendingFile] = []
    try:
        for day in np.unique(days).tolist():
            sel = np.flatnonzero(days == day)
            part = rows if len(sel) == rows.n else rows.take(sel)
            date = dt.datetime.fromtimestamp(day * 86400, dt.UTC).date().isoformat()
            lo, hi = int(seqs[sel[0]]), int(seqs[sel[-1]])
            rel = f"date={date}/part-{shard}-{lo}-{hi}.parquet"
            extra = {"namespace": namespace, "shard": shard, "seq_lo": lo, "seq_hi": hi}
            pending = write_pending(ns_dir / rel, to_table(part, schema, extra), schema)
            pending.entry = {
                "path": rel,
                "date": date,
                "shard": shard,
                "seq_lo": lo,
                "seq_hi": hi,
                "rows": part.n,
                "id_min": int(part.id.min()),
                "id_max": int(part.id.max()),
            }
            out.append(pending)
    except BaseException:
        for pending in out:
            pending.discard()
        raise
    return out


def write_pending(path: Path, table: pa.Table, schema: Schema) -> PendingFile:
    """Write ``table`` to a temp name beside ``path`` (Arrow's own file writer: the
    encoding and the writes run without the GIL and without a copy through Python)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            pq.write_table(table, sink, **_parquet_options(schema, table))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return PendingFile(path, tmp)


def write_table(path: Path, table: pa.Table, schema: Schema) -> tuple[str, int]:
    """Write ``table`` to ``path`` atomically; its SHA-256 and size."""
    done = write_pending(path, table, schema).finish()
    return done["sha256"], done["bytes"]


def _parquet_options(schema: Schema, table: pa.Table) -> dict[str, Any]:
    """zstd, but snappy for large binary rows (images: near GB/s, and it gives up fast on
    data that does not compress) and none for the frames of compressed fields (compressed
    already). Dictionaries for strings only, statistics for metadata only: hashing or
    comparing payload rows costs more than the whole write."""
    codecs, strings, stats = {}, [], []
    obs = schema.fields.get("obs")
    for f in table.schema:
        spec = schema.fields.get(f.name)
        big = spec is not None and not spec.ragged and spec.row_items > LIST_MAX_ITEMS
        codecs[f.name] = "snappy" if big else "zstd"
        framed = obs if f.name == "next_obs" else spec
        if framed is not None and keeps_frames(framed):
            codecs[f.name] = "none"
        if pa.types.is_dictionary(f.type) or pa.types.is_string(f.type):
            strings.append(f.name)
        if spec is None and f.name not in ("next_obs", "info"):
            stats.append(f.name)
    return {"compression": codecs, "use_dictionary": strings, "write_statistics": stats}
