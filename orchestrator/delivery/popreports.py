"""What a client's pops report to Redis in the pipeline of its next pop: batches popped,
unreadable queue items skipped and seconds waited on an empty queue (the recipe's
counters), and the lineage entries its trainer declared (:mod:`~orchestrator.delivery.
lineage`). Held here until then, so a pop pays no round trip of its own for them."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from orchestrator.delivery.lineage import LineageLog, Replayable, Traced, record
from orchestrator.delivery.registry import POPPED, SKIPPED, WAIT_S, Registry

LINEAGE_PENDING = 256
"""Lineage entries a client holds before it sends them without waiting for a pop."""


class PopReports:
    """A client's pending counters and lineage entries; thread-safe (a pop, a flush or a
    read-ahead's trainer on another thread)."""

    def __init__(self, registry: Registry, lineage: LineageLog) -> None:
        self.registry, self.lineage = registry, lineage
        self._popped: dict[str, int] = {}
        self._skipped: dict[str, int] = {}
        self._waited: dict[str, float] = {}  # seconds pops waited on an empty queue
        self._counting = threading.Lock()  # the counters: a pop, a flush from another thread
        # Entries sent with the next pop, as (recipe, recipe version, policy, ids, time):
        # encoded there, so a read-ahead's trainer, which declares batches from its own
        # thread while the read-ahead's pops drain the deque, pays only the append.
        self._lineage: collections.deque[tuple[str, int, Any, np.ndarray, float, Replayable]] = (
            collections.deque()
        )
        self._logged_skip: set[str] = set()

    def popped(self, name: str) -> None:
        with self._counting:
            self._popped[name] = self._popped.get(name, 0) + 1

    def waited(self, name: str, seconds: float) -> None:
        with self._counting:
            self._waited[name] = self._waited.get(name, 0.0) + seconds

    def skipped(self, name: str) -> bool:
        """Count an unreadable queue item of recipe ``name``; True for its first one here
        (the client logs that one only)."""
        with self._counting:
            self._skipped[name] = self._skipped.get(name, 0) + 1
        first = name not in self._logged_skip
        self._logged_skip.add(name)
        return first

    def trained(
        self, name: str, batch: Traced, policy_version: Any, at: float | None = None
    ) -> bool:
        """Hold one lineage entry (of time ``at``, default now); True once
        ``LINEAGE_PENDING`` wait (send them now)."""
        at = time.time() if at is None else at
        replay = Replayable.of(batch)
        self._lineage.append((name, batch.recipe_version, policy_version, batch.ids, at, replay))
        return len(self._lineage) >= LINEAGE_PENDING

    def pending(self) -> bool:
        return bool(self._popped or self._skipped or self._lineage or self._waited)

    def queue(self, pipe: Any) -> None:
        """Queue the counters and the entries held so far on ``pipe`` (and forget them)."""
        with self._counting:
            popped, skipped, waited = self._popped, self._skipped, self._waited
            self._popped, self._skipped, self._waited = {}, {}, {}
        for counts, field in ((popped, POPPED), (skipped, SKIPPED)):
            for name, k in counts.items():
                pipe.hincrby(self.registry.counters(name), field, k)
        for name, seconds in waited.items():  # claw_prefetch_wait_seconds_total
            pipe.hincrbyfloat(self.registry.counters(name), WAIT_S, seconds)
        while True:  # popleft: entries appended meanwhile wait for the next pop
            try:
                name, version, policy, ids, at, replay = self._lineage.popleft()
            except IndexError:
                return
            self.lineage.queue(pipe, record(name, version, policy, ids, at, replay))
