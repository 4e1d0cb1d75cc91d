"""Run a private Redis Cluster of a few masters on loopback free ports (tests, benchmarks).

Each node is a :class:`~claw_tasks.connection.server.RedisServer` with ``cluster-enabled yes``
and an even share of the 16384 slots (as ``redis-cli --cluster create`` gives, but for
any number of masters), and on request a replica per master (``replicas``): what a
failover does to acknowledged writes, and ``CLAW_INGEST_REPLICAS``, are in
docs/reliability.md. Nodes can be
SIGKILLed and restarted on the same port and directory (with AOF, ``appendfsync always``,
they come back with every acknowledged write). ops/redis-cluster.sh does the same for a
long-lived cluster on fixed ports.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Self

from redis.exceptions import ResponseError

from claw_tasks.connection.client import Client, redis_client
from claw_tasks.connection.server import RedisServer

SLOTS = 16384
CLUSTER_OPTIONS = {
    "cluster-enabled": "yes",
    "cluster-config-file": "nodes.conf",
    "cluster-node-timeout": "5000",
    # A restarted master must serve its slots at once, even before it hears the others.
    "cluster-require-full-coverage": "no",
}


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
    """``masters`` redis-server nodes forming one cluster, each with ``replicas`` replicas;
    a context manager that stops them and removes their data. ``options`` go to every node
    (AOF settings, ``cluster-node-timeout``...)."""

    def __init__(
        self, masters: int = 3, options: Mapping[str, str] | None = None, replicas: int = 0
    ) -> None:
        self.options = {**CLUSTER_OPTIONS, **(options or {}), "cluster-enabled": "yes"}
        self.masters, self.replicas = masters, replicas
        self.nodes: list[RedisServer] = []  # the masters first, then the replicas

    @property
    def url(self) -> str:
        """The data store URL (``redis+cluster://``, every master a seed)."""
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])
        return f"redis+cluster://{seeds}"

    def start(self) -> Self:
        while len(self.nodes) < self.masters:
            self.nodes.append(self._start_node())
        # What `redis-cli --cluster create` does, for any number of masters (it wants 3+):
        # each node takes an even share of the slots and its own config epoch, then meets
        # the first node.
        share = -(-SLOTS // len(self.nodes))
        for i, node in enumerate(self.nodes):
            client = node.client()
            client.execute_command(
                "CLUSTER", "ADDSLOTSRANGE", i * share, min(SLOTS, (i + 1) * share) - 1
            )
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            if i:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            client.close()
        self.wait_ok()
        for i in range(self.masters * self.replicas):
            self._add_replica(self.nodes[i % self.masters])
        self.wait_ok()
        return self

    def _add_replica(self, master: RedisServer, timeout: float = 30.0) -> None:
        node = self._start_node()
        self.nodes.append(node)
        master_id = master.client().execute_command("CLUSTER", "MYID")
        client = node.client()
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", master.port)
        deadline = time.monotonic() + timeout
        while True:  # REPLICATE needs the master known first (gossip takes a moment)
            try:
                client.execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except ResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        while client.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica on port {node.port} did not sync with its master")
            time.sleep(0.05)
        client.close()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows the others."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self._state(n) for n in self.nodes if n.running]
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

    def _state(self, node: RedisServer) -> str:
        try:
            info = node.client(socket_timeout=1).cluster("info")
        except Exception:  # a node still starting: not ok yet
            return "down"
        known, slots = int(info.get("cluster_known_nodes", 0)), info.get("cluster_slots_assigned")
        if known < len(self.nodes) or int(slots or 0) != SLOTS:
            return "joining"
        return str(info.get("cluster_state", "?"))

    def client(self) -> Client:
        return redis_client(self.url)

    def node_of(self, key: str) -> RedisServer:
        """The master that serves ``key``."""
        client = self.client()
        port = client.get_node_from_key(key).port
        client.close()
        return next(n for n in self.nodes if n.port == port)

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A node that replicates ``master`` now (``replicas`` > 0)."""
        for node in self.nodes:
            if node is master or not node.running:
                continue
            client = node.client()
            try:
                if client.info("replication").get("master_port") == master.port:
                    return node
            finally:
                client.close()
        raise LookupError(f"no node replicates the one on port {master.port}")

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
