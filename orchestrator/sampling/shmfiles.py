"""Files in ``/dev/shm`` that processes of one host share: opened safely, mapped whole.

The habits of :mod:`orchestrator.delivery.shm` (which sits above this layer): a name is
never followed through a symlink (``O_NOFOLLOW``: a planted link must not get a file of
ours mapped read-write), the file must be a regular one this user owns, created ``0600``,
and a mapping is never made past the file's end (a read there is a SIGBUS, not an error).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from pathlib import Path

SHM_DIR = Path("/dev/shm")


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
    """Map the first ``size`` bytes of ``fd`` read-write (grown to ``size`` if shorter:
    tmpfs allocates pages only when they are written)."""
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)
    return mmap.mmap(fd, size)


def unlink(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
