"""`claw web` as a real child process for the inspector's tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebServer:
    def __init__(
        self,
        redis_url: str,
        log: Path,
        *args: str,
        password: str | None = "pw",
        broker_url: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **os.environ,
            "CLAW_REDIS_URL": redis_url,
            "CLAW_BROKER_URL": broker_url or redis_url,
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
        }
        env.pop("CLAW_WEB_PASSWORD", None)
        env.pop("CLAW_WEB_PASSWORD_FILE", None)
        if password is not None:
            env["CLAW_WEB_PASSWORD"] = password
        cmd = [
            sys.executable,
            "-m",
            "orchestrator.cli.main",
            "web",
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            failed = False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                failed = self.proc.poll() is not None or time.monotonic() > deadline
            if failed:
                self.stop()
                raise RuntimeError(f"claw web did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
