"""The sampling index's reads of committed slot ranges: what a change log's ``ins`` and
``evict`` events name is read again whole, every column and the alive bits, so an
overwritten step's row is replaced. From ``reread.lua``'s replies, read in the page's own
round trip, or, past the script's limits, by one GETRANGE per column and chunk run (the
run tables of a run column's blocks) in a round trip of its own."""

from __future__ import annotations

from typing import Any

import numpy as np

from claw_tasks.format.schema import Schema
from claw_tasks.store import Store, decode_meta
from claw_tasks.store.layout import (
    META_CHUNK_SLOTS,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    expand_runs,
    payload_chunk_slots,
    run_blocks,
)
from orchestrator.sampling.changelog import slot_runs


class SlotReads:
    """Slot-range re-reads into ``columns``. A base of
    :class:`~orchestrator.sampling.index.SamplingIndex`, which sets these attributes and
    gives :meth:`column_dtype` and :meth:`check_config` (a subclass's, if it overrides it)."""

    store: Store
    cap: int
    schema: Schema | None
    columns: dict[str, np.ndarray]
    live_change: int
    """Alive flags set minus cleared by the writes since the last apply (exact)."""

    def column_dtype(self, col: str) -> np.dtype:
        raise NotImplementedError

    def check_config(self, raw: bytes | None) -> None:
        raise NotImplementedError

    def _reread_columns(self) -> list[str]:
        cols = [c for c in self.columns if c != "alive"]
        return [c for c in cols if not c.startswith("f:")] + [c for c in cols if c.startswith("f:")]

    def _reread(
        self,
        inserted: dict[int, list[tuple[int, int]]],
        spans: list[Any] | None = None,
        sizes: list[int] | None = None,
        config_raw: bytes | None = None,
    ) -> list[np.ndarray]:
        """Read the inserted slot ranges again, every column and the alive bits: from
        ``spans`` (``reread.lua``'s replies, read with the pages) for each shard whose
        reply covers its page's ``sizes`` entries, the others in one round trip (with the
        config, for new tags)."""
        changed = []
        if spans is not None and sizes is not None:
            cols = self._reread_columns()
            for shard in list(inserted):
                reply = spans[shard]  # lost, entries seen, then the spans
                if len(reply) < 2 or int(reply[1]) < sizes[shard]:
                    continue  # past the script's limits: read below
                del inserted[shard]
                for at in range(2, len(reply), len(cols) + 3):
                    start, stop = int(reply[at]), int(reply[at + 1])
                    for col, raw in zip(cols, reply[at + 2 : at + 2 + len(cols)], strict=True):
                        if col in RUN_COLUMNS:  # the script's list of the span's blocks
                            self._put_runs(shard, start, stop, col, raw)
                        else:
                            self._put(shard, start, stop, col, raw)
                    self._put_alive(shard, start, stop, reply[at + 2 + len(cols)])
                    base = shard * self.cap
                    changed.append(np.arange(base + start, base + stop, dtype=np.int64))
            if not inserted:
                self.check_config(config_raw)
                return changed
        keys = self.store.keys
        cols = [c for c in self.columns if c != "alive" and not c.startswith("f:")]
        plan = [
            (s, run)
            for s, ins in inserted.items()
            for run in slot_runs(ins, self.cap, META_CHUNK_SLOTS)
        ]
        payload = []  # (shard, column, start, stop): runs split at the field's chunks
        for col in [c for c in self.columns if c.startswith("f:")]:
            per_chunk = payload_chunk_slots(self.columns[col].itemsize)
            for shard, ins in inserted.items():
                payload += [(shard, col, *run) for run in slot_runs(ins, self.cap, per_chunk)]
        with self.store.r.pipeline(transaction=False) as pipe:
            pipe.get(keys.config)
            for shard, (start, stop) in plan:
                chunk, off = divmod(start, META_CHUNK_SLOTS)
                for col in cols:
                    if col in RUN_COLUMNS:  # the run tables of the blocks the run touches
                        for block in run_blocks(start, stop):
                            pipe.get(keys.runs(shard, col, block))
                        continue
                    size = self.columns[col].itemsize
                    pipe.getrange(
                        keys.meta(shard, col, chunk), off * size, (off + stop - start) * size - 1
                    )
                pipe.getrange(keys.shard_key(shard, "alive"), start // 8, (stop - 1) // 8)
            for shard, col, start, stop in payload:
                size = self.columns[col].itemsize
                chunk, off = divmod(start, payload_chunk_slots(size))
                key = keys.shard_key(shard, f"{col}:{chunk}")
                pipe.getrange(key, off * size, (off + stop - start) * size - 1)
            config_raw, *replies = pipe.execute()
        for (shard, col, start, stop), raw in zip(
            payload, replies[len(replies) - len(payload) :], strict=True
        ):
            self._put(shard, start, stop, col, raw)
        i = 0
        for shard, (start, stop) in plan:
            for col in cols:
                if col in RUN_COLUMNS:  # one reply per block the run touches
                    blocks = len(run_blocks(start, stop))
                    self._put_runs(shard, start, stop, col, replies[i : i + blocks])
                    i += blocks
                    continue
                self._put(shard, start, stop, col, replies[i])
                i += 1
            self._put_alive(shard, start, stop, replies[i])
            i += 1
            base = shard * self.cap
            changed.append(np.arange(base + start, base + stop, dtype=np.int64))
        self.check_config(config_raw)
        return changed

    def _put(self, shard: int, start: int, stop: int, col: str, raw: bytes) -> None:
        """Column ``col`` of slots [start, stop) of ``shard`` from its stored bytes (short:
        zeros after them)."""
        dest = self.columns[col][shard * self.cap + start : shard * self.cap + stop]
        if col.startswith("f:"):
            view = dest.view(np.uint8)
            if len(raw) == view.nbytes:  # reread.lua pads its rows: no zeros first
                view[:] = np.frombuffer(raw, np.uint8)
                return
            view[:] = 0
            view[: len(raw)] = np.frombuffer(raw, np.uint8)
            return
        dtype = self.column_dtype(col)
        if len(raw) == dest.nbytes and dtype.itemsize == dest.itemsize:
            dest[:] = decode_meta(col, np.frombuffer(raw, dtype), self.schema)
            return
        values = np.zeros(stop - start, dtype)
        got = np.frombuffer(raw, dtype)
        values[: len(got)] = got
        dest[:] = decode_meta(col, values, self.schema)

    def _put_runs(
        self, shard: int, start: int, stop: int, col: str, tables: list[bytes | None]
    ) -> None:
        """Run column ``col`` of slots [start, stop) of ``shard`` from the run tables of
        the blocks those slots fall in (``run_blocks``), in order."""
        off = run_blocks(start, stop).start * RUN_CHUNK_SLOTS
        got = expand_runs(list(tables), slice(start - off, stop - off), self.column_dtype(col))
        self.columns[col][shard * self.cap + start : shard * self.cap + stop] = got

    def _put_alive(self, shard: int, start: int, stop: int, raw: bytes) -> None:
        """The alive flags of slots [start, stop) of ``shard`` from the bitmap's bytes
        ``start // 8 .. (stop - 1) // 8``."""
        bits = np.unpackbits(np.frombuffer(raw, np.uint8))[start % 8 : start % 8 + stop - start]
        alive = self.columns["alive"][shard * self.cap + start : shard * self.cap + stop]
        self.live_change -= int(np.count_nonzero(alive))
        alive[:] = False
        alive[: len(bits)] = bits.astype(bool)
        self.live_change += int(np.count_nonzero(alive))
