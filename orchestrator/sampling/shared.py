"""One sampling index per host and namespace, in shared memory, for every process.

A :class:`~orchestrator.sampling.index.SamplingIndex` of its own in every prefetch worker
process costs ~66 bytes per slot each: 660 MB per process at 10M steps, times the pool's
processes. :class:`SharedIndex` keeps the same columns once per host, in ``/dev/shm``, and
every process of that host serving the namespace maps them:

- ``clawidx-<key>.lock``: the columns' read-write lock (``flock``). A process holds it
  shared from its :meth:`~SharedIndex.sync` until :meth:`~SharedIndex.release` (while it
  draws and assembles a batch), and exclusively while it writes: a reader never sees a
  row half written. The writer of a sync is whichever process asks first (no standing
  leader): it applies the change logs exactly as a private index does, into the shared
  columns. A process that asked while another one wrote skips its own sync if that one
  started reading the logs after it asked (it would read the same log entries; a write
  applying pages its caller read before, a fetch's tail, does not count); one that
  finds others reading columns written less than ``MAX_LAG_S`` ago reads them too
  instead of waiting to write (else the pool's processes would sample one at a time).
- ``clawidx-<key>.ctl``: a header of counters, the writer's state (the log positions, the
  namespace config, the columns' layout: JSON) and a ring of the rows each sync changed,
  from which every process refreshes its own samplers (one that fell a ring behind, or
  any process after a rebuild or a dictionary pruning, refreshes whole).
- ``clawidx-<key>.d<n>``: the columns, generation ``n`` of the layout (a cold rebuild or
  a new free tag writes a new one; the old one is unlinked, its pages freed once the last
  process has remapped).
- ``clawidx-<key>.users``: held shared by every attached process; the last one to close
  removes the files.

A writer sets ``dirty`` in the header before it touches anything and clears it last; a
writer killed half-way (SIGKILL, OOM) leaves it set and loses its lock with its life, so
the next process to sync rebuilds the columns cold, and no reader uses them meanwhile.
The files name the Redis server and namespace (``<key>``); the state records the server's
``run_id`` and the namespace's creation time, so a restarted server or a recreated
namespace is rebuilt rather than trusted.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from claw_tasks.connection.client import identity, is_cluster
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceConfig, Store, column_dtype
from claw_tasks.store.changes import positions
from orchestrator.sampling.index import LogRead, RebuildNeeded, SamplingIndex, release_heap
from orchestrator.sampling.shmfiles import (
    H_DIRTY,
    H_GEN,
    H_HEAD,
    H_JSON,
    H_MAGIC,
    H_META,
    H_REBUILDS,
    H_RING,
    H_STARTED,
    H_WROTE,
    INDEX_PREFIX,
    SHM_DIR,
    IndexFiles,
    Kind,
    free_bytes,
    map_file,
    open_file,
    reap_orphans,
    same_file,
    unlink,
)

log = logging.getLogger(__name__)
MAGIC = 0x3158444957414C43  # b"CLAWIDX1"
# Header fields (int64 each) of the .ctl file.
MAX_LAG_S = 0.05
"""How far behind the change logs a process may draw when another one is reading the
columns: it then skips writing them if they were written less than this long ago."""
STATE_AT, STATE_MAX = 4096, 1 << 20  # the JSON state's region (sparse until written)
RING_AT = STATE_AT + STATE_MAX
RING_MIN, RING_MAX = 4096, 1 << 20
"""Changed rows the ring keeps: a process more than this behind refreshes whole."""
_ALIGN = 64


def index_key(store: Store) -> str:
    """What names a namespace's shared index: its data store, the namespace and when it
    was created (a namespace made again gets files of its own: its shards and capacity
    may differ), and the user."""
    created = store.config().created
    ident = "|".join(
        str(x) for x in (*identity(store.r), store.namespace, repr(created), os.geteuid())
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def server_id(client: Any) -> str:
    """The server's ``run_id`` (a restarted server has another; its data may differ); a
    cluster's node names (its nodes' restarts are told by their change logs)."""
    if is_cluster(client):
        return "cluster:" + ",".join(identity(client)[1:])
    return str(client.info("server").get("run_id", ""))


class SharedIndex(SamplingIndex):
    """A :class:`SamplingIndex` whose columns live in shared memory (see the module
    docstring). Between :meth:`sync` and :meth:`release` the columns are current and
    unchanging; after :meth:`release` another process may rewrite them."""

    def __init__(self, store: Store, directory: Path = SHM_DIR) -> None:
        super().__init__(store)
        self._f = IndexFiles(directory / f"{INDEX_PREFIX}{index_key(store)}")
        self._finalizer = weakref.finalize(self, self._f.close)
        self._hdr: np.ndarray | None = None
        self._ring: np.ndarray | None = None
        self._writable: dict[str, np.ndarray] = {}
        self._head, self._rebuilds, self._meta = 0, -1, -1
        self._holding = False
        self._created: float | None = None
        self._run_id = ""
        self._layout: list[Any] = []

    # ---- the protocol ----------------------------------------------------------------
    def sync(self, read: LogRead | None = None, current: bool = False) -> np.ndarray | None:
        """Bring the shared columns up to date and hold them shared until
        :meth:`release`. Returns the rows changed since this process's last sync (None:
        refresh whole), and calls the listeners. ``read``: as
        :meth:`SamplingIndex.sync` (used when the shared columns are still at its
        positions).

        This process writes the columns unless another one is reading them and they were
        written less than :data:`MAX_LAG_S` ago: then it reads them as they are (waiting
        for the readers would make the pool's processes sample one at a time). With
        ``current`` it never does: the columns then hold every change logged before the
        call (its own writes, e.g. the commit whose sweep forms a rollout, included)."""
        self.release()
        while True:
            hdr = self._hdr
            asked = int(hdr[H_STARTED]) if hdr is not None else None
            recent = (
                not current
                and hdr is not None
                and not hdr[H_DIRTY]
                and time.monotonic_ns() - int(hdr[H_WROTE]) < MAX_LAG_S * 1e9
            )
            if self._exclusive(wait=not recent):
                try:
                    hdr = self._attach()
                    if hdr[H_DIRTY] or asked is None or hdr[H_STARTED] <= asked:
                        self._write(read)
                except BaseException:
                    self.columns = {}
                    fcntl.flock(self._f.lock, fcntl.LOCK_UN)
                    raise
                self.columns = self._readonly()
            self._lock(fcntl.LOCK_SH)  # a writer may slip in between: checked below
            self._holding = True
            if not self._hdr[H_DIRTY]:  # type: ignore[index]  # the header is mapped while the index is held
                break
            self.release()  # that writer died half-way: rebuild
        try:
            self._load_state(self._read_state())
            rows = self._observe()
        except BaseException:
            self.release()
            raise
        self.notify(rows)
        return rows

    def hold(self) -> bool:
        """Hold the shared columns as the last writer left them (no change-log read), with
        the log positions they are as of, and refresh this process's listeners with the
        rows other processes' syncs changed. False when there is nothing to hold yet
        (never attached, or a writer died half-way): :meth:`sync` first."""
        self.release()
        if self._hdr is None or self._f.lock < 0:
            return False
        self._lock(fcntl.LOCK_SH)
        self._holding = True
        try:
            state = self._read_state()
            if self._hdr[H_DIRTY] or not state.get("data"):
                self.release()
                return False
            self._load_state(state)
            rows = self._observe()
        except BaseException:
            self.release()
            raise
        self.notify(rows)
        return True

    def release(self) -> None:
        """Let other processes write the columns again."""
        if self._holding:
            self._holding = False
            fcntl.flock(self._f.lock, fcntl.LOCK_UN)

    def close(self, invalidate: bool = False) -> None:
        """Detach (``invalidate``: make the next sync of any process rebuild cold, e.g.
        the namespace was dropped); the last process removes the files."""
        self.release()
        self._hdr = self._ring = None
        self.columns, self._writable = {}, {}
        self._f.close(invalidate)

    def _exclusive(self, wait: bool) -> bool:
        """Take the lock exclusively; without ``wait``, only if nobody holds it."""
        if self._f.lock < 0:
            self._open_lock()  # returns it held exclusively
            return True
        try:
            fcntl.flock(self._f.lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def _lock(self, op: int) -> None:
        if self._f.lock < 0:
            self._open_lock()
        fcntl.flock(self._f.lock, op)

    def _open_lock(self) -> None:
        """Open and lock the lock file, again if it was removed before we locked it."""
        path = self._f.base.with_suffix(".lock")
        while True:
            fd = open_file(path, create=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if same_file(fd, path):
                break
            os.close(fd)
        self._f.lock = fd
        self._f.users = open_file(self._f.base.with_suffix(".users"), create=True)
        fcntl.flock(self._f.users, fcntl.LOCK_SH)
        # indexes whose processes were killed (segments are the fill's and beat's to reap)
        reap_orphans(directory=self._f.base.parent, kinds=Kind.INDEX)

    def _attach(self) -> np.ndarray:
        """The header (under the exclusive lock), mapped on first use and made when new
        or not ours; a changed server or namespace marks it dirty."""
        if self._hdr is not None:
            return self._hdr
        fd = open_file(self._f.base.with_suffix(".ctl"), create=True)
        try:
            size = os.fstat(fd).st_size
            ctl = mmap.mmap(fd, size) if size >= RING_AT else None
            hdr = None if ctl is None else np.frombuffer(ctl, np.int64, 16)
            if hdr is None or hdr[H_MAGIC] != MAGIC or RING_AT + 8 * int(hdr[H_RING]) != size:
                ring = int(np.clip(self.n_shards * self.cap, RING_MIN, RING_MAX))
                os.ftruncate(fd, 0)  # not one of ours yet: nobody else maps it
                ctl = map_file(fd, RING_AT + 8 * ring)
                hdr = np.frombuffer(ctl, np.int64, 16)
                hdr[:] = 0
                hdr[H_MAGIC], hdr[H_RING], hdr[H_DIRTY] = MAGIC, ring, 1
        finally:
            os.close(fd)
        self._f.ctl, self._hdr, ring = ctl, hdr, int(hdr[H_RING])
        self._ring = np.frombuffer(self._f.ctl, np.int64, ring, RING_AT)
        self._run_id = server_id(self.store.r)
        state = self._read_state()
        if state.get("run_id") != self._run_id:
            hdr[H_DIRTY] = 1
        return hdr

    # ---- writing (under the exclusive lock) --------------------------------------------
    def _write(self, read: LogRead | None) -> None:
        hdr = self._hdr
        assert hdr is not None
        # The columns are as of the logs read after this (or of the pages a fetch read a
        # moment before, when this write applies them).
        hdr[H_WROTE] = time.monotonic_ns()
        state = self._read_state() if not hdr[H_DIRTY] else {}
        hdr[H_DIRTY] = 1
        self.columns = {}
        if state:
            self._load_state(state)
            self.columns = self._writable
            self.log_last, self.log_seen = list(state["last"]), list(state["seen"])
        if not self.columns or read is None or read.at(self.log_last, self.log_seen) is None:
            # This write reads the logs from here on: a process that asked before now
            # may take its columns for its own sync. One that applies pages its caller
            # read earlier (a fetch's tail) must not count: a commit between that read
            # and now is not in them.
            hdr[H_STARTED] += 1
        rows = self.apply_logs(read)  # a failure leaves it dirty: the next one rebuilds
        if rows is None or self.forgotten or len(rows) > len(self._ring):  # type: ignore[arg-type]  # the ring is mapped while the index is held
            hdr[H_REBUILDS] += 1
        elif len(rows):
            head = int(hdr[H_HEAD])
            at = np.arange(head, head + len(rows)) % len(self._ring)  # type: ignore[arg-type]  # the ring is mapped while the index is held
            self._ring[at] = rows  # type: ignore[index]  # the ring is mapped while the index is held
            hdr[H_HEAD] = head + len(rows)
        self._save_state()
        hdr[H_GEN] += 1
        hdr[H_DIRTY] = 0

    def rebuild(self) -> None:
        """Read every column of every shard from Redis into a new data file."""
        last, seen, raw = positions(self.store, self.n_shards)
        self.store.config(refresh=True)
        self._take_config(raw)
        self._new_data(self.all_columns(), {})
        self.log_last, self.log_seen = last, seen
        release_heap()

    def check_config(self, raw: bytes | None) -> None:
        """A changed config: a recreated namespace is rebuilt; new free tags get a new
        data file with their columns."""
        if raw is None or raw == self.config_raw:
            return
        if NamespaceConfig.from_bytes(raw, self.store.namespace).created != self._created:
            raise RebuildNeeded
        self._take_config(raw)
        new = [c for c in self.all_columns() if c not in self.columns]
        if new:
            self.store.config(refresh=True)
            self._new_data([*self.columns, *new], dict(self.columns))
        self._hdr[H_META] += 1  # type: ignore[index]  # readers take the new schema

    def _take_config(self, raw: bytes | None) -> None:
        cfg = NamespaceConfig.from_bytes(raw, self.store.namespace) if raw else None
        self.schema = cfg.schema if cfg else None
        self._created = cfg.created if cfg else None
        self.config_raw = raw

    def _new_data(self, cols: list[str], keep: dict[str, np.ndarray]) -> None:
        """Lay ``cols`` (and ``alive``) out in a new data file: columns in ``keep``
        copied, the others read from Redis shard by shard; then publish it."""
        hdr = self._hdr
        assert hdr is not None
        rows, layout, at = self.n_shards * self.cap, [], 0
        for col in [c for c in cols if c != "alive"] + ["alive"]:
            dtype = np.dtype(bool) if col == "alive" else column_dtype(col, self.schema)
            layout.append([col, dtype.str, at])
            at += -(-rows * dtype.itemsize // _ALIGN) * _ALIGN
        name = f"{self._f.base.name}.d{int(hdr[H_META]) + 1}"
        path = self._f.base.parent / name
        unlink(path)  # left by a writer that died before publishing it
        fd = open_file(path, create=True)
        try:
            data = map_file(fd, max(at, 1))
        finally:
            os.close(fd)
        views = _views(data, layout, rows)
        for col, arr in keep.items():
            views[col][:] = arr
        read = [c for c in views if c not in keep and c != "alive"]
        if read:
            for shard in range(self.n_shards):
                part = self.read_columns(shard, read)
                for col in [*read, *([] if "alive" in keep else ["alive"])]:
                    views[col][shard * self.cap : (shard + 1) * self.cap] = part[col]
        old = self._f.data_name
        self._f.data, self._f.data_name, self._layout = data, name, layout
        self._writable = self.columns = views
        hdr[H_META] += 1
        if old and old != name:
            unlink(self._f.base.parent / old)

    def _save_state(self) -> None:
        raw = self.config_raw
        blob = json.dumps(
            {
                "run_id": self._run_id,
                "data": self._f.data_name,
                "layout": self._layout,
                "last": self.log_last,
                "seen": self.log_seen,
                "config": base64.b64encode(raw).decode() if raw else None,
            }
        ).encode()
        if len(blob) > STATE_MAX:
            raise ValueError(f"shared index state of {len(blob)} bytes > {STATE_MAX}")
        ctl = self._f.ctl
        assert ctl is not None and self._hdr is not None
        ctl[STATE_AT : STATE_AT + len(blob)] = blob
        self._hdr[H_JSON] = len(blob)

    # ---- reading (under either lock) --------------------------------------------------
    def _read_state(self) -> dict[str, Any]:
        n = int(self._hdr[H_JSON]) if self._hdr is not None else 0
        if not n or self._f.ctl is None:
            return {}
        return json.loads(bytes(self._f.ctl[STATE_AT : STATE_AT + n]))

    def _load_state(self, state: dict[str, Any]) -> None:
        """Map the data file and take the schema the state names, when they changed."""
        hdr = self._hdr
        assert hdr is not None
        if "last" in state:  # the positions the columns are as of (a reader checks from them)
            self.log_last, self.log_seen = list(state["last"]), list(state["seen"])
        if self._meta == hdr[H_META] and self._f.data_name == state.get("data"):
            return
        if state.get("data") != self._f.data_name:
            rows = self.n_shards * self.cap
            layout = state["layout"]
            fd = open_file(self._f.base.parent / state["data"], create=False)
            try:
                need = max(at + rows * np.dtype(dt).itemsize for _, dt, at in layout)
                if os.fstat(fd).st_size < need:
                    raise ValueError(f"shared index {state['data']}: shorter than its layout")
                data = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._f.data, self._f.data_name, self._layout = data, state["data"], layout
            self._writable = _views(data, layout, rows)
        raw = base64.b64decode(state["config"]) if state.get("config") else None
        if raw != self.config_raw:
            self._take_config(raw)
        self.columns = self._readonly()
        self._meta = int(hdr[H_META])

    def _observe(self) -> np.ndarray | None:
        """Rows changed since this process last looked (None: refresh whole)."""
        hdr, ring = self._hdr, self._ring
        assert hdr is not None and ring is not None
        head, rebuilds = int(hdr[H_HEAD]), int(hdr[H_REBUILDS])
        whole = rebuilds != self._rebuilds or head - self._head > len(ring)
        rows = None if whole else np.unique(ring[np.arange(self._head, head) % len(ring)])
        self._head, self._rebuilds = head, rebuilds
        return rows

    def _readonly(self) -> dict[str, np.ndarray]:
        out = {}
        for col, arr in self._writable.items():
            view = arr.view()
            view.flags.writeable = False
            out[col] = view
        return out

    def shm_bytes(self) -> int:
        """Bytes of this index's files in shared memory (allocated pages)."""
        total = 0
        for path in self._f.paths():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
        return total


def _views(data: mmap.mmap, layout: list[Any], rows: int) -> dict[str, np.ndarray]:
    """The columns of a data file (writable views of its mapping)."""
    return {col: np.frombuffer(data, np.dtype(dt), rows, at) for col, dt, at in layout}


def make_index(store: Store) -> SamplingIndex:
    """The host's shared index of the namespace where ``/dev/shm`` exists, has room for
    two generations of its columns, and ``CLAW_SHARED_INDEX`` does not turn it off; else
    one of the process's own."""
    if not (get_settings().shared_index and SHM_DIR.is_dir()):
        return SamplingIndex(store)
    cfg = store.config(refresh=True)
    mirrored = SamplingIndex(store).payload_fields() if cfg.schema is not None else {}
    need = 2 * cfg.n_shards * cfg.cap * (_BYTES_PER_SLOT + sum(mirrored.values()))
    if free_bytes(SHM_DIR) < need:
        log.warning(
            "namespace %r: %s has %d MB free, its shared sampling index needs %d MB; "
            "this process builds its own (enlarge /dev/shm, e.g. Docker's --shm-size, "
            "or set CLAW_SHARED_INDEX=0 to silence this)",
            store.namespace,
            SHM_DIR,
            free_bytes(SHM_DIR) >> 20,
            need >> 20,
        )
        return SamplingIndex(store)
    return SharedIndex(store)


_BYTES_PER_SLOT = 128  # 66 of metadata columns, free tags and the ring, with room
