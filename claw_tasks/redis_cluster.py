"""Run a private Redis Cluster of a few masters on loopback free ports (tests, benchmarks).

Each node is a :class:`~claw_tasks.redis_server.RedisServer` with ``cluster-enabled yes``;
``redis-cli --cluster create`` spreads the 16384 slots over them. No replicas: what a
failover does to acknowledged writes is described in docs/reliability.md. Nodes can be
SIGKILLed and restarted on the same port and directory (with AOF, ``appendfsync always``,
they come back with every acknowledged write). ops/redis-cluster.sh does the same for a
long-lived cluster on fixed ports.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from redis.cluster import RedisCluster

from claw_tasks.redis_server import RedisServer, find_redis_server

CLUSTER_OPTIONS = {
    "cluster-enabled": "yes",
    "cluster-config-file": "nodes.conf",
    "cluster-node-timeout": "5000",
    # A restarted master must serve its slots at once, even before it hears the others.
    "cluster-require-full-coverage": "no",
}


def find_redis_cli() -> str:
    """redis-cli next to the redis-server in use, else on PATH."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if not found:
        raise FileNotFoundError("no redis-cli found: install Redis (apt-get install redis-tools)")
    return found


def _free_pair() -> int:
    """A port below 55536 that is free, with port + 10000 free too (the cluster bus)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55536)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


class LocalCluster:
    """``masters`` redis-server nodes forming one cluster; a context manager that stops
    them and removes their data. ``options`` go to every node (e.g. AOF settings)."""

    def __init__(self, masters: int = 3, options: Mapping[str, str] | None = None) -> None:
        self.options = {**(options or {}), **CLUSTER_OPTIONS}
        self.masters = masters
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """The data store URL (``redis+cluster://`` of the first node as the seed)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> Self:
        while len(self.nodes) < self.masters:
            self.nodes.append(self._start_node())
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [find_redis_cli(), "--cluster", "create", *addresses, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports ``cluster_state:ok`` and agrees on the slots."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self._state(n) for n in self.nodes]
            if all(s == "ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout:.0f}s: states {states}")
            time.sleep(0.05)

    def _start_node(self, attempts: int = 5) -> RedisServer:
        """A node on a free port whose bus port (+10000) is free too (so at most 55535)."""
        for attempt in range(attempts):
            node = RedisServer(port=_free_pair(), options=self.options)
            try:
                return node.start()
            except RuntimeError:
                node.close()
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _state(node: RedisServer) -> str:
        try:
            info = node.client(socket_timeout=1).cluster("info")
        except Exception:  # a node still starting: not ok yet
            return "down"
        return str(info.get("cluster_state", "?"))

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def node_of(self, key: str) -> RedisServer:
        """The node that serves ``key``."""
        port = self.client().get_node_from_key(key).port
        return next(n for n in self.nodes if n.port == port)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
