"""Sampling rate limit in the spirit of Reverb's SampleToInsertRatio.

Sampling may proceed while ``inserted >= min_size`` and
``inserted * samples_per_insert - (sampled + rows) >= min_size * samples_per_insert -
error_buffer``. Inserts are never blocked (producers must not stall); when the ratio is
exceeded, prefetch waits instead of over-sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

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
