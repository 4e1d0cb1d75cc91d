"""Ingest backpressure: Redis runs with ``maxmemory-policy noeviction``, so a full Redis
refuses writes. The producer sees it coming instead: above ``high_water`` of
``maxmemory`` an ``Ingestor`` blocks (``on_full="block"``, the default) until memory falls
below it again (eviction, a dropped namespace, a larger ``maxmemory``) or ``timeout``
passes, then raises; with ``on_full="raise"`` it raises at once. Nothing is dropped: the
batch stays with the Ingestor and is sent on the next flush."""

from __future__ import annotations

import time

from claw_tasks.connection.client import Client, memory

ON_FULL = ("block", "raise")
CHECK_EVERY_S = 0.5  # INFO memory is read at most this often while under the mark


class StoreFullError(RuntimeError):
    """Redis is near ``maxmemory``; nothing was sent (the steps are kept)."""


class MemoryGate:
    """Checks Redis memory against ``high_water * maxmemory`` before a batch is sent."""

    def __init__(
        self,
        r: Client,
        high_water: float = 0.95,
        on_full: str = "block",
        timeout: float = 300.0,
    ) -> None:
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, got {on_full!r}")
        if not 0 < high_water <= 1:
            raise ValueError(f"memory_high_water must be in (0, 1], got {high_water}")
        self.r, self.high_water, self.on_full, self.timeout = r, high_water, on_full, timeout
        self._next_check = 0.0

    def usage(self) -> tuple[int, int]:
        """(used_memory, maxmemory) of the fullest master (a cluster refuses a write when
        the master of its slot is full); maxmemory 0 means no limit."""
        return max(memory(self.r), key=lambda m: m[0] / m[1] if m[1] else 0.0)

    def wait(self) -> None:
        """Return once there is room; raise StoreFullError per the policy."""
        now = time.monotonic()
        if now < self._next_check:
            return
        deadline = now + self.timeout
        while True:
            used, limit = self.usage()
            if not limit or used < self.high_water * limit:
                self._next_check = time.monotonic() + CHECK_EVERY_S
                return
            if self.on_full == "raise" or time.monotonic() >= deadline:
                raise StoreFullError(
                    f"Redis memory {used / 2**20:,.0f} MiB is over {self.high_water:.0%} of "
                    f"maxmemory {limit / 2**20:,.0f} MiB; nothing was sent (the steps are "
                    "kept). Free memory with a retention policy (`claw retention`) or "
                    "`claw drop`, or raise maxmemory"
                )
            time.sleep(CHECK_EVERY_S)
