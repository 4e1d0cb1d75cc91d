"""Processes the tests start: a real ``celery worker`` (the fixtures in tests/conftest.py
start them; a test that kills or restarts one starts its own), other Celery commands (beat,
Flower), and a free loopback port for a server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from claw_tasks.worker.command import worker_argv
from tests.support.paths import ROOT


class Worker:
    """A real ``celery worker`` process (its own process group, so it can be SIGKILLed)."""

    def __init__(
        self,
        redis_url: str,
        queues: str,
        concurrency: int,
        log: Path,
        env: dict,
        broker_url: str | None = None,
    ) -> None:
        self.log = log
        full_env = {
            **os.environ,
            "CLAW_REDIS_URL": redis_url,
            "CLAW_BROKER_URL": broker_url or redis_url,
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        cmd = worker_argv(
            queues, concurrency, name=f"w{uuid.uuid4().hex[:6]}", lone=True, heartbeat=False
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=full_env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while b"ready." not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:  # a warm shutdown waits for running tasks: slow on a loaded machine
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def celery(args: list[str], redis_url: str, log: Path, **env: str) -> subprocess.Popen:
    """``celery -A claw_tasks.worker.app ARGS`` in its own process group (``stop`` ends it)."""
    full = {**os.environ, "CLAW_REDIS_URL": redis_url, "CLAW_BROKER_URL": redis_url, **env}
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "claw_tasks.worker.app", *args],
        cwd=ROOT,
        env=full,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group; SIGKILL it after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; a server binds it just after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(name: str, redis_url: str, *args: str, timeout: float = 240) -> str:
    """Run ``examples/<name>`` to the end against ``redis_url`` (the broker is that Redis
    too, whatever CLAW_BROKER_URL the run has) and return its stdout; a failure shows its
    output."""
    env = {**os.environ, "CLAW_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    env.pop("CLAW_BROKER_URL", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    err = proc.stderr
    if len(err) > 8000:  # a chained traceback's root cause is at its start
        err = f"{err[:4000]}\n[...]\n{err[-4000:]}"
    assert proc.returncode == 0, proc.stdout + err
    return proc.stdout
