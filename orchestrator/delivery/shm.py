"""Same-host fast path: large batches travel through POSIX shared memory (/dev/shm).

The writer streams an encoded batch into a fresh file in ``/dev/shm`` and queues a small
reference message instead of the batch: ``b"CLSR" | u32 wire format version | msgpack
{name, size, host}``, versioned with the batch encoding (:data:`wire.VERSION`). The reader
opens the file, unlinks it at once and maps it: the mapping (and so the decoded arrays,
which are views of it) stays valid until the last array is garbage collected, and nothing
is left in ``/dev/shm``.

Segments are named ``claw-<pid namespace>-<creator pid>-<random>`` so :func:`reap_orphans`
can reclaim the segments of writers that crashed, or of readers that died before reading.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any

import msgpack

from orchestrator.delivery.wire import (
    VERSION,
    Batch,
    Frame,
    check_version,
    decode_batch,
    is_batch,
)

SHM_DIR = Path("/dev/shm")
PREFIX = "claw-"
REF_MAGIC = b"CLSR"
_REF_PREFIX = struct.Struct("<4sI")  # magic, wire format version
DEFAULT_THRESHOLD = 256 * 1024
ORPHAN_AGE_S = 600.0
"""Segments older than this are reaped whatever their creator (their reader is gone)."""

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
def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


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


def write_segment(frame: Frame) -> str:
    """Write an encoded batch into a new segment and return its name.

    Raises ``OSError`` (e.g. ENOSPC when ``/dev/shm`` is full); nothing is left behind then.
    """
    name = f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        # write() allocates the pages (ENOSPC here when /dev/shm is full); the reader maps
        # the file only once it is whole, so no access can fault on a missing page.
        _write_all(fd, frame.chunks())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return name


def read_segment(name: str, size: int) -> Batch:
    """Map a segment, unlink it and decode the batch zero-copy (arrays are writable views)."""
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"not a Claw segment name: {name!r}")
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise SegmentMissing(name) from None
    try:
        path.unlink(missing_ok=True)
        if os.fstat(fd).st_size != size:
            raise ValueError(f"segment {name}: size {os.fstat(fd).st_size} != {size}")
        mm = mmap.mmap(fd, size)  # lazy faults: MAP_POPULATE measured slower overall
    finally:
        os.close(fd)
    return decode_batch(mm)


def to_message(
    frame: Frame, *, reader_host: str | None, threshold: int = DEFAULT_THRESHOLD
) -> bytes:
    """The queue item for a batch: a shm reference when the reader shares this host and the
    batch is at least ``threshold`` bytes, else the encoded batch itself.

    Falls back to the inline encoding if the segment cannot be written.
    """
    if reader_host is not None and frame.nbytes >= threshold and reader_host == host_id():
        try:
            name = write_segment(frame)
        except OSError as exc:
            log.warning("shm fast path unavailable, sending the batch inline: %s", exc)
        else:
            return reference_message(name, frame.nbytes, reader_host)
    return frame.tobytes()


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
    if name.startswith(PREFIX) and "/" not in name:
        (SHM_DIR / name).unlink(missing_ok=True)


def _creator_alive(name: str) -> bool | None:
    """Whether a segment's creator runs; None when unknown (another pid namespace)."""
    try:
        ns, pid = (int(part) for part in name[len(PREFIX) :].split("-")[:2])
    except ValueError:
        return None
    if ns != _pid_namespace():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(max_age_s: float, *, dead_grace_s: float = 5.0) -> list[str]:
    """Remove Claw segments older than ``max_age_s``, or whose creator is dead and that are
    older than ``dead_grace_s``. Returns the names removed.

    A segment whose creator exited while its reference still waits in a queue is reaped after
    ``dead_grace_s`` too; its reader then gets :class:`SegmentMissing` and pops the next batch.
    """
    removed = []
    now = time.time()
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > max_age_s or (age > dead_grace_s and _creator_alive(path.name) is False):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    return removed
