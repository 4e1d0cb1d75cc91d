"""Unit tests run on the code alone, so ``make test-fast`` needs no service and stays fast.

Here the service fixtures of tests/conftest.py are refused, and so is starting a
redis-server, a Redis Cluster, a Celery worker or a browser, or opening a TCP connection:
a test that needs one belongs in tests/stack/ or tests/system/. Child Python processes
(shared memory across processes, fresh-interpreter imports) are fine."""

from __future__ import annotations

import itertools
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from claw_tasks.connection.cluster import LocalCluster
from claw_tasks.connection.server import RedisServer

SERVICE_FIXTURES = frozenset(
    {
        "redis_server",
        "redis_cluster",
        "own_redis_url",
        "store_url",
        "broker_url",
        "redis_url",
        "r",
        "store",
        "broker_vhost",
        "amqp_url",
        "start_worker",
        "ingest_worker",
        "workers",
    }
)
SERVICE_PROGRAMS = ("redis-server", "celery", "chromium")


class ServiceInUnitTest(RuntimeError):
    """A unit test reached for a service."""


def _refuse(what: str) -> None:
    raise ServiceInUnitTest(f"{what} in a unit test: it belongs in tests/stack/ or tests/system/")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture is set up (a session-scoped redis-server would start first)."""
    used = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if used:
        _refuse(f"fixture {', '.join(sorted(used))}")


@pytest.fixture(autouse=True)
def no_services(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:

    def start(self: object) -> Any:
        _refuse(type(self).__name__)

    connect = socket.socket.connect

    def guarded_connect(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _refuse(f"a TCP connection to {address}")
        return connect(sock, address)

    popen_init = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        words = [str(a) for a in args] if isinstance(args, list | tuple) else str(args).split()
        ran = [Path(words[0]).name] + [m for flag, m in itertools.pairwise(words) if flag == "-m"]
        if any(program in name for name in ran for program in SERVICE_PROGRAMS):
            _refuse(f"starting {' '.join(words)[:80]}")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(RedisServer, "start", start)
    monkeypatch.setattr(LocalCluster, "start", start)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    yield
