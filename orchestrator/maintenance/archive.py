"""Archival to Parquet: the ``claw.maintenance.archive`` task (nightly, by beat) and
``claw archive NS --to DIR``.

Layout: ``DIR/ns=<namespace>/date=<YYYY-MM-DD>/part-<shard>-<seq_lo>-<seq_hi>.parquet``
(the date is the steps' commit date, UTC; ``seq`` = id // n_shards) and one
``DIR/ns=<namespace>/_manifest.json`` listing every file with its rows, id range and
SHA-256, and the per-shard watermark the files reach.

Incremental: a shard is read from its watermark (``Store.watermarks``) up, a bounded run of
slots at a time. Per run: files (temp name, fsync, rename, fsync dir), then the manifest
(the same way), then the watermark. A crash leaves files the manifest does not list (the
next run deletes them and writes those steps again) or a manifest ahead of the watermark
(the next run moves the watermark up to it): no step is written twice, none is skipped.
"""

from __future__ import annotations

import datetime as dt
import secrets
import shlex
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from claw_tasks.connection.resp import Commands, RoundTrips
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.schema import tag_column
from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED, UNTRAINABLE
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.scan import read_fixed_into, read_meta_run, read_payload_run
from claw_tasks.store.scripts import Lua
from claw_tasks.worker.app import app
from orchestrator.maintenance.archive_files import (
    MANIFEST,
    Manifest,
    PendingFile,
    namespace_dir,
    write_parquet,
)
from orchestrator.maintenance.beat import each_namespace
from orchestrator.maintenance.snapshots import archive_snapshots
from orchestrator.maintenance.steptable import STRING_COLUMNS, TAG_PREFIX, StepRows

CHUNK_BYTES = 64 * 1024 * 1024  # payload read and written per file, at most
MAX_CHUNK_ROWS = 1 << 18
_UNLOCK = Lua("unlock", "orchestrator")

Progress = Callable[[int], None]  # called with the number of seqs just covered

__all__ = [
    "CHUNK_BYTES",
    "ArchiveBusy",
    "ArchiveLock",
    "ArchiveResult",
    "Archiver",
    "archive",
    "archive_namespace",
    "pending",
]


class ArchiveBusy(RuntimeError):
    """Another archive run holds the namespace's lock."""


# ---- the lock -------------------------------------------------------------------------
class ArchiveLock:
    """One archive run per namespace: a token lock with a TTL, extended while it runs (a
    killed run's lock lapses after ``ttl`` seconds)."""

    def __init__(self, store: Store, ttl: float) -> None:
        self.r, self.key, self.ttl = store.r, store.owned_key("archive-lock"), ttl
        self.token = secrets.token_hex(8)

    def __enter__(self) -> ArchiveLock:
        if not self.r.set(self.key, self.token, nx=True, px=int(self.ttl * 1000)):
            raise ArchiveBusy(
                f"another archive run holds {self.key} (it lapses {self.ttl:g}s after that "
                "run stops); try again later"
            )
        return self

    def extend(self) -> None:
        """Keep the lock; raise if it lapsed and another run took it."""
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) != self.token.encode():
                    raise ArchiveBusy(f"lost the archive lock {self.key} (the run stalled)")
                pipe.multi()
                pipe.pexpire(self.key, int(self.ttl * 1000))
                pipe.execute()
            except redis.WatchError:
                raise ArchiveBusy(f"lost the archive lock {self.key}") from None

    def __exit__(self, *exc: object) -> None:
        _UNLOCK(self.r, [self.key], [self.token])


# ---- archiving ------------------------------------------------------------------------
@dataclass
class ArchiveResult:
    namespace: str
    files: list[str] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0
    watermarks: dict[int, int] = field(default_factory=dict)
    overwritten: int = 0  # seqs the ring reused before they were archived
    blocked: dict[int, int] = field(default_factory=dict)  # shard -> seq still in flight
    snapshots: list[str] = field(default_factory=list)  # snapshot files written this run

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "files": self.files,
            "rows": self.rows,
            "bytes": self.bytes,
            "watermarks": {str(k): v for k, v in self.watermarks.items()},
            "overwritten": self.overwritten,
            "blocked": {str(k): v for k, v in self.blocked.items()},
            "snapshots": self.snapshots,
        }


def pending(store: Store) -> int:
    """Seqs above the watermarks: what an archive run would go through."""
    store.config(refresh=True)
    with store.r.pipeline(transaction=False) as pipe:
        n = store.queue_seqs(pipe)
        store.queue_watermarks(pipe)
        got = [int(v or 0) for v in pipe.execute()]
    return sum(max(0, seq - wm) for seq, wm in zip(got[:n], got[n:], strict=True))


