"""``as_of``: a recipe that samples a snapshot of its namespace (``claw snapshot``).

Its sources see the index's columns with the snapshot's state laid over them: ``alive``
only on rows that still hold a step the snapshot had (the same id, live then and now:
evicted steps cannot come back, steps committed since are not there), and the snapshot's
trainable bit, quality, priorities and free tags on them. Every other column is the
index's (steps never change in them). The overlay is kept current from the rows each
sync changes, as the samplers are.
"""

from __future__ import annotations

import time

import numpy as np

from claw_tasks.format.stepmeta import UNTRAINABLE
from claw_tasks.store import Store
from orchestrator.sampling.candidates import Columns, InsufficientData

RECHECK_S = 10.0
"""How often a sampler of a snapshot checks that it still exists (a deleted one stops
serving within this)."""


class AsOf:
    """The columns a recipe with ``as_of: name`` draws from (see the module docstring)."""

    def __init__(self, store: Store, name: str) -> None:
        self.store, self.name = store, name
        self.created = store.snapshot_info(name).created
        labels = store.labels(name)
        self.ids = np.where(labels.alive, labels.ids, -1)
        self.untrainable = np.where(labels.untrainable, UNTRAINABLE, 0).astype(np.uint8)
        self.fixed = store.as_of_columns(labels)
        self.steps = int(labels.alive.sum())
        self.alive: np.ndarray | None = None
        self.flags: np.ndarray | None = None
        self._checked = time.monotonic()

    def columns(self, cols: Columns, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The overlay over ``cols`` (the index's), updated on ``rows`` (None: whole)."""
        if self.alive is None or self.flags is None or rows is None:
            self.alive = cols["alive"] & (cols["id"] == self.ids)
            self.flags = (cols["flags"] & np.uint8(~UNTRAINABLE & 0xFF)) | self.untrainable
        elif len(rows):
            self.alive[rows] = cols["alive"][rows] & (cols["id"][rows] == self.ids[rows])
            self.flags[rows] = (cols["flags"][rows] & np.uint8(~UNTRAINABLE & 0xFF)) | (
                self.untrainable[rows]
            )
        return {**cols, **self.fixed, "alive": self.alive, "flags": self.flags}

    def check(self, source: str, need: int) -> None:
        """Raise InsufficientData once the snapshot is gone (looked up every RECHECK_S)."""
        if time.monotonic() - self._checked < RECHECK_S:
            return
        self._checked = time.monotonic()
        found = {s.name: s.created for s in self.store.snapshots()}
        if found.get(self.name) != self.created:
            raise InsufficientData(
                source, 0, need, f"as_of: snapshot {self.name!r} was deleted or taken again"
            )
