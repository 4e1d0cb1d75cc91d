"""The command lines of Claw's Celery processes (worker, beat, flower), so that ``claw up``,
the demo, the tests and the benches start them one way. Builds no app: a caller only
spawns it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

APP = "claw_tasks.worker.app"
"""The ``-A`` target every Claw Celery process loads."""


def celery_argv(*args: str) -> list[str]:
    """``python -m celery -A claw_tasks.worker.app ARGS`` with this interpreter (the venv's
    Celery, whatever ``celery`` is on ``PATH``)."""
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def worker_argv(
    queues: str | Sequence[str],
    concurrency: int,
    *,
    name: str | None = None,
    events: bool = False,
    lone: bool = False,
    heartbeat: bool = True,
    loglevel: str = "INFO",
) -> list[str]:
    """A prefork worker on ``queues``. ``events`` sends task events (Flower shows the
    jobs); ``lone`` skips mingle and gossip, which only matter to a worker among others
    (seconds off its start); ``heartbeat=False`` also stops the heartbeats Flower reads
    (a test's or bench's worker); ``name`` is its node name, ``NAME@%h``."""
    argv = celery_argv(
        "worker",
        "-Q",
        queues if isinstance(queues, str) else ",".join(queues),
        "-c",
        str(concurrency),
        "-P",
        "prefork",
        "-l",
        loglevel,
    )
    if name is not None:
        argv += ["-n", f"{name}@%h"]
    if events:
        argv.append("-E")
    if lone:
        argv += ["--without-mingle", "--without-gossip"]
    if not heartbeat:
        argv.append("--without-heartbeat")
    return argv
