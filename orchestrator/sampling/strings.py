"""Dictionary codes of string metadata, both ways, cached per namespace.

A string's code never changes, so known codes and names are cached for good. Codes are
allocated in increasing order, so a string not in the dictionary yet can only appear on
rows with a code above every code the index has shown so far: it is asked for again once
the index shows such a code. (Episode ids are not a dictionary: the where language hashes
them itself.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.store import Store
from orchestrator.sampling.index import SamplingIndex


class Strings:
    """``encode`` for :class:`claw_tasks.where.Where`; cached ``decode`` for fields."""

    def __init__(self, store: Store, index: SamplingIndex) -> None:
        self.store, self.index = store, index
        self._codes: dict[str, dict[str, int]] = {}  # column -> string -> code
        self._names: dict[str, dict[int, str | None]] = {}  # column -> code -> string
        self._unknown: dict[str, set[str]] = {}  # column -> strings not in the dictionary
        self._top: dict[str, int] = {}  # column -> highest code seen while some are unknown

    def encode(self, column: str, strings: Sequence[str]) -> np.ndarray:
        """Codes of ``strings`` in ``column`` (-1 = not in the dictionary)."""
        known = self._codes.setdefault(column, {})
        unknown = self._unknown.setdefault(column, set())
        ask = [s for s in dict.fromkeys(strings) if s not in known and s not in unknown]
        if ask:
            if not unknown:
                self._top[column] = int(self.index.columns[column].max(initial=0))
            for s, code in zip(ask, self.store.lookup_codes(column, ask).tolist(), strict=True):
                if code > 0:
                    known[s] = code
                else:
                    unknown.add(s)
        return np.array([known.get(s, -1) for s in strings], np.int64)

    def observe(self, changed: np.ndarray | None) -> None:
        """Forget unknown strings of columns where ``changed`` rows show a new code, and
        codes the dictionaries pruned (all known codes after a rebuild: it may have missed
        the pruning events)."""
        if changed is None:
            self._codes.clear()
        for column, gone in self.index.forgotten.items():
            known = self._codes.get(column, {})
            for s in [s for s, c in known.items() if c in gone]:
                del known[s]
        for column, unknown in self._unknown.items():
            if not unknown:
                continue
            col = self.index.columns[column]
            top = int(col.max(initial=0) if changed is None else col[changed].max(initial=0))
            if changed is None or top > self._top[column]:
                unknown.clear()

    def missing(self, column: str, codes: np.ndarray) -> list[int]:
        """Codes of ``column`` whose names are not cached (0 = missing is never asked)."""
        names = self._names.setdefault(column, {})
        return [c for c in np.unique(codes).tolist() if c > 0 and c not in names]

    def learn(self, column: str, codes: Sequence[int], names: Sequence[Any]) -> None:
        """Cache names fetched for ``codes`` (bytes or None)."""
        cache = self._names.setdefault(column, {})
        for c, n in zip(codes, names, strict=True):
            cache[c] = None if n is None else n.decode()

    def decode(self, column: str, codes: np.ndarray) -> np.ndarray:
        """Object array of the cached names of ``codes`` (None for 0 = missing)."""
        names = self._names.get(column, {})
        return np.array([names.get(c) for c in codes.ravel().tolist()], object).reshape(codes.shape)
