"""Replay: the batches that trained a policy, again, bit for bit (``claw replay``).

A lineage entry (:mod:`orchestrator.delivery.lineage`) records what made its batch beyond
the data: the step ids in the order the trainer got them, the importance weights and
source indexes, the seed the prefetch worker's augmentation drew from
(:func:`~orchestrator.transforms.augment.augment_rng`) and the recipe version, by the
digest under which the registry keeps its definition. :func:`replay` makes each batch
again from those and the steps: assembled as a draw of the same ids is (n-step returns,
sequence windows, frame stacks: :func:`~orchestrator.sampling.sample.read_drawn`),
augmented with that seed, collated as the worker collates. Nothing is drawn again: what
the sampler chose, and the weights it gave, are read back, not recomputed.

The steps come from Redis while they are stored there with every step their assembly
follows; else from the Parquet archive (``archive``, the directory ``claw archive`` wrote),
whose files holding them (and the files beside those in their shard, for the steps an
n-step return or a stack crosses into) are restored into a scratch namespace, dropped when
the replay ends. A row neither holds, or a batch whose recipe version is no longer kept
or whose entry records no seed, is reported (:class:`Missing`: which rows and why): a
batch is given back whole or not at all, never with a row made up.

Replayed as stored, not as of the draw: a step's payload never changes, but what can
change on a stored step (its priority, a reward or ``terminated`` set later by
``update_rewards``, reward tags, its curation label) is read as it is now, and an n-step
return that stopped at a step not yet stored when it was drawn (a producer that stores
``next_obs`` with each step) is assembled from what is stored now; neither is detected.
A ``running_normalize`` op's statistics are not recorded per batch: such recipes are
reported, not replayed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError, Store
from orchestrator.delivery.collate import cast, collate
from orchestrator.delivery.lineage import Entry, LineageLog, digest
from orchestrator.delivery.registry import Registry
from orchestrator.maintenance.archive_files import Manifest
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.maintenance.restore import create_scratch, find_archive, restore_files
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.sample import Unassembled, read_drawn
from orchestrator.transforms.augment import AugmentPlan, augment_rng, build_pipelines

__all__ = ["MAX_RESTORE", "Missing", "Replayed", "Replayer", "replay", "scratch_name"]

MAX_RESTORE = 1 << 30
"""Archive bytes (Parquet, as the manifest counts them) a replay restores into Redis at
most at once: a batch drawn across a large archive needs most of its files, and the
scratch namespace lives beside the data in the same Redis."""
SCRATCH_TRIES = 4
"""Names tried for a scratch namespace before giving up (each taken only if it is new)."""


@dataclass(frozen=True)
class Missing:
    """Rows of a batch that cannot be replayed exactly: their positions in the batch, their
    step ids, and why."""

    rows: np.ndarray
    ids: np.ndarray
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows.tolist(), "ids": self.ids.tolist(), "reason": self.reason}


@dataclass
class Replayed:
    """One lineage entry replayed: its batch as the trainer got it (None when a row is
    missing), where its steps came from (``"redis"`` or ``"archive"``), and what is
    missing."""

    entry: Entry
    batch: Batch | None
    source: str = ""
    missing: list[Missing] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.batch is not None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.entry.to_json(),
            "exact": self.exact,
            "source": self.source,
            "missing": [m.to_json() for m in self.missing],
        }


def replay(
    namespace_or_store: str | Store,
    *,
    policy: Any = None,
    start: str = "-",
    end: str = "+",
    archive: Path | str | None = None,
    redis_url: str | None = None,
    max_restore: int = MAX_RESTORE,
) -> Iterator[Replayed]:
    """The batches declared as training ``policy`` (or every entry from ``start`` to
    ``end``, stream ids), oldest first, made again from Redis or ``archive``, restoring at
    most ``max_restore`` bytes of its files at once (``redis_url`` defaults to
    ``CLAW_REDIS_URL``)."""
    store = namespace_or_store
    if not isinstance(store, Store):
        store = Store(redis_url or get_settings().redis_url, store)
    entries = LineageLog(store).replayable(policy, start, end)
    with Replayer(store, archive, max_restore) as replayer:
        for entry in entries:
            yield replayer.replay(entry)


class Replayer:
    """Replays entries of one namespace; holds the scratch namespace the archive's files
    are restored into (dropped by :meth:`close`)."""

    def __init__(
        self,
        store: Store,
        archive: Path | str | None = None,
        max_restore: int = MAX_RESTORE,
    ) -> None:
        if max_restore < 1:
            raise ValueError(f"max_restore must be >= 1 byte, not {max_restore}")
        self.store, self.registry = store, Registry(store)
        self.max_restore = max_restore
        self.ns_dir = None if archive is None else find_archive(archive)
        self.manifest = None if self.ns_dir is None else Manifest.load(self.ns_dir)
        self.scratch: Store | None = None
        self.capacity = 0  # the scratch namespace's, in steps
        self.rows = 0  # steps restored into it
        self.restored: dict[str, dict[str, Any]] = {}  # its archive files, by path
        self.old = np.zeros(0, np.int64)  # archived ids restored, sorted ...
        self.new = np.zeros(0, np.int64)  # ... and their ids in the scratch namespace
        self.recipes: dict[str, tuple[Recipe | None, AugmentPlan | None]] = {}

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the scratch namespace, if one was made."""
        if self.scratch is not None:
            drop_namespace(self.store.r, self.scratch.namespace)
            self.scratch.clear_tombstone()
            self.scratch = None
        self.restored, self.rows = {}, 0
        self.old, self.new = np.zeros(0, np.int64), np.zeros(0, np.int64)

    def replay(self, entry: Entry) -> Replayed:
        """One entry's batch, or what keeps it from being replayed exactly."""
        ids = entry.batch_ids
        everything = np.arange(len(ids))

        def refused(reason: str) -> Replayed:
            return Replayed(entry, None, missing=[Missing(everything, ids, reason)])

        if entry.recipe_digest is None:
            return refused("the entry records no recipe version (written without one)")
        if digest(ids) != entry.digest:  # the order recorded gives the ids as popped
            return refused("the entry's row order does not match its digest of the ids")
        recipe, plan = self._recipe(entry.recipe_digest)
        if recipe is None:
            return refused(
                f"recipe {entry.recipe!r} version {entry.recipe_version} "
                f"({entry.recipe_digest}) is no longer kept"
            )
        why = unsupported(recipe, plan)
        if why:
            return refused(why)
        if plan is not None and entry.seed is None:
            return refused("the entry records no augmentation seed (a part of a batch)")
        got = read_drawn(self.store, recipe, ids)
        if isinstance(got, Batch):
            return Replayed(entry, self._finish(entry, recipe, plan, got), "redis")
        kept, source = self._from_archive(recipe, ids, got)
        if not isinstance(kept, Batch):
            return Replayed(entry, None, missing=kept)
        return Replayed(entry, self._finish(entry, recipe, plan, kept), source)

    def _recipe(self, digest: str) -> tuple[Recipe | None, AugmentPlan | None]:
        if digest not in self.recipes:
            recipe = self.registry.definition(digest)
            plan = None
            if recipe is not None and recipe.augment:
                plan = build_pipelines(recipe.augment)
            self.recipes[digest] = (recipe, plan)
        return self.recipes[digest]

    def _from_archive(
        self, recipe: Recipe, ids: np.ndarray, redis: Unassembled
    ) -> tuple[Batch | list[Missing], str]:
        """The batch assembled from the archive's copies of its steps, or its missing rows
        (those Redis cannot assemble and the archive cannot either)."""
        if self.ns_dir is None or self.manifest is None:
            return _missing(
                ids,
                redis,
                "no longer stored in Redis (evicted), and no archive was given",
                "a step its assembly follows was evicted, and no archive was given",
            ), ""
        over = self._restore(ids)
        if over:
            return [Missing(np.arange(len(ids)), ids, over)], ""
        at = np.searchsorted(self.old, ids)
        at = np.minimum(at, max(len(self.old) - 1, 0))
        found = (self.old[at] == ids) if len(self.old) else np.zeros(len(ids), bool)
        if not found.all():  # the batch is replayed from one of them, not pieced together
            unarchived = ~found
            gone = redis.gone[unarchived[redis.gone]]
            incomplete = redis.incomplete[unarchived[redis.incomplete]]
            if not len(gone) and not len(incomplete):
                rows = np.flatnonzero(unarchived)
                why = "in Redis but not in the archive, which holds the batch's other rows"
                return [Missing(rows, ids[rows], why)], ""
            return _missing(
                ids,
                Unassembled(gone, incomplete),
                "evicted from Redis and never archived",
                "a step its assembly follows was evicted from Redis and never archived",
            ), ""
        assert self.scratch is not None
        got = read_drawn(self.scratch, recipe, self.new[at])
        if not isinstance(got, Batch):
            return _missing(
                ids,
                got,
                "not restored from the archive",
                "a step its n-step return, window, stack or next_obs follows is not archived",
            ), ""
        got.ids = ids
        return got, "archive"

    def _restore(self, ids: np.ndarray) -> str:
        """Restore the archive files holding ``ids``, and the files before and after each
        in its shard, into the scratch namespace (each file once); the files restored for
        earlier batches are dropped first when keeping them would pass ``max_restore``.
        Returns why the batch's files are not restored ("" when they are)."""
        assert self.manifest is not None and self.ns_dir is not None
        n = self.manifest.n_shards
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for f in self.manifest.files:
            by_shard.setdefault(int(f["shard"]), []).append(f)
        need: dict[str, dict[str, Any]] = {}
        for shard, files in by_shard.items():
            files.sort(key=lambda f: int(f["seq_lo"]))
            seqs = ids[ids % n == shard] // n
            if not len(seqs):
                continue
            lo = np.array([int(f["seq_lo"]) for f in files])
            hi = np.array([int(f["seq_hi"]) for f in files])
            k = np.searchsorted(lo, seqs, side="right") - 1
            hit = np.unique(k[(k >= 0) & (seqs <= hi[np.maximum(k, 0)])])
            for j in np.unique(np.concatenate([hit - 1, hit, hit + 1])).tolist():
                if 0 <= j < len(files):
                    need[files[j]["path"]] = files[j]
        size = sum(int(f["bytes"]) for f in need.values())
        if size > self.max_restore:
            return (
                f"its archive files take {size:,} bytes, more than max_restore "
                f"({self.max_restore:,}) allows restoring into Redis"
            )
        held = sum(int(f["bytes"]) for p, f in self.restored.items() if p not in need)
        if held + size > self.max_restore:
            self.close()  # the earlier batches' files make room for this one's
        want = {p: f for p, f in need.items() if p not in self.restored}
        if not want:
            return ""
        rows = sum(int(f["rows"]) for f in want.values())
        if self.scratch is not None and self.rows + rows > self.capacity:
            # Its ring would overwrite steps restored before: restore them all again, into
            # a scratch namespace twice the size.
            want.update(self.restored)
            rows = sum(int(f["rows"]) for f in want.values())
            self.close()
        if self.scratch is None:
            self.scratch, self.capacity = self._new_scratch(2 * rows), 2 * rows
            self.restored, self.rows = {}, 0
            self.old, self.new = np.zeros(0, np.int64), np.zeros(0, np.int64)
        old, new = restore_files(self.ns_dir, self.scratch, list(want.values()))
        self.restored.update(want)
        self.rows += rows
        keep = new >= 0
        old = np.concatenate([self.old, old[keep]])
        new = np.concatenate([self.new, new[keep]])
        order = np.argsort(old, kind="stable")
        self.old, self.new = old[order], new[order]
        return ""

    def _new_scratch(self, capacity: int) -> Store:
        """A namespace of its own, created here (never one that exists: its name is random
        and its creation exclusive), which :meth:`close` drops."""
        assert self.ns_dir is not None
        for _ in range(SCRATCH_TRIES):
            scratch = Store(self.store.r, scratch_name(self.store.namespace))
            try:
                create_scratch(self.ns_dir, scratch, capacity)
            except NamespaceError:
                continue
            return scratch
        raise NamespaceError(f"no free scratch namespace for {self.store.namespace!r}")

    def _finish(
        self, entry: Entry, recipe: Recipe, plan: AugmentPlan | None, drawn: Batch
    ) -> Batch:
        """The batch as the prefetch worker delivered it: the recorded weights and
        sources, augmented with the recorded seed, collated."""
        n = len(drawn)
        weights = np.ones(n, np.float32) if entry.weights is None else entry.weights
        source_index = np.zeros(n, np.int16) if entry.source_index is None else entry.source_index
        fields = drawn.fields
        if plan is not None:
            assert entry.seed is not None
            fields = plan.apply(fields, augment_rng(entry.seed))
        arrays = collate(fields)
        if recipe.layout is not None:
            arrays = cast(arrays, recipe.layout.dtypes)
        return Batch(
            arrays,  # type: ignore[arg-type]  # collate's arrays: the fields as numpy arrays
            drawn.ids,
            weights,
            source_index.astype(np.int16),
            tuple(s.name for s in recipe.sources),
            entry.recipe_version,
            drawn.meta,
            seed=entry.seed,
            recipe_digest=entry.recipe_digest,
        )


def scratch_name(namespace: str) -> str:
    """A name for a scratch namespace of ``namespace``'s replay: ``<ns>.replay-<64 random
    bits>``."""
    return f"{namespace}.replay-{secrets.token_hex(8)}"


def _missing(ids: np.ndarray, rows: Unassembled, gone: str, incomplete: str) -> list[Missing]:
    """The rows of ``rows`` as :class:`Missing` entries, one per reason."""
    return [
        Missing(at, ids[at], why)
        for at, why in ((rows.gone, gone), (rows.incomplete, incomplete))
        if len(at)
    ]


def unsupported(recipe: Recipe, plan: AugmentPlan | None) -> str:
    """Why batches of ``recipe`` cannot be replayed exactly ("" when they can)."""
    kinds = [
        k
        for k, on in (
            ("group", recipe.grouped),
            ("token", recipe.tokens is not None),
            ("rollout", recipe.rollout is not None),
            ("joint", getattr(recipe, "joint", None) is not None),
            ("nearest", recipe.nearest is not None),
        )
        if on
    ]
    if kinds:
        return f"replay does not assemble {kinds[0]} batches"
    if plan is not None and any(p.running_ops() for p in plan.pipelines.values()):
        return "running_normalize statistics are not recorded per batch"
    return ""
