"""The gateway's spool: answered calls on local disk until the store has them.

A handler appends its call's record here before the reply goes back to the agent (one
``write()`` of a few KB to the page cache, no fsync unless asked); the recorder thread
appends, before it publishes a batch, which calls that batch holds and under which batch
id (``group``), and, once the store confirms the batch (the done records of its
messages) or the call is counted unrecorded, that the calls are settled (``ack``). A
process SIGKILLed at any point leaves in its spool every answered call the store may not
have: the next gateway on the spool re-records them, a grouped call in its batch again
under the same id (the ingest worker commits a batch id once: the message sent before
the kill and the one sent after cannot both land), a call numbered before the kill
keeping its turn index (the turn script hands out one index per call id). What a write()
does not survive is the machine losing power before the kernel wrote the page out:
``fsync=True`` covers that, at a disk flush per call.

The directory must be the gateway's user's and closed to others (its records become
stored turns). Layout: ``DIR/lock`` (an exclusive ``flock`` held for the process's life:
one gateway per spool), ``DIR/owner`` (the namespace whose calls it holds: a gateway of
another one is refused while any are left) and segments ``DIR/<n>.spool``, appended to
in order. A segment is a run of records, each
``<kind u8><meta u32><body u32><crc32 u32>`` then ``meta`` (JSON) and ``body`` (raw
bytes: a call's reply); a record cut short (the process died in its write) or failing
its crc ends its segment's reading, one whose JSON is not a record's is skipped. The
active segment is rotated at ``segment_bytes``; segments are deleted oldest first once
every call in them is settled (acks may name calls of older segments, so a newer one is
never deleted first). The segments together stay under ``max_bytes``: a call that does
not fit is not spooled (:meth:`Spool.append_call` returns False: the caller counts it,
and records it from memory only). No pickle: JSON and raw bytes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<BIII")
CALL, GROUP, ACK = 1, 2, 3
SEGMENT_BYTES = 16 * 1024 * 1024
"""Bytes after which the active segment is closed and a new one begun."""
_ROTATE_SETTLED = 1024 * 1024
"""An active segment of at least this many bytes whose calls are all settled is rotated
(then deleted) at once, rather than waiting to reach ``SEGMENT_BYTES``."""


class SpoolLocked(RuntimeError):
    """Another process holds the spool, or it holds another namespace's calls."""


@dataclass
class Spooled:
    """A call found in the spool on start, not settled: its record as the gateway wrote it,
    and the batch id it was grouped under before the kill ('' none)."""

    call_id: str
    meta: bytes
    body: bytes
    batch_id: str = ""


@dataclass
class _Segment:
    number: int
    path: Path
    size: int = 0
    pending: set[str] = field(default_factory=set)


