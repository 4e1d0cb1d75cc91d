"""Slot arrays: fixed-width values a reader keeps per slot beside the steps (a vector
index's vectors, the ids they were computed from, their IVF lists), named by the reader
and stored like the store's own columns: per shard, in chunks indexed by slot, each chunk
sized once when first touched (``lua/arrays_size.lua``) so later SETRANGEs never
reallocate it. A column of scalars is chunked as the metadata columns are, a column of
vectors as the payload columns (just under 1 MiB a chunk). Rows are global:
``shard * cap + slot``. Never pickled: raw little-endian arrays."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import ARRAYS_PREFIX, META_CHUNK_SLOTS, payload_chunk_slots
from claw_tasks.store.scripts import Lua, execute

_SIZE = Lua("arrays_size")


class SlotArrays:
    """Columns ``kinds`` (name -> (dtype, shape of a row: ``()`` a scalar, ``(n,)`` a
    vector)) of the slot arrays ``name`` of a namespace; the reader chooses a name no other
    reader uses (a vector index: its name)."""

    def __init__(
        self, store: StoreCore, name: str, kinds: Mapping[str, tuple[str, tuple[int, ...]]]
    ) -> None:
        cfg = store.config()
        self.store, self.r, self.name = store, store.r, name
        self.n_shards, self.cap = cfg.n_shards, cfg.cap
        self.dtypes = {k: np.dtype(d) for k, (d, _) in kinds.items()}
        self.items = {k: int(np.prod(shape)) for k, (_, shape) in kinds.items()}
        self.widths = {k: self.dtypes[k].itemsize * n for k, n in self.items.items()}
        self.slots = {
            k: payload_chunk_slots(self.widths[k]) if shape else META_CHUNK_SLOTS
            for k, (_, shape) in kinds.items()
        }
        self.vector = {k: bool(shape) for k, (_, shape) in kinds.items()}
        self.sized: set[str] = set()

    def _key(self, shard: int, kind: str, chunk: int) -> str:
        return self.store.layout_keys.shard_key(shard, f"{ARRAYS_PREFIX}{self.name}:{kind}:{chunk}")

    def _chunks(self, kind: str) -> range:
        return range(-(-self.cap // self.slots[kind]))

    def clear(self, also: Sequence[str] = (), then: Callable[[Any], None] | None = None) -> int:
        """Delete every chunk (and the namespace-level keys ``also``, e.g. the reader's
        own head); returns the keys deleted. One round trip, shared with the commands
        ``then`` queues after the deletes (the reader's own writes)."""
        doomed = [
            self._key(shard, kind, c)
            for shard in range(self.n_shards)
            for kind in self.slots
            for c in self._chunks(kind)
        ]
        doomed += also
        with self.r.pipeline(transaction=False) as pipe:
            for key in doomed:  # one DEL per key: a cluster routes each to its slot
                pipe.delete(key)
            if then is not None:
                then(pipe)
            deleted = sum(int(n) for n in pipe.execute()[: len(doomed)])
        self.sized.clear()
        return deleted

    def write(self, rows: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        """Write ``values`` (kind -> one row per ``rows``) at global ``rows`` (sorted):
        one SETRANGE per run of consecutive slots of a chunk, one round trip (and one more
        the first time this process touches a chunk, to size it)."""
        self._size(rows, list(values))
        with self.r.pipeline(transaction=False) as pipe:
            for kind, v in values.items():
                v = np.ascontiguousarray(v, self.dtypes[kind].newbyteorder("<"))
                for key, off, lo, hi in self._runs(rows, kind):
                    pipe.setrange(key, off, v[lo:hi].tobytes())
            pipe.execute()

    def read(self, rows: np.ndarray, kinds: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Values at global ``rows`` (sorted), kind -> (len(rows), n) for a vector column,
        (len(rows),) for a scalar one; unwritten slots read as zeros. One GETRANGE per run,
        one round trip."""
        kinds = list(self.slots) if kinds is None else kinds
        plan = {kind: list(self._runs(rows, kind)) for kind in kinds}
        with self.r.pipeline(transaction=False) as pipe:
            for kind, runs in plan.items():
                w = self.widths[kind]
                for key, off, lo, hi in runs:
                    pipe.getrange(key, off, off + (hi - lo) * w - 1)
            replies = iter(pipe.execute())
        out = {}
        for kind, runs in plan.items():
            w = self.widths[kind]
            buf = b"".join(next(replies).ljust((hi - lo) * w, b"\0") for _, _, lo, hi in runs)
            out[kind] = self._shaped(kind, np.frombuffer(buf, self.dtypes[kind]).copy())
        return out

    def read_all(self, kinds: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Whole arrays over every row: a cold load, chunk by chunk (one round trip per
        shard)."""
        kinds = list(self.slots) if kinds is None else kinds
        n = self.n_shards * self.cap
        out = {k: np.zeros(n * self.items[k], self.dtypes[k]) for k in kinds}
        for shard in range(self.n_shards):
            with self.r.pipeline(transaction=False) as pipe:
                for kind in kinds:
                    for c in self._chunks(kind):
                        pipe.get(self._key(shard, kind, c))
                replies = iter(pipe.execute())
            for kind in kinds:
                per, w = self.slots[kind], self.items[kind]
                for c in self._chunks(kind):
                    raw = next(replies)
                    if not raw:
                        continue
                    part = np.frombuffer(raw, self.dtypes[kind])
                    lo = (shard * self.cap + c * per) * w
                    hi = min(lo + len(part), (shard + 1) * self.cap * w)
                    out[kind][lo:hi] = part[: hi - lo]
        return {k: self._shaped(k, v) for k, v in out.items()}

    def _shaped(self, kind: str, flat: np.ndarray) -> np.ndarray:
        return flat.reshape(-1, self.items[kind]) if self.vector[kind] else flat

    def _runs(self, rows: np.ndarray, kind: str) -> Iterator[tuple[str, int, int, int]]:
        """(key, byte offset, lo, hi): rows[lo:hi] are consecutive slots of one chunk."""
        if not len(rows):
            return
        per, w = self.slots[kind], self.widths[kind]
        shard, slot = rows // self.cap, rows % self.cap
        chunk = slot // per
        cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(chunk) != 0) | (np.diff(shard) != 0))
        starts = np.concatenate([[0], cut + 1]).tolist()
        ends = [*starts[1:], len(rows)]
        for lo, hi in zip(starts, ends, strict=True):
            key = self._key(int(shard[lo]), kind, int(chunk[lo]))
            yield key, int(slot[lo] % per) * w, lo, hi

    def _size(self, rows: np.ndarray, kinds: Sequence[str]) -> None:
        """Size each chunk key ``rows`` touch once (per process)."""
        shards, slots = rows // self.cap, rows % self.cap
        want: dict[int, dict[str, int]] = {}
        for kind in kinds:
            per = self.slots[kind]
            for sh, c in set(zip(shards.tolist(), (slots // per).tolist(), strict=True)):
                key = self._key(sh, kind, c)
                if key not in self.sized:
                    want.setdefault(sh, {})[key] = min(per, self.cap - c * per) * self.widths[kind]
        if not want:
            return

        def queue(pipe: Any) -> None:
            for keys in want.values():  # one call per shard: its keys share one slot
                _SIZE.queue(pipe, list(keys), list(keys.values()))

        execute(self.r, [_SIZE], queue)
        for keys in want.values():
            self.sized.update(keys)
