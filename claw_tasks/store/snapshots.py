"""Snapshots: immutable versions of a namespace's labels and priorities, for rollback,
diffs and as-of sampling.

After its commit a stored step changes in three places only: its labels (the trainable bit
of ``flags``, ``quality``, free tags: curation) and its ``priority`` (trainers, the priority
pass). Its payload and the rest of its row stay as committed until it is evicted. So a
snapshot copies no payload and no immutable column: per shard it keeps, in the hash
``claw:{ns:<s>}:snap:<name>``,

- ``seq``: the shard's sequence counter. A slot ``s`` live at the snapshot held the step of
  seq ``seq - (seq - 1 - s) mod cap`` (allocating a seq clears its slot's alive bit, so a
  live slot holds the newest seq mapped to it): ids are derived, not stored;
- ``alive``: which slots held a committed, live step: the snapshot's steps;
- ``untrainable``, ``quality``, ``priority``, ``t:<tag>``: those columns as stored,

each zstd-compressed, read in one MULTI/EXEC per shard, so no commit, eviction or update
lands half-way through a shard's read (shards are read at different moments: reads,
compression and writes of several shards overlap, :meth:`Snapshots._take_shards`). The header
(``claw:{ns}:snapshots``, name -> msgpack) holds the time, the seqs, the live steps, the
config record (retention, schema), the string of every dictionary code the columns hold
(a rollback re-encodes them, so a code pruned since comes back with its string), and the
caller's ``extra`` (the orchestrator's recipes and normalisation statistics). Before
compression that is 2 bits + 8 bytes a slot (+4 or 8 per free tag); unset priorities and
unlabelled steps compress to almost nothing (docs/benchmarks.md, "Snapshots").

A :class:`~claw_tasks.store.labels.Labels` is that state over the global rows ``shard * cap
+ slot`` (the sampling index's rows), from a snapshot or read now (``store/labels.py``, with
``diff``, which compares two); :meth:`Snapshots.rollback` writes a snapshot's values back
through ``update.lua`` (logged, so sampling indexes apply it; slots reused since are
skipped). Evicted steps cannot come back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.schema import tag_column
from claw_tasks.format.stepmeta import UNTRAINABLE
from claw_tasks.store.config import NamespaceConfig
from claw_tasks.store.core import StoreCore
from claw_tasks.store.evict import Eviction
from claw_tasks.store.labels import Labels
from claw_tasks.store.layout import META_CHUNK_SLOTS, NUM_TAG_DTYPE, STR_TAG_DTYPE, nan_xor
from claw_tasks.store.snapshot_format import (
    NOW,
    SnapshotError,
    SnapshotInfo,
    check_name,
    column_dtype,
    decode_labels,
    info_of,
    pack_column,
)
from claw_tasks.store.updates import Updates

WRITE_IDS = 65_536
"""Ids per ``update.lua`` call of a rollback (one log entry each)."""

THREADS = 2
"""Threads a snapshot's shard reads and column compression run on (:meth:`Snapshots.
_take_shards`; docs/benchmarks.md, "Snapshots")."""


@dataclass(frozen=True)
class Rollback:
    """What a rollback wrote: steps per column, and the steps it could not touch."""

    changed: dict[str, int]  # column -> steps written back
    evicted: int  # steps of the snapshot gone since: they cannot come back
    added: int  # steps committed since the snapshot (live)
    dropped: int  # of those, evicted by ``drop_new``


class Snapshots:
    """Snapshots of a namespace over a :class:`StoreCore`; writes back through the
    :class:`Updates` part and drops steps through :class:`Eviction`."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core

    # ---- taking and listing -------------------------------------------------------
    def snapshot(self, name: str, extra: Mapping[str, Any] | None = None) -> SnapshotInfo:
        """Record the namespace's labels, priorities and tags now, as ``name`` (names are
        never reused while the snapshot exists); ``extra`` (msgpack-able) is kept with it.
        Then applies the retention policy's ``max_snapshots``/``snapshot_max_age``."""
        check_name(name)
        core = self.core
        cfg = core.config(refresh=True)
        if core.r.hexists(core.layout_keys.snapshots, name):
            raise SnapshotError(f"snapshot {name!r} of {core.namespace!r} exists: delete it first")
        created = time.time()
        seqs, steps, size, strings = [], 0, 0, {}
        codes: dict[str, set[int]] = {}
        for seq, alive, packed, found in self._take_shards(name, cfg):
            size += sum(len(v) for v in packed.values())
            seqs.append(seq)
            steps += alive
            for col, c in found.items():
                codes.setdefault(col, set()).update(c)
        for col, found in codes.items():
            found.discard(0)
            names = core.dicts.decode_codes(col, sorted(found))
            strings[col] = [[c, s] for c, s in zip(sorted(found), names, strict=True) if s]
        header = {
            "created": created,
            "seqs": seqs,
            "steps": steps,
            "bytes": size,
            "config": cfg.to_bytes(),
            "strings": strings,
            "extra": dict(extra or {}),
        }
        core.r.hset(core.layout_keys.snapshots, name, packb(header))  # listed once complete
        self.prune(cfg.retention.max_snapshots if cfg.retention else None, None, keep=name)
        if cfg.retention is not None and cfg.retention.snapshot_max_age is not None:
            self.prune(None, cfg.retention.snapshot_max_age, keep=name)
        return info_of(name, header, self.core.namespace)

    def _take_shards(
        self, name: str, cfg: NamespaceConfig
    ) -> list[tuple[int, int, dict[str, bytes], dict[str, list[int]]]]:
        """Each shard's part of snapshot ``name``, written: its seq, live steps, the stored
        (compressed) columns and the string codes they hold, in shard order.

        Pipelined across shards: up to ``THREADS`` shard reads (one MULTI/EXEC each, on
        their own connections) are in flight while the columns already read are packed,
        compressed (zstd and numpy release the GIL) and written, a column per task; so
        Redis serves one shard's read while this process compresses another's, and at
        most ``THREADS`` shards' columns are held at once."""
        with ThreadPoolExecutor(THREADS, thread_name_prefix="claw-snapshot") as pool:
            reads = {
                s: pool.submit(self._read_shard, s, cfg) for s in range(cfg.n_shards)[:THREADS]
            }
            out = []
            for shard in range(cfg.n_shards):
                seq, cols = reads.pop(shard).result()
                if shard + THREADS < cfg.n_shards:
                    reads[shard + THREADS] = pool.submit(self._read_shard, shard + THREADS, cfg)
                n = min(cfg.cap, seq)
                alive = cols.pop("alive")[:n]
                raw = {"alive": alive, "untrainable": cols.pop("untrainable")[:n]}
                raw.update((col, arr[:n]) for col, arr in cols.items())
                jobs = {col: pool.submit(pack_column, col, arr, alive) for col, arr in raw.items()}
                packed: dict[str, bytes] = {"seq": str(seq).encode()}
                found = {}
                for col, job in jobs.items():
                    packed[col], held = job.result()
                    if held is not None:
                        found[col] = held
                out.append((seq, int(alive.sum()), packed, found))
                self.core.r.hset(self.core.layout_keys.snapshot(shard, name), mapping=packed)
            return out

    def _read_shard(self, shard: int, cfg: NamespaceConfig) -> tuple[int, dict[str, np.ndarray]]:
        """The shard's seq, alive bits and mutable columns, in one MULTI/EXEC."""
        keys = self.core.layout_keys
        tags = [tag_column(t) for t in (cfg.schema.tags if cfg.schema else {})]
        cols = ["flags", "quality", "priority", *tags]
        n_chunks = math.ceil(cfg.cap / META_CHUNK_SLOTS)
        with self.core.r.pipeline(transaction=True) as pipe:
            pipe.get(keys.shard_key(shard, "seq"))
            pipe.get(keys.shard_key(shard, "alive"))
            for col in cols:
                for c in range(n_chunks):
                    pipe.get(keys.meta(shard, col, c))
            seq, bits, *chunks = pipe.execute()
        out: dict[str, np.ndarray] = {}
        alive = np.unpackbits(np.frombuffer(bits or b"", np.uint8))[: cfg.cap].astype(bool)
        out["alive"] = np.pad(alive, (0, cfg.cap - len(alive)))
        for i, col in enumerate(cols):
            dtype = column_dtype(col, cfg)
            arr = np.zeros(cfg.cap, dtype)
            for c in range(n_chunks):
                raw = chunks[i * n_chunks + c]
                if raw:
                    part = np.frombuffer(raw, dtype)
                    arr[c * META_CHUNK_SLOTS : c * META_CHUNK_SLOTS + len(part)] = part
            if col == "flags":
                out["untrainable"] = (arr & UNTRAINABLE) != 0
            else:
                out[col] = arr
        return int(seq or 0), out

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot of the namespace, oldest first."""
        raw = self.core.r.hgetall(self.core.layout_keys.snapshots)
        found = [info_of(k.decode(), unpackb(v), self.core.namespace) for k, v in raw.items()]
        return sorted(found, key=lambda s: (s.created, s.name))

    def snapshot_info(self, name: str) -> SnapshotInfo:
        raw = self.core.r.hget(self.core.layout_keys.snapshots, check_name(name))
        if raw is None:
            known = ", ".join(s.name for s in self.snapshots()) or "none"
            raise SnapshotError(
                f"namespace {self.core.namespace!r} has no snapshot {name!r} (snapshots: {known})"
            )
        return info_of(name, unpackb(raw), self.core.namespace)

    def drop_snapshot(self, name: str) -> bool:
        """Delete a snapshot (its header first: it is no longer listed); True if it was."""
        core = self.core
        try:
            info = self.snapshot_info(name)
        except SnapshotError:
            return False
        core.r.hdel(core.layout_keys.snapshots, name)
        for shard in range(info.config.n_shards):
            core.r.unlink(core.layout_keys.snapshot(shard, name))
        return True

    def prune(
        self, keep_count: int | None, max_age: float | None, *, keep: str | None = None
    ) -> list[str]:
        """Delete snapshots past ``keep_count`` (oldest first) or older than ``max_age``
        seconds (never ``keep``); returns their names."""
        found = self.snapshots()
        now, gone = time.time(), []
        for i, s in enumerate(found):
            old = max_age is not None and now - s.created > max_age
            extra = keep_count is not None and i < len(found) - keep_count
            if (old or extra) and s.name != keep and self.drop_snapshot(s.name):
                gone.append(s.name)
        return gone

    # ---- reading states -----------------------------------------------------------
    def labels(self, name: str | None = None) -> Labels:
        """A snapshot's state (``name``), or the namespace's now (None or ``"now"``)."""
        core = self.core
        if name is None or name == NOW:
            cfg = core.config(refresh=True)
            with ThreadPoolExecutor(THREADS, thread_name_prefix="claw-snapshot") as pool:
                parts = list(pool.map(lambda s: self._read_shard(s, cfg), range(cfg.n_shards)))
            seqs = tuple(seq for seq, _ in parts)
            tags = [c for c in parts[0][1] if c.startswith("t:")] if parts else []
            cat = np.concatenate
            strings = self._strings_of(
                {c: cat([p[c] for _, p in parts]) for c in ["quality", *tags]},
                cat([p["alive"] for _, p in parts]),
                cfg,
            )
            return Labels(
                cfg.n_shards,
                cfg.cap,
                seqs,
                cat([p["alive"] for _, p in parts]),
                cat([p["untrainable"] for _, p in parts]),
                cat([p["quality"] for _, p in parts]),
                cat([p["priority"] for _, p in parts]),
                {c: cat([p[c] for _, p in parts]) for c in tags},
                strings,
            )
        h = unpackb(core.r.hget(core.layout_keys.snapshots, check_name(name)) or packb(None))
        if h is None:
            self.snapshot_info(name)  # the SnapshotError naming the snapshots there are
        cfg = NamespaceConfig.from_bytes(h["config"], core.namespace)
        shards = []
        for shard in range(cfg.n_shards):
            got = core.r.hgetall(core.layout_keys.snapshot(shard, name))
            if not got:
                raise SnapshotError(f"snapshot {name!r}: shard {shard} is missing (deleted?)")
            shards.append({k.decode(): v for k, v in got.items()})
        return decode_labels(h, cfg, shards)

    def _strings_of(
        self, cols: Mapping[str, np.ndarray], alive: np.ndarray, cfg: NamespaceConfig
    ) -> dict[str, dict[int, str]]:
        out = {}
        for col, arr in cols.items():
            if arr.dtype != STR_TAG_DTYPE:
                continue
            codes = [c for c in np.unique(arr[alive]).tolist() if c]
            names = self.core.dicts.decode_codes(col, codes)
            out[col] = {c: s for c, s in zip(codes, names, strict=True) if s is not None}
        return out

    def recode(self, labels: Labels, col: str, codes: np.ndarray) -> np.ndarray:
        """``codes`` of ``labels``' column ``col`` as the namespace's dictionary codes them
        now (a string pruned since is encoded again); 0 stays 0 (missing)."""
        table = labels.strings.get(col, {})
        known = sorted(table)
        if not known:
            return np.zeros_like(codes)
        now = self.core.dicts.encode_strings(col, [table[c] for c in known])
        lut = np.zeros(max(known) + 1, STR_TAG_DTYPE)
        lut[known] = now
        inside = (codes >= 0) & (codes < len(lut))
        return np.where(inside, lut[np.clip(codes, 0, len(lut) - 1)], 0).astype(STR_TAG_DTYPE)

    # ---- rollback -----------------------------------------------------------------
    def rollback(self, name: str, *, drop_new: bool = False) -> Rollback:
        """Put the snapshot's labels, priorities and tags back on every step of it that is
        still live, bit for bit (only values that differ are written). Steps committed
        since stay (``drop_new``: they are evicted, reason ``manual``); steps evicted since
        cannot come back and are counted."""
        snap, now = self.labels(name), self.labels(None)
        if (snap.n_shards, snap.cap) != (now.n_shards, now.cap):
            raise SnapshotError(f"snapshot {name!r} was taken of another layout of the namespace")
        same = snap.same_steps(now)
        ids = now.ids
        updates = Updates(self.core)
        changed = {}

        def write(rows: np.ndarray, col: str, values: np.ndarray, op: str = "cur") -> None:
            sel = np.flatnonzero(rows)
            done = 0
            for at in range(0, len(sel), WRITE_IDS):
                part = sel[at : at + WRITE_IDS]
                raw = values[part].tobytes()
                done += updates.write_column(ids[part], col, raw, values.itemsize, op=op)
            changed[col] = changed.get(col, 0) + done

        for on in (True, False):
            rows = np.flatnonzero(same & (snap.untrainable == on) & (now.untrainable != on))
            done = 0
            for at in range(0, len(rows), WRITE_IDS):
                done += updates.write_bits(ids[rows[at : at + WRITE_IDS]], UNTRAINABLE, on)
            changed["trainable"] = changed.get("trainable", 0) + done
        quality = self.recode(snap, "quality", snap.quality)
        write(same & (quality != now.quality), "quality", quality.astype("<i4"))
        write(same & (snap.priority != now.priority), "priority", snap.priority, "prio")
        for col in sorted(set(snap.tags) | set(now.tags)):
            cur = now.tags.get(col)
            if cur is None:
                continue  # a tag the namespace no longer has a column for
            want = snap.tags.get(col)
            if want is None:  # declared since: the snapshot's steps had no value
                want = np.zeros_like(cur)
            elif want.dtype == STR_TAG_DTYPE:
                want = self.recode(snap, col, want)
            write(same & (want != cur), col, want.astype(cur.dtype))
        added = now.alive & ~same
        dropped = 0
        if drop_new and added.any():
            dropped = Eviction(self.core).evict(ids[added], reason="manual")
        return Rollback(
            changed,
            evicted=int((snap.alive & ~same).sum()),
            added=int(added.sum()),
            dropped=dropped,
        )

    def as_of_columns(self, labels: Labels) -> dict[str, np.ndarray]:
        """``labels``' mutable columns as the sampling index holds them: priorities and
        numeric tags decoded, string codes mapped to today's dictionary (:meth:`recode`)."""
        out: dict[str, np.ndarray] = {
            "quality": self.recode(labels, "quality", labels.quality),
            "priority": nan_xor(labels.priority.view(np.float32)),
        }
        for col, arr in labels.tags.items():
            if arr.dtype == STR_TAG_DTYPE:
                out[col] = self.recode(labels, col, arr)
            else:
                out[col] = nan_xor(arr.view(NUM_TAG_DTYPE))
        return out
