"""Reads: steps by id or episode, metadata and payload columns at (shard, slot) pairs,
each in one pipelined round trip; ``next_obs`` resolved through the stored links."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from claw_tasks.format.schema import FieldSpec, Schema, tag_column, tag_key, tag_name
from claw_tasks.format.stepmeta import (
    DICT_COLUMNS,
    EXPLICIT_NEXT,
    TERMINATED,
    TRUNCATED,
    UNTRAINABLE,
    episode_code,
)
from claw_tasks.store.compressed import decode_stored
from claw_tasks.store.config import NamespaceConfig, NamespaceError
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import (
    EPISODE_INDEX_ENTRY,
    META,
    META_CHUNK_SLOTS,
    NUM_TAG_DTYPE,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    SPARSE_CHUNK_SLOTS,
    column_dtype,
    expand_runs,
    nan_xor,
    payload_chunk_slots,
    run_blocks,
)
from claw_tasks.store.shards import Shards


class Reader:
    """Steps and columns as stored; ids that were evicted are reported, never guessed."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.r, self.layout_keys = core.r, core.layout_keys  # the core's, for brevity

    def locate(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, slot) of each id, whether or not the slot still holds it."""
        cfg = self.core.config()
        ids = np.asarray(ids, np.int64)
        seq = ids // cfg.n_shards
        return (ids % cfg.n_shards).astype(np.int64), (seq - 1) % cfg.cap

    def read_meta(
        self, shards: np.ndarray, slots: np.ndarray, cols: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Metadata columns at (shard, slot) pairs, one pipelined round trip."""
        # A run-table column: each (shard, block) table once; a slot's position in them.
        per_shard = len(run_blocks(0, self.core.config().cap))
        flat = np.asarray(shards, np.int64) * per_shard + slots // RUN_CHUNK_SLOTS
        blocks, pos = np.unique(flat, return_inverse=True)
        at = pos.reshape(-1) * RUN_CHUNK_SLOTS + slots % RUN_CHUNK_SLOTS
        with self.r.pipeline(transaction=False) as pipe:
            for col in cols:
                if col in RUN_COLUMNS:
                    for b in blocks.tolist():
                        pipe.get(self.layout_keys.runs(b // per_shard, col, b % per_shard))
                    continue
                size = self._dtype(col).itemsize
                for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                    off = (sl % META_CHUNK_SLOTS) * size
                    pipe.getrange(
                        self.layout_keys.meta(sh, col, sl // META_CHUNK_SLOTS), off, off + size - 1
                    )
            replies = pipe.execute()
        out, k, i = {}, len(slots), 0
        for col in cols:
            dtype = self._dtype(col)
            if col in RUN_COLUMNS:
                out[col] = expand_runs(replies[i : i + len(blocks)], at, dtype)
                i += len(blocks)
                continue
            raw = b"".join(r.ljust(dtype.itemsize, b"\0") for r in replies[i : i + k])
            out[col] = np.frombuffer(raw, dtype).copy()
            i += k
        return out

    def _dtype(self, col: str) -> np.dtype:
        """``column_dtype`` of ``col``; the config is read only for a tag column."""
        return META[col] if col in META else column_dtype(col, self.core.config().schema)

    def meta_columns(self, shard: int, cols: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Whole metadata columns of a shard (length ``cap``), plus ``alive`` (bool)."""
        cfg = self.core.config()
        schema = cfg.schema
        if cols is None:
            cols = list(META)
            if schema is not None:
                cols += [tag_column(t) for t in schema.tags]
        n_chunks = math.ceil(cfg.cap / META_CHUNK_SLOTS)
        blocks = run_blocks(0, cfg.cap)
        with self.r.pipeline(transaction=False) as pipe:
            for col in cols:
                for c in blocks if col in RUN_COLUMNS else range(n_chunks):
                    pipe.get(
                        (self.layout_keys.runs if col in RUN_COLUMNS else self.layout_keys.meta)(
                            shard, col, c
                        )
                    )
            pipe.get(self.layout_keys.shard_key(shard, "alive"))
            replies = pipe.execute()
        out: dict[str, np.ndarray] = {}
        i = 0
        for col in cols:
            dtype = self._dtype(col)
            if col in RUN_COLUMNS:
                out[col] = expand_runs(replies[i : i + len(blocks)], slice(0, cfg.cap), dtype)
                i += len(blocks)
                continue
            arr = np.zeros(cfg.cap, dtype)
            for c in range(n_chunks):
                raw = replies[i + c]
                if raw:
                    part = np.frombuffer(raw, dtype)
                    arr[c * META_CHUNK_SLOTS : c * META_CHUNK_SLOTS + len(part)] = part
            out[col] = decode_meta(col, arr, schema)
            i += n_chunks
        bits = replies[-1] or b""
        alive = np.unpackbits(np.frombuffer(bits, np.uint8))[: cfg.cap].astype(bool)
        out["alive"] = np.pad(alive, (0, cfg.cap - len(alive)))
        return out

    def read_fields(
        self,
        shards: np.ndarray,
        slots: np.ndarray,
        fields: Sequence[str],
        next_slots: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """Payload fields at (shard, slot) pairs in one pipelined round trip.

        ``next_obs`` is read from ``next_slots`` (the next step's slot; -1 = the explicit
        next_obs stored with the step; -2 = none, zeros). Ragged fields come back as lists.
        """
        cfg = self.core.config()
        schema = cfg.schema
        if schema is None:
            raise NamespaceError(f"namespace {self.core.namespace!r} has no data yet")
        # (output name, stored field, spec, slots to read, own slots for explicit next_obs)
        plan: list[tuple[str, str, FieldSpec, np.ndarray, np.ndarray | None]] = []
        for name in fields:
            if name == "next_obs":
                if next_slots is None:
                    raise ValueError("next_obs needs next_slots")
                if "obs" not in schema.fields:
                    known = ", ".join(schema.fields)
                    raise KeyError(f"next_obs needs an 'obs' field (schema fields: {known})")
                plan.append((name, "obs", schema.fields["obs"], next_slots, slots))
            elif name in schema.fields:
                plan.append((name, name, schema.fields[name], slots, None))
            else:
                known = ", ".join(schema.fields)
                raise KeyError(f"unknown field {name!r} (schema fields: {known})")
        with self.r.pipeline(transaction=False) as pipe:
            for _, stored, spec, at, own in plan:
                self._queue_reads(pipe, spec, stored, shards, at, own)
            replies = pipe.execute()
        out: dict[str, Any] = {}
        k = len(slots)
        for i, (name, stored, spec, _at, _own) in enumerate(plan):
            chunk = replies[i * k : (i + 1) * k]
            dtype = np.dtype(spec.dtype)
            if spec.codec is not None:
                out[name] = decode_stored(self.core, stored, spec, chunk)
            elif spec.ragged:
                tail = spec.shape[1:]
                out[name] = [np.frombuffer(b or b"", dtype).reshape(-1, *tail) for b in chunk]
            else:
                size = spec.row_bytes
                raw = b"".join(b if len(b) == size else b.ljust(size, b"\0") for b in chunk)
                out[name] = np.frombuffer(raw, dtype).reshape(k, *spec.shape)
        return out

    def _queue_reads(
        self,
        pipe: Any,
        spec: FieldSpec,
        name: str,
        shards: np.ndarray,
        at: np.ndarray,
        own: np.ndarray | None,
    ) -> None:
        size = spec.row_bytes
        cs = payload_chunk_slots(size)
        for j, (sh, sl) in enumerate(zip(shards.tolist(), at.tolist(), strict=True)):
            if sl == -2:  # no next_obs known: an empty reply reads as zeros
                pipe.getrange(self.layout_keys.field(sh, name, 0), 1, 0)
            elif sl == -1:  # explicit next_obs, stored with the step itself
                slot = int(own[j])  # type: ignore[index]  # own is read whenever a row stores its next_obs
                pipe.hget(self.layout_keys.sparse(sh, "nx", slot // SPARSE_CHUNK_SLOTS), slot)
            elif spec.codec is not None:
                pipe.hget(self.layout_keys.compressed(sh, name, sl // SPARSE_CHUNK_SLOTS), sl)
            elif spec.ragged:
                pipe.hget(self.layout_keys.ragged(sh, name, sl // SPARSE_CHUNK_SLOTS), sl)
            else:
                off = (sl % cs) * size
                pipe.getrange(self.layout_keys.field(sh, name, sl // cs), off, off + size - 1)

    def read_frames(
        self, shards: np.ndarray, slots: np.ndarray, name: str, explicit: bool = False
    ) -> list[bytes | None]:
        """A compressed field's stored frames at (shard, slot) pairs, not decoded (None:
        no frame); ``explicit``: the explicit ``next_obs`` frames stored with the steps.
        What an archive keeps as it is (``claw_tasks.codecs.decode`` reads them)."""
        with self.r.pipeline(transaction=False) as pipe:
            for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                chunk = sl // SPARSE_CHUNK_SLOTS
                key = self.layout_keys.sparse(sh, "nx", chunk) if explicit else None
                pipe.hget(key or self.layout_keys.compressed(sh, name, chunk), sl)
            return pipe.execute()

    def read_info(self, shards: np.ndarray, slots: np.ndarray) -> list[bytes | None]:
        """The ``info`` stored with the steps at (shard, slot) pairs, as stored (msgpack,
        ``claw_tasks.format.arrays.unpackb`` reads it; None: none), one round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                pipe.hget(self.layout_keys.sparse(sh, "info", sl // SPARSE_CHUNK_SLOTS), sl)
            return pipe.execute()

    def get(self, ids: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None) -> dict:
        """Steps by id: metadata and payload fields. ``next_obs`` is resolved (the next
        step's obs or the explicit one); ``has_next_obs`` marks rows that have one (zeros
        elsewhere). Raises KeyError naming ids that were evicted or never written."""
        ids = np.asarray(ids, np.int64)
        cfg = self.core.config(
            refresh=self.core.cached_config is None or self.core.cached_config.schema is None
        )
        shards, slots = self.locate(ids)
        meta_cols = [*META, *(tag_column(t) for t in (cfg.schema.tags if cfg.schema else {}))]
        meta = self.read_meta(shards, slots, meta_cols)
        alive = self._alive_at(shards, slots)
        missing = ids[(meta["id"] != ids) | ~alive]
        if len(missing):
            raise KeyError(
                f"step ids not in the store (evicted or never written): {missing[:20].tolist()}"
            )
        if fields is None:
            fields = cfg.schema.default_fields if cfg.schema else []
        out = self._public_meta(meta, cfg)
        next_slots = None
        if "next_obs" in fields:
            next_slots = self._next_slots(shards, slots, ids, meta)
            out["has_next_obs"] = next_slots != -2
        return {**out, **self.read_fields(shards, slots, fields, next_slots)}

    def _alive_at(self, shards: np.ndarray, slots: np.ndarray) -> np.ndarray:
        with self.r.pipeline(transaction=False) as pipe:
            for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                pipe.getbit(self.layout_keys.shard_key(sh, "alive"), sl)
            return np.array(pipe.execute(), bool)

    def _next_slots(
        self, shards: np.ndarray, slots: np.ndarray, ids: np.ndarray, meta: dict[str, np.ndarray]
    ) -> np.ndarray:
        """Slot holding each step's next_obs: the next step's slot, -1 (explicit next_obs
        stored with the step) or -2 (none known: no successor stored yet, none given)."""
        cfg = self.core.config()
        delta = meta["next"].astype(np.int64)
        explicit = (meta["flags"] & EXPLICIT_NEXT) != 0
        nxt = (slots + delta) % cfg.cap
        linked = (delta != 0) & ~explicit
        ok = np.zeros(len(ids), bool)
        if linked.any():
            want = ids[linked] + delta[linked] * cfg.n_shards
            got = self.read_meta(shards[linked], nxt[linked], ["id"])["id"]
            ok[np.flatnonzero(linked)[got == want]] = True
        return np.where(explicit, -1, np.where(ok, nxt, -2))

    def _public_meta(self, meta: dict[str, np.ndarray], cfg: NamespaceConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": meta["id"],
            "step_index": meta["step_index"],
            "policy_version": meta["policy_version"],
            "timestamp": meta["timestamp"],
            "reward": meta["reward"],
            "priority": nan_xor(meta["priority"]),
            "terminated": (meta["flags"] & TERMINATED) != 0,
            "truncated": (meta["flags"] & TRUNCATED) != 0,
            "trainable": (meta["flags"] & UNTRAINABLE) == 0,
        }
        for col in DICT_COLUMNS:
            out[col] = self.core.dicts.decode_codes(col, meta[col])
        out["episode_id"] = Shards(self.core).episode_names(
            meta["id"] % cfg.n_shards, meta["episode"]
        )
        tags = cfg.schema.tags if cfg.schema else {}
        for name, kind in tags.items():
            col = meta[tag_column(name)]
            out[tag_key(name)] = (
                self.core.dicts.decode_codes(tag_column(name), col)
                if kind == "str"
                else nan_xor(col)
            )
        return out

    def trajectory_ids(self, episode_id: str) -> np.ndarray | None:
        """The live step ids of an episode, by step_index, from the episode index (what a
        reward post reads: O(the episode's steps), not the shard's episode column). None
        when the namespace has no ``episode_index``. Entries of steps since evicted or
        overwritten by the ring, or committed twice, are dropped here."""
        cfg = self.core.config()
        if not cfg.episode_index:
            return None
        code = episode_code(str(episode_id))
        shard = code % cfg.n_shards
        raw = self.r.hget(self.layout_keys.shard_key(shard, "eptraj"), str(code))
        entries = np.frombuffer(raw or b"", EPISODE_INDEX_ENTRY)
        ids = np.unique(entries["id"])
        if len(ids):
            ids = ids[self._live(ids)]
        by_id = dict(zip(entries["id"].tolist(), entries["step_index"].tolist(), strict=True))
        order = np.argsort([by_id[i] for i in ids.tolist()], kind="stable")
        return ids[order]

    def _live(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id is stored: its slot holds it and is alive (one round trip)."""
        shards, slots = self.locate(ids)
        with self.r.pipeline(transaction=False) as pipe:
            for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                off = (sl % META_CHUNK_SLOTS) * 8
                pipe.getrange(self.layout_keys.meta(sh, "id", sl // META_CHUNK_SLOTS), off, off + 7)
                pipe.getbit(self.layout_keys.shard_key(sh, "alive"), sl)
            replies = pipe.execute()
        held = np.frombuffer(b"".join(r.ljust(8, b"\0") for r in replies[0::2]), "<i8")
        return (held == ids) & np.asarray(replies[1::2], bool)

    def episode(self, episode_id: str, fields: Sequence[str] | None = None) -> dict:
        """All stored steps of an episode, ordered by step_index."""
        cfg = self.core.config()
        code = episode_code(str(episode_id))
        shard = code % cfg.n_shards
        cols = self.meta_columns(shard, ["episode", "id", "step_index"])
        slots = np.flatnonzero((cols["episode"] == code) & cols["alive"])
        if len(slots) == 0:
            raise KeyError(f"episode {episode_id!r} has no stored steps")
        order = np.argsort(cols["step_index"][slots], kind="stable")
        ids = cols["id"][slots[order]]
        return self.get(ids, fields)

    def info(self) -> dict[str, Any]:
        cfg = self.core.config(refresh=True)
        with self.r.pipeline(transaction=False) as pipe:
            for s in range(cfg.n_shards):
                pipe.get(self.layout_keys.shard_key(s, "seq"))
                pipe.bitcount(self.layout_keys.shard_key(s, "alive"))
                pipe.hgetall(self.layout_keys.shard_key(s, "evictions"))
            pipe.xlen(self.layout_keys.dead)
            pipe.hget(self.layout_keys.outcomes, "unreplicated")
            *replies, dead, unreplicated = pipe.execute()
        seqs = [int(v or 0) for v in replies[0::3]]
        evictions = dict.fromkeys(("ttl", "cap", "manual", "ring"), 0)
        for by_reason in replies[2::3]:
            for k, v in by_reason.items():
                evictions[k.decode()] = evictions.get(k.decode(), 0) + int(v)
        return {
            "namespace": self.core.namespace,
            "capacity": cfg.capacity,
            "n_shards": cfg.n_shards,
            "steps": sum(replies[1::3]),
            "committed_total": sum(seqs),
            "evictions": evictions,
            "dead_letters": dead,
            "unreplicated_total": int(unreplicated or 0),
            "schema": None if cfg.schema is None else cfg.schema.to_dict(),
            "created": cfg.created,
        }


def decode_meta(col: str, arr: np.ndarray, schema: Schema | None) -> np.ndarray:
    """Undo the zero-means-missing encodings (NaN-xor floats)."""
    if col == "priority" or (tag_name(col) is not None and arr.dtype == NUM_TAG_DTYPE):
        return nan_xor(arr)
    return arr
