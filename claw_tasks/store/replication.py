"""Acknowledged means replicated: ``WAIT`` after a write, on the connection that made it.

Redis replicates asynchronously: a master answers a write before any replica has it, and
a replica promoted after the master died lacks what it had not received. ``WAIT n ms``
answers how many replicas acknowledged everything the calling connection wrote so far,
blocking until ``n`` did or ``ms`` passed; it counts the connection's own writes only
(the replication offset of its last write; before Redis 7.2 of its last command), so it
must follow the write on the same connection, which a pipeline guarantees: the write and
its ``WAIT`` go in one round trip.

On a Redis Cluster ``WAIT`` must reach the master that served the write. redis-py's
cluster client routes a keyless command by its own policy (all nodes, replies summed) and,
retrying a failed command, sends it anew where that policy says: a ``WAIT`` answered by
other nodes would count their replicas. So the write and its ``WAIT`` are sent on the
client of the master that serves the key's slot (``node_client``), outside the cluster
client's redirections; a ``MOVED``, ``ASK`` or connection error there raises (the caller
retries: the cluster client learns the new owner of the slot on its next command).

A command that changes nothing is not replicated and leaves the connection's offset where
its last write left it. A caller that must know that an earlier write, maybe another
connection's, reached the replicas queues a write that always replicates before the
``WAIT`` (every commit renews its batch marker's expiry after the script, which writes
nothing when another delivery committed the part first; the dictionary pass adds 0 to
its counter): the offset is the master's, and a replica that has it has everything the
master wrote before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError

from claw_tasks.connection.client import Client, is_cluster
from claw_tasks.connection.resp import load


@dataclass(frozen=True)
class Replication:
    """How many replicas must hold a write before it counts as done, and how long to wait
    for them (``timeout_ms`` > 0: ``WAIT`` with 0 would block until they do)."""

    replicas: int
    timeout_ms: int

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms <= 0:
            raise ValueError(
                f"replicas {self.replicas} must be >= 0 and timeout {self.timeout_ms} ms > 0"
            )


class NotReplicated(RedisError):
    """A write reached fewer replicas than required within the timeout (or its master
    could not tell: it is a replica now). Transient: the write is idempotent and is made
    again, and nothing that depends on it was confirmed."""


def node_client(client: Client, key: str) -> redis.Redis:
    """The client of the master serving ``key``'s slot: ``client`` itself on a standalone
    Redis."""
    if not is_cluster(client):
        return client  # type: ignore[return-value]  # not a cluster: a redis.Redis
    return client.get_redis_connection(client.get_node_from_key(key))


def replicated(
    client: Client,
    key: str,
    replication: Replication,
    queue: Callable[[Any], None],
    scripts: Sequence[Any] = (),
    what: str = "write",
) -> list[Any]:
    """Run the commands ``queue`` puts on a pipeline, then ``WAIT``, in one round trip on
    the master of ``key``'s slot; their replies. An error of a command raises it (NOSCRIPT:
    ``scripts`` are loaded and the round trip made again); fewer replicas than
    ``replication.replicas`` raises :class:`NotReplicated` naming ``what``."""
    node = node_client(client, key)
    replies = _run(node, queue, replication)
    if any(isinstance(r, NoScriptError) for r in replies[:-1]):
        load(node, scripts)
        replies = _run(node, queue, replication)
    for reply in replies[:-1]:
        if isinstance(reply, Exception):
            raise reply
    acked = replies[-1]
    where = _address(node)
    if isinstance(acked, Exception):  # e.g. a master turned replica: cannot tell
        raise NotReplicated(
            f"{what} on {where}: WAIT failed ({acked}): not confirmed, retried; the master "
            "may be failing over"
        ) from acked
    if int(acked) < replication.replicas:
        raise NotReplicated(
            f"{what} on {where} reached {acked} of the {replication.replicas} replica(s) "
            f"required (CLAW_INGEST_REPLICAS) within {replication.timeout_ms} ms: not "
            "confirmed, retried; bring the master's replicas up, or lower "
            "CLAW_INGEST_REPLICAS (docs/reliability.md)"
        )
    return replies[:-1]


def _run(node: redis.Redis, queue: Callable[[Any], None], replication: Replication) -> list[Any]:
    with node.pipeline(transaction=False) as pipe:
        queue(pipe)
        pipe.execute_command("WAIT", replication.replicas, replication.timeout_ms)
        return pipe.execute(raise_on_error=False)


def _address(node: redis.Redis) -> str:
    kw = node.connection_pool.connection_kwargs
    return str(kw.get("path") or f"{kw.get('host')}:{kw.get('port')}")


def replica_counts(client: Client) -> dict[str, int]:
    """Replicas connected to each master of the store (address -> count), one ``INFO
    replication`` per master."""
    if is_cluster(client):
        masters = [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
    else:
        masters = [(_address(client), client)]  # type: ignore[arg-type]  # not a cluster
    return {name: int(r.info("replication").get("connected_slaves", 0)) for name, r in masters}


def replicas_advice(client: Client, required: int) -> str | None:
    """What an ingest worker says at start about ``CLAW_INGEST_REPLICAS`` against the
    store's replicas (None: nothing to say): a master with fewer than ``required``
    confirms none of its commits until enough connect; with 0 required, masters that all
    have a replica could keep acknowledged steps through a failover."""
    counts = replica_counts(client)
    short = sorted(name for name, n in counts.items() if n < required)
    if required and short:
        return (
            f"CLAW_INGEST_REPLICAS={required}, but master(s) {', '.join(short)} have fewer "
            "replicas connected: batches written to them are retried, not confirmed, until "
            "enough replicas connect"
        )
    if not required and counts and all(counts.values()):
        return (
            "every master of the store has a replica, and CLAW_INGEST_REPLICAS=0: a batch is "
            "confirmed before a replica has it, and a failover can lose it; set "
            "CLAW_INGEST_REPLICAS=1 (docs/reliability.md)"
        )
    return None
