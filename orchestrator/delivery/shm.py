"""Same-host fast path: large batches travel through POSIX shared memory (/dev/shm).

The writer streams an encoded batch into a segment (a file in ``/dev/shm``) and queues a
small reference message instead of the batch: ``b"CLSR" | u32 wire format version |
msgpack {name, size, host}``, versioned with the batch encoding (:data:`wire.VERSION`).

Segments are reused: creating a fresh file costs the writer page allocation and zeroing,
and its reader the freeing of every page (the write of a 10.8 MB image batch took 4.3 ms
into a fresh file, 1.8 ms into a reused one: ``docs/benchmarks.md``). A segment goes round:

1. queued: the writer wrote it (under a fresh name) and queued its reference;
2. taken: the reader opened it, took a shared ``flock`` on its descriptor and renamed it
   to ``<name>.taken`` (so the name of the reference is gone: a reference is read once),
   then mapped it; the decoded arrays are views of the mapping, and the reader keeps the
   descriptor, and so the lock, until the last of them is garbage collected;
3. free: the writer, which kept its own descriptor of every segment it wrote, finds the
   ``.taken`` name with no lock on it (the reader released it, or died), renames it to a
   fresh name and overwrites it: back to 1.

A writer tracks at most :data:`POOL_SIZE` segments; a segment unlinked by anyone (a
discarded reference, the reaper) simply drops out of its pool.

:func:`deliver` skips the copy into a reused segment: the batch is laid out first and its
pending fields (the augmented images) are computed straight into the writer's own mapping
of a free segment of exactly the batch's size, kept mapped across reuses (pages that exist,
written whole before: a store through a mapping cannot report a full ``/dev/shm``).

Segments are files of :mod:`orchestrator.sampling.shmfiles`, which creates, opens, maps
and names them safely, and whose one reaper (``reap_orphans``) reclaims the segments of
writers that crashed, of readers that died before reading, and free ones nobody reused
for ``ORPHAN_AGE_S``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from orchestrator.delivery.wire import (
    VERSION,
    WireBatch,
    check_version,
    decode_batch,
    is_batch,
)
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.shmfiles import (
    SEGMENT_PREFIX,
    SHM_DIR,
    map_file,
    open_file,
    segment_name,
)

REF_MAGIC = b"CLSR"
_REF_PREFIX = struct.Struct("<4sI")  # magic, wire format version
DEFAULT_THRESHOLD = 256 * 1024
TAKEN = ".taken"
POOL_SIZE = 32
"""Segments a writer process tracks for reuse (queued, taken or free)."""

log = logging.getLogger(__name__)


class SegmentMissing(LookupError):
    """The referenced segment is gone (already read, or reaped after its TTL)."""


class ForeignSegment(ValueError):
    """The reference names a segment on another host; this process cannot read it (the
    segment stays for a reader on its host, or for that host's reaper)."""


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


@functools.cache
def host_id() -> str:
    """An id shared exactly by processes that see the same ``/dev/shm``.

    Combines ``/etc/machine-id``, the kernel boot id and the device of the ``/dev/shm`` mount,
    so two containers with private ``/dev/shm`` mounts on one machine get different ids.
    """
    shm_dev = SHM_DIR.stat().st_dev if SHM_DIR.is_dir() else "none"
    raw = f"{_read('/etc/machine-id')}|{_read('/proc/sys/kernel/random/boot_id')}|{shm_dev}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _write_all(fd: int, chunks: list[memoryview]) -> None:
    for chunk in chunks:
        while chunk.nbytes:
            chunk = chunk[os.write(fd, chunk) :]


@dataclass
class _Segment:
    fd: int  # the writer's own descriptor: the segment's pages outlive any name
    name: str  # the name it was queued under (``name + TAKEN`` once a reader has it)
    size: int
    mm: mmap.mmap | None = None  # the writer's mapping (kept while the size stays)

    def unmap(self) -> None:
        """Drop the writer's mapping (one still exported is left to the garbage collector)."""
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None


class _Pool:
    """This process's segments (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.segments: list[_Segment] = []
        self.lock = threading.Lock()

    def take(self, size: int) -> _Segment | None:
        """A free segment, locked exclusively, preferring one of ``size`` bytes."""
        found: _Segment | None = None
        for seg in list(self.segments):
            if found is not None and found.size == size:
                break
            state = _state(seg)
            if state == "gone":
                self.drop(seg)
            elif state == "free":
                if found is None or seg.size == size:
                    if found is not None:
                        fcntl.flock(found.fd, fcntl.LOCK_UN)
                    found = seg
                else:
                    fcntl.flock(seg.fd, fcntl.LOCK_UN)
        return found

    def add(self, seg: _Segment) -> None:
        self.segments.append(seg)
        while len(self.segments) > POOL_SIZE:  # forget the oldest: unlinked if free
            old = self.segments[0]
            if _state(old) == "free":
                (SHM_DIR / f"{old.name}{TAKEN}").unlink(missing_ok=True)
            self.drop(old)

    def drop(self, seg: _Segment) -> None:
        self.segments.remove(seg)
        seg.unmap()
        os.close(seg.fd)

    def release_free(self) -> None:
        """Forget every segment, unlinking the free ones."""
        for seg in list(self.segments):
            if _state(seg) == "free":
                (SHM_DIR / f"{seg.name}{TAKEN}").unlink(missing_ok=True)
            self.drop(seg)


def _state(seg: _Segment) -> str:
    """``queued``, ``taken`` (a reader holds it), ``free`` (then locked by us) or ``gone``.

    The queued name is looked at first: a reader renames it only after taking its lock,
    so a segment seen under neither name was unlinked."""
    if (SHM_DIR / seg.name).exists():
        return "queued"
    if not (SHM_DIR / f"{seg.name}{TAKEN}").exists():
        return "gone"
    try:
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "taken"
    return "free"


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _my_pool() -> _Pool:
    """This process's pool (a forked child starts its own and closes the inherited one's
    descriptors, which would keep the parent's segments alive)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            atexit.register(release_pool)
        elif _pool.pid != os.getpid():
            for seg in _pool.segments:
                seg.unmap()
                os.close(seg.fd)
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
        return _pool


def release_pool() -> None:
    """Forget this process's segments, unlinking the free ones (queued ones stay for their
    readers, taken ones for the reaper). Runs at exit."""
    with _pool_lock:
        if _pool is not None and _pool.pid == os.getpid():
            with _pool.lock:
                _pool.release_free()


def write_segment(wire: WireBatch) -> str:
    """Write an encoded batch into a segment (a free one of this process's, else a new
    one) and return its name.

    Raises ``OSError`` (e.g. ENOSPC when ``/dev/shm`` is full); no new file is left behind
    then, and a reused segment goes back to the pool.
    """
    pool = _my_pool()
    with pool.lock:
        while (seg := pool.take(wire.nbytes)) is not None:
            name = _rewrite(pool, seg, wire)
            if name is not None:
                return name
        name = segment_name()
        path = SHM_DIR / name
        fd = open_file(path, create=True, exclusive=True)
        try:
            # write() allocates the pages (ENOSPC here when /dev/shm is full); the reader
            # maps the file only once it is whole, so no access can fault on a missing page.
            _write_all(fd, wire.chunks())
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        pool.add(_Segment(fd, name, wire.nbytes))
        return name


def _rewrite(pool: _Pool, seg: _Segment, wire: WireBatch) -> str | None:
    """Overwrite free segment ``seg`` (locked by us) with ``wire`` under a fresh name;
    None when it was reaped meanwhile."""
    taken, name = SHM_DIR / f"{seg.name}{TAKEN}", segment_name()
    try:
        os.rename(taken, SHM_DIR / name)
    except FileNotFoundError:
        pool.drop(seg)
        return None
    try:
        if seg.size != wire.nbytes:
            seg.unmap()  # past a shrunk end a mapping's pages fault (SIGBUS)
            os.ftruncate(seg.fd, wire.nbytes)
        os.lseek(seg.fd, 0, os.SEEK_SET)
        _write_all(seg.fd, wire.chunks())
    except BaseException:
        os.rename(SHM_DIR / name, taken)  # free again (its bytes are rewritten on reuse)
        seg.size = os.fstat(seg.fd).st_size
        fcntl.flock(seg.fd, fcntl.LOCK_UN)
        raise
    seg.name, seg.size = name, wire.nbytes  # write() set the mtime the reaper ages it by
    fcntl.flock(seg.fd, fcntl.LOCK_UN)  # before the reference is queued
    return name


def _fill_in_place(
    pool: _Pool, wire: WireBatch, fill: Callable[[dict[str, np.ndarray]], None]
) -> str | None:
    """Lay ``wire`` out in a free segment of exactly its size (whose pages exist: written
    whole before) under a fresh name, ``fill`` its pending fields in the mapping, and
    return the name; None when there is no such segment."""
    while (seg := pool.take(wire.nbytes)) is not None:
        if seg.size != wire.nbytes:  # resizing means allocating pages: the write() path
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
            return None
        taken, name = SHM_DIR / f"{seg.name}{TAKEN}", segment_name()
        try:
            os.rename(taken, SHM_DIR / name)
        except FileNotFoundError:
            pool.drop(seg)
            continue
        try:
            if seg.mm is None:  # mapped once, then reused: no page faults per batch
                seg.mm = map_file(seg.fd, seg.size, populate=True)
            fill(wire.write_into(seg.mm))
        except BaseException:
            os.rename(SHM_DIR / name, taken)  # free again
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
            raise
        # queued now: stores through a mapping leave the mtime, by which the reaper
        # judges a segment's age, as the first write() set it
        os.utime(seg.fd)
        seg.name = name
        fcntl.flock(seg.fd, fcntl.LOCK_UN)  # before the reference is queued
        return name
    return None


def deliver(
    wire: WireBatch,
    fill: Callable[[dict[str, np.ndarray]], None],
    *,
    reader_host: str | None,
    threshold: int = DEFAULT_THRESHOLD,
) -> bytes:
    """The queue item for a batch with pending fields (:class:`~orchestrator.delivery.wire.
    Pending`), which ``fill`` writes into the arrays it is given.

    When :func:`to_message` would use a segment and one of this process's free segments has
    the batch's size, the batch is laid out in its mapping and ``fill`` writes straight into
    it (no copy of those fields into the segment afterwards); otherwise ``fill`` writes into
    new arrays and the batch goes as :func:`to_message` sends it.
    """
    if reader_host is not None and wire.nbytes >= threshold and reader_host == host_id():
        pool = _my_pool()
        with pool.lock:
            name = _fill_in_place(pool, wire, fill)
        if name is not None:
            return reference_message(name, wire.nbytes, reader_host)
    arrays = {name: np.empty(spec.shape, spec.dtype) for name, (*_, spec) in wire.pending.items()}
    fill(arrays)
    wire.place(arrays)
    return to_message(wire, reader_host=reader_host, threshold=threshold)


def read_segment(name: str, size: int) -> Batch:
    """Take a segment (lock, rename to ``<name>.taken``), map it and decode the batch
    zero-copy (arrays are writable views); the lock is held until the last array is gone."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name or name.endswith(TAKEN):
        raise ValueError(f"not a Claw segment name: {name!r}")
    path = SHM_DIR / name
    try:
        fd = open_file(path, create=False)  # never a planted symlink or another's file
    except FileNotFoundError:
        raise SegmentMissing(name) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # its writer is rewriting it: the reference is stale
            raise SegmentMissing(name) from None
        # Unlinked meanwhile (reaped)? The descriptor still reads it.
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, SHM_DIR / f"{name}{TAKEN}")
        if os.fstat(fd).st_size != size:
            raise ValueError(f"segment {name}: size {os.fstat(fd).st_size} != {size}")
        mm = map_file(fd, size)  # lazy faults: MAP_POPULATE measured slower overall
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)  # releases the lock: the writer may reuse it
    return decode_batch(mm)


def to_message(
    wire: WireBatch, *, reader_host: str | None, threshold: int = DEFAULT_THRESHOLD
) -> bytes:
    """The queue item for a batch: a shm reference when the reader shares this host and the
    batch is at least ``threshold`` bytes, else the encoded batch itself.

    Falls back to the inline encoding if the segment cannot be written.
    """
    if reader_host is not None and wire.nbytes >= threshold and reader_host == host_id():
        try:
            name = write_segment(wire)
        except OSError as exc:
            log.warning("shm fast path unavailable, sending the batch inline: %s", exc)
        else:
            return reference_message(name, wire.nbytes, reader_host)
    return wire.tobytes()


def reference_message(name: str, size: int, host: str) -> bytes:
    """The queue item referring to segment ``name`` of ``size`` bytes on ``host``."""
    ref = {"name": name, "size": size, "host": host}
    return _REF_PREFIX.pack(REF_MAGIC, VERSION) + msgpack.packb(ref)


def reference_of(msg: Any) -> dict[str, Any] | None:
    """The shm reference a queue item holds; None when it is not one. Raises
    :class:`~orchestrator.delivery.wire.WireVersionError` for an unknown version."""
    mv = memoryview(msg)
    if bytes(mv[: len(REF_MAGIC)]) != REF_MAGIC:
        return None
    if len(mv) < _REF_PREFIX.size:
        raise ValueError("truncated shm reference")
    check_version(_REF_PREFIX.unpack_from(mv)[1], "shm reference")
    ref = msgpack.unpackb(mv[_REF_PREFIX.size :], raw=False)
    if not isinstance(ref, dict):
        raise ValueError(f"corrupt shm reference: {type(ref).__name__}, not a map")
    return ref


def from_message(msg: Any) -> Batch:
    """Decode a queue item made by :func:`to_message` (inline batch or shm reference).

    Raises :class:`SegmentMissing` when a referenced segment no longer exists, and
    :class:`ForeignSegment` when it lives on another host (it is left untouched).
    """
    if is_batch(msg):
        return decode_batch(msg)
    ref = reference_of(msg)
    if ref is None:
        raise ValueError("not a Claw queue item")
    if ref["host"] != host_id():
        raise ForeignSegment(f"shm reference from host {ref['host']}, this host is {host_id()}")
    return read_segment(ref["name"], ref["size"])


def discard(msg: Any) -> None:
    """Reclaim a queue item that will never be read (unlink its segment, if it has one).

    A reference in a version this process does not know is left to the segment reaper."""
    try:
        ref = reference_of(msg)
    except ValueError:  # an unknown version (WireVersionError) or corrupt
        return
    if ref is None:
        return
    name = ref.get("name", "")
    if name.startswith(SEGMENT_PREFIX) and "/" not in name:
        (SHM_DIR / name).unlink(missing_ok=True)
