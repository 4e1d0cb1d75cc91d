"""Settings from the environment (``CLAW_*``), read once per process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster, and the scheme of each one's nodes
(claw_tasks/connection/client.py)."""


@dataclass(frozen=True)
class Settings:
    """Process-wide configuration.

    ``redis_url`` is the data store (a Redis Cluster with ``redis+cluster://``, see
    claw_tasks/connection/client.py); ``broker_url`` the Celery broker (a standalone Redis or
    RabbitMQ; defaults to the data store's server, which a cluster cannot be);
    ``beat_url`` the standalone Redis where RedBeat keeps the schedule
    (``CLAW_BEAT_REDIS_URL``; defaults to the data store, or to a Redis broker when the
    store is a cluster).
    """

    redis_url: str
    broker_url: str
    namespace: str
    visibility_timeout: int
    stage_ttl: int
    limits: IngestLimits
    scorers: tuple[str, ...] = ()
    """Priority scorers (``module:function``) namespaces may name (``CLAW_SCORERS``,
    comma-separated): whoever configures a namespace must not pick code for workers."""
    beat_url: str = DEFAULT_REDIS_URL
    archive_dir: str | None = None  # where the nightly archive writes (claw.maintenance.archive)
    archive_lock_ttl: float = 60.0  # an archive run's lock lapses this long after the run stops
    # Bounds of a worker's per-namespace caches (stores, sampling sessions with their
    # index) and of its per-recipe augmentation plans: least recently used go first.
    namespace_cache_size: int = 64
    plan_cache_size: int = 256
    shared_index: bool = True
    """Processes of a host share one sampling index per namespace in /dev/shm
    (``CLAW_SHARED_INDEX=0``: each process builds its own)."""
    compress_at: str = "producer"
    """Where an Ingestor encodes compressed fields (``CLAW_COMPRESS_AT``): ``producer``
    (less to send: slow links) or ``worker`` (the ingest worker: busy producer CPUs)."""
    codec_threads: int = 1
    """Threads that encode (ingest) or decode (prefetch, reads) one batch's compressed
    frames (``CLAW_CODEC_THREADS``); the codecs release the GIL while they work."""
    albumentations: tuple[str, ...] = ("pixel", "spatial")
    """Albumentations transforms a recipe may name (``CLAW_ALBUMENTATIONS``, comma-separated
    names or the groups ``pixel`` and ``spatial``; empty: none): whoever registers a recipe
    chooses what workers run."""


@dataclass(frozen=True)
class IngestLimits:
    """What one ingest message may carry and cost; the worker dead-letters a batch past
    these before it reads a claim check, decompresses or allocates anything."""

    message_bytes: int  # a batch payload, inline or claim-checked
    decompressed_bytes: int  # all lz4 frames of one batch, once decompressed
    batch_steps: int  # steps in one batch (and never more than a shard's capacity)
    dead_letter_bytes: int  # dead letters kept per namespace (oldest trimmed first)
    dead_letter_prefix: int  # payload bytes a dead letter keeps (plus the whole digest)
    retries: int  # transient Redis errors: retries with exponential backoff
    verify_frames: bool = True  # decode a producer's compressed frames before storing them


def _int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None
    if value < 0:
        raise ValueError(f"{name}={value}: must be >= 0")
    return value


def load_limits() -> IngestLimits:
    limits = IngestLimits(
        message_bytes=_int("CLAW_MAX_MESSAGE_BYTES", 256 * 1024 * 1024),
        decompressed_bytes=_int("CLAW_MAX_DECOMPRESSED_BYTES", 256 * 1024 * 1024),
        batch_steps=_int("CLAW_MAX_BATCH_STEPS", 65536),
        dead_letter_bytes=_int("CLAW_DEAD_LETTER_BYTES", 64 * 1024 * 1024),
        dead_letter_prefix=_int("CLAW_DEAD_LETTER_PREFIX", 1024 * 1024),
        retries=_int("CLAW_INGEST_RETRIES", 10),
        verify_frames=bool(_int("CLAW_VERIFY_FRAMES", 1)),
    )
    if limits.dead_letter_prefix * 4 > limits.dead_letter_bytes:
        raise ValueError(
            f"CLAW_DEAD_LETTER_PREFIX={limits.dead_letter_prefix} must be at most a quarter of "
            f"CLAW_DEAD_LETTER_BYTES={limits.dead_letter_bytes} (a dead letter must fit the cap)"
        )
    return limits


def load_settings() -> Settings:
    redis_url = os.environ.get("CLAW_REDIS_URL") or DEFAULT_REDIS_URL
    broker_url, beat_url = _broker_and_beat(redis_url)
    visibility = int(os.environ.get("CLAW_VISIBILITY_TIMEOUT", "600"))
    return Settings(
        redis_url=redis_url,
        broker_url=broker_url,
        beat_url=beat_url,
        namespace=os.environ.get("CLAW_NAMESPACE", "default"),
        visibility_timeout=visibility,
        # A claim-check payload must outlive every redelivery of its message.
        stage_ttl=int(os.environ.get("CLAW_STAGE_TTL", str(max(86400, 4 * visibility)))),
        scorers=tuple(filter(None, map(str.strip, os.environ.get("CLAW_SCORERS", "").split(",")))),
        archive_dir=os.environ.get("CLAW_ARCHIVE_DIR") or None,
        archive_lock_ttl=float(os.environ.get("CLAW_ARCHIVE_LOCK_TTL", "60")),
        namespace_cache_size=int(os.environ.get("CLAW_NAMESPACE_CACHE_SIZE", "64")),
        plan_cache_size=int(os.environ.get("CLAW_PLAN_CACHE_SIZE", "256")),
        shared_index=os.environ.get("CLAW_SHARED_INDEX", "1").strip().lower()
        not in ("0", "false", "no", "off"),
        albumentations=_names(os.environ.get("CLAW_ALBUMENTATIONS", "pixel,spatial")),
        compress_at=os.environ.get("CLAW_COMPRESS_AT", "producer"),
        codec_threads=max(1, int(os.environ.get("CLAW_CODEC_THREADS", "1"))),
        limits=load_limits(),
    )


def _broker_and_beat(redis_url: str) -> tuple[str, str]:
    """The broker and RedBeat URLs: both default to the data store's server, except that
    neither kombu nor RedBeat can use a Redis Cluster."""
    broker = os.environ.get("CLAW_BROKER_URL") or ""
    beat = os.environ.get("CLAW_BEAT_REDIS_URL") or ""
    if not is_cluster_url(redis_url):
        return broker or redis_url, beat or redis_url
    if not broker:
        raise ValueError(
            f"CLAW_REDIS_URL={redact_url(redis_url)} is a Redis Cluster, which cannot be the "
            "Celery broker: set CLAW_BROKER_URL to a standalone Redis or RabbitMQ"
        )
    if not beat and not broker.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            "RedBeat keeps the schedule in a standalone Redis, and the store is a cluster and "
            "the broker is not Redis: set CLAW_BEAT_REDIS_URL to a standalone Redis"
        )
    return broker, beat or broker


def broker_for(redis_url: str | None, settings: Settings) -> str:
    """The broker of a client given a data store URL and no broker: the store's server,
    or, for a Redis Cluster (which cannot be a broker), ``CLAW_BROKER_URL`` as it is now."""
    if redis_url is None:
        return settings.broker_url
    return _broker_and_beat(redis_url)[0] if is_cluster_url(redis_url) else redis_url


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list setting."""
    return tuple(filter(None, map(str.strip, value.split(","))))


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
