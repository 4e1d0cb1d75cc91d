"""One shard's part of a batch commit: the metadata columns, payload blobs and episode
links that the commit script writes in one atomic step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from claw_tasks.format.arrays import packb
from claw_tasks.format.batch import STR_META, StepBatch
from claw_tasks.format.columns import Placed, Ragged
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import Schema, tag_column
from claw_tasks.format.stepmeta import EXPLICIT_NEXT, TERMINATED, TRUNCATED
from claw_tasks.store.compressed import explicit_frames, frames_of
from claw_tasks.store.config import LOG_MAXLEN, MARKER_TTL, NamespaceConfig, NamespaceError
from claw_tasks.store.core import StoreCore
from claw_tasks.store.layout import (
    META,
    META_CHUNK_SLOTS,
    NUM_TAG_DTYPE,
    RUN_CHUNK_SLOTS,
    RUN_COLUMNS,
    RUN_ENTRY,
    SPARSE_CHUNK_SLOTS,
    STR_TAG_DTYPE,
    nan_xor,
    payload_chunk_slots,
    runs_of,
)
from claw_tasks.store.replication import Replication, replicated
from claw_tasks.store.scripts import Scripts


@dataclass
class CommitResult:
    committed: int = 0
    replayed: int = 0  # already committed by an earlier delivery
    expired: int = 0  # slots reused by newer steps before the commit landed (past capacity)
    # Step id of each batch row (-1: expired, never stored); set by ``Writer.commit``.
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass
class Writes:
    """What the commit script writes: dense columns (in order, each cut into its chunk runs
    from ``slot0``), then sparse rows (one blob per row, in spec order), and the sparse
    chunks to clear first."""

    slot0: int
    cap: int
    cols: list[list[Any]] = field(default_factory=list)
    sparse: list[list[Any]] = field(default_factory=list)
    clear: list[list[Any]] = field(default_factory=list)
    dense_blobs: list[Any] = field(default_factory=list)
    sparse_blobs: list[Any] = field(default_factory=list)
    runs: list[list[Any]] = field(default_factory=list)

    def dense(
        self, name: str, row_bytes: int, chunk_slots: int, blob: Any, zero: bool = False
    ) -> None:
        """``zero``: every byte of ``blob`` is zero; it is not sent (the script makes the
        zeros a chunk that exists needs; one that does not is not created: a missing chunk
        reads as zeros)."""
        blobs = [] if zero else _chunk_runs(blob, row_bytes, chunk_slots, self.slot0, self.cap)
        self.cols.append([name, row_bytes, chunk_slots, zero, len(blobs)])
        self.dense_blobs += blobs

    def run_table(self, name: str, values: np.ndarray) -> None:
        """A :data:`RUN_COLUMNS` column: its runs of equal values (one for a commit's one
        ``now``), cut where blocks end and packed as the blocks' tables hold them; the
        script splices each piece into its block's table."""
        first, vals = runs_of(values)
        pieces, n, i = [], len(values), 0
        while i < n:
            slot = (self.slot0 + i) % self.cap
            run = min(n - i, RUN_CHUNK_SLOTS - slot % RUN_CHUNK_SLOTS, self.cap - slot)
            lo = int(np.searchsorted(first, i, "right")) - 1
            hi = int(np.searchsorted(first, i + run, "left"))
            rec = np.empty(hi - lo, RUN_ENTRY)
            rec["slot"] = np.maximum(first[lo:hi], i) - i + slot % RUN_CHUNK_SLOTS
            rec["value"] = vals[lo:hi]
            pieces.append([i, rec.tobytes()])
            i += run
        self.runs.append([name, RUN_CHUNK_SLOTS, pieces])

    def rows(self, name: str, rows: list[int], blobs: Any) -> None:
        self.sparse.append([name, SPARSE_CHUNK_SLOTS, rows])
        self.sparse_blobs.extend(blobs)

    @property
    def blobs(self) -> list[Any]:
        return self.dense_blobs + self.sparse_blobs


