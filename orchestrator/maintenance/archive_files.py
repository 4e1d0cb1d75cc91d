"""The archive directory's files: atomic writes (temp name, fsync, rename, fsync the
directory), the manifest, and the Parquet files with their SHA-256 computed as they are
written. The layout and the crash-safety argument are in :mod:`orchestrator.maintenance.archive`."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
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


class _Hashing(io.RawIOBase):
    """A file that hashes what goes through it: the checksum without reading back."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.h.update(data)
        self.size += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.size


def write_parquet(
    ns_dir: Path, namespace: str, schema: Schema, shard: int, rows: StepRows, seqs: np.ndarray
) -> list[dict[str, Any]]:
    """Write ``rows`` (of ``shard``, at ``seqs``) as one file per commit date under
    ``ns_dir``, each atomically and hashed on the way; returns their manifest entries."""
    days = np.floor(rows.timestamp / 86400).astype(np.int64)
    out = []
    for day in np.unique(days).tolist():
        sel = np.flatnonzero(days == day)
        part = rows if len(sel) == rows.n else rows.take(sel)
        date = dt.datetime.fromtimestamp(day * 86400, dt.UTC).date().isoformat()
        lo, hi = int(seqs[sel[0]]), int(seqs[sel[-1]])
        rel = f"date={date}/part-{shard}-{lo}-{hi}.parquet"
        extra = {"namespace": namespace, "shard": shard, "seq_lo": lo, "seq_hi": hi}
        digest, size = write_table(ns_dir / rel, to_table(part, schema, extra), schema)
        entry = {
            "path": rel,
            "date": date,
            "shard": shard,
            "seq_lo": lo,
            "seq_hi": hi,
            "rows": part.n,
            "id_min": int(part.id.min()),
            "id_max": int(part.id.max()),
            "bytes": size,
            "sha256": digest,
        }
        out.append(entry)
    return out


def write_table(path: Path, table: pa.Table, schema: Schema) -> tuple[str, int]:
    """Write ``table`` to ``path`` atomically; its SHA-256 and size, computed on the way."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        sink = _Hashing(f)
        pq.write_table(table, pa.PythonFile(sink, mode="w"), **_parquet_options(schema, table))
        return sink.h.hexdigest(), sink.size


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
