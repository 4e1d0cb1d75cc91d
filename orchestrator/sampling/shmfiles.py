"""Files in ``/dev/shm`` that processes of one host share: opened safely, mapped whole;
the shared sampling index's set of files (:class:`IndexFiles`) and their reaper.

The habits of :mod:`orchestrator.delivery.shm` (which sits above this layer): a name is
never followed through a symlink (``O_NOFOLLOW``: a planted link must not get a file of
ours mapped read-write), the file must be a regular one this user owns, created ``0600``,
and a mapping is never made past the file's end (a read there is a SIGBUS, not an error).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
INDEX_PREFIX = "clawidx-"  # not ``claw-``: the batch segment reaper must not take these
# The shared sampling index's .ctl header (orchestrator.sampling.shared): int64 fields.
H_MAGIC, H_STARTED, H_GEN, H_DIRTY, H_REBUILDS, H_META, H_HEAD, H_JSON, H_RING, H_WROTE = range(10)


def open_file(path: Path, *, create: bool) -> int:
    """A read-write descriptor of ``path`` (made empty when ``create`` and absent).

    Raises FileNotFoundError when absent and not ``create``, ValueError when the name is
    a symlink or not a regular file owned by this user."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        raise
    except OSError as e:
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


def map_file(fd: int, size: int) -> mmap.mmap:
    """Map the first ``size`` bytes of ``fd`` read-write, its pages allocated first: a
    full tmpfs (a container's 64 MB ``/dev/shm``) is then an OSError (ENOSPC) here, not a
    SIGBUS at the first write to a page it cannot back."""
    if os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size)


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


def reap_unused(directory: Path = SHM_DIR) -> list[str]:
    """Remove the files of shared indexes no process uses (their last user was killed
    before it could); returns the names removed."""
    removed = []
    for users in directory.glob(f"{INDEX_PREFIX}*.users"):
        base = users.with_suffix("")
        try:
            ufd = open_file(users, create=False)
        except (FileNotFoundError, ValueError):
            continue
        try:
            lfd = open_file(base.with_suffix(".lock"), create=False)
        except (FileNotFoundError, ValueError):
            os.close(ufd)
            continue
        try:
            fcntl.flock(ufd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # in use, or being attached
        else:
            paths = IndexFiles(base).paths()
            unlink(*paths)
            removed += [p.name for p in paths]
        finally:
            os.close(lfd)
            os.close(ufd)
    return removed