class CommitPart:
    """One shard's part of a batch: its column blobs and the Lua commit, into the slots
    ``Writer.allocate`` took for it."""

    def __init__(
        self,
        store: StoreCore,
        cfg: NamespaceConfig,
        schema: Schema,
        batch: StepBatch,
        rows: np.ndarray,
        shard: int,
        ep_codes: np.ndarray,
        str_cols: dict[str, np.ndarray],
        now: float | np.ndarray,
    ) -> None:
        self.s, self.cfg, self.schema, self.b = store, cfg, schema, batch
        self.whole = len(rows) == batch.n
        self.rows, self.shard, self.now = rows, shard, now
        self.ep = ep_codes if self.whole else ep_codes[rows]
        self.str_cols = str_cols
        self.nx_rows = self._explicit_rows()  # rows (in the part) with an explicit next_obs

    def _sel(self, arr: np.ndarray) -> np.ndarray:
        return arr if self.whole else arr[self.rows]

    def run(
        self,
        seq0: int,
        state: str,
        dead: list[int],
        result: CommitResult,
        replication: Replication | None = None,
    ) -> None:
        """Commit into the slots from ``seq0`` (``state``: what the allocation found, as
        ``Writer.allocate`` returns it) and count the outcome in ``result``. With
        ``replication``, the commit is followed by ``WAIT`` in its round trip, and a part
        committed before (a redelivery) is waited for too: NotReplicated if too few
        replicas have it."""
        k = self.s.layout_keys
        n = len(self.rows)
        placed = any(isinstance(v, Placed) for v in self.b.fields.values())
        if state == "expired":
            result.expired += n
            return
        result.ids[self.rows] = self._ids(seq0)
        marker = k.shard_key(self.shard, f"b:{self.b.batch_id}")
        wait = replication if replication is not None and replication.replicas > 0 else None
        what = f"shard {self.shard}'s commit of batch {self.b.batch_id}"

        def renew(pipe: Any) -> None:
            # A commit made by another delivery (before this one, or between its allocation
            # and its commit, where the script finds the marker done and writes nothing)
            # may not be on the replicas yet: renewing the marker's expiry is a write that
            # replicates, so the WAIT after it covers that commit too.
            pipe.expire(marker, MARKER_TTL)

        if state == "done":
            if wait is not None:
                replicated(self.s.r, marker, wait, renew, what=what)
            result.replayed += n
            return
        if placed and state == "new":
            raise NamespaceError(
                f"batch {self.b.batch_id}: its payload was written in place but its slots "
                "were never allocated (or the allocation expired)"
            )
        meta, eps = self._meta(seq0)
        writes = self._writes(meta, (seq0 - 1) % self.cfg.cap)
        spec = {
            "cols": writes.cols,
            "sparse": writes.sparse,
            "clear": writes.clear,
            "eps": eps,
            "dead": dead,
            "loglen": LOG_MAXLEN,
            "runs": writes.runs,
        }
        keys = [marker] + [
            k.shard_key(self.shard, name)
            for name in (
                "seq",
                "log",
                "links",
                "epname",
                "alive",
                "eplast",
                "prune",
                "eptraj",
            )
        ]
        args = [
            k.shard(self.shard),
            n,
            self.cfg.cap,
            MARKER_TTL,
            seq0,
            self.shard,
            self.cfg.n_shards,
            META_CHUNK_SLOTS,
            msgpack.packb(spec, use_bin_type=False),  # bytes as Lua strings (cmsgpack)
            *writes.blobs,
        ]
        if wait is None:
            _, state, skipped = self.s.scripts.commit(keys=keys, args=args)
        else:
            script = Scripts.ALL["commit"]

            def queue(pipe: Any) -> None:
                script.queue(pipe, keys, args)
                renew(pipe)

            (_, state, skipped), _ = replicated(
                self.s.r,
                marker,
                wait,
                queue,
                [script],
                what=what,
            )
        result.ids[self.rows[:skipped]] = -1
        dead_kept = sum(r >= skipped for r in dead)
        result.committed += n - skipped - dead_kept
        result.expired += skipped

    def _meta(self, seq0: int) -> tuple[dict[str, np.ndarray], list]:
        """The metadata columns of the part's rows, and its episode runs (from ``_links``)."""
        b, n = self.b, len(self.rows)
        step_index = self._sel(b.step_index).astype(np.int32)
        term = self._sel(b.terminated).astype(bool)
        trunc = self._sel(b.truncated).astype(bool)
        nxt, eps = self._links(step_index, term | trunc, seq0)
        zeros_i4 = np.zeros(n, np.int32)
        meta: dict[str, np.ndarray] = {
            "id": self._ids(seq0),
            "episode": self.ep,
            "step_index": step_index,
            "quality": zeros_i4,
            "policy_version": zeros_i4
            if b.policy_version is None
            else self._sel(b.policy_version).astype(np.int32),
            "timestamp": np.full(n, self.now, np.float64)
            if np.ndim(self.now) == 0
            else self._sel(self.now).astype(np.float64),
            "reward": self._sel(b.reward).astype(np.float32),
            "priority": nan_xor(
                np.full(n, np.nan, np.float32)
                if b.priority is None
                else self._sel(b.priority).astype(np.float32)
            ),
            "next": nxt,
            "flags": self._flags(term, trunc),
        }
        for col in STR_META:
            meta[col] = self._sel(self.str_cols[col]) if col in self.str_cols else zeros_i4
        meta.update(self._tag_columns())
        return meta, eps

    def _ids(self, seq0: int) -> np.ndarray:
        return (seq0 + np.arange(len(self.rows), dtype=np.int64)) * self.cfg.n_shards + self.shard

    def _flags(self, term: np.ndarray, trunc: np.ndarray) -> np.ndarray:
        flags = (term * TERMINATED | trunc * TRUNCATED).astype(np.uint8)
        flags[self.nx_rows] |= EXPLICIT_NEXT
        return flags

    def _tag_columns(self) -> dict[str, np.ndarray]:
        """One column per schema tag: string codes (0 = missing) or NaN-xor floats."""
        b, n = self.b, len(self.rows)
        out = {}
        for name, kind in self.schema.tags.items():
            tc = tag_column(name)
            if kind == "str":
                codes = self.str_cols.get(tc)
                out[tc] = np.zeros(n, np.int32) if codes is None else self._sel(codes)
            else:
                vals = self._sel(b.nums[tc]) if tc in b.nums else np.full(n, np.nan)
                out[tc] = nan_xor(vals.astype(np.float64))
        return out

    def _writes(self, meta: dict[str, np.ndarray], slot0: int) -> Writes:
        """Metadata and payload fields as dense columns; ragged fields, explicit next_obs
        and info as sparse rows."""
        w = Writes(slot0, self.cfg.cap)
        for col, arr in meta.items():
            if col in RUN_COLUMNS:
                w.run_table(f"mr:{col}", arr)
                continue
            dtype = META.get(col) or (STR_TAG_DTYPE if arr.dtype.kind == "i" else NUM_TAG_DTYPE)
            data = np.ascontiguousarray(arr, dtype)
            zero = not data.view(np.uint8).any()  # an unused column costs no memory
            w.dense(f"m:{col}", dtype.itemsize, META_CHUNK_SLOTS, data.data.cast("B"), zero)
        for name, spec in self.schema.fields.items():
            v = self.b.fields[name]
            if spec.codec is not None:
                part = _rows_of(v, self.rows) if not self.whole else v
                frames = frames_of(spec, part, meta["id"], self._runs)
                w.rows(f"z:{name}", list(range(len(self.rows))), frames)
                w.clear.append([f"z:{name}", SPARSE_CHUNK_SLOTS])
            elif spec.ragged:
                self._ragged_rows(w, name, spec.row_bytes, v)  # type: ignore[arg-type]  # a ragged field's value is Ragged
            elif not isinstance(v, Placed):  # Placed: already written in place by the client
                arr = np.ascontiguousarray(self._sel(v))
                blob = arr.data.cast("B") if arr.size else b""
                w.dense(f"f:{name}", spec.row_bytes, payload_chunk_slots(spec.row_bytes), blob)
        if len(self.nx_rows):
            w.rows("nx", self.nx_rows.tolist(), self._explicit_blobs(self.nx_rows))
        info_rows, info_blobs = self._info()
        if info_rows:
            w.rows("info", info_rows, info_blobs)
        w.clear += [["nx", SPARSE_CHUNK_SLOTS], ["info", SPARSE_CHUNK_SLOTS]]
        return w

    def _ragged_rows(self, w: Writes, name: str, row_bytes: int, v: Ragged) -> None:
        n = len(self.rows)
        rg = v if self.whole else v.take(self.rows)
        values = np.ascontiguousarray(rg.values)
        off, raw = rg.offsets, values.data.cast("B") if values.size else b""  # all rows empty
        # An empty row is not stored (readers take a missing entry for one; the commit has
        # cleared the slots' old entries): a field most steps leave empty, such as a joint
        # step's global state, costs only the steps that hold it. obs keeps every entry:
        # eviction copies it to a predecessor's next_obs.
        rows = range(n) if name == "obs" else np.flatnonzero(rg.lengths).tolist()
        blobs = [raw[off[i] * row_bytes : off[i + 1] * row_bytes] for i in rows]
        w.rows(f"r:{name}", list(rows), blobs)
        w.clear.append([f"r:{name}", SPARSE_CHUNK_SLOTS])

    def _links(
        self, step_index: np.ndarray, ended: np.ndarray, seq0: int
    ) -> tuple[np.ndarray, list]:
        """In-part next deltas, and the runs of consecutive steps per episode (for the
        cross-batch links made in Lua; with ``episode_index``, each run's index entries)."""
        n = len(step_index)
        order = _by_episode(self.ep, step_index)
        ep_s, idx_s = self.ep[order], step_index[order].astype(np.int64)
        consecutive = (ep_s[1:] == ep_s[:-1]) & (idx_s[1:] == idx_s[:-1] + 1)
        consecutive &= ~ended[order][:-1]
        nxt = np.zeros(n, np.int32)
        src, dst = order[:-1][consecutive], order[1:][consecutive]
        nxt[src] = (dst - src).astype(np.int32)
        starts = np.flatnonzero(np.concatenate([[True], ~consecutive]))
        ends = np.concatenate([starts[1:] - 1, [n - 1]])
        self._runs = [order[s : e + 1] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        names = self.b.episode.values
        ep_index = self._sel(self.b.episode.index)
        # Each episode's newest row (its highest seq), whatever the rows' step order: the
        # name and index of an episode live until the ring passes its newest step.
        new_ep = np.concatenate([[True], ep_s[1:] != ep_s[:-1]])
        newest = np.maximum.reduceat(order, np.flatnonzero(new_ep))[np.cumsum(new_ep) - 1]
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
                    int(newest[s]),
                ]
            )
            if self.cfg.episode_index:  # the run's step_index, id pairs, packed in Lua
                rows = order[s : e + 1]
                ids = (seq0 + rows) * self.cfg.n_shards + self.shard
                eps[-1].append(np.column_stack([idx_s[s : e + 1], ids]).ravel().tolist())
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

    def _explicit_blobs(self, nx_rows: np.ndarray) -> list[Any]:
        b = self.b
        idx = {int(r): j for j, r in enumerate(b.next_rows.tolist())}
        src_rows = nx_rows if self.whole else self.rows[nx_rows]
        obs = self.schema.fields["obs"]
        if obs.codec is not None or isinstance(b.next_obs, Encoded):
            pos = np.array([idx[int(r)] for r in src_rows.tolist()], np.int64)
            return explicit_frames(obs, _rows_of(b.next_obs, pos))  # type: ignore[arg-type]  # next_obs is set when explicit rows exist
        out = []
        for r in src_rows.tolist():
            v = b.next_obs
            j = idx[int(r)]
            row = v.row(j) if isinstance(v, Ragged) else v[j]  # type: ignore[union-attr]  # a payload field is Ragged or an array here
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


