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
