"""String dictionaries: string metadata (task ids, tags, ...) is stored as int32 codes,
one code per distinct string, so columns stay fixed-width and filters compare ints."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import redis

from claw_tasks.store.layout import Keys
from claw_tasks.store.scripts import Scripts


class Dictionaries:
    """Codes <-> strings of a column's dictionary (code 0 = missing): the ``dict`` script
    adds strings; lookups are plain hash reads."""

    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts) -> None:
        self.r, self.layout_keys, self.scripts = client, keys, scripts

    def encode_strings(self, column: str, values: Sequence[str]) -> np.ndarray:
        """Codes of ``values`` in the column's dictionary, adding unknown strings."""
        if not values:
            return np.zeros(0, np.int32)
        keys = [
            self.layout_keys.dict(column),
            self.layout_keys.rdict(column),
            self.layout_keys.dpend(column),
        ]
        codes = self.scripts.dict(keys=keys, args=list(values))
        return np.asarray(codes, np.int32)

    def lookup_codes(self, column: str, values: Sequence[Any]) -> np.ndarray:
        """Codes of known strings; unknown strings get -1 (they match nothing)."""
        if not values:
            return np.zeros(0, np.int32)
        strings = [str(v) for v in values]
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hmget(self.layout_keys.dict(column), strings)
            pipe.hmget(self.layout_keys.dpend(column), strings)  # marked for pruning: still valid
            found, marked = pipe.execute()
        codes = [f or (m and m.split(b":")[0]) for f, m in zip(found, marked, strict=True)]
        return np.array([-1 if c is None else int(c) for c in codes], np.int32)

    def decode_codes(self, column: str, codes: Iterable[int]) -> list[str | None]:
        codes = [int(c) for c in codes]
        uniq = sorted({c for c in codes if c > 0})
        found = self.r.hmget(self.layout_keys.rdict(column), uniq) if uniq else []
        names = dict(zip(uniq, found, strict=True))
        return [None if c <= 0 or names[c] is None else names[c].decode() for c in codes]
