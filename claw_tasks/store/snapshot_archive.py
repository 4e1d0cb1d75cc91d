"""Snapshots in and out of the nightly archive: :meth:`SnapshotArchive.export_snapshot`
writes one as a self-contained msgpack document, :class:`Exported` reads such a document
back (untrusted: a file), and :meth:`SnapshotArchive.import_snapshot` records its state,
laid over a restored namespace, as a snapshot again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.store.config import NamespaceConfig
from claw_tasks.store.core import StoreCore
from claw_tasks.store.labels import Labels
from claw_tasks.store.snapshot_format import (
    SnapshotError,
    SnapshotInfo,
    check_name,
    decode_labels,
    info_of,
    pack_column,
)
from claw_tasks.store.snapshots import Snapshots


@dataclass(frozen=True)
class Exported:
    """A snapshot as the nightly archive keeps it (:meth:`SnapshotArchive.export_snapshot`),
    read back: its source namespace, name, time, state (over the source's layout and
    ids) and ``extra``."""

    namespace: str
    name: str
    created: float
    labels: Labels
    extra: dict[str, Any]

    @classmethod
    def from_bytes(cls, raw: bytes) -> Exported:
        """Parse an exported document (untrusted: a file); raises SnapshotError."""
        try:
            doc = unpackb(raw)
            h = doc["header"]
            cfg = NamespaceConfig.from_bytes(h["config"], str(doc["namespace"]))
            shards = [{str(k): v for k, v in part.items()} for part in doc["shards"]]
            if len(shards) != cfg.n_shards or len(h["seqs"]) != cfg.n_shards:
                raise ValueError("shard count does not match its config")
            labels = decode_labels(h, cfg, shards)
            return cls(doc["namespace"], check_name(doc["name"]), h["created"], labels, h["extra"])
        except SnapshotError:
            raise
        except Exception as e:  # a damaged or foreign file: say which part, never crash
            raise SnapshotError(f"not an exported Claw snapshot: {type(e).__name__}: {e}") from None


class SnapshotArchive:
    """Export and import of a namespace's snapshots over a :class:`StoreCore`; finds a
    snapshot through the :class:`Snapshots` part."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    def export_snapshot(self, name: str) -> bytes:
        """The snapshot as one self-contained msgpack document (what the nightly archive
        keeps): ``namespace``, ``name``, the header and each shard's hash, as stored."""
        core = self.core
        info = Snapshots(core).snapshot_info(name)
        header = unpackb(core.r.hget(core.layout_keys.snapshots, name))
        shards = [
            {k.decode(): v for k, v in core.r.hgetall(core.layout_keys.snapshot(s, name)).items()}
            for s in range(info.config.n_shards)
        ]
        doc = {"namespace": core.namespace, "name": name, "header": header, "shards": shards}
        return packb(doc)

    def import_snapshot(
        self, name: str, labels: Labels, created: float, extra: Mapping[str, Any] | None = None
    ) -> SnapshotInfo:
        """Record ``labels`` (over this namespace's layout, its ids: ``labels.moved``) as
        snapshot ``name`` taken at ``created``: how a restore brings an archived snapshot
        back. Retention is not applied here (the next eviction pass does)."""
        check_name(name)
        core = self.core
        cfg = core.config(refresh=True)
        if (labels.n_shards, labels.cap) != (cfg.n_shards, cfg.cap):
            raise SnapshotError(f"snapshot {name!r}: laid over another layout of the namespace")
        if core.r.hexists(core.layout_keys.snapshots, name):
            raise SnapshotError(f"snapshot {name!r} of {core.namespace!r} exists: delete it first")
        size, steps = 0, int(labels.alive.sum())
        for shard, seq in enumerate(labels.seqs):
            n, at = min(cfg.cap, seq), shard * cfg.cap
            part = slice(at, at + n)
            cols = {
                "alive": labels.alive[part],
                "untrainable": labels.untrainable[part],
                "quality": labels.quality[part],
                "priority": labels.priority[part],
                **{c: v[part] for c, v in labels.tags.items()},
            }
            packed = {"seq": str(seq).encode()}
            packed.update((c, pack_column(c, v, cols["alive"])[0]) for c, v in cols.items())
            size += sum(len(v) for v in packed.values())
            core.r.hset(core.layout_keys.snapshot(shard, name), mapping=packed)
        header = {
            "created": float(created),
            "seqs": list(labels.seqs),
            "steps": steps,
            "bytes": size,
            "config": cfg.to_bytes(),
            "strings": {
                c: [[k, v] for k, v in sorted(t.items())] for c, t in labels.strings.items()
            },
            "extra": dict(extra or {}),
        }
        core.r.hset(core.layout_keys.snapshots, name, packb(header))  # listed once complete
        return info_of(name, header, core.namespace)
