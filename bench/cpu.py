"""CPU seconds of what a bench runs beside it: a process group (a Celery worker and its
pool) from /proc, and a redis-server from ``INFO cpu``. CPU time moves less with the
shared machine's load than wall time does."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import redis

TICK = os.sysconf("SC_CLK_TCK")


def _stat(d: Path) -> list[str] | None:
    """The fields of ``/proc/<pid>[/task/<tid>]/stat`` after the command name (None: gone)."""
    try:
        return (d / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _seconds(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _processes() -> list[tuple[Path, list[str]]]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (fields := _stat(d)) is not None:
            out.append((d, fields))
    return out


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group."""
    return sum(_seconds(f) for _, f in _processes() if int(f[2]) == pgid)


def redis_cpu(r: redis.Redis) -> float:
    """CPU seconds (user + system) the redis-server has used since it started."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by Python thread
    name (threads of one name summed; threads Python did not start as ``native-<tid>``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for d in Path("/proc/self/task").iterdir():
        if (fields := _stat(d)) is not None:
            name = names.get(int(d.name), f"native-{d.name}")
            out[name] = out.get(name, 0.0) + _seconds(fields)
    return out


def children_cpu(marker: str) -> float:
    """CPU seconds (user + system) of this process's live children whose command line
    holds ``marker`` (e.g. the adapters' read-ahead processes)."""
    total = 0.0
    for d, fields in _processes():
        if int(fields[1]) != os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            total += _seconds(fields)
    return total
