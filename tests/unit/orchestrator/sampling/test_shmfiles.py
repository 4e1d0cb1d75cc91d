"""Claw's files in /dev/shm (sampling.shmfiles): one safe open and map for every kind, and
one reaper that knows what makes each kind an orphan, and reaps the kinds asked for (here
on a temporary directory)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from orchestrator.sampling import shmfiles


def _index(directory, key: str) -> list:
    paths = [
        directory / f"{shmfiles.INDEX_PREFIX}{key}.{part}" for part in ("lock", "users", "ctl")
    ]
    for path in paths:
        os.close(shmfiles.open_file(path, create=True))
    return paths


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    return int(proc.stdout)


def test_one_reaper_takes_every_kind_of_orphan_and_nothing_in_use(tmp_path):
    unused = _index(tmp_path, "unused")
    used = _index(tmp_path, "used")
    holder = shmfiles.open_file(used[1], create=False)
    fcntl.flock(holder, fcntl.LOCK_SH)  # an attached process
    fresh = tmp_path / shmfiles.segment_name()
    old = tmp_path / shmfiles.segment_name()
    ns = shmfiles.pid_namespace()
    orphan = tmp_path / f"{shmfiles.SEGMENT_PREFIX}{ns}-{_dead_pid()}-0123456789abcdef.taken"
    for path in (fresh, old, orphan):
        path.write_bytes(b"x")
    then = time.time() - 60
    os.utime(old, (then, then))
    os.utime(orphan, (then, then))
    try:
        indexes = shmfiles.reap_orphans(0, directory=tmp_path, kinds=shmfiles.Kind.INDEX)
        assert sorted(indexes) == sorted(p.name for p in unused)  # no segment looked at
        assert all(p.exists() for p in (fresh, old, orphan))
        unused = _index(tmp_path, "unused")
        removed = shmfiles.reap_orphans(3600, directory=tmp_path)
        assert sorted(removed) == sorted([p.name for p in unused] + [orphan.name])
        assert shmfiles.reap_orphans(30, directory=tmp_path) == [old.name]  # past its age
        assert all(p.exists() for p in used) and fresh.exists()
    finally:
        os.close(holder)
    assert shmfiles.reap_orphans(0, directory=tmp_path, kinds=shmfiles.Kind.SEGMENT) == [fresh.name]
    assert sorted(shmfiles.reap_orphans(3600, directory=tmp_path)) == sorted(p.name for p in used)


def test_a_planted_symlink_or_fifo_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    link = tmp_path / shmfiles.segment_name()
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="cannot open it safely"):
        shmfiles.open_file(link, create=True)
    fifo = tmp_path / shmfiles.segment_name()
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        shmfiles.open_file(fifo, create=False)  # and never blocks on it
    with pytest.raises(FileExistsError):
        shmfiles.open_file(victim, create=True, exclusive=True)
    assert victim.read_bytes() == b"keep"


def test_a_mapping_allocates_its_pages_and_stays_within_the_file(tmp_path):
    fd = shmfiles.open_file(tmp_path / shmfiles.segment_name(), create=True, exclusive=True)
    try:
        mm = shmfiles.map_file(fd, 8192, populate=True)
        assert os.fstat(fd).st_size == 8192 and len(mm) == 8192
        mm[-1:] = b"z"
        mm.close()
    finally:
        os.close(fd)
