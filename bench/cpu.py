"""CPU seconds of what a bench runs beside it: a process group (a Celery worker and its
pool) from /proc, and a redis-server from ``INFO cpu``. CPU time moves less with the
shared machine's load than wall time does."""

from __future__ import annotations

import os
from pathlib import Path

import redis

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def redis_cpu(r: redis.Redis) -> float:
    """CPU seconds (user + system) the redis-server has used since it started."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by Python thread
    name (threads of one name summed; threads Python did not start as ``native-<tid>``)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for d in Path("/proc/self/task").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(d.name), f"native-{d.name}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def children_cpu(marker: str) -> float:
    """CPU seconds (user + system) of this process's live children whose command line
    holds ``marker`` (e.g. the adapters' read-ahead processes)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and marker in cmdline:
            total += int(fields[11]) + int(fields[12])
    return total / TICK
