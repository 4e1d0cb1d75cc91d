"""Eviction of chosen steps (retention, manual): ``lua/evict.lua`` over bounded chunks.

Choosing the steps is the caller's business (``orchestrator.maintenance.evict`` applies a
namespace's retention policy); here a plan is made from a shard's metadata columns and run
as script calls of at most ``EVICT_CHUNK`` steps, each checking every step before it
touches it, so a plan made from slightly old columns never removes a step it did not mean
(a slot the ring reused since is skipped). Eviction counts go to the shard's ``evictions``
hash by reason (``ttl``, ``cap``, ``manual``; ``ring`` is counted by ``alloc.lua``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from claw_tasks.format.stepmeta import EXPLICIT_NEXT, TERMINATED, TRUNCATED
from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import META_CHUNK_SLOTS, SPARSE_CHUNK_SLOTS, payload_chunk_slots
from claw_tasks.store.reader import Reader
from claw_tasks.store.scripts import Lua

EVICT_CHUNK = 64
"""Steps per script call: keeps each call to about a millisecond (a few under heavy load)."""
NAMES_PER_READ = 1024
"""Episodes per ``HMGET`` of their newest seqs in a plan (one round trip): one of every
episode a large eviction empties (9,826 at 1M steps) held Redis 3.4 ms."""
REASONS = ("ttl", "cap", "manual", "ring")
PLAN_COLUMNS = ("id", "episode", "step_index", "next", "flags")
"""The metadata columns (plus ``alive``) an eviction plan reads."""
_SCRIPT = Lua("evict")
_FIXED_KEYS = ("alive", "evicted", "evictions", "log", "links", "epname", "eplast", "eptraj")


class Eviction:
    """Evict steps by id or by slot; read the counts by reason. Plans read the shard's
    columns through the reader (``meta_columns``, ``info``)."""

    def __init__(self, core: StoreCore) -> None:
        self.core, self.reader = core, Reader(core)

    def evict(self, ids: Sequence[int] | np.ndarray, reason: str = "manual") -> int:
        """Evict live steps by id (ids already gone are skipped); returns how many went."""
        cfg = self.core.config()
        ids = np.asarray(ids, np.int64).reshape(-1)
        total = 0
        for shard in np.unique(ids % cfg.n_shards).tolist():
            cols = self.reader.meta_columns(shard, PLAN_COLUMNS)
            mine = ids[ids % cfg.n_shards == shard]
            slots = (mine // cfg.n_shards - 1) % cfg.cap
            total += self.evict_slots(shard, cols, slots[cols["id"][slots] == mine], reason)
        return total

    def evict_slots(
        self,
        shard: int,
        cols: Mapping[str, np.ndarray],
        slots: np.ndarray,
        reason: str,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Evict the steps at ``slots`` of ``shard`` as ``cols`` (that shard's
        :data:`PLAN_COLUMNS` and ``alive``, length cap) show them; returns how many went."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        slots = np.unique(np.asarray(slots, np.int64))
        slots = slots[cols["alive"][slots]]
        if not len(slots):
            return 0
        plan = _Plan(self.core, shard, cols, slots)
        fixed = [self.core.layout_keys.shard_key(shard, k) for k in _FIXED_KEYS]
        done = 0
        for start in range(0, len(slots), EVICT_CHUNK):
            keys, spec = plan.chunk(slots[start : start + EVICT_CHUNK], fixed)
            evicted, _ = _SCRIPT(self.core.r, keys, [reason, LOG_MAXLEN, spec])
            done += int(evicted)
            if progress is not None:
                progress(min(EVICT_CHUNK, len(slots) - start))
        for start in range(0, len(plan.gone), EVICT_CHUNK):
            episodes = plan.gone[start : start + EVICT_CHUNK]
            spec = msgpack.packb({"episodes": episodes}, use_bin_type=False)
            _SCRIPT(self.core.r, fixed, [reason, LOG_MAXLEN, spec])
        return done

    def evictions(self) -> dict[str, int]:
        """Steps evicted so far, by reason (every shard summed)."""
        return self.reader.info()["evictions"]


class _Plan:
    """What evicting some slots of a shard involves: keys, predecessors, episodes."""

    def __init__(
        self, store: StoreCore, shard: int, cols: Mapping[str, np.ndarray], slots: np.ndarray
    ) -> None:
        cfg = store.config()
        self.store, self.shard, self.cols, self.cap = store, shard, cols, cfg.cap
        self.n_shards = cfg.n_shards
        schema = cfg.schema
        fields = schema.fields if schema else {}
        # Hashes a victim's entries are deleted from: ragged fields and compressed ones,
        # except delta frames, which stay until the ring reuses their slots (an older live
        # step of the same group may be a delta to this key; docs/architecture.md).
        self.sparse_bases = [
            f"z:{name}" if spec.codec is not None else f"r:{name}"
            for name, spec in fields.items()
            if (spec.ragged or spec.codec is not None)
            and (spec.codec is None or spec.codec.name != "delta")
        ] + ["nx", "info"]
        self.obs = fields.get("obs")
        victim = np.zeros(self.cap, bool)
        victim[slots] = True
        self.pred = self._predecessors(victim) if self.obs is not None else None
        self.gone = self._gone_episodes(victim, slots)

    def _predecessors(self, victim: np.ndarray) -> np.ndarray:
        """Per slot, the live, non-victim step whose next_obs is that slot's obs (-1: none)."""
        c, cap, n = self.cols, self.cap, self.n_shards
        src = np.flatnonzero(c["alive"] & ~victim & (c["next"] != 0))
        src = src[(c["flags"][src] & (EXPLICIT_NEXT | TERMINATED | TRUNCATED)) == 0]
        delta = c["next"][src].astype(np.int64)
        tgt = (src + delta) % cap
        ok = victim[tgt] & (c["id"][tgt] == c["id"][src] + delta * n)
        pred = np.full(cap, -1, np.int64)
        pred[tgt[ok]] = src[ok]
        return pred

    def _gone_episodes(self, victim: np.ndarray, slots: np.ndarray) -> list[list[Any]]:
        """Episodes whose every live step is a victim, with their newest seq as it is now."""
        c = self.cols
        codes = np.unique(c["episode"][slots])
        left = np.unique(c["episode"][c["alive"] & ~victim])
        gone = np.setdiff1d(codes, left)
        gone = gone[gone != 0]
        if not len(gone):
            return []
        names = [str(int(code)) for code in gone]
        key = self.store.layout_keys.shard_key(self.shard, "eplast")
        with self.store.r.pipeline(transaction=False) as pipe:
            for start in range(0, len(names), NAMES_PER_READ):
                pipe.hmget(key, names[start : start + NAMES_PER_READ])
            newest = [v for got in pipe.execute() for v in got]
        return [[k, (v or b"").decode()] for k, v in zip(names, newest, strict=True)]

    def chunk(self, slots: np.ndarray, fixed: list[str]) -> tuple[list[str], bytes]:
        """KEYS and the msgpack plan of one script call."""
        keys = list(fixed)
        index: dict[str, int] = {}

        def key(name: str) -> int:  # a KEYS index (1-based, as in Lua)
            if name not in index:
                keys.append(name)
                index[name] = len(keys)
            return index[name]

        k, c, shard, mc = self.store.layout_keys, self.cols, self.shard, META_CHUNK_SLOTS
        victims = []
        for slot in slots.tolist():
            sc = slot // SPARSE_CHUNK_SLOTS
            sparse = [key(f"{k.shard(shard)}{base}:{sc}") for base in self.sparse_bases]
            vid = int(c["id"][slot])
            entry: list[Any] = [
                slot,
                np.int64(vid).tobytes(),
                key(k.meta(shard, "id", slot // mc)),
                (slot % mc) * 8,
                vid // self.n_shards,
                str(int(c["episode"][slot])),
                int(c["step_index"][slot]),
                sparse,
                self._pred(slot, key),
            ]
            victims.append(entry)
        return keys, msgpack.packb({"victims": victims}, use_bin_type=False)

    def _pred(self, slot: int, key: Callable[[str], int]) -> list[Any]:
        p = -1 if self.pred is None else int(self.pred[slot])
        if p < 0 or self.obs is None:
            return []
        k, c, shard, mc = self.store.layout_keys, self.cols, self.shard, META_CHUNK_SLOTS
        pid = int(c["id"][p])
        obs = self.obs
        if obs.codec is not None:  # the frame as stored (a delta's key outlives it)
            source = ["h", key(k.compressed(shard, "obs", slot // SPARSE_CHUNK_SLOTS)), 0, 0]
        elif obs.ragged:
            source = ["h", key(k.ragged(shard, "obs", slot // SPARSE_CHUNK_SLOTS)), 0, 0]
        else:
            cs = payload_chunk_slots(obs.row_bytes)
            fk = key(k.field(shard, "obs", slot // cs))
            source = ["f", fk, (slot % cs) * obs.row_bytes, obs.row_bytes]
        return [
            p,
            np.int64(pid).tobytes(),
            key(k.meta(shard, "id", p // mc)),
            (p % mc) * 8,
            key(k.meta(shard, "flags", p // mc)),
            p % mc,
            key(k.meta(shard, "next", p // mc)),
            (p % mc) * 4,
            int(c["next"][p]),
            *source,
            key(k.sparse(shard, "nx", p // SPARSE_CHUNK_SLOTS)),
            min(mc, self.cap - p // mc * mc),  # flags chunk bytes
        ]
