"""Snapshots as the read path sees them: the store's (``claw_tasks.store.snapshots``:
labels, priorities, tags, watermarks, config) plus the registered recipes with their
params and their augmentation's normalisation statistics, which a rollback puts back too;
diffs restricted by a where filter; snapshots in the nightly archive, and back from it
with a restore (laid over the restored steps' new ids).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.labels import Diff, diff, moved
from claw_tasks.store.snapshot_archive import Exported
from claw_tasks.store.snapshot_format import SnapshotError, SnapshotInfo
from claw_tasks.store.snapshots import Rollback
from claw_tasks.where import Where
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.registry import Registry
from orchestrator.maintenance.archive_files import atomic_path
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.recipe.model import Recipe

SNAPSHOT_DIR = "_snapshots"
"""Where an archive keeps snapshots, beside the Parquet partitions (a name starting with
``_``: Parquet readers skip it)."""


@dataclass(frozen=True)
class RollbackReport:
    labels: Rollback
    restored: dict[str, int]  # recipe -> its new version, the snapshot's content
    bumped: dict[str, int]  # recipes registered since: kept, moved to a new version
    statistics: list[str]  # recipes whose normalisation statistics were put back

    def to_json(self) -> dict[str, Any]:
        lab = self.labels
        return {
            "changed": lab.changed,
            "evicted_since": lab.evicted,
            "added_since": lab.added,
            "dropped": lab.dropped,
            "recipes": self.restored,
            "bumped": self.bumped,
            "statistics": self.statistics,
        }


def take(store: Store, name: str) -> SnapshotInfo:
    """Snapshot the namespace with its recipes (content, version, params) and each one's
    normalisation statistics."""
    reg = Registry(store)
    recipes: dict[str, Any] = {}
    stats: dict[str, dict[str, bytes]] = {}
    for n in reg.names():
        entry = reg.get(n)
        if entry is None:
            continue
        recipes[n] = entry.recipe.model_dump(mode="json")
        raw = store.r.hgetall(reg.augment_stats(n))
        if raw:
            stats[n] = {k.decode(): v for k, v in raw.items()}
    return store.snapshot(name, extra={"recipes": recipes, "augment_stats": stats})


def rollback(
    store: Store, name: str, client: BatchClient, *, drop_new: bool = False
) -> RollbackReport:
    """Put labels, priorities and tags back (``Store.rollback``), then the recipes as the
    snapshot recorded them (each as a new version: queued batches go, a fill is forced)
    with their normalisation statistics; recipes registered since stay, moved to a new
    version too, since their queued batches were made with the labels rolled back."""
    info = store.snapshot_info(name)
    labels = store.rollback(name, drop_new=drop_new)
    saved: dict[str, Any] = info.extra.get("recipes", {})
    reg = Registry(store)
    restored, statistics = {}, []
    for n, data in saved.items():
        restored[n] = client.restore(Recipe.model_validate(data)).version
        stats = info.extra.get("augment_stats", {}).get(n)
        with store.r.pipeline(transaction=True) as pipe:
            pipe.delete(reg.augment_stats(n))
            if stats:
                pipe.hset(reg.augment_stats(n), mapping=stats)
                statistics.append(n)
            pipe.execute()
    bumped = {n: client.set_params(n).version for n in reg.names() if n not in saved}
    return RollbackReport(labels, restored, bumped, statistics)


def diff_states(store: Store, a: str, b: str, where: str | dict | None = None) -> Diff:
    """What changed from snapshot ``a`` to ``b`` (``now``: the namespace as it is), over the
    steps matching ``where`` as the namespace's metadata shows them now (a step whose slot
    was reused since is matched on its successor's)."""
    la, lb = store.labels(a), store.labels(b)
    rows = None
    if where:
        index, strings = synced_index(store)
        tags = dict(index.schema.tags) if index.schema else {}
        rows = Where(where, tags, strings.encode).mask(index.columns, {}, now=time.time())
        rows = np.asarray(rows, bool)
    return diff(la, lb, rows)


def archive_snapshots(store: Store, ns_dir: Path) -> list[str]:
    """Write each snapshot not yet in ``ns_dir/_snapshots`` (snapshots never change: one
    file each, ``<name>-<created>.msgpack``, atomically); returns the files written."""
    written = []
    for s in store.snapshots():
        path = ns_dir / SNAPSHOT_DIR / f"{s.name}-{s.created:.6f}.msgpack"
        if path.exists():
            continue
        with atomic_path(path) as tmp:
            tmp.write_bytes(store.export_snapshot(s.name))
        written.append(path.relative_to(ns_dir).as_posix())
    return written


@dataclass(frozen=True)
class RestoredSnapshot:
    """What a restore did with one archived snapshot."""

    name: str
    file: str
    steps: int  # of the snapshot's steps, restored with its labels
    missing: int  # not restored: never archived (the ring passed them first) or past the ring
    skipped: str | None = None  # why it was not brought back (a snapshot of that name exists)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def archived_snapshots(ns_dir: Path) -> list[Path]:
    """The snapshot files of an archive directory, oldest first (by their name's time)."""

    def created(p: Path) -> tuple[float, str]:
        stem, _, at = p.stem.rpartition("-")
        try:
            return float(at), stem
        except ValueError:
            return float("inf"), p.stem

    return sorted((ns_dir / SNAPSHOT_DIR).glob("*.msgpack"), key=created)


def restore_snapshots(
    store: Store, files: list[Path], old_ids: np.ndarray, new_ids: np.ndarray
) -> list[RestoredSnapshot]:
    """Bring archived snapshots back into ``store``'s namespace after a restore wrote
    their steps: ``old_ids`` (the ids the archive names) became ``new_ids`` (-1: not
    stored). Each keeps its name, time, recipes and statistics; its steps are the ones
    restored (:func:`claw_tasks.store.labels.moved`). A name already there is skipped
    (a restore run again finds its own)."""
    out = []
    now = store.labels()
    have = {s.name for s in store.snapshots()}
    for path in files:
        snap = Exported.from_bytes(path.read_bytes())
        rel = path.relative_to(path.parent.parent).as_posix()
        if snap.name in have:
            out.append(RestoredSnapshot(snap.name, rel, 0, 0, "a snapshot of that name exists"))
            continue
        labels, missing = moved(snap.labels, old_ids, new_ids, now)
        try:
            store.import_snapshot(snap.name, labels, snap.created, snap.extra)
        except SnapshotError as e:  # taken meanwhile under that name
            out.append(RestoredSnapshot(snap.name, rel, 0, 0, str(e)))
            continue
        have.add(snap.name)
        out.append(RestoredSnapshot(snap.name, rel, int(labels.alive.sum()), missing))
    return out
