"""Claw's files in ``/dev/shm``, shared by the processes of one host: created, opened and
mapped safely, named, and reaped, for both kinds — the shared sampling index's set of files
(:class:`IndexFiles`, :mod:`orchestrator.sampling.shared`) and the batch segments of the
delivery's fast path (:mod:`orchestrator.delivery.shm`).

A name is never followed through a symlink (``O_NOFOLLOW``: a planted link must not get a
file of ours mapped read-write), nor opened blocking (a planted FIFO), the file must be a
regular one this user owns, created ``0600``, and a mapping is never made past the file's
end (a read there is a SIGBUS, not an error). :func:`reap_orphans` is the one reaper: it
knows every kind of Claw file and what makes one an orphan.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import mmap
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
INDEX_PREFIX = "clawidx-"
"""A shared index's files: ``clawidx-<key>.<part>``, named by what they index."""
SEGMENT_PREFIX = "claw-"
"""A batch segment: ``claw-<pid namespace>-<creator pid>-<random>[.taken]``, named by
who made it (its reaper asks whether that process still runs)."""
ORPHAN_AGE_S = 600.0
"""Segments older than this are reaped whatever their creator (their reader is gone)."""
# The shared sampling index's .ctl header (orchestrator.sampling.shared): int64 fields.
H_MAGIC, H_STARTED, H_GEN, H_DIRTY, H_REBUILDS, H_META, H_HEAD, H_JSON, H_RING, H_WROTE = range(10)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map all pages in one call


def open_file(path: Path, *, create: bool, exclusive: bool = False) -> int:
    """A read-write descriptor of ``path`` (made empty when ``create`` and absent;
    ``exclusive``: made now, or FileExistsError).

    Raises FileNotFoundError when absent and not ``create``, ValueError when the name is
    a symlink or not a regular file owned by this user. A file made ``exclusive`` cannot
    be a planted one (no existing name is opened, a link neither), so its other errors
    stay OSErrors (ENOSPC, EMFILE: the caller's fallback handles them)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= (os.O_CREAT if create else 0) | (os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as e:
        if exclusive:
            raise
        raise ValueError(f"{path}: cannot open it safely ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ValueError(f"{path}: not a regular file owned by this user; remove it")
    return fd


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not unlinked or replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def map_file(fd: int, size: int, *, populate: bool = False) -> mmap.mmap:
    """Map the first ``size`` bytes of ``fd`` read-write and shared, its pages allocated
    first: a full tmpfs (a container's 64 MB ``/dev/shm``) is then an OSError (ENOSPC)
    here, not a SIGBUS at the first write to a page it cannot back. ``populate``: map
    every page now, in one call (a mapping reused for many writes); else they fault in
    on first touch (cheaper for a mapping read once)."""
    if os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0))


@functools.cache
def pid_namespace() -> int:
    """This process's pid namespace (a segment's creator pid means something only in it)."""
    return os.stat("/proc/self/ns/pid").st_ino


def segment_name() -> str:
    """A fresh name for a batch segment made by this process."""
    return f"{SEGMENT_PREFIX}{pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"


def free_bytes(directory: Path = SHM_DIR) -> int:
    """Bytes this user may still allocate in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def unlink(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@dataclass
class IndexFiles:
    """A process's descriptors and mappings of one shared index (closed by its finalizer,
    which also removes the files when no other process uses them)."""

    base: Path
    pid: int = field(default_factory=os.getpid)
    lock: int = -1
    users: int = -1
    ctl: mmap.mmap | None = None
    data: mmap.mmap | None = None
    data_name: str = ""

    def paths(self) -> list[Path]:
        """Every file of this index, the lock file last."""
        lock = self.base.with_suffix(".lock")
        found = sorted(self.base.parent.glob(f"{self.base.name}.*"))
        return [p for p in found if p != lock] + [lock]

    def close(self, invalidate: bool = False) -> None:
        if self.pid != os.getpid():  # a forked child's copy: the parent's locks stay
            for fd in (self.lock, self.users):
                if fd >= 0:
                    os.close(fd)
            self.lock = self.users = -1
            return
        if self.lock < 0:
            return
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        if invalidate and self.ctl is not None:
            np.frombuffer(self.ctl, np.int64, 16)[H_DIRTY] = 1
        fcntl.flock(self.users, fcntl.LOCK_UN)
        try:
            fcntl.flock(self.users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another process still uses them
        else:  # the last one: remove everything, the lock file last (still held)
            unlink(*self.paths())
        os.close(self.users)
        os.close(self.lock)  # releases the lock
        self.lock = self.users = -1


class Kind(enum.Flag):
    """The kinds of Claw files :func:`reap_orphans` reaps."""

    INDEX = enum.auto()  # a shared sampling index's files
    SEGMENT = enum.auto()  # a batch segment


def reap_orphans(
    max_age_s: float = ORPHAN_AGE_S,
    *,
    dead_grace_s: float = 5.0,
    directory: Path = SHM_DIR,
    kinds: Kind = Kind.INDEX | Kind.SEGMENT,
) -> list[str]:
    """Remove Claw's orphaned files of ``kinds`` in ``directory``; returns the names
    removed (a caller holding an index's lock asks for indexes only: no segment's creator
    is looked up meanwhile).

    - a shared index's files, when no process uses them (their last user was killed
      before it could remove them): nobody holds ``.users`` or ``.lock``;
    - a batch segment older than ``max_age_s`` (its reader is gone), or whose creator is
      dead and that is older than ``dead_grace_s``: a segment whose creator exited while
      its reference still waits in a queue goes too, and its reader gets
      ``SegmentMissing`` and pops the next batch."""
    removed: list[str] = []
    if Kind.INDEX in kinds:
        for path in directory.glob(f"{INDEX_PREFIX}*.users"):
            removed += _unused_index(path)
    if Kind.SEGMENT in kinds:
        now = time.time()
        for path in directory.glob(f"{SEGMENT_PREFIX}*"):
            try:
                age = now - path.lstat().st_mtime
            except FileNotFoundError:
                continue
            dead = age > dead_grace_s and _creator_alive(path.name) is False
            if age > max_age_s or dead:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path.name)
    return removed


def _unused_index(users: Path) -> list[str]:
    """Remove the files of the shared index whose ``.users`` file this is when no process
    uses it (nor is attaching); returns their names."""
    base = users.with_suffix("")
    try:
        ufd = open_file(users, create=False)
    except (FileNotFoundError, ValueError):
        return []
    try:
        lfd = open_file(base.with_suffix(".lock"), create=False)
    except (FileNotFoundError, ValueError):
        os.close(ufd)
        return []
    try:
        fcntl.flock(ufd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return []  # in use, or being attached
    else:
        paths = IndexFiles(base).paths()
        unlink(*paths)
        return [p.name for p in paths]
    finally:
        os.close(lfd)
        os.close(ufd)


def _creator_alive(name: str) -> bool | None:
    """Whether a segment's creator runs; None when unknown (another pid namespace)."""
    try:
        ns, pid = (int(part) for part in name[len(SEGMENT_PREFIX) :].split("-")[:2])
    except ValueError:
        return None
    if ns != pid_namespace():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
