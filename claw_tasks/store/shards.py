"""Per-shard state a reader asks about, as numbers and names, never keys: the shards'
sequence counters, archive watermarks, episode names, whether slots still hold the steps a
reader expects, and the dead letters of the namespace."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from claw_tasks.connection.client import get_many
from claw_tasks.store.core import StoreCore
from claw_tasks.store.scripts import Lua, execute

_HOLDING = Lua("holding")


class Shards:
    """Counters and watermarks of a namespace's shards; slot liveness by expected seq."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.r, self.layout_keys = core.r, core.layout_keys

    def _each(self, name: str) -> list[str]:
        return [self.layout_keys.shard_key(s, name) for s in range(self.core.config().n_shards)]

    def seqs(self) -> list[int]:
        """Each shard's sequence counter: the steps ever committed to it (one round trip,
        cluster included)."""
        return [int(v or 0) for v in get_many(self.r, self._each("seq"))]

    def queue_seqs(self, pipe: Any) -> int:
        """Queue a read of each shard's sequence counter on ``pipe`` (for a caller's own
        round trip); returns how many replies it adds, each a counter (None: 0)."""
        keys = self._each("seq")
        for key in keys:
            pipe.get(key)
        return len(keys)

    def seq(self, shard: int) -> int:
        """``shard``'s sequence counter alone, as it is now (a loop over the shards reads
        each when it comes to it)."""
        return int(self.r.get(self.layout_keys.shard_key(shard, "seq")) or 0)

    def queue_watermarks(self, pipe: Any) -> int:
        """Queue a read of each shard's archive watermark on ``pipe`` (for a caller's own
        round trip); returns how many replies it adds (None: nothing archived yet)."""
        keys = self._each("archived")
        for key in keys:
            pipe.get(key)
        return len(keys)

    def watermarks(self) -> list[int | None]:
        """Each shard's archive watermark: every step of the shard with a seq at or below
        it is archived (None: nothing archived yet)."""
        return [None if v is None else int(v) for v in get_many(self.r, self._each("archived"))]

    def set_watermark(self, shard: int, seq: int) -> None:
        """Move ``shard``'s archive watermark to ``seq``: only once the archive files
        holding its steps up to ``seq`` are durable (eviction trusts it)."""
        self.r.set(self.layout_keys.archived(shard), seq)

    def episode_names(self, shards: np.ndarray, codes: np.ndarray) -> list[str | None]:
        """The names of episode ``codes`` of steps of ``shards`` (None: unknown), one
        HMGET per shard, one round trip."""
        shards, codes = np.asarray(shards, np.int64), np.asarray(codes, np.int64)
        out: list[str | None] = [None] * len(codes)
        if not len(codes):
            return out
        groups = [(s, np.flatnonzero(shards == s)) for s in np.unique(shards).tolist()]
        with self.r.pipeline(transaction=False) as pipe:
            for s, at in groups:
                pipe.hmget(self.layout_keys.shard_key(s, "epname"), codes[at].tolist())
            replies = pipe.execute()
        for (_, at), found in zip(groups, replies, strict=True):
            for i, v in zip(at.tolist(), found, strict=True):
                out[i] = None if v is None else v.decode(errors="replace")
        return out

    def holding(self, shards: np.ndarray, slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """Whether each slot still holds the step of seq ``seqs`` it held when read: not
        allocated again since (the ring did not come round) and not evicted. One script
        call per shard, one round trip."""
        cap = self.core.config().cap
        shards = np.asarray(shards, np.int64)
        parts: list[np.ndarray] = []

        def queue(pipe: Any) -> None:
            parts.clear()  # run again after a NOSCRIPT
            for shard in np.unique(shards).tolist():
                on = shards == shard
                parts.append(on)
                args = [cap, msgpack.packb(slots[on].tolist()), msgpack.packb(seqs[on].tolist())]
                keys = [
                    self.layout_keys.shard_key(shard, "alive"),
                    self.layout_keys.shard_key(shard, "seq"),
                ]
                _HOLDING.queue(pipe, keys, args)

        replies = execute(self.r, [_HOLDING], queue)
        out = np.zeros(len(shards), bool)
        for on, reply in zip(parts, replies, strict=True):
            out[on] = np.frombuffer(reply, np.uint8) == ord("1")
        return out

    def dead_letters(self, limit: int) -> tuple[int, list[tuple[bytes, dict[bytes, bytes]]]]:
        """(how many dead letters there are, the newest ``limit`` entries, newest first:
        (stream id, fields))."""
        total = self.r.xlen(self.layout_keys.dead)
        entries = self.r.xrevrange(self.layout_keys.dead, count=limit) if limit > 0 else []
        return total, entries
