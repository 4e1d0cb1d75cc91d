"""The Redis step store: namespace config, atomic batch commits, reads, updates."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from claw_tasks.batch import STR_META, Placed, Ragged, StepBatch
from claw_tasks.codec import packb, unpackb
from claw_tasks.schema import FieldSpec, Schema, tag_column, tag_name
from claw_tasks.store.layout import (
    DICT_COLUMNS,
    EXPLICIT_NEXT,
    META,
    META_CHUNK_SLOTS,
    NUM_TAG_DTYPE,
    SPARSE_CHUNK_SLOTS,
    STR_TAG_DTYPE,
    TERMINATED,
    TRUNCATED,
    UNTRAINABLE,
    Keys,
    episode_code,
    nan_xor,
    payload_chunk_slots,
    row_episode_codes,
)
from claw_tasks.store.scripts import Scripts, execute

MARKER_TTL = 7 * 86400
LOG_MAXLEN = 100_000
DEFAULT_CAPACITY = 1_000_000


class NamespaceError(LookupError):
    """The namespace does not exist or is configured differently."""


@dataclass(frozen=True)
class NamespaceConfig:
    capacity: int
    n_shards: int
    schema: Schema | None
    created: float

    @property
    def cap(self) -> int:
        """Slots per shard."""
        return math.ceil(self.capacity / self.n_shards)

    def to_bytes(self) -> bytes:
        return packb(
            {
                "capacity": self.capacity,
                "n_shards": self.n_shards,
                "schema": None if self.schema is None else self.schema.to_dict(),
                "created": self.created,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> NamespaceConfig:
        d = unpackb(data)
        schema = None if d["schema"] is None else Schema.from_dict(d["schema"])
        return cls(d["capacity"], d["n_shards"], schema, d["created"])


@dataclass
class CommitResult:
    committed: int = 0
    replayed: int = 0  # already committed by an earlier delivery
    expired: int = 0  # slots reused by newer steps before the commit landed (past capacity)


class Store:
    """One namespace of the step store. Cheap to construct; safe to share in a process."""

    def __init__(self, client: redis.Redis | str, namespace: str) -> None:
        self.r = redis.Redis.from_url(client) if isinstance(client, str) else client
        self.keys = Keys(namespace)
        self.namespace = namespace
        self.scripts = Scripts(self.r)
        self._config: NamespaceConfig | None = None

    # ---- configuration -------------------------------------------------------------
    def config(self, refresh: bool = False) -> NamespaceConfig:
        if self._config is None or refresh:
            raw = self.r.get(self.keys.config)
            if raw is None:
                raise NamespaceError(f"namespace {self.namespace!r} does not exist")
            self._config = NamespaceConfig.from_bytes(raw)
        return self._config

    def exists(self) -> bool:
        return bool(self.r.exists(self.keys.config))

    def create(
        self,
        capacity: int = DEFAULT_CAPACITY,
        n_shards: int = 1,
        schema: Schema | None = None,
    ) -> NamespaceConfig:
        """Create the namespace, or return it when it exists with the same capacity/shards."""
        if capacity < 1 or n_shards < 1:
            raise ValueError("capacity and n_shards must be >= 1")
        cfg = NamespaceConfig(capacity, n_shards, schema, time.time())
        if not self.r.set(self.keys.config, cfg.to_bytes(), nx=True):
            cfg = self.config(refresh=True)
            if (cfg.capacity, cfg.n_shards) != (capacity, n_shards):
                raise NamespaceError(
                    f"namespace {self.namespace!r} exists with capacity {cfg.capacity} and "
                    f"{cfg.n_shards} shard(s), not {capacity} and {n_shards}"
                )
            if schema is not None:
                self.ensure_schema(schema)
        self._config = cfg
        return self.config()

    def ensure_schema(self, schema: Schema) -> Schema:
        """Set the schema if there is none; otherwise check ``schema`` against it (new tags
        are added). A field mismatch raises SchemaError naming the field."""
        cached = self._config.schema if self._config else None
        if cached is not None and cached.merged(schema).tags == cached.tags:
            return cached
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(self.keys.config)
                    raw = pipe.get(self.keys.config)
                    if raw is None:
                        raise NamespaceError(f"namespace {self.namespace!r} does not exist")
                    cfg = NamespaceConfig.from_bytes(raw)
                    new = schema if cfg.schema is None else cfg.schema.merged(schema)
                    if cfg.schema is None or new.tags != cfg.schema.tags:
                        cfg = NamespaceConfig(cfg.capacity, cfg.n_shards, new, cfg.created)
                        pipe.multi()
                        pipe.set(self.keys.config, cfg.to_bytes())
                        pipe.execute()
                    else:
                        pipe.unwatch()
                    self._config = cfg
                    return new
                except redis.WatchError:
                    continue

    def schema(self) -> Schema | None:
        return self.config(refresh=True).schema

    # ---- dictionaries --------------------------------------------------------------
    def encode_strings(self, column: str, values: Sequence[str]) -> np.ndarray:
        """Codes of ``values`` in the column's dictionary, adding unknown strings."""
        if not values:
            return np.zeros(0, np.int32)
        codes = self.scripts.dict(
            keys=[self.keys.dict(column), self.keys.rdict(column)], args=list(values)
        )
        return np.asarray(codes, np.int32)

    def lookup_codes(self, column: str, values: Sequence[Any]) -> np.ndarray:
        """Codes of known strings; unknown strings get -1 (they match nothing)."""
        if not values:
            return np.zeros(0, np.int32)
        found = self.r.hmget(self.keys.dict(column), [str(v) for v in values])
        return np.array([-1 if c is None else int(c) for c in found], np.int32)

    def decode_codes(self, column: str, codes: Iterable[int]) -> list[str | None]:
        codes = [int(c) for c in codes]
        uniq = sorted({c for c in codes if c > 0})
        found = self.r.hmget(self.keys.rdict(column), uniq) if uniq else []
        names = dict(zip(uniq, found, strict=True))
        return [None if c <= 0 or names[c] is None else names[c].decode() for c in codes]

    # ---- commit --------------------------------------------------------------------
    def commit(
        self, batch: StepBatch, now: float | None = None, dead_rows: Sequence[int] = ()
    ) -> CommitResult:
        """Commit a validated batch: one atomic, idempotent Lua commit per shard part.

        A batch with ``Placed`` fields (written in place after ``allocate``) lies in one
        shard; its ``dead_rows`` (rejected) are committed but never made alive."""
        try:
            schema = self.ensure_schema(batch.schema())  # no round trip once cached
        except NamespaceError:
            self.create()
            schema = self.ensure_schema(batch.schema())
        cfg = self.config()
        n = batch.n
        result = CommitResult()
        if n == 0:
            return result
        now = time.time() if now is None else now
        str_cols = self._encode_str_columns(batch, schema)
        ep_codes = row_episode_codes(batch.episode.values, batch.episode.index)
        shards = ep_codes % cfg.n_shards
        for shard in np.unique(shards).tolist():
            rows = np.arange(n) if cfg.n_shards == 1 else np.flatnonzero(shards == shard)
            part = CommitPart(self, cfg, schema, batch, rows, int(shard), ep_codes, str_cols, now)
            part.run(list(dead_rows), result)
        return result

    def _encode_str_columns(self, batch: StepBatch, schema: Schema) -> dict[str, np.ndarray]:
        """Per-row int32 codes of every string column (0 = missing)."""
        names = [k for k, v in batch.strs.items() if v.values]
        script = Scripts.ALL["dict"]

        def queue(pipe: Any) -> None:
            for k in names:
                keys = [self.keys.dict(k), self.keys.rdict(k)]
                script.queue(pipe, keys, batch.strs[k].values)

        replies = execute(self.r, [script], queue) if names else []
        out: dict[str, np.ndarray] = {}
        for k, codes in zip(names, replies, strict=True):
            vocab = np.concatenate([np.asarray(codes, np.int32), np.zeros(1, np.int32)])
            out[k] = vocab[batch.strs[k].index]  # index -1 picks the trailing 0
        return out

    def allocate(
        self, shard: int, batch_id: str, n: int, placed: Mapping[str, int] | None = None
    ) -> tuple[int, str]:
        """Take (idempotently, per batch id) ``n`` slots of a shard: returns ``(seq0,
        state)``. The older steps in those slots are evicted now, and the chunks of the
        ``placed`` fields (name -> row bytes) are sized for writing in place."""
        cfg = self.config()
        k = self.keys
        args: list[Any] = [n, MARKER_TTL, k.shard(shard), cfg.cap, LOG_MAXLEN]
        for name, row_bytes in (placed or {}).items():
            args += [f"f:{name}", row_bytes, payload_chunk_slots(row_bytes)]
        seq0, state = self.scripts.alloc(
            keys=[
                k.shard_key(shard, f"b:{batch_id}"), k.shard_key(shard, "seq"),
                k.shard_key(shard, "log"), k.shard_key(shard, "alive"),
            ],
            args=args,
        )  # fmt: skip
        return int(seq0), state.decode() if isinstance(state, bytes) else state

    def place(self, shard: int, seq0: int, fields: Mapping[str, np.ndarray]) -> None:
        """Write fixed-shape payload rows into the slots of ``seq0..`` (after ``allocate``):
        one pipelined SETRANGE per chunk run, straight from the arrays' memory."""
        cfg = self.config()
        with self.r.pipeline(transaction=False) as pipe:
            for name, arr in fields.items():
                arr = np.ascontiguousarray(arr)
                n, rb = len(arr), arr.nbytes // max(1, len(arr))
                raw = arr.data.cast("B") if arr.size else memoryview(b"")
                cs = payload_chunk_slots(rb)
                i = 0
                while i < n:
                    slot = (seq0 - 1 + i) % cfg.cap
                    run = min(n - i, cs - slot % cs, cfg.cap - slot)
                    key = self.keys.field(shard, name, slot // cs)
                    pipe.setrange(key, (slot % cs) * rb, raw[i * rb : (i + run) * rb])
                    i += run
            pipe.execute()

    # ---- reads ---------------------------------------------------------------------
    def locate(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, slot) of each id, whether or not the slot still holds it."""
        cfg = self.config()
        ids = np.asarray(ids, np.int64)
        seq = ids // cfg.n_shards
        return (ids % cfg.n_shards).astype(np.int64), (seq - 1) % cfg.cap

    def read_meta(
        self, shards: np.ndarray, slots: np.ndarray, cols: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Metadata columns at (shard, slot) pairs, one pipelined round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            for col in cols:
                size = self._col_dtype(col).itemsize
                for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                    off = (sl % META_CHUNK_SLOTS) * size
                    pipe.getrange(
                        self.keys.meta(sh, col, sl // META_CHUNK_SLOTS), off, off + size - 1
                    )
            replies = pipe.execute()
        out, k = {}, len(slots)
        for i, col in enumerate(cols):
            dtype = self._col_dtype(col)
            raw = b"".join(r.ljust(dtype.itemsize, b"\0") for r in replies[i * k : (i + 1) * k])
            out[col] = np.frombuffer(raw, dtype).copy()
        return out

    def _col_dtype(self, col: str) -> np.dtype:
        if col in META:
            return META[col]
        schema = self.config().schema
        tag = tag_name(col)
        kind = schema.tags.get(tag) if schema and tag is not None else None
        if kind is None:
            raise KeyError(f"unknown metadata column {col!r}")
        return STR_TAG_DTYPE if kind == "str" else NUM_TAG_DTYPE

    def meta_columns(self, shard: int, cols: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Whole metadata columns of a shard (length ``cap``), plus ``alive`` (bool)."""
        cfg = self.config()
        schema = cfg.schema
        if cols is None:
            cols = list(META)
            if schema is not None:
                cols += [tag_column(t) for t in schema.tags]
        n_chunks = math.ceil(cfg.cap / META_CHUNK_SLOTS)
        with self.r.pipeline(transaction=False) as pipe:
            for col in cols:
                for c in range(n_chunks):
                    pipe.get(self.keys.meta(shard, col, c))
            pipe.get(self.keys.shard_key(shard, "alive"))
            replies = pipe.execute()
        out: dict[str, np.ndarray] = {}
        for i, col in enumerate(cols):
            dtype = self._col_dtype(col)
            arr = np.zeros(cfg.cap, dtype)
            for c in range(n_chunks):
                raw = replies[i * n_chunks + c]
                if raw:
                    part = np.frombuffer(raw, dtype)
                    arr[c * META_CHUNK_SLOTS : c * META_CHUNK_SLOTS + len(part)] = part
            out[col] = decode_meta(col, arr, schema)
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
        cfg = self.config()
        schema = cfg.schema
        if schema is None:
            raise NamespaceError(f"namespace {self.namespace!r} has no data yet")
        # (output name, stored field, spec, slots to read, own slots for explicit next_obs)
        plan: list[tuple[str, str, FieldSpec, np.ndarray, np.ndarray | None]] = []
        for name in fields:
            if name == "next_obs":
                if next_slots is None:
                    raise ValueError("next_obs needs next_slots")
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
        for i, (name, _, spec, _at, _own) in enumerate(plan):
            chunk = replies[i * k : (i + 1) * k]
            dtype = np.dtype(spec.dtype)
            if spec.ragged:
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
                pipe.getrange(self.keys.field(sh, name, 0), 1, 0)
            elif sl == -1:  # explicit next_obs, stored with the step itself
                slot = int(own[j])  # type: ignore[index]
                pipe.hget(self.keys.sparse(sh, "nx", slot // SPARSE_CHUNK_SLOTS), slot)
            elif spec.ragged:
                pipe.hget(self.keys.ragged(sh, name, sl // SPARSE_CHUNK_SLOTS), sl)
            else:
                off = (sl % cs) * size
                pipe.getrange(self.keys.field(sh, name, sl // cs), off, off + size - 1)

    def get(self, ids: Sequence[int] | np.ndarray, fields: Sequence[str] | None = None) -> dict:
        """Steps by id: metadata and payload fields. ``next_obs`` is resolved (the next
        step's obs or the explicit one); ``has_next_obs`` marks rows that have one (zeros
        elsewhere). Raises KeyError naming ids that were evicted or never written."""
        ids = np.asarray(ids, np.int64)
        cfg = self.config(refresh=self._config is None or self._config.schema is None)
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
            fields = [*cfg.schema.fields, "next_obs"] if cfg.schema else []
        out = self._public_meta(meta, cfg)
        next_slots = None
        if "next_obs" in fields:
            next_slots = self._next_slots(shards, slots, ids, meta)
            out["has_next_obs"] = next_slots != -2
        return {**out, **self.read_fields(shards, slots, fields, next_slots)}

    def _alive_at(self, shards: np.ndarray, slots: np.ndarray) -> np.ndarray:
        with self.r.pipeline(transaction=False) as pipe:
            for sh, sl in zip(shards.tolist(), slots.tolist(), strict=True):
                pipe.getbit(self.keys.shard_key(sh, "alive"), sl)
            return np.array(pipe.execute(), bool)

    def _next_slots(
        self, shards: np.ndarray, slots: np.ndarray, ids: np.ndarray, meta: dict[str, np.ndarray]
    ) -> np.ndarray:
        """Slot holding each step's next_obs: the next step's slot, -1 (explicit next_obs
        stored with the step) or -2 (none known: no successor stored yet, none given)."""
        cfg = self.config()
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
            out[col] = self.decode_codes(col, meta[col])
        out["episode_id"] = self._episode_names(meta["episode"], meta["id"])
        tags = cfg.schema.tags if cfg.schema else {}
        for name, kind in tags.items():
            col = meta[tag_column(name)]
            out[f"tags.{name}"] = (
                self.decode_codes(tag_column(name), col) if kind == "str" else nan_xor(col)
            )
        return out

    def _episode_names(self, codes: np.ndarray, ids: np.ndarray) -> list[str | None]:
        cfg = self.config()
        with self.r.pipeline(transaction=False) as pipe:
            for code, i in zip(codes.tolist(), ids.tolist(), strict=True):
                pipe.hget(self.keys.shard_key(i % cfg.n_shards, "epname"), code)
            return [None if v is None else v.decode() for v in pipe.execute()]

    def episode(self, episode_id: str, fields: Sequence[str] | None = None) -> dict:
        """All stored steps of an episode, ordered by step_index."""
        cfg = self.config()
        code = episode_code(str(episode_id))
        shard = code % cfg.n_shards
        cols = self.meta_columns(shard, ["episode", "id", "step_index"])
        slots = np.flatnonzero((cols["episode"] == code) & cols["alive"])
        if len(slots) == 0:
            raise KeyError(f"episode {episode_id!r} has no stored steps")
        order = np.argsort(cols["step_index"][slots], kind="stable")
        ids = cols["id"][slots[order]]
        return self.get(ids, fields)

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

    def info(self) -> dict[str, Any]:
        cfg = self.config(refresh=True)
        with self.r.pipeline(transaction=False) as pipe:
            for s in range(cfg.n_shards):
                pipe.get(self.keys.shard_key(s, "seq"))
                pipe.bitcount(self.keys.shard_key(s, "alive"))
            pipe.xlen(self.keys.dead)
            replies = pipe.execute()
        seqs = [int(v or 0) for v in replies[0:-1:2]]
        return {
            "namespace": self.namespace,
            "capacity": cfg.capacity,
            "n_shards": cfg.n_shards,
            "steps": sum(replies[1:-1:2]),
            "committed_total": sum(seqs),
            "dead_letters": replies[-1],
            "schema": None if cfg.schema is None else cfg.schema.to_dict(),
            "created": cfg.created,
        }

    # ---- updates -------------------------------------------------------------------
    def update_priorities(self, ids: Sequence[int] | np.ndarray, priorities: Any) -> int:
        """Set priorities of live steps; ids evicted or overwritten are skipped. Returns
        how many were updated."""
        pr = np.asarray(priorities, np.float32).reshape(-1)
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(pr) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(pr)} priorities")
        if not np.all(np.isfinite(pr)) or np.any(pr < 0):
            raise ValueError("priorities must be finite and >= 0")
        return self._update(ids, "priority", nan_xor(pr).tobytes(), 4, "set", "prio")

    def curate(
        self,
        ids: Sequence[int] | np.ndarray | None = None,
        *,
        episode_id: str | None = None,
        quality: str | None = None,
        trainable: bool | None = None,
    ) -> int:
        """Label steps (by id, or a whole episode): ``quality`` and/or ``trainable``.
        Returns how many live steps were labelled (evicted ids are skipped)."""
        if (ids is None) == (episode_id is None):
            raise ValueError("give either ids or episode_id")
        if quality is None and trainable is None:
            raise ValueError("give quality and/or trainable")
        if episode_id is not None:
            ids = self.episode(episode_id, fields=[])["id"]
        ids = np.asarray(ids, np.int64).reshape(-1)
        done = 0
        if quality is not None:
            code = self.encode_strings("quality", [quality])
            done = self._update(
                ids, "quality", np.repeat(code, len(ids)).tobytes(), 4, "set", "cur"
            )
        if trainable is not None:
            mode = "bits_off" if trainable else "bits_on"
            done = max(done, self._update(ids, "flags", bytes([UNTRAINABLE]), 1, mode, "cur"))
        return done

    def _update(
        self, ids: np.ndarray, col: str, values: bytes, size: int, mode: str, op: str
    ) -> int:
        cfg = self.config()
        shards = ids % cfg.n_shards
        vals = np.frombuffer(values, np.uint8)
        calls = []
        for shard in np.unique(shards).tolist():
            sel = np.flatnonzero(shards == shard)
            part_vals = vals if mode != "set" else vals.reshape(-1, size)[sel]
            keys = [self.keys.shard_key(shard, k) for k in ("log", "seq", "alive", "evicted")]
            args = [
                self.keys.shard(shard), cfg.cap, cfg.n_shards, shard, META_CHUNK_SLOTS, col,
                size, mode, ids[sel].tobytes(), part_vals.tobytes(), LOG_MAXLEN, op,
            ]  # fmt: skip
            calls.append((keys, args))
        if len(calls) == 1:  # the common case: one EVALSHA straight on the client
            return int(self.scripts.update(*calls[0]))
        script = Scripts.ALL["update"]  # several shards: one pipelined round trip
        replies = execute(self.r, [script], lambda p: [script.queue(p, k, a) for k, a in calls])
        return sum(int(v) for v in replies)


def decode_meta(col: str, arr: np.ndarray, schema: Schema | None) -> np.ndarray:
    """Undo the zero-means-missing encodings (NaN-xor floats)."""
    if col == "priority" or (tag_name(col) is not None and arr.dtype == NUM_TAG_DTYPE):
        return nan_xor(arr)
    return arr


class CommitPart:
    """One shard's part of a batch: allocation, column blobs, the Lua commit."""

    def __init__(
        self,
        store: Store,
        cfg: NamespaceConfig,
        schema: Schema,
        batch: StepBatch,
        rows: np.ndarray,
        shard: int,
        ep_codes: np.ndarray,
        str_cols: dict[str, np.ndarray],
        now: float,
    ) -> None:
        self.s, self.cfg, self.schema, self.b = store, cfg, schema, batch
        self.whole = len(rows) == batch.n
        self.rows, self.shard, self.now = rows, shard, now
        self.ep = ep_codes if self.whole else ep_codes[rows]
        self.str_cols = str_cols

    def _sel(self, arr: np.ndarray) -> np.ndarray:
        return arr if self.whole else arr[self.rows]

    def run(self, dead: list[int], result: CommitResult) -> None:
        """Allocate (unless the client did), commit, and count the outcome in ``result``."""
        k = self.s.keys
        n = len(self.rows)
        placed = any(isinstance(v, Placed) for v in self.b.fields.values())
        seq0, state = self.s.allocate(self.shard, self.b.batch_id, n)
        if state == "done":
            result.replayed += n
            return
        if state == "expired":
            result.expired += n
            return
        if placed and state == "new":
            raise NamespaceError(
                f"batch {self.b.batch_id}: its payload was written in place but its slots "
                "were never allocated (or the allocation expired)"
            )
        cols, blobs, sparse, clear, eps = self._payload(seq0)
        spec = {
            "cols": cols, "sparse": sparse, "clear": clear, "eps": eps, "dead": dead,
            "loglen": LOG_MAXLEN,
        }  # fmt: skip
        keys = [
            k.shard_key(self.shard, name)
            for name in (
                f"b:{self.b.batch_id}",
                "seq",
                "log",
                "links",
                "epname",
                "alive",
                "eplast",
                "prune",
            )
        ]
        args = [
            k.shard(self.shard), n, self.cfg.cap, MARKER_TTL, seq0, self.shard,
            self.cfg.n_shards, META_CHUNK_SLOTS, packb(spec), *blobs,
        ]  # fmt: skip
        _, state, skipped = self.s.scripts.commit(keys=keys, args=args)
        dead_kept = sum(r >= skipped for r in dead)
        result.committed += n - skipped - dead_kept
        result.expired += skipped

    def _payload(self, seq0: int) -> tuple[list, list, list, list, list]:
        b, n = self.b, len(self.rows)
        ms = META_CHUNK_SLOTS
        step_index = self._sel(b.step_index).astype(np.int32)
        term = self._sel(b.terminated).astype(bool)
        trunc = self._sel(b.truncated).astype(bool)
        nx_rows = self._explicit_rows()
        flags = term * TERMINATED | trunc * TRUNCATED
        flags = flags.astype(np.uint8)
        if len(nx_rows):
            flags[nx_rows] |= EXPLICIT_NEXT
        nxt, eps = self._links(step_index, term | trunc)
        zeros_i4 = np.zeros(n, np.int32)
        meta: dict[str, np.ndarray] = {
            "id": (seq0 + np.arange(n, dtype=np.int64)) * self.cfg.n_shards + self.shard,
            "episode": self.ep,
            "step_index": step_index,
            "quality": zeros_i4,
            "policy_version": zeros_i4
            if b.policy_version is None
            else self._sel(b.policy_version).astype(np.int32),
            "timestamp": np.full(n, self.now, np.float64),
            "reward": self._sel(b.reward).astype(np.float32),
            "priority": nan_xor(
                np.full(n, np.nan, np.float32)
                if b.priority is None
                else self._sel(b.priority).astype(np.float32)
            ),
            "next": nxt,
            "flags": flags,
        }
        for col in STR_META:
            meta[col] = self._sel(self.str_cols[col]) if col in self.str_cols else zeros_i4
        for name, kind in self.schema.tags.items():
            tc = tag_column(name)
            if kind == "str":
                meta[tc] = self._sel(self.str_cols[tc]) if tc in self.str_cols else zeros_i4
            else:
                vals = self._sel(b.nums[tc]) if tc in b.nums else np.full(n, np.nan)
                meta[tc] = nan_xor(vals.astype(np.float64))
        cols: list[list[Any]] = []
        col_blobs: list[Any] = []  # one per column without a staged source, in order
        sparse_blobs: list[Any] = []  # then the sparse rows, in spec order
        for col, arr in meta.items():
            dtype = META.get(col) or (STR_TAG_DTYPE if arr.dtype.kind == "i" else NUM_TAG_DTYPE)
            cols.append([f"m:{col}", dtype.itemsize, ms])
            col_blobs.append(np.ascontiguousarray(arr, dtype).data.cast("B"))
        sparse: list[list[Any]] = []
        clear: list[list[Any]] = []
        for name, spec in self.schema.fields.items():
            v = b.fields[name]
            if spec.ragged:
                rg = v.take(self.rows) if not self.whole else v  # type: ignore[union-attr]
                off = rg.offsets
                rb = spec.row_bytes
                sparse.append([f"r:{name}", SPARSE_CHUNK_SLOTS, list(range(n))])
                raw = np.ascontiguousarray(rg.values).data.cast("B")
                sparse_blobs.extend(raw[off[i] * rb : off[i + 1] * rb] for i in range(n))
                clear.append([f"r:{name}", SPARSE_CHUNK_SLOTS])
                continue
            if isinstance(v, Placed):  # already written in place by the client
                continue
            cols.append([f"f:{name}", spec.row_bytes, payload_chunk_slots(spec.row_bytes)])
            arr = np.ascontiguousarray(self._sel(v))  # type: ignore[arg-type]
            col_blobs.append(arr.data.cast("B") if arr.size else b"")
        if len(nx_rows):
            sparse.append(["nx", SPARSE_CHUNK_SLOTS, nx_rows.tolist()])
            sparse_blobs.extend(self._explicit_blobs(nx_rows))
        info_rows, info_blobs = self._info()
        if info_rows:
            sparse.append(["info", SPARSE_CHUNK_SLOTS, info_rows])
            sparse_blobs.extend(info_blobs)
        clear += [["nx", SPARSE_CHUNK_SLOTS], ["info", SPARSE_CHUNK_SLOTS]]
        return cols, col_blobs + sparse_blobs, sparse, clear, eps

    def _links(self, step_index: np.ndarray, ended: np.ndarray) -> tuple[np.ndarray, list]:
        """In-part next deltas, and the runs of consecutive steps per episode (for the
        cross-batch links made in Lua)."""
        n = len(step_index)
        order = np.lexsort((step_index, self.ep))
        ep_s, idx_s = self.ep[order], step_index[order].astype(np.int64)
        consecutive = (ep_s[1:] == ep_s[:-1]) & (idx_s[1:] == idx_s[:-1] + 1)
        consecutive &= ~ended[order][:-1]
        nxt = np.zeros(n, np.int32)
        src, dst = order[:-1][consecutive], order[1:][consecutive]
        nxt[src] = (dst - src).astype(np.int32)
        starts = np.flatnonzero(np.concatenate([[True], ~consecutive]))
        ends = np.concatenate([starts[1:] - 1, [n - 1]])
        names = self.b.episode.values
        ep_index = self._sel(self.b.episode.index)
        eps = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            first, last = int(order[s]), int(order[e])
            eps.append(
                [
                    str(int(ep_s[s])),
                    first,
                    int(idx_s[s]),
                    last,
                    int(idx_s[e]),
                    bool(ended[last]),
                    names[ep_index[first]],
                ]
            )
        return nxt, eps

    def _explicit_rows(self) -> np.ndarray:
        b = self.b
        if not len(b.next_rows):
            return np.zeros(0, np.int64)
        if self.whole:
            return b.next_rows.astype(np.int64)
        pos = np.full(b.n, -1, np.int64)
        pos[self.rows] = np.arange(len(self.rows))
        return pos[b.next_rows][pos[b.next_rows] >= 0]

    def _explicit_blobs(self, nx_rows: np.ndarray) -> list[bytes]:
        b = self.b
        idx = {int(r): j for j, r in enumerate(b.next_rows.tolist())}
        src_rows = nx_rows if self.whole else self.rows[nx_rows]
        out = []
        for r in src_rows.tolist():
            v = b.next_obs
            j = idx[int(r)]
            row = v.row(j) if isinstance(v, Ragged) else v[j]  # type: ignore[union-attr]
            out.append(np.ascontiguousarray(row).tobytes())
        return out

    def _info(self) -> tuple[list[int], list[bytes]]:
        b = self.b
        if not b.info:
            return [], []
        pos = {int(r): j for j, r in enumerate(self.rows.tolist())} if not self.whole else None
        rows, blobs = [], []
        for r, d in zip(b.info_rows.tolist(), b.info, strict=True):
            rel = r if pos is None else pos.get(r)
            if rel is not None:
                rows.append(rel)
                blobs.append(packb(d))
        return rows, blobs