@dataclass
class _Run:
    """What ``Archiver._read`` found in a run of seqs."""

    covered: int  # seqs settled from the run's start (the watermark may move past them)
    rows: StepRows | None = None
    seqs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lost: int = 0  # steps overwritten while they were read


class Archiver:
    """Archives one namespace into ``root`` (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        root: Path | str,
        *,
        grace: float | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        progress: Progress | None = None,
    ) -> None:
        self.store, self.root = store, Path(root)
        self.dir = namespace_dir(self.root, store.namespace)
        # A seq allocated but not committed holds the watermark back, until a later seq of
        # the shard has been committed for this long (its allocation is then abandoned).
        self.grace = 2 * get_settings().visibility_timeout if grace is None else grace
        self.chunk_bytes = chunk_bytes
        self.progress = progress or (lambda n: None)

    def run(self, lock_ttl: float | None = None) -> ArchiveResult:
        cfg = self.store.config(refresh=True)
        if cfg.schema is None:
            return ArchiveResult(self.store.namespace)
        with ArchiveLock(self.store, lock_ttl or get_settings().archive_lock_ttl) as lock:
            self.lock = lock
            manifest = self._recover(cfg.n_shards, cfg.created)
            manifest.schema, manifest.spaces = cfg.schema.to_dict(), cfg.spaces
            result = ArchiveResult(self.store.namespace)
            # Fixed-shape payloads are received straight into their arrays.
            self.round_trips = RoundTrips(self.store.r)
            try:
                for shard in range(cfg.n_shards):
                    self._shard(shard, manifest, result)
            finally:
                self.round_trips.close()
            result.watermarks = dict(manifest.watermarks)
            result.snapshots = archive_snapshots(self.store, self.dir)
            return result

    def _recover(self, n_shards: int, created: float) -> Manifest:
        """Settle what a crashed run left: files not in the manifest go, a watermark behind
        the manifest moves up. A watermark ahead of it means another directory; another
        creation time, a namespace dropped and created again (its seqs start over)."""
        manifest = Manifest.load(self.dir) or Manifest(self.store.namespace, n_shards, created)
        if manifest.created != created:
            when = dt.datetime.fromtimestamp(manifest.created, dt.UTC).isoformat(timespec="seconds")
            raise NamespaceError(
                f"{self.dir} holds the archive of an earlier namespace {self.store.namespace!r} "
                f"(created {when}; this one was dropped and created again since): archive it "
                "to another directory"
            )
        listed = {f["path"] for f in manifest.files}
        if self.dir.exists():
            for path in self.dir.rglob("*"):
                rel = path.relative_to(self.dir).as_posix()
                is_tmp = path.name.startswith(".") and path.name.endswith(".tmp")
                if path.is_file() and (is_tmp or (path.suffix == ".parquet" and rel not in listed)):
                    path.unlink()
        marks = [w or 0 for w in self.store.watermarks()]
        for shard, mark in enumerate(marks):
            have = manifest.watermarks.get(shard, 0)
            if mark > have:
                reset = (
                    "from claw_tasks.settings import get_settings; from claw_tasks.store "
                    f"import Store; Store(get_settings().redis_url, {self.store.namespace!r})"
                    f".set_watermark({shard}, 0)"
                )
                raise NamespaceError(
                    f"shard {shard} of {self.store.namespace!r} is archived up to seq {mark}, "
                    f"but {self.dir / MANIFEST} only up to {have}: its archive is in another "
                    "directory (archive there), or archive again from the oldest stored "
                    "step after setting its watermark to 0, with the same CLAW_ "
                    f"environment: python -c {shlex.quote(reset)}"
                )
            if mark < have:
                self.store.set_watermark(shard, have)
        return manifest

    def _chunk_rows(self) -> int:
        schema = self.store.config().schema
        assert schema is not None
        row = 64 + sum(256 if spec.ragged else spec.row_bytes for spec in schema.fields.values())
        return int(max(1, min(MAX_CHUNK_ROWS, self.chunk_bytes // row)))

    def _shard(self, shard: int, manifest: Manifest, result: ArchiveResult) -> None:
        cfg = self.store.config()
        mark = manifest.watermarks.get(shard, 0)
        seq_now = self.store.seq(shard)
        lo = max(mark + 1, seq_now - cfg.cap + 1)
        if lo > mark + 1:  # the ring passed these before they were archived
            result.overwritten += lo - mark - 1
            self.progress(lo - mark - 1)
        per_chunk = self._chunk_rows()

        def run_at(lo: int) -> int:
            return min(seq_now - lo + 1, per_chunk, cfg.cap - (lo - 1) % cfg.cap)

        # A pipeline of three: the next run is read from Redis (a thread) while this one
        # is encoded to temp files (here) and the files of the one before are checksummed,
        # fsynced and renamed, then listed in the manifest and the watermark moved past
        # them (another thread, one run at a time, in order: a run is settled only once
        # the one before it is).
        with (
            ThreadPoolExecutor(1, thread_name_prefix="claw-archive-read") as reads,
            ThreadPoolExecutor(1, thread_name_prefix="claw-archive-sync") as syncs,
        ):
            ahead = reads.submit(self._read, shard, lo, run_at(lo)) if lo <= seq_now else None
            settling: Future[int] | None = None
            try:
                while ahead is not None:
                    n, chunk = run_at(lo), ahead.result()
                    nxt = lo + chunk.covered
                    full = chunk.covered == n
                    more = full and nxt <= seq_now
                    ahead = reads.submit(self._read, shard, nxt, run_at(nxt)) if more else None
                    result.overwritten += chunk.lost
                    files = self._write(shard, chunk.rows, chunk.seqs) if chunk.rows else []
                    try:
                        self._settled(settling)
                    except BaseException:
                        for pending in files:
                            pending.discard()
                        raise
                    settling = syncs.submit(
                        self._settle, shard, files, chunk.covered, nxt - 1, manifest, result
                    )
                    if not full:
                        result.blocked[shard] = nxt
                    lo = nxt
            finally:
                if ahead is not None:
                    ahead.cancel()
            self._settled(settling)

    def _settled(self, settling: Future[int] | None) -> None:
        """Wait for the run being settled (raising what it raised); report its seqs."""
        if settling is not None:
            covered = settling.result()
            if covered:
                self.progress(covered)

    def _settle(
        self,
        shard: int,
        files: list[PendingFile],
        covered: int,
        mark: int,
        manifest: Manifest,
        result: ArchiveResult,
    ) -> int:
        """Make a run's files durable, then list them and move the watermark to ``mark``
        (see the module docstring); the seqs it covered."""
        try:
            entries = [pending.finish() for pending in files]
        except BaseException:
            for pending in files:
                pending.discard()
            raise
        for entry in entries:
            result.files.append(entry["path"])
            result.rows += entry["rows"]
            result.bytes += entry["bytes"]
        if covered:
            self.lock.extend()
            manifest.files += entries
            manifest.watermarks[shard] = mark
            manifest.save(self.dir)
            self.store.set_watermark(shard, mark)
        return covered

    def _read(self, shard: int, lo: int, n: int) -> _Run:
        """The settled prefix of the run of ``n`` seqs from ``lo``: how many seqs it
        covers, and the steps stored there (alive, not overwritten while read)."""
        cfg = self.store.config()
        meta = read_meta_run(self.store, shard, lo, n)
        seqs = lo + np.arange(n, dtype=np.int64)
        expected = seqs * cfg.n_shards + shard
        stored = meta["id"] == expected
        overwritten = meta["id"] > expected  # a newer seq took the slot meanwhile
        old = stored & (meta["timestamp"] < time.time() - self.grace)
        later_old = np.concatenate([np.cumsum(old[::-1])[::-1][1:], [0]]) > 0
        settled = stored | overwritten | later_old
        unsettled = np.flatnonzero(~settled)
        covered = int(unsettled[0]) if len(unsettled) else n
        rows = np.flatnonzero(stored[:covered] & meta["alive"][:covered])
        if not len(rows):
            return _Run(covered)
        schema = cfg.schema
        assert schema is not None
        direct = [k for k, f in schema.fields.items() if not f.ragged and f.codec is None]
        fields, next_obs, info = read_payload_run(
            self.store, shard, lo, covered, rows, meta["flags"], skip=direct
        )
        for name in direct:
            arr = read_fixed_into(self.store, shard, lo, covered, name, self._getranges)
            fields[name] = arr if len(rows) == covered else arr[rows]
        # Steps whose slot was reused while being read are not what we read: drop them.
        again = read_meta_run(self.store, shard, lo, covered, ["id"])
        keep = (again["id"][rows] == expected[rows]) & again["alive"][rows]
        step_rows = self._step_rows(shard, meta, rows, fields, next_obs, info)
        if not keep.all():
            step_rows = step_rows.take(np.flatnonzero(keep))
        return _Run(covered, step_rows, seqs[rows][keep], int((~keep).sum()))

    def _getranges(self, ranges: list[tuple[str, int, int]], out: memoryview) -> None:
        commands = Commands()
        commands.into(ranges, out.nbytes, out=np.frombuffer(out, np.uint8))
        self.round_trips.run(commands)

    def _step_rows(
        self,
        shard: int,
        meta: dict[str, np.ndarray],
        rows: np.ndarray,
        fields: dict[str, Any],
        next_obs: dict[int, np.ndarray],
        info: dict[int, dict[str, Any]],
    ) -> StepRows:
        schema = self.store.config().schema
        assert schema is not None
        m = {c: v[rows] for c, v in meta.items()}
        flags = m["flags"]
        strs = {c: self._strings(c, m[c]) for c in STRING_COLUMNS}
        nums = {}
        for name, kind in schema.tags.items():
            col = m[tag_column(name)]
            if kind == "str":
                strs[TAG_PREFIX + name] = self._strings(tag_column(name), col)
            else:
                nums[TAG_PREFIX + name] = col
        for name, spec in schema.fields.items():
            if spec.ragged and isinstance(fields[name], list):  # not kept frames (Encoded)
                fields[name] = Ragged.of(fields[name], spec.dtype)
        return StepRows(
            id=m["id"],
            episode_id=self._episodes(shard, m["episode"]),
            step_index=m["step_index"],
            policy_version=m["policy_version"],
            timestamp=m["timestamp"],
            reward=m["reward"],
            priority=m["priority"],
            terminated=(flags & TERMINATED) != 0,
            truncated=(flags & TRUNCATED) != 0,
            trainable=(flags & UNTRAINABLE) == 0,
            strs=strs,
            nums=nums,
            fields=fields,
            next_obs=next_obs,
            info=info,
        )

    def _strings(self, column: str, codes: np.ndarray) -> StrColumn:
        uniq, index = np.unique(codes, return_inverse=True)
        names = self.store.decode_codes(column, uniq)
        return _vocab(names, index)

    def _episodes(self, shard: int, codes: np.ndarray) -> StrColumn:
        uniq, index = np.unique(codes, return_inverse=True)
        found = self.store.episode_names(np.full(len(uniq), shard), uniq)
        names = [f"#{c}" if v is None else v for c, v in zip(uniq, found, strict=True)]
        return _vocab(names, index)

    def _write(self, shard: int, rows: StepRows, seqs: np.ndarray) -> list[PendingFile]:
        """One file per commit date of the rows, written to a temp name."""
        schema = self.store.config().schema
        assert schema is not None
        return write_parquet(self.dir, self.store.namespace, schema, shard, rows, seqs)


def _vocab(names: list[str | None], index: np.ndarray) -> StrColumn:
    """A StrColumn from decoded unique values (None = missing) and the per-row index."""
    keep = [i for i, v in enumerate(names) if v is not None]
    remap = np.full(len(names) + 1, -1, np.int32)
    remap[keep] = np.arange(len(keep), dtype=np.int32)
    return StrColumn([names[i] for i in keep], remap[index.reshape(-1)])  # type: ignore[misc]  # a dataclass of these two fields


def archive_namespace(
    store: Store, root: Path | str, progress: Progress | None = None, **kw: Any
) -> ArchiveResult:
    """Archive what is new in ``store``'s namespace to ``root`` (see the module docstring)."""
    return Archiver(store, root, progress=progress, **kw).run()


@app.task(name="claw.maintenance.archive", acks_late=True, reject_on_worker_lost=True)
def archive(
    namespace: str | None = None, to: str | None = None, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, Any]:
    """Archive one namespace, or every one, to ``to`` (default ``CLAW_ARCHIVE_DIR``), in
    files of up to ``chunk_bytes`` of payload. A namespace another run is archiving is
    left to it; any other failure fails the task (after the other namespaces are done:
    :func:`~orchestrator.maintenance.beat.each_namespace`), naming the namespace."""
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, not {chunk_bytes!r}")
    root = to or get_settings().archive_dir
    if not root:
        raise ValueError("no archive directory: set CLAW_ARCHIVE_DIR on the workers, or pass `to`")

    def work(store: Store) -> dict[str, Any]:
        try:
            return archive_namespace(store, root, chunk_bytes=chunk_bytes).to_json()
        except ArchiveBusy as e:
            return {"busy": str(e)}

    return each_namespace("archive", work, [namespace] if namespace else None)
