"""Where things are: the data store, the broker, RedBeat's Redis, the namespace, the
services' default ports, and the URL helpers every printed or parsed URL goes through."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from .variable import Variable

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
WEB_PORT = 8808
"""Where ``claw web`` (and ``claw up``'s inspector, and Compose's) listens by default."""
METRICS_PORT = 9808
"""Where ``claw metrics`` (and ``claw up``'s endpoint, and Compose's) listens by default."""
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster, and the scheme of each one's nodes
(claw_tasks/connection/client.py)."""

CONNECTION: tuple[Variable, ...] = (
    Variable(
        "CLAW_REDIS_URL",
        "redis_url",
        str,
        DEFAULT_REDIS_URL,
        "the data store: a Redis, or a Redis Cluster with `redis+cluster://host:port`; "
        "`rediss://…?ssl_ca_certs=…` for TLS (docs/reliability.md)",
    ),
    Variable(
        "CLAW_BROKER_URL",
        "broker_url",
        str,
        None,
        "the Celery broker of workers and clients alike (`Settings.broker_for`): a standalone "
        "Redis, or RabbitMQ with `amqp://user:pw@host:5672/vhost` (durable quorum queues, "
        "publisher confirms; Compose profile `rabbitmq`; docs/architecture.md, Delivery)",
        shown="the store's server (required when that is a cluster)",
    ),
    Variable(
        "CLAW_BEAT_REDIS_URL",
        "beat_url",
        str,
        None,
        "the standalone Redis where beat (RedBeat) keeps the schedule",
        shown="`CLAW_REDIS_URL`, or the broker when the store is a cluster",
    ),
    Variable("CLAW_NAMESPACE", "namespace", str, "default", "the namespace clients and tools use"),
)


def redact_url(url: str) -> str:
    """``url`` fit to print: a password (``redis://:pw@h``, ``amqp://u:pw@h``) becomes ``***``.

    Every URL the CLI, logs or errors show goes through this; secrets come from the
    environment and are never echoed back."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    hosts = parts.netloc.rpartition("@")[2]  # as written: IPv6, several cluster seeds
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def is_cluster_url(url: str) -> bool:
    """True if ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES
