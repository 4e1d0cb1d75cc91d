"""Local process management for `claw up` and `claw demo`: Redis, Celery workers, beat, Flower.

Every child runs in its own process group (and, on Linux, gets SIGTERM if this process
dies), so stopping a service stops its pool children too and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from claw_tasks.broker.app import QUEUES
from claw_tasks.connection.server import RedisServer, embedded_dir, ensure_redis, log_tail
from claw_tasks.settings import get_settings
from claw_tasks.worker.command import celery_argv, worker_argv

_PR_SET_PDEATHSIG = 1
KEEP_LOGS = 5  # earlier logs kept per service: x.log.1 (the last run) … x.log.5


class DevStackError(RuntimeError):
    """A service did not start, or stopped on its own."""


def default_log_dir() -> Path:
    """Logs of local services: next to the embedded Redis data (`~/.cache/claw/logs`)."""
    return embedded_dir().parent / "logs"


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that asks Linux to SIGTERM the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after fork
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def log_contains(text: str) -> Callable[[Service], bool]:
    """Readiness probe: the service's log contains `text`."""
    return lambda svc: text.encode() in svc.log.read_bytes()


def port_open(port: int, host: str = "127.0.0.1") -> Callable[[Service], bool]:
    """Readiness probe: something accepts TCP connections on `host:port`."""

    def probe(_: Service) -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            return False

    return probe


def rotate(log: Path, keep: int = KEEP_LOGS) -> None:
    """Keep the earlier runs' logs: `x.log` becomes `x.log.1`, `x.log.1` `x.log.2`, …, the
    oldest beyond `keep` is removed."""
    if not log.exists() or not log.stat().st_size:
        return
    for i in range(keep - 1, 0, -1):
        older = log.with_name(f"{log.name}.{i}")
        if older.exists():
            older.replace(log.with_name(f"{log.name}.{i + 1}"))
    log.replace(log.with_name(f"{log.name}.1"))


@dataclass
class Service:
    """A child process with a log file and a readiness probe."""

    name: str
    argv: list[str]
    log: Path
    where: str  # what it serves, for the status table
    ready: Callable[[Service], bool]
    env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        rotate(self.log)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log, lines)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the service's process group (its pool children included)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def failure(self, what: str) -> DevStackError:
        return DevStackError(f"{self.name} {what} (log {self.log}):\n{self.log_tail()}")


def worker_service(
    log_dir: Path, queues: Sequence[str], concurrency: int, *, quick: bool = False
) -> Service:
    """A Celery worker for `queues`. `quick`: a lone throwaway worker (no mingle/gossip)."""
    name = "-".join(queues) if len(queues) < len(QUEUES) else "all"
    argv = worker_argv(queues, concurrency, name=name, events=True, lone=quick)
    return Service(
        f"worker ({name})",
        argv,
        log_dir / f"worker-{name}.log",
        f"queues {','.join(queues)} · concurrency {concurrency}",
        log_contains(" ready."),
    )


def beat_service(log_dir: Path) -> Service:
    argv = celery_argv("beat", "-S", "redbeat.RedBeatScheduler", "-l", "INFO")
    return Service(
        "beat", argv, log_dir / "beat.log", "RedBeat scheduler", log_contains("beat: Starting")
    )


def flower_service(log_dir: Path, port: int) -> Service:
    argv = celery_argv("flower", f"--port={port}", "--address=127.0.0.1")
    return Service(
        "flower", argv, log_dir / "flower.log", f"http://127.0.0.1:{port}", port_open(port)
    )


def web_service(log_dir: Path, port: int, password: str | None) -> Service:
    """The inspector (`claw web`); ``password`` (made by `claw up`) goes by environment,
    never argv."""
    argv = [sys.executable, "-m", "orchestrator.cli.main", "web", "--port", str(port)]
    env = {"CLAW_WEB_PASSWORD": password} if password else {}
    return Service(
        "web", argv, log_dir / "web.log", f"http://127.0.0.1:{port}", port_open(port), env
    )


class DevStack:
    """Redis plus child services; a context manager that stops all of them on exit."""

    def __init__(self, log_dir: Path, startup_timeout: float = 60.0) -> None:
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.services: list[Service] = []
        self.redis_url = ""
        self.broker_url = ""
        self.redis_server: RedisServer | None = None
        self._cleanups: list[Callable[[], None]] = []

    def start_redis(self, url: str | None = None) -> str:
        """Use the Redis at `url` / CLAW_REDIS_URL / the local default, else start one."""
        self.redis_url, self.redis_server = ensure_redis(url)
        self.broker_url = get_settings().broker_for(self.redis_url)
        return self.redis_url

    def start_own_redis(self, directory: Path) -> str:
        """Start a private redis-server with its data in `directory` (never a shared one)."""
        self.redis_server = RedisServer(dir=directory).start()
        self.redis_url = self.broker_url = self.redis_server.url
        return self.redis_url

    @property
    def child_env(self) -> dict[str, str]:
        return {"CLAW_REDIS_URL": self.redis_url, "CLAW_BROKER_URL": self.broker_url}

    def start(self, services: Sequence[Service]) -> None:
        """Spawn `services` together, then wait until each is ready."""
        if not self.redis_url:
            raise DevStackError("start Redis before the services that use it")
        for svc in services:
            svc.env = {**self.child_env, **svc.env}
            svc.spawn()
            self.services.append(svc)
        deadline = time.monotonic() + self.startup_timeout
        for svc in services:
            while not svc.ready(svc):
                if not svc.running:
                    raise svc.failure("exited during startup")
                if time.monotonic() > deadline:
                    raise svc.failure(f"was not ready within {self.startup_timeout:.0f}s")
                time.sleep(0.1)

    def on_stop(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` on stop, after the services and before Redis."""
        self._cleanups.append(cleanup)

    def watch(
        self,
        interval: float = 0.5,
        *,
        max_restarts: int = 5,
        window: float = 300.0,
        on_restart: Callable[[Service, int | None], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Supervise until Ctrl-C (or ``stop`` is set): a service that stops on its own (a
        worker killed by the OOM killer, say) is started again, its previous log kept as
        ``<log>.1``, and ``on_restart(service, exit code)`` is told. One that stops more
        than ``max_restarts`` times within ``window`` seconds raises DevStackError."""
        stopped_at: dict[str, list[float]] = {}
        while stop is None or not stop.is_set():
            for svc in self.services:
                if svc.running:
                    continue
                now = time.monotonic()
                recent = [t for t in stopped_at.get(svc.name, []) if now - t < window]
                stopped_at[svc.name] = [*recent, now]
                if len(recent) >= max_restarts:
                    raise svc.failure(f"stopped {len(recent) + 1} times within {window:.0f}s")
                code = svc.proc.returncode if svc.proc is not None else None
                svc.signal_group(signal.SIGKILL)  # what it left behind (pool children)
                svc.spawn()
                if on_restart is not None:
                    on_restart(svc, code)
            if stop is None:
                time.sleep(interval)
            else:
                stop.wait(interval)

    def stop_services(self, services: Sequence[Service], timeout: float = 20.0) -> None:
        """SIGTERM these services' groups, SIGKILL what is left after `timeout`; the rest of
        the stack runs on."""
        for svc in services:
            if svc.running:
                svc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for svc in services:
            assert svc.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                svc.proc.wait(max(0.1, deadline - time.monotonic()))
            svc.signal_group(signal.SIGKILL)  # leftovers: pool children, a hung main
            svc.proc.wait()
        self.services = [s for s in self.services if s not in services]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop every service (as `stop_services`), then the cleanups, then Redis."""
        self.stop_services(list(self.services), timeout)
        while self._cleanups:
            self._cleanups.pop()()
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.stop()
            return
        # A second Ctrl-C while stopping must not leave children behind.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
