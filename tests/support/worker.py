"""A real ``celery worker`` process for the tests (the fixtures in tests/conftest.py start
them; a test that kills or restarts one starts its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

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
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "claw_tasks.worker.app",
            "worker",
            "-Q",
            queues,
            "-c",
            str(concurrency),
            "-P",
            "prefork",
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"w{uuid.uuid4().hex[:6]}@%h",
        ]
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
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
