"""How a replay-buffer adapter sizes its reads: :class:`Cadence` watches the trainer's
bursts (samples between adds) and :func:`plan_for` turns a burst length into the
read-ahead, ``parts`` and prefetch depth a hand-tuned buffer would use for it, so the
adapters size themselves from what they see when the trainer does not tell them (SB3
never passes ``gradient_steps`` to its buffer)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How a buffer reads ahead: each prefetched batch serves ``parts`` samples,
    ``readahead`` such batches wait decoded in this process, ``depth`` in the recipe's
    Redis queue."""

    parts: int
    readahead: int
    depth: int


def plan_for(burst: int, parts: int | None = None, readahead: int | None = None) -> Plan:
    """The sizing for bursts of ``burst`` samples between adds (SB3's ``gradient_steps``):
    a burst's per-batch costs (a fill task, a pop, a decode) paid once per ``parts``
    samples (default ``burst // 16``, 1 to 16), the read-ahead holding one whole burst (up
    to 256 samples), the Redis queue two. Never more than about one burst is queued, so a
    batch is drawn at most a burst or two before it is used."""
    burst = max(1, min(burst, 256))  # longer bursts: the same sizes
    if parts is None:
        parts = max(1, min(16, burst // 16))
    if readahead is None:
        readahead = max(2, -(-burst // parts))
    depth = max(4, -(-max(8, 2 * burst) // parts))
    return Plan(parts, readahead, depth)


class Cadence:
    """The sizes of a buffer's reads, from the trainer's bursts of samples between adds.

    Given a ``burst`` (SB3's ``gradient_steps``), ``parts`` or ``readahead``, the plan is
    fixed: :func:`plan_for` of those. Given none, it is observed: the burst to plan for is
    the longest of the last ``window`` bursts and the current one, rounded up to a power
    of two (so a varying burst, e.g. SB3's ``gradient_steps=-1`` with episodic
    ``train_freq``, does not re-plan each time; it shrinks only after ``window`` shorter
    ones). :meth:`sampled` and :meth:`added` return the new plan when it changes: the
    first long burst grows it as it goes, offline training (adds that never come again)
    too."""

    def __init__(
        self,
        burst: int | None = None,
        parts: int | None = None,
        readahead: int | None = None,
        window: int = 8,
    ) -> None:
        self.auto = burst is None and parts is None and readahead is None
        self.plan = plan_for(burst or 1, parts, readahead)
        self.current = 0
        self.recent: deque[int] = deque(maxlen=window)
        self._planned = 1  # the size() the plan is for

    def size(self) -> int:
        """The burst length planned for."""
        longest = max(self.current, max(self.recent, default=1), 1)
        return 1 << (longest - 1).bit_length()

    def sampled(self) -> Plan | None:
        """A sample: the new plan when the current burst outgrew the last one."""
        self.current += 1
        return self._replan() if self.auto and self.current > self._planned else None

    def added(self) -> Plan | None:
        """An add (the end of a burst, if samples came before): the new plan, if any."""
        if not self.current:
            return None
        self.recent.append(self.current)
        self.current = 0
        return self._replan() if self.auto else None

    def _replan(self) -> Plan | None:
        self._planned = self.size()
        plan = plan_for(self._planned)
        if plan == self.plan:
            return None
        log.info(
            "bursts of %d samples: %d per prefetched batch, %d read ahead, prefetch depth %d",
            self.size(),
            plan.parts,
            plan.readahead,
            plan.depth,
        )
        self.plan = plan
        return plan
