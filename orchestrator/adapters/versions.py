"""The policy (update) version each served sample trains, as the adapter counts it or the
trainer declares it. The buffer's :class:`~orchestrator.adapters.link.BufferLink` records
it in the lineage log with the ids of that sample, so ``claw lineage NS --policy v``
answers for drop-in users too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.adapters.options import check_policy_version

PolicyVersion = str | Callable[[int], Any] | None
"""How an adapter declares what each sample trains: the name of one of its counters (e.g.
``"updates"``), a callable given the sample's number (1, 2, ...) returning the version
(``None``: not recorded), or None (nothing recorded)."""


class Versions:
    """The policy version each sample an adapter serves trains (see ``PolicyVersion``).

    ``counters`` names what the adapter counts (e.g. ``updates``: its ``sample()`` calls;
    ``timesteps``: transitions added), each read when a sample is served; ``declare``
    picks one, or is a callable of the sample's number, or None."""

    def __init__(self, declare: PolicyVersion, counters: Mapping[str, Callable[[], int]]) -> None:
        check_policy_version(declare, counters)
        if declare is not None and not isinstance(declare, str) and not callable(declare):
            raise TypeError(
                f"policy_version: a counter's name, a callable or None, not {declare!r}"
            )
        self.declare, self.counters = declare, counters

    def of(self, number: int) -> Any:
        """The version sample ``number`` (1, 2, ... as the adapter counts its samples)
        trains; None: not recorded."""
        if self.declare is None:
            return None
        if isinstance(self.declare, str):
            return self.counters[self.declare]()
        return self.declare(number)
