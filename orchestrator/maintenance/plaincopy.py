"""A plain copy of an archive: compressed fields decoded, for tools that know no codec.

An archive keeps a compressed field's frames as the store held them (PNG, zstd, ...:
:mod:`orchestrator.maintenance.steptable`), which DuckDB, Polars or pandas read as opaque
bytes. The plain copy has the same files, rows and columns, with those fields in the
columns a raw field has (fixed-size binary pixels, lists), no codec in its metadata and
its own manifest, so it reads as a plain Parquet dataset (and restores into a namespace of
raw fields). Each source file is verified against the manifest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from claw_tasks.format.schema import Schema
from orchestrator.maintenance.archive_files import MANIFEST, Manifest, namespace_dir, write_table
from orchestrator.maintenance.restore import ArchiveError, find_archive, read_verified
from orchestrator.maintenance.steptable import plain, plain_schema


@dataclass
class PlainCopyResult:
    directory: str
    rows: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def plain_copy(archive: Path | str, to: Path | str) -> PlainCopyResult:
    """Write the plain copy of the archive at ``archive`` (its directory or the one
    ``ns=<namespace>`` under it) to ``to/ns=<namespace>/``, which must not hold one yet."""
    src = find_archive(archive)
    manifest = Manifest.load(src)
    assert manifest is not None
    out = namespace_dir(Path(to), manifest.namespace)
    if (out / MANIFEST).exists() or out.resolve() == src.resolve():
        raise ArchiveError(f"{out} holds an archive already: give --to another directory")
    schema = None if manifest.schema is None else plain_schema(Schema.from_dict(manifest.schema))
    result = PlainCopyResult(str(out))
    entries = []
    for entry in manifest.files:
        table = plain(read_verified(src, entry))
        assert schema is not None
        digest, size = write_table(out / entry["path"], table, schema)
        entries.append({**entry, "bytes": size, "sha256": digest})
        result.files.append(entry["path"])
        result.rows += entry["rows"]
        result.bytes += size
    copy = Manifest(
        namespace=manifest.namespace,
        n_shards=manifest.n_shards,
        created=manifest.created,
        schema=None if schema is None else schema.to_dict(),
        spaces=manifest.spaces,
        watermarks=dict(manifest.watermarks),
        files=entries,
    )
    copy.save(out)
    return result
