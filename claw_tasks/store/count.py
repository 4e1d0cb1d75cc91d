"""Counting live steps by metadata equality. A second filter beside
``orchestrator/filters.py``, kept in its own module until the two are unified."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.schema import tag_column, tag_name
from claw_tasks.store.layout import (
    DICT_COLUMNS,
    META,
    STR_TAG_DTYPE,
    TERMINATED,
    TRUNCATED,
    UNTRAINABLE,
    episode_code,
)
from claw_tasks.store.reader import Reader


class Counting(Reader):
    """``count(where=...)`` over whole metadata columns, shard by shard."""

    def count(self, where: Mapping[str, Any] | None = None) -> int:
        """Live steps, optionally where metadata equals a value or is in a list."""
        cfg = self.config()
        total = 0
        where = dict(where or {})
        for shard in range(cfg.n_shards):
            cols_needed = ["id"] + [self._where_col(k) for k in where]
            cols = self.meta_columns(shard, list(dict.fromkeys(cols_needed)))
            mask = cols["alive"].copy()
            for key, cond in where.items():
                mask &= self._match(key, cols[self._where_col(key)], cond)
            total += int(mask.sum())
        return total

    def _where_col(self, key: str) -> str:
        if key == "episode_id":
            return "episode"
        if key in ("terminated", "truncated", "trainable"):
            return "flags"
        if key in META:
            return key
        name = key.removeprefix("tags.")
        return tag_column(name)

    def _match(self, key: str, col: np.ndarray, cond: Any) -> np.ndarray:
        values = list(cond["in"]) if isinstance(cond, Mapping) and "in" in cond else [cond]
        if isinstance(cond, Mapping) and "in" not in cond:
            raise ValueError(f"count(where={{{key!r}: ...}}): only equality and 'in' here")
        bits = {"terminated": TERMINATED, "truncated": TRUNCATED}
        if key in bits:
            return np.isin((col & bits[key]) != 0, values)
        if key == "trainable":
            return np.isin((col & UNTRAINABLE) == 0, values)
        if key == "episode_id":
            return np.isin(col, [episode_code(str(v)) for v in values])
        wcol = self._where_col(key)
        is_tag = tag_name(wcol) is not None
        if key in DICT_COLUMNS or (is_tag and col.dtype == STR_TAG_DTYPE):
            return np.isin(col, self.lookup_codes(wcol if is_tag else key, values))
        return np.isin(col, values)
