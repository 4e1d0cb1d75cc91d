"""Counting live steps that match a ``where`` (either form of :mod:`claw_tasks.where`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from claw_tasks.store.core import StoreCore
from claw_tasks.store.reader import Reader
from claw_tasks.where import Where


class Counting:
    """``count(where=...)`` over whole metadata columns (``Reader.meta_columns``), shard by
    shard; string values are looked up in the core's dictionaries."""

    def __init__(self, core: StoreCore) -> None:
        self.core, self.reader = core, Reader(core)

    def count(
        self,
        where: str | Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        now: float | None = None,
    ) -> int:
        """Live steps matching ``where`` (none: all of them); ``params`` resolves its
        ``$names``, ``now`` is what ``age`` is measured from (default: the current time).
        Raises FilterError naming the cause for a where that does not fit the schema."""
        cfg = self.core.config(refresh=True)  # a tag added since the config was cached
        w = Where(where, cfg.schema.tags if cfg.schema else {}, self.core.dicts.lookup_codes)
        now = time.time() if now is None else now
        total = 0
        for shard in range(cfg.n_shards):
            cols = self.reader.meta_columns(shard, sorted(w.columns))
            total += int((cols["alive"] & w.mask(cols, params, now=now)).sum())
        return total
