"""Sampling rate limit in the spirit of Reverb's SampleToInsertRatio.

Sampling may proceed while ``inserted >= min_size`` and
``inserted * samples_per_insert - (sampled + rows) >= min_size * samples_per_insert -
error_buffer``. Inserts are never blocked (producers must not stall); when the ratio is
exceeded, prefetch waits instead of over-sampling. :class:`Room` is the fill's gate: this
limit and the queue's depth.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.delivery.registry import Registry
from orchestrator.recipe.model import Recipe
from orchestrator.recipe.options import RateLimit


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # "" when allowed

    def __bool__(self) -> bool:
        return self.allowed


def check(limit: RateLimit | None, inserted: int, sampled: float, rows: int) -> Verdict:
    """May ``rows`` more rows be sampled, given the steps inserted and rows sampled so far?"""
    if limit is None:
        return Verdict(True, "")
    if inserted < limit.min_size:
        return Verdict(False, f"waiting for min_size: {inserted} of {limit.min_size} steps")
    spi = limit.samples_per_insert
    room = inserted * spi - (sampled + rows) - (limit.min_size * spi - limit.error_buffer)
    if room < 0:
        return Verdict(
            False,
            f"samples_per_insert {spi} reached: {sampled:.0f} rows sampled for {inserted} "
            "steps inserted",
        )
    return Verdict(True, "")


class Room:
    """Whether a fill may make one more batch: its queue under ``prefetch.depth`` and the
    rate limit allowing ``batch_size`` more rows. Queue length, steps inserted and rows
    sampled are read once per fill (one round trip, :meth:`Registry.fill_state`) and
    tracked as batches are pushed; read again only before the rate limit would stop the
    fill (steps may have come meanwhile). ``last_state`` is the state the previous fill
    recorded."""

    def __init__(self, reg: Registry, recipe: Recipe) -> None:
        self.reg, self.recipe = reg, recipe
        self.length, self.inserted, self.sampled, self.last_state = reg.fill_state(recipe.name)
        self.fresh = True

    def why_not(self, made: int) -> str | None:
        """None when one more batch may be made after ``made``; else why not: ``""`` (the
        queue is full, or this fill made its depth) or ``"rate limited: ..."``."""
        depth, rows = self.recipe.prefetch.depth, self.recipe.batch_size
        while made < depth and self.length < depth:
            verdict = check(self.recipe.rate_limit, self.inserted, self.sampled, rows)
            if verdict:
                self.fresh = False
                return None
            if self.fresh:
                return f"rate limited: {verdict.reason}"
            self.length, self.inserted, self.sampled, _ = self.reg.fill_state(self.recipe.name)
            self.fresh = True
        return ""

    def pushed(self, length: int) -> None:
        """A batch was pushed and the queue is ``length`` long."""
        self.length, self.sampled = length, self.sampled + self.recipe.batch_size
