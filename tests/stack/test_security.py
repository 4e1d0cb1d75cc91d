"""Security settings end to end: per-namespace Redis ACLs (a producer and a trainer confined
to their namespace's keys work against a full-access worker and cannot read anything else),
and the metrics endpoint's bearer token."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from claw_tasks.client import Ingestor
from claw_tasks.connection.server import RedisServer
from claw_tasks.store.acl import setuser_command
from claw_tasks.store.layout import Keys
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.registry import ACTIVE
from tests.support.paths import ROOT


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _user(server: RedisServer, namespace: str) -> str:
    """Create the namespace's user; returns its URL."""
    admin = server.client()
    # The line `claw acl` prints, then the password.
    admin.execute_command(*setuser_command(namespace, f"u-{namespace}").split())
    admin.execute_command("ACL", "SETUSER", f"u-{namespace}", f">pw-{namespace}")
    admin.close()
    return f"redis://u-{namespace}:pw-{namespace}@{server.host}:{server.port}/0"


def _produce(url: str, namespace: str, episodes: int, steps: int) -> None:
    ing = Ingestor(namespace, url, broker_url=url, flush_interval=None)  # the user's login
    for e in range(episodes):
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(steps):
                ep.add(np.full(4, t, np.float32), np.int64(t), float(t), priority=1.0)
    assert ing.close().committed == episodes * steps


def test_namespace_users_produce_and_train_and_see_nothing_else(server, start_worker):
    start_worker("ingest,prefetch", 2, CLAW_REDIS_URL=server.url, CLAW_BROKER_URL=server.url)
    admin = server.client()
    url_a, url_b = _user(server, "a"), _user(server, "b")
    _produce(url_b, "b", 2, 10)
    _produce(url_a, "a", 3, 20)

    trainer = BatchClient("a", url_a, broker_url=url_a)
    trainer.register(
        {
            "name": "r",
            "batch_size": 8,
            "fields": ["obs", "reward"],
            "sources": [{"name": "all"}],
            "prefetch": {"depth": 2},
        }
    )
    batch = trainer.pop("r", timeout=60)
    assert len(batch.ids) == 8 and batch["obs"].shape == (8, 4)
    assert trainer.update_priorities(batch.ids, np.full(8, 5.0), wait=True) == 8
    assert trainer.stats("r")["r"]["popped"] == 1
    trainer.close()
    assert admin.sismember(ACTIVE, "a")  # written by the worker's fill, not by the trainer
    assert admin.acl_log() == [], admin.acl_log()  # nothing above was refused

    a = redis.Redis.from_url(url_a)
    b_keys = Keys("b")
    refused = [
        lambda: a.get(b_keys.config),  # another namespace's keys
        lambda: a.getrange(b_keys.meta(0, "reward", 0), 0, -1),
        lambda: a.set(b_keys.config, b"x"),
        lambda: a.lpop("ingest"),  # in-flight messages of every namespace
        lambda: a.lrange("prefetch", 0, -1),
        lambda: a.sadd(ACTIVE, "x"),  # the directory of namespaces is the workers'
        lambda: a.scan(0),  # key names of other namespaces
        lambda: a.flushall(),
    ]
    for attempt in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert a.exists(Keys("a").config) == 1
    assert admin.exists(b_keys.config) == 1
    a.close()
    admin.close()


def _scrape(port: int, token: str | None, scheme: str = "Bearer") -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"{scheme} {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _listening(port: int) -> list[str]:
    """The IPv4 addresses a socket listens on at ``port`` (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, hexport = local.partition(":")
        if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def test_metrics_endpoint_requires_the_bearer_token(server, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = "s3cret-token-value"
    log = tmp_path / "metrics.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli.main",
            "--redis-url",
            server.url,
            "metrics",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CLAW_METRICS_TOKEN": token},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while b"serving" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert _listening(port) == ["127.0.0.1"]  # loopback unless --host widens it
        assert _scrape(port, None)[0] == 401
        assert _scrape(port, "wrong")[0] == 401
        assert _scrape(port, "s3cret-tökén")[0] == 401  # non-ASCII: refused, not a 500
        status, body = _scrape(port, token)
        assert status == 200 and 'claw_up{component="store"} 1.0' in body
        assert _scrape(port, token, scheme="bearer")[0] == 200  # schemes are case-insensitive
    finally:
        proc.terminate()
        proc.wait(20)
    assert "bearer token required" in log.read_text()
    assert token not in log.read_text()


def _certificates(tmp: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=claw-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (tmp / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
    )
    return {"ca": tmp / "ca.pem", "cert": tmp / "server.pem", "key": tmp / "server.key"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_tls_store_and_broker_end_to_end(tmp_path, start_worker, namespace):
    """``rediss://`` for the store and the broker: certificate paths travel in the URL's
    query, read by redis-py (store) and by Claw's broker settings (Celery); a client that
    does not trust the CA is refused."""
    certs = _certificates(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        tls_port = sock.getsockname()[1]
    options = {
        "tls-port": str(tls_port),
        "tls-cert-file": str(certs["cert"]),
        "tls-key-file": str(certs["key"]),
        "tls-ca-cert-file": str(certs["ca"]),
        "tls-auth-clients": "no",
    }
    server = RedisServer(options=options)
    try:
        server.start()
    except RuntimeError as e:  # a redis-server built without TLS
        server.close()
        pytest.skip(f"redis-server without TLS: {e}")
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}&ssl_cert_reqs=required"
        start_worker("ingest", 1, CLAW_REDIS_URL=url, CLAW_BROKER_URL=url)
        _produce(url, namespace, 2, 5)
        assert server.client().exists(Keys(namespace).config) == 1
        untrusted = redis.Redis.from_url(f"rediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=required")
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            untrusted.ping()
    finally:
        server.close()