class Spool:
    """One gateway process's spool in ``directory`` (created if missing). Opening it takes
    its lock (:class:`SpoolLocked` with a one-line message when held) and reads what a
    previous process left: :attr:`found`, the unsettled calls in the order they were
    answered. Thread-safe: handlers append calls, the recorder thread groups and settles."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        *,
        segment_bytes: int = SEGMENT_BYTES,
        fsync: bool = False,
        owner: str = "",
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(self.dir)
        self.max_bytes, self.segment_bytes, self.fsync = max_bytes, segment_bytes, fsync
        lock = self.dir / "lock"
        self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # a lock file its holder removed (closing) between our open and our flock
            if os.fstat(self._lock_fd).st_ino != os.stat(lock).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            os.close(self._lock_fd)
            raise SpoolLocked(
                f"the spool {self.dir} is held by another gateway process (give each its "
                "own: --spool DIR)"
            ) from None
        self._mutex = threading.Lock()
        self._segments: list[_Segment] = []
        self._where: dict[str, _Segment] = {}  # unsettled call id -> its segment
        self.found = self._read()
        mark = self.dir / "owner"  # whose calls these are (the namespace)
        held = mark.read_text() if mark.exists() else ""
        if held and held != owner and self.found:
            os.close(self._lock_fd)
            raise SpoolLocked(
                f"the spool {self.dir} holds calls of {held!r}, not {owner!r}: give this "
                "gateway its own (--spool DIR)"
            )
        mark.write_text(owner)
        number = self._segments[-1].number + 1 if self._segments else 0
        self._active = self._open(number)
        self._delete_settled()

    # ---- writing ----------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The segments' bytes together."""
        return sum(s.size for s in self._segments)

    def append_call(self, call_id: str, meta: bytes, body: bytes) -> bool:
        """Spool an answered call; False (nothing written) when the spool is full."""
        record = _record(CALL, meta, body)
        with self._mutex:
            if self.size + len(record) > self.max_bytes:
                return False
            seg = self._write(record)
            seg.pending.add(call_id)
            self._where[call_id] = seg
        return True

    def group(self, batch_id: str, call_ids: Iterable[str]) -> None:
        """Note that the batch ``batch_id`` (about to be published) holds these calls."""
        self._note(GROUP, {"b": batch_id, "c": list(call_ids)})

    def settle(self, call_ids: Iterable[str]) -> None:
        """These calls are in the store (or counted unrecorded): forget them, and delete
        the segments left with nothing unsettled."""
        ids = [c for c in call_ids if c in self._where]
        if not ids:
            return
        self._note(ACK, {"c": ids})
        with self._mutex:
            for c in ids:
                seg = self._where.pop(c, None)
                if seg is not None:
                    seg.pending.discard(c)
            self._delete_settled()

    def close(self) -> None:
        """Release the spool; a spool with nothing unsettled is removed."""
        with self._mutex:
            os.close(self._active_fd)
            if not self._where:
                for s in self._segments:
                    s.path.unlink(missing_ok=True)
                self._segments.clear()
            if not self._segments:  # removed while held: a newcomer locks a new file
                (self.dir / "owner").unlink(missing_ok=True)
                (self.dir / "lock").unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # something else is in it
                    self.dir.rmdir()
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)

    def _note(self, kind: int, what: dict) -> None:
        """Append a group or ack record (bookkeeping: past the cap if it must be). A
        failed write is logged, not raised: the recording goes on; what the note would have
        said is then lost to a kill (an ack: the calls are recorded again, under the same
        batch id; a group: again under a new one)."""
        record = _record(kind, json.dumps(what, separators=(",", ":")).encode(), b"")
        with self._mutex:
            try:
                self._write(record)
            except OSError as e:
                log.warning("spool %s: a note could not be written: %s", self.dir, e)

    def _write(self, record: bytes) -> _Segment:
        """Append ``record`` to the active segment (the caller holds the mutex)."""
        seg = self._active
        if seg.size and seg.size + len(record) > self.segment_bytes:
            os.close(self._active_fd)
            seg = self._active = self._open(seg.number + 1)
        try:
            written = os.write(self._active_fd, record)
        except OSError:
            written = -1
        if written != len(record):  # a disk full: no torn record before the next one
            os.ftruncate(self._active_fd, seg.size)
            raise OSError(f"spool {self.dir}: a record could not be written whole")
        if self.fsync:
            os.fsync(self._active_fd)
        seg.size += len(record)
        return seg

    def _open(self, number: int) -> _Segment:
        seg = _Segment(number, self.dir / f"{number:010d}.spool")
        self._active_fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        seg.size = os.fstat(self._active_fd).st_size
        self._segments.append(seg)
        return seg

    def _delete_settled(self) -> None:
        """Delete the oldest segments while they have nothing unsettled (the caller holds
        the mutex); an active one so settled and grown is rotated first."""
        active = self._active
        grown = active.size >= min(_ROTATE_SETTLED, self.segment_bytes)
        if grown and all(not s.pending for s in self._segments):
            os.close(self._active_fd)
            self._active = self._open(active.number + 1)
        while self._segments[0] is not self._active and not self._segments[0].pending:
            self._segments.pop(0).path.unlink(missing_ok=True)

    # ---- reading what a previous process left ------------------------------------------
    def _read(self) -> list[Spooled]:
        calls: dict[str, Spooled] = {}
        numbered = []
        for path in self.dir.glob("*.spool"):
            with contextlib.suppress(ValueError):  # not a segment's name
                numbered.append((int(path.stem), path))
        for number, path in sorted(numbered):
            seg = _Segment(number, path, path.stat().st_size)
            self._segments.append(seg)
            for kind, meta, body in _records(path):
                try:
                    what = json.loads(meta)
                    if kind == CALL:
                        call_id = str(what["call_id"])
                        calls[call_id] = Spooled(call_id, meta, body)
                        seg.pending.add(call_id)
                        self._where[call_id] = seg
                    elif kind == GROUP:
                        for c in what["c"]:
                            if c in calls:
                                calls[c].batch_id = str(what["b"])
                    else:
                        for c in what["c"]:
                            calls.pop(c, None)
                            old = self._where.pop(c, None)
                            if old is not None:
                                old.pending.discard(c)
                except (ValueError, KeyError, TypeError) as e:  # whole, yet not a record of ours
                    log.warning("spool %s: a record that cannot be read skipped: %r", path, e)
        return list(calls.values())


def _check_private(directory: Path) -> None:
    """Refuse a spool another user could write to (its records become stored turns): the
    directory must be this user's and closed to others, its parent this user's or root's
    (a shared temporary directory's subdirectory made by someone else is not)."""
    uid = os.getuid()
    st = os.stat(directory)
    if st.st_uid != uid or st.st_mode & 0o022:
        raise PermissionError(
            f"the spool {directory} is another user's or writable by others: give this "
            "gateway a directory of its own (--spool DIR)"
        )
    if os.stat(directory.parent).st_uid not in (uid, 0):
        raise PermissionError(
            f"the spool's parent {directory.parent} is another user's: give this gateway a "
            "directory of its own (--spool DIR)"
        )


def _record(kind: int, meta: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(meta))
    return b"".join((_HEAD.pack(kind, len(meta), len(body), crc), meta, body))


def _records(path: Path) -> Iterable[tuple[int, bytes, bytes]]:
    """A segment's whole records, up to the first cut short or corrupt one."""
    data = path.read_bytes()
    at = 0
    while at + _HEAD.size <= len(data):
        kind, m, b, crc = _HEAD.unpack_from(data, at)
        start, end = at + _HEAD.size, at + _HEAD.size + m + b
        if end > len(data) or kind not in (CALL, GROUP, ACK):
            break
        meta, body = data[start : start + m], data[start + m : end]
        if zlib.crc32(body, zlib.crc32(meta)) != crc:
            break
        yield kind, meta, body
        at = end
    if at != len(data):
        log.warning("spool %s: %d bytes past its last whole record ignored", path, len(data) - at)
