"""``LRU``: the bounded cache behind every per-namespace cache of a long-lived worker."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``maxsize`` entries and, with ``weigh``, at most ``max_bytes`` of them
    (``weigh(value)`` each, weighed once when stored; the newest entry is kept whatever
    it weighs); the least recently used goes first. A worker serving many namespaces (or
    recipes) over days keeps only the ones it uses. Thread-safe."""

    def __init__(
        self,
        maxsize: int,
        on_evict: Callable[[V], None] | None = None,
        *,
        weigh: Callable[[V], int] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"an LRU cache needs maxsize >= 1, got {maxsize}")
        if (weigh is None) != (max_bytes is None):
            raise ValueError("an LRU cache bounded by bytes needs both weigh and max_bytes")
        self.maxsize, self.max_bytes, self.weigh = maxsize, max_bytes, weigh
        self.on_evict = on_evict
        """Called with each entry pushed out by the bound (say, to close a client)."""
        self._items: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}
        self.nbytes = 0
        """What the entries weigh together (0 without ``weigh``)."""
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The entry of ``key``, made by ``make()`` (under the lock) when absent."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            value = self._items[key] = make()
            self._weighed(key, value)
            self._trim()
            return value

    def find(self, key: K) -> V | None:
        """The entry of ``key`` (now the most recently used), or None when absent."""
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            self._weighed(key, value)
            self._trim()

    def _weighed(self, key: K, value: V) -> None:
        if self.weigh is not None:
            self.nbytes += (w := self.weigh(value)) - self._weights.get(key, 0)
            self._weights[key] = w

    def _trim(self) -> None:
        def over() -> bool:
            if len(self._items) > self.maxsize:
                return True
            return self.max_bytes is not None and self.nbytes > self.max_bytes

        while len(self._items) > 1 and over():
            key, value = self._items.popitem(last=False)
            self.nbytes -= self._weights.pop(key, 0)
            if self.on_evict is not None:
                self.on_evict(value)

    def drop(self, match: Callable[[K], bool]) -> int:
        """Remove the entries whose key matches; returns how many."""
        return len(self.pop_where(match))

    def pop_where(self, match: Callable[[K], bool]) -> list[V]:
        """Remove the entries whose key matches; returns their values."""
        with self._lock:
            keys = [k for k in self._items if match(k)]
            for k in keys:
                self.nbytes -= self._weights.pop(k, 0)
            return [self._items.pop(k) for k in keys]

    def values(self) -> list[V]:
        """The values (a snapshot), least recently used first."""
        with self._lock:
            return list(self._items.values())

    def __iter__(self) -> Iterator[K]:
        """The keys (a snapshot), least recently used first."""
        with self._lock:
            return iter(list(self._items))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)
