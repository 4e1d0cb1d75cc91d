"""A snapshot as stored (laid out in :mod:`claw_tasks.store.snapshots`): its name rule, its
header as :class:`SnapshotInfo`, and its columns packed (bit-packed, zstd) and decoded back
into :class:`~claw_tasks.store.labels.Labels`. No Redis: the parts that take, list, export
and import snapshots share it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from claw_tasks.format.schema import tag_column
from claw_tasks.store.config import NamespaceConfig, NamespaceError
from claw_tasks.store.labels import Labels
from claw_tasks.store.layout import STR_TAG_DTYPE

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""A snapshot name (used with ``fullmatch``: ``$`` would pass a final newline)."""
NOW = "now"
"""Not a snapshot name: the namespace as it is (``claw diff NS A now``)."""
COLUMN_DTYPES = {"flags": np.dtype("u1"), "quality": STR_TAG_DTYPE, "priority": np.dtype("<u4")}
"""The mutable columns as a snapshot reads them: priorities (and numeric tags, ``<u8``) as
their stored bits, so a rollback compares and writes them back bit for bit."""
ZSTD_LEVEL = 1
"""Level 3 took 3x the time for the same size: random priorities barely compress, the
label columns are mostly zeros either way (docs/benchmarks.md, "Snapshots")."""


class SnapshotError(NamespaceError):
    """No such snapshot, or a name that cannot be one."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot's header: what ``claw snapshots`` lists."""

    name: str
    created: float
    seqs: tuple[int, ...]
    steps: int  # live steps at the snapshot
    bytes: int  # compressed columns stored
    config: NamespaceConfig
    extra: dict[str, Any] = field(default_factory=dict)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name == NOW:
        raise SnapshotError(
            f"snapshot name {name!r}: letters, digits, '_', '.', '-' (up to 128, not {NOW!r})"
        )
    return name


def info_of(name: str, h: Mapping[str, Any], namespace: str) -> SnapshotInfo:
    """The :class:`SnapshotInfo` of snapshot ``name``'s stored header ``h``."""
    cfg = NamespaceConfig.from_bytes(h["config"], namespace)
    return SnapshotInfo(
        name, h["created"], tuple(h["seqs"]), h["steps"], h["bytes"], cfg, h["extra"]
    )


def column_dtype(col: str, cfg: NamespaceConfig) -> np.dtype:
    """A snapshot column's dtype as stored."""
    if col in COLUMN_DTYPES:
        return COLUMN_DTYPES[col]
    kind = cfg.schema.tags[col[2:]] if cfg.schema else "num"
    return STR_TAG_DTYPE if kind == "str" else np.dtype("<u8")


def pack_column(col: str, arr: np.ndarray, alive: np.ndarray) -> tuple[bytes, list[int] | None]:
    """A snapshot column as stored (bits packed for the bool ones, zstd-compressed), and
    for a string column the codes its live rows hold (a rollback needs their strings)."""
    raw = np.packbits(arr).tobytes() if arr.dtype == bool else arr.tobytes()
    codes = None
    if arr.dtype == STR_TAG_DTYPE:
        held = arr[alive]
        top = int(held.max()) if len(held) else 0
        small = int(held.min(initial=0)) >= 0 and top <= 4 * len(held)
        codes = np.flatnonzero(np.bincount(held)).tolist() if small else np.unique(held).tolist()
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw), codes


def decode_labels(
    h: Mapping[str, Any], cfg: NamespaceConfig, shards: list[dict[str, bytes]]
) -> Labels:
    """The :class:`Labels` of a snapshot's header and shard hashes (as stored)."""
    dctx = zstandard.ZstdDecompressor()
    cols: dict[str, list[np.ndarray]] = {}
    tags = [tag_column(t) for t in (cfg.schema.tags if cfg.schema else {})]
    for shard, got in enumerate(shards):
        n = min(cfg.cap, h["seqs"][shard])
        for col in ("alive", "untrainable", "quality", "priority", *tags):
            raw = dctx.decompress(got[col]) if col in got else b""
            if col in ("alive", "untrainable"):
                arr = np.unpackbits(np.frombuffer(raw, np.uint8))[:n].astype(bool)
            else:
                arr = np.frombuffer(raw, column_dtype(col, cfg))
            full = np.zeros(cfg.cap, arr.dtype)
            full[: len(arr)] = arr
            cols.setdefault(col, []).append(full)
    cat = np.concatenate
    strings = {c: {int(code): s for code, s in pairs} for c, pairs in h["strings"].items()}
    return Labels(
        cfg.n_shards,
        cfg.cap,
        tuple(h["seqs"]),
        cat(cols["alive"]),
        cat(cols["untrainable"]),
        cat(cols["quality"]),
        cat(cols["priority"]),
        {c: cat(cols[c]) for c in tags},
        strings,
    )