def _by_episode(ep: np.ndarray, step_index: np.ndarray) -> np.ndarray:
    """``np.lexsort((step_index, ep))``: rows by episode code, then step index. When the
    rows come as a few runs of one episode each, in step order (a vectorised producer's
    batch), the runs are sorted instead of the rows: ~5x less than ``lexsort`` here."""
    n = len(ep)
    change = ep[1:] != ep[:-1]
    heads = np.flatnonzero(np.concatenate([[True], change]))
    if n < 2 or 8 * len(heads) > n or not ((step_index[1:] >= step_index[:-1]) | change).all():
        return np.lexsort((step_index, ep))
    codes = ep[heads]
    by_code = np.argsort(codes, kind="stable")
    if (codes[by_code][1:] == codes[by_code][:-1]).any():  # an episode in several runs
        return np.lexsort((step_index, ep))
    ends = np.append(heads[1:], n)
    return np.concatenate([np.arange(heads[i], ends[i]) for i in by_code.tolist()])


def _chunk_runs(blob: Any, row_bytes: int, chunk_slots: int, slot0: int, cap: int) -> list[Any]:
    """``blob``'s rows cut where their chunks end (views), as ``slot_runs`` in ranges.lua
    walks them: the script writes each run whole instead of copying it out in Lua."""
    if not row_bytes:  # nothing to write: the script refuses it, as a chunk of no bytes
        return [blob]
    n, out, i = len(blob) // row_bytes, [], 0
    while i < n:
        slot = (slot0 + i) % cap
        run = min(n - i, chunk_slots - slot % chunk_slots, cap - slot)
        out.append(blob[i * row_bytes : (i + run) * row_bytes])
        i += run
    return out


def _rows_of(v: Any, rows: np.ndarray) -> Any:
    """``rows`` of a field value (an array's ``take`` would index it flattened)."""
    return v.take(rows) if isinstance(v, Ragged | Encoded) else v[rows]
