"""Counting live steps that match a ``where`` (either form of :mod:`claw_tasks.where`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from claw_tasks.store.reader import Reader


class Counting(Reader):
    """``count(where=...)`` over whole metadata columns, shard by shard."""

    def count(
        self,
        where: str | Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        now: float | None = None,
    ) -> int:
        """Live steps matching ``where`` (none: all of them); ``params`` resolves its
        ``$names``, ``now`` is what ``age`` is measured from (default: the current time).
        Raises FilterError naming the cause for a where that does not fit the schema."""
        # Imported here: claw_tasks.where reads the layout, whose package imports this module.
        from claw_tasks.where import Where

        cfg = self.config(refresh=True)  # a tag added since the config was cached
        w = Where(where, cfg.schema.tags if cfg.schema else {}, self.lookup_codes)
        now = time.time() if now is None else now
        total = 0
        for shard in range(cfg.n_shards):
            cols = self.meta_columns(shard, sorted(w.columns))
            total += int((cols["alive"] & w.mask(cols, params, now=now)).sum())
        return total
