"""The one way Claw opens a client of its data store: a standalone Redis or a Redis Cluster.

A Redis Cluster is named by its URL's scheme: ``redis+cluster://host:port`` (or
``rediss+cluster://`` with TLS), any node of the cluster as the seed, or several
comma-separated (``redis+cluster://h1:7000,h2:7000``) so that a client made while one is
down still connects; the client finds the others and follows slot moves (redis-py's
``RedisCluster``). Everything else is a
standalone server (``redis://``, ``rediss://``, ``unix://``). The scheme, not a separate
setting, so that one string (``CLAW_REDIS_URL``, ``--redis-url``) says all of it and a
process cannot pair a cluster URL with a standalone client by mistake.

What runs on a cluster keeps to its rules (docs/architecture.md, "Redis Cluster"): every
script call and every transaction touches one slot — a shard's keys share the hash tag
``{ns:shard}``, a namespace's own keys ``{ns}`` — and reads that span shards are one
command per shard, pipelined per node. The Celery broker and RedBeat stay on a standalone
Redis (or RabbitMQ): kombu and RedBeat have no cluster client.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from claw_tasks.settings import CLUSTER_SCHEMES, is_cluster_url

Client: TypeAlias = redis.Redis | RedisCluster
"""A data store client: what ``redis_client`` returns."""


def is_cluster(client: Any) -> bool:
    """True if ``client`` talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


def plain_url(url: str) -> str:
    """``url`` with a cluster scheme replaced by the plain one (``redis://``), as redis-py
    and redis-cli spell a node's address."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower())
    return url if scheme is None else urlunsplit(parts._replace(scheme=scheme))


def _route_scripts_by_their_keys() -> None:
    """redis-py 8.0's cluster pipeline asks a node ``COMMAND GETKEYS`` for every EVAL/EVALSHA
    it queues, one more round trip each (its static command policies lack them), where its
    plain ``execute_command`` reads a script's keys from its arguments; registered as keyed
    commands, they are routed as ``execute_command`` routes them. A sampled batch on a
    cluster then costs one round trip per node, not one more per script call. From 8.1 the
    table is a deprecated copy nothing reads (reading it warns), and the pipeline routes
    EVAL/EVALSHA by their keys itself (8.2's ``ClusterPipeline``: keyed unless flagged):
    nothing is registered then."""
    try:
        from redis.commands import policies
    except ImportError:  # redis-py < 8: its pipeline routes scripts by their keys
        return
    # vars(), not getattr: a table served by the module's __getattr__ is the deprecated one
    table = vars(policies).get("STATIC_POLICIES")
    if table is None:
        return
    keyed = policies.CommandPolicies(
        request_policy=policies.RequestPolicy.DEFAULT_KEYED,
        response_policy=policies.ResponsePolicy.DEFAULT_KEYED,
    )
    core = table.setdefault("core", {})
    for name in ("eval", "evalsha", "eval_ro", "evalsha_ro"):
        core.setdefault(name, keyed)


_route_scripts_by_their_keys()


def redis_client(url: str, **kwargs: Any) -> Client:
    """A client of the data store at ``url``: ``RedisCluster`` for a cluster URL, else
    ``redis.Redis``. ``kwargs`` go to ``from_url`` (timeouts, protocol...)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    parts = urlsplit(url)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(
            f"{parts.scheme}:// URL names database {parts.path.lstrip('/')!r}: a Redis "
            "Cluster has database 0 only; drop the path"
        )
    # Several seeds, comma-separated (redis+cluster://h1:7000,h2:7001): a client made
    # while the first one is down still finds the cluster.
    auth, _, hosts = parts.netloc.rpartition("@")
    first, *more = hosts.split(",")
    seeds = [ClusterNode(*_host_port(h)) for h in more]
    netloc = f"{auth}@{first}" if auth else first
    plain = plain_url(urlunsplit(parts._replace(netloc=netloc)))
    return RedisCluster.from_url(plain, **({"startup_nodes": seeds} if seeds else {}), **kwargs)


def async_redis_client(url: str, **kwargs: Any) -> Any:
    """The asyncio twin of :func:`redis_client` (``redis.asyncio``), for an event loop that
    must not block on a round trip (the capture gateway's admission)."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode as AsyncNode
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    first, *more = hosts.split(",")
    seeds = [AsyncNode(*_host_port(h)) for h in more]
    netloc = f"{auth}@{first}" if auth else first
    plain = plain_url(urlunsplit(parts._replace(netloc=netloc)))
    return AsyncCluster.from_url(plain, **({"startup_nodes": seeds} if seeds else {}), **kwargs)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cluster seed {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def get_many(client: Client, keys: list[str]) -> list[bytes | None]:
    """GET of keys that may be in different slots (e.g. one per shard): one MGET on a
    standalone server; on a cluster one MGET per slot, pipelined per node."""
    if is_cluster(client):
        return client.mget_nonatomic(keys)
    return client.mget(keys)


def memory(client: Client) -> list[tuple[int, int]]:
    """``(used_memory, maxmemory)`` of the server, or of every master of a cluster (INFO
    on a cluster client asks one node only)."""
    if is_cluster(client):
        infos = list(client.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
    else:
        infos = [client.info("memory")]
    return [(int(i["used_memory"]), int(i.get("maxmemory", 0))) for i in infos]


def identity(client: Client) -> tuple[Any, ...]:
    """What tells data stores apart in a process's caches: the server's address and
    database, or a cluster's seed nodes."""
    if is_cluster(client):
        return ("cluster", *sorted(n.name for n in client.get_nodes()))
    kw = client.connection_pool.connection_kwargs
    return (kw.get("host"), kw.get("port"), kw.get("path"), kw.get("db"))
