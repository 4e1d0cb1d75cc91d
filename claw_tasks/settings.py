"""Claw's configuration: every ``CLAW_*`` variable, declared once, read once per process.

``VARIABLES`` is the table (name, type, default, one line of doc), the way Celery's
``celery/app/defaults.py`` declares its settings; ``Settings.from_env`` reads it and
``get_settings()`` keeps the result for the process. This module is the only reader of
``CLAW_*`` in Claw (``tests/unit/claw_tasks/test_settings.py`` greps for others): a
component that reads a variable itself is how it ends up on a different broker from the
workers.

Rebuilding: ``Settings.from_env(mapping)`` reads any mapping (tests, a CLI flag merged into
the environment); ``use_settings(settings)`` installs one as the process's settings, and
``use_settings()`` makes the next ``get_settings()`` read ``os.environ`` again (tests call
it after changing the environment). ``python -m claw_tasks.settings`` prints the table
the README's "Configuration" section holds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
WEB_PORT = 8808
"""Where ``claw web`` (and ``claw up``'s inspector, and Compose's) listens by default."""
METRICS_PORT = 9808
"""Where ``claw metrics`` (and ``claw up``'s endpoint, and Compose's) listens by default."""
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster, and the scheme of each one's nodes
(claw_tasks/connection/client.py)."""
MIB = 1024 * 1024


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r}: expected an integer") from None
    if value < 0:
        raise ValueError(f"{value}: must be >= 0")
    return value


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list."""
    return tuple(filter(None, map(str.strip, text.split(","))))


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"{value}: must be a finite number of seconds > 0")
    return value


def _seconds_or_never(text: str) -> float:
    """Seconds >= 0; 0 turns the thing off."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"{value}: must be a finite number of seconds >= 0 (0: never)")
    return value


def _compress_at(text: str) -> str:
    if text not in ("producer", "worker"):
        raise ValueError(f"{text!r}: 'producer' or 'worker'")
    return text


@dataclass(frozen=True)
class Variable:
    """One ``CLAW_*`` variable: the ``Settings`` attribute it sets (``limits.x``: an
    ``IngestLimits`` one), how its text is read, its default and what it means.

    Unset or empty means the default, except for lists, where empty is the empty list."""

    name: str
    attr: str
    read: Callable[[str], Any]
    default: Any
    doc: str
    shown: str | None = None
    """The default as the docs show it, when it is derived or a size."""

    @property
    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None or self.default in ("", ()):
            return "none"
        if isinstance(self.default, tuple):
            return f"`{','.join(self.default)}`"
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        return f"`{self.default}`"


VARIABLES: tuple[Variable, ...] = (
    # ---- where things are
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
    # ---- delivery and maintenance
    Variable(
        "CLAW_VISIBILITY_TIMEOUT",
        "visibility_timeout",
        _count,
        600,
        "seconds before an unacknowledged task is redelivered (Redis broker; RabbitMQ "
        "redelivers when the worker's connection closes)",
    ),
    Variable(
        "CLAW_STAGE_TTL",
        "stage_ttl",
        _count,
        None,
        "TTL of claim-check staging keys for large ingest batches (it must outlive every "
        "redelivery)",
        shown="`max(86400, 4 x CLAW_VISIBILITY_TIMEOUT)`",
    ),
    Variable(
        "CLAW_SCHEDULE",
        "schedule",
        str,
        "",
        "beat schedule overrides: a YAML file, or inline YAML such as `{claw-evict: {every: "
        '10s}, claw-archive: {cron: "30 1 * * *"}}` (docs/architecture.md, Maintenance)',
    ),
    Variable(
        "CLAW_ARCHIVE_DIR",
        "archive_dir",
        str,
        None,
        "where `claw.maintenance.archive` writes (workers)",
    ),
    Variable(
        "CLAW_ARCHIVE_LOCK_TTL",
        "archive_lock_ttl",
        float,
        60.0,
        "seconds an archive run's lock outlives a killed run",
        shown="`60`",
    ),
    Variable(
        "CLAW_SCORERS",
        "scorers",
        _names,
        (),
        "priority scorers (`module:function`, comma-separated) that namespaces may name: "
        "whoever configures a namespace must not pick code for workers",
    ),
    Variable(
        "CLAW_FEATURES",
        "features",
        _names,
        (),
        "feature functions (`module:function`, comma-separated) that vector indexes may "
        "name (docs/retrieval.md): whoever defines an index must not pick code for workers",
    ),
    Variable(
        "CLAW_ALBUMENTATIONS",
        "albumentations",
        _names,
        ("pixel", "spatial"),
        "Albumentations transforms a recipe may name (comma-separated names, or the groups "
        "`pixel` and `spatial`; empty: none)",
    ),
    Variable(
        "CLAW_LINEAGE_MAXLEN",
        "lineage_maxlen",
        _count,
        100_000,
        "popped batches a namespace's lineage log keeps (the oldest trimmed first; "
        "docs/architecture.md, Lineage)",
    ),
    # ---- per-process resources
    Variable(
        "CLAW_NAMESPACE_CACHE_SIZE",
        "namespace_cache_size",
        _count,
        64,
        "namespaces a worker keeps a `Store` and sampling session for (least recently used "
        "go first)",
    ),
    Variable(
        "CLAW_PLAN_CACHE_SIZE",
        "plan_cache_size",
        _count,
        256,
        "recipes' augmentation plans a prefetch worker keeps (least recently used go first)",
    ),
    Variable(
        "CLAW_SHARED_INDEX",
        "shared_index",
        _flag,
        True,
        "prefetch processes of a host share one sampling index per namespace in `/dev/shm`; "
        "`0`: each builds its own (docs/architecture.md, Sampling index)",
    ),
    Variable(
        "CLAW_READAHEAD",
        "readahead",
        _count,
        0,
        "batches of each recipe a `BatchClient` keeps popped and decoded in the trainer's "
        "process, so `pop` is a local dequeue (`0`: none; the replay-buffer adapters size "
        "their own)",
    ),
    Variable(
        "CLAW_INDEX_PAYLOAD_BYTES",
        "index_payload_bytes",
        _count,
        64,
        "raw fixed-shape fields of at most this many bytes a row are kept in the sampling "
        "index as well, so a batch of them reads no payload from Redis (`0`: none)",
    ),
    Variable(
        "CLAW_COMPRESS_AT",
        "compress_at",
        _compress_at,
        "producer",
        "who encodes compressed fields: the `Ingestor` (`producer`: less to send) or the "
        "ingest workers (`worker`: spares busy producer CPUs)",
    ),
    Variable(
        "CLAW_CODEC_THREADS",
        "codec_threads",
        lambda t: max(1, _count(t)),
        1,
        "threads a process encodes or decodes one batch's compressed frames in",
    ),
    # ---- what one ingest message may carry and cost (workers; docs/reliability.md)
    Variable(
        "CLAW_MAX_MESSAGE_BYTES",
        "limits.message_bytes",
        _count,
        256 * MIB,
        "bytes of one ingest batch's payload, inline or claim-checked",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_MAX_DECOMPRESSED_BYTES",
        "limits.decompressed_bytes",
        _count,
        256 * MIB,
        "bytes decompressing one batch may hold: all its frames' declared sizes, the "
        "largest twice (docs/reliability.md)",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_MAX_BATCH_STEPS",
        "limits.batch_steps",
        _count,
        65536,
        "steps in one ingest batch (and never more than a shard's capacity)",
    ),
    Variable(
        "CLAW_VERIFY_FRAMES",
        "limits.verify_frames",
        _flag,
        True,
        "`0`: the ingest worker checks a producer's frame headers but does not trial-decode them",
    ),
    Variable(
        "CLAW_DEAD_LETTER_BYTES",
        "limits.dead_letter_bytes",
        _count,
        64 * MIB,
        "dead letters kept per namespace (oldest trimmed first)",
        shown="64 MiB",
    ),
    Variable(
        "CLAW_DEAD_LETTER_PREFIX",
        "limits.dead_letter_prefix",
        _count,
        MIB,
        "payload bytes one dead letter keeps (at most a quarter of `CLAW_DEAD_LETTER_BYTES`)",
        shown="1 MiB",
    ),
    Variable(
        "CLAW_INGEST_RETRIES",
        "limits.retries",
        _count,
        10,
        "retries of a transient Redis error in ingest (exponential backoff)",
    ),
    # ---- what one HTTP request may make the gateway or the inspector hold or wait for, and
    # how deep a where may nest (docs/reliability.md, HTTP surfaces)
    Variable(
        "CLAW_GATEWAY_MAX_REPLY_BYTES",
        "http.gateway_reply_bytes",
        _count,
        32 * MIB,
        "`claw gateway`: bytes of one upstream reply or stream kept to record it; past them "
        "the rest is relayed as it arrives and the call is not recorded (`too_large`)",
        shown="32 MiB",
    ),
    Variable(
        "CLAW_GATEWAY_QUEUE_BYTES",
        "http.gateway_queue_bytes",
        _count,
        256 * MIB,
        "`claw gateway`: bytes of replies waiting for the recorder, together (past them: "
        "`queue_full`)",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_GATEWAY_UPSTREAM_TIMEOUT",
        "http.gateway_upstream_timeout",
        _seconds,
        300.0,
        "`claw gateway`: seconds to wait for the upstream's headers, and between its reads "
        "(then `502`)",
        shown="`300`",
    ),
    Variable(
        "CLAW_GATEWAY_RECORDER_STALL",
        "http.gateway_recorder_stall",
        _seconds,
        120.0,
        "`claw gateway`: seconds the recorder may spend on one batch of calls before "
        "`/healthz` answers `503` (and rewards `503` rather than wait)",
        shown="`120`",
    ),
    Variable(
        "CLAW_GATEWAY_ADMISSION_WAIT",
        "http.gateway_admission_wait",
        _seconds,
        10.0,
        "`claw gateway`: seconds a new trajectory's first call waits for the staleness budget "
        "(docs/llm.md, Admission) before it is answered `429` with `Retry-After`",
        shown="`10`",
    ),
    Variable(
        "CLAW_GATEWAY_ADMISSION_EXPIRY",
        "http.gateway_admission_expiry",
        _seconds_or_never,
        3600.0,
        "`claw gateway`: seconds an admitted trajectory may go without a recorded turn or "
        "its reward before its staleness-budget slots come back (counted `expired`; "
        "docs/llm.md, Admission); `0`: never",
        shown="`3600`",
    ),
    Variable(
        "CLAW_WEB_LOGIN_BODY_BYTES",
        "http.web_login_body_bytes",
        _count,
        4096,
        "`claw web`: bytes of a request body without a session (the login form; `413`)",
        shown="4 KiB",
    ),
    Variable(
        "CLAW_WEB_MAX_BODY_BYTES",
        "http.web_body_bytes",
        _count,
        MIB,
        "`claw web`: bytes of a request body with a session (`413`)",
        shown="1 MiB",
    ),
    Variable(
        "CLAW_WEB_MAX_FORM_FIELDS",
        "http.web_form_fields",
        _count,
        1000,
        "`claw web`: form fields of a request with a session (16 without one; `400`)",
    ),
    Variable(
        "CLAW_WHERE_MAX_DEPTH",
        "where_max_depth",
        lambda t: max(1, _count(t)),
        32,
        "how deep a `where` may nest (parentheses, `not`, `and`/`or` lists) in the "
        "inspector, `claw query`, recipes and retention rules; deeper is refused",
    ),
    # ---- secrets of the services (never printed)
    Variable(
        "CLAW_METRICS_TOKEN",
        "metrics_token",
        str,
        None,
        "when set, `claw metrics` (and `claw up`'s endpoint) require `Authorization: Bearer "
        "<token>`; `claw gateway`'s `/metrics` requires it, else the gateway's token",
    ),
    Variable(
        "CLAW_GATEWAY_TOKEN",
        "gateway_token",
        str,
        None,
        "`claw gateway`: the bearer token agents send as their API key (required)",
    ),
    Variable(
        "CLAW_GATEWAY_REWARD_TOKEN",
        "gateway_reward_token",
        str,
        None,
        "`claw gateway`: the reward endpoint's token",
        shown="`CLAW_GATEWAY_TOKEN`",
    ),
    Variable(
        "CLAW_GATEWAY_ADMIN_TOKEN",
        "gateway_admin_token",
        str,
        None,
        "`claw gateway`: the token of `POST /sessions` (per-trajectory keys)",
        shown="`CLAW_GATEWAY_REWARD_TOKEN`",
    ),
    Variable(
        "CLAW_UPSTREAM_API_KEY",
        "upstream_api_key",
        str,
        None,
        "`claw gateway`: the key sent to the inference server",
    ),
    Variable("CLAW_WEB_USER", "web_user", str, "claw", "the inspector's login name"),
    Variable(
        "CLAW_WEB_PASSWORD",
        "web_password",
        str,
        None,
        "the inspector's password (none: `claw web` and `claw up` make one and print it "
        "once; Compose requires one)",
    ),
    Variable(
        "CLAW_WEB_PASSWORD_FILE",
        "web_password_file",
        str,
        None,
        "a file with the inspector's password or its `scrypt$` hash",
    ),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


@dataclass(frozen=True)
class IngestLimits:
    """What one ingest message may carry and cost; the worker dead-letters a batch past
    these before it reads a claim check, decompresses or allocates anything (the
    ``limits.*`` entries of ``VARIABLES``)."""

    message_bytes: int
    decompressed_bytes: int
    batch_steps: int
    dead_letter_bytes: int
    dead_letter_prefix: int
    retries: int
    verify_frames: bool = True


@dataclass(frozen=True)
class HttpLimits:
    """What one request may make the capture gateway or the web inspector hold or wait
    for (the ``http.*`` entries of ``VARIABLES``): past a bound a request is refused
    (4xx) or, for an upstream reply, relayed unrecorded (counted), never held whole."""

    gateway_reply_bytes: int = 32 * MIB
    gateway_queue_bytes: int = 256 * MIB
    gateway_upstream_timeout: float = 300.0
    gateway_recorder_stall: float = 120.0
    gateway_admission_wait: float = 10.0
    gateway_admission_expiry: float = 3600.0
    web_login_body_bytes: int = 4096
    web_body_bytes: int = MIB
    web_form_fields: int = 1000


GROUPS: dict[str, type] = {"limits": IngestLimits, "http": HttpLimits}
"""The ``Settings`` attributes that group variables (``limits.x``, ``http.x``)."""


@dataclass(frozen=True)
class Settings:
    """Process-wide configuration; one attribute per ``VARIABLES`` entry (its doc is there).

    ``redis_url`` is the data store (a Redis Cluster with ``redis+cluster://``);
    ``broker_url`` this process's Celery broker (``broker_for`` says which);
    ``beat_url`` the standalone Redis where RedBeat keeps the schedule. ``given`` holds
    the names of the variables the environment set (the rest are defaults).
    """

    redis_url: str
    broker_url: str
    beat_url: str
    namespace: str
    visibility_timeout: int
    stage_ttl: int
    schedule: str
    archive_dir: str | None
    archive_lock_ttl: float
    scorers: tuple[str, ...]
    features: tuple[str, ...]
    albumentations: tuple[str, ...]
    namespace_cache_size: int
    plan_cache_size: int
    lineage_maxlen: int
    shared_index: bool
    readahead: int
    index_payload_bytes: int
    compress_at: str
    codec_threads: int
    limits: IngestLimits
    http: HttpLimits = HttpLimits()
    where_max_depth: int = 32
    metrics_token: str | None = field(default=None, repr=False)
    gateway_token: str | None = field(default=None, repr=False)
    gateway_reward_token: str | None = field(default=None, repr=False)
    gateway_admin_token: str | None = field(default=None, repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)
    web_user: str = "claw"
    web_password: str | None = field(default=None, repr=False)
    web_password_file: str | None = None
    given: frozenset[str] = frozenset()

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, overrides: Mapping[str, str] | None = None
    ) -> Settings:
        """The settings ``env`` (default ``os.environ``) describes, with ``overrides`` (e.g.
        a command-line flag standing for its variable) taking precedence; ``ValueError``
        names the variable whose text cannot be used."""
        env = os.environ if env is None else env
        if overrides:
            env = {**env, **overrides}
        top: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        given = set()
        for var in VARIABLES:
            text = env.get(var.name)
            value = var.default
            if text is not None and (text.strip() or var.read is _names):
                try:
                    value = var.read(text)
                except ValueError as e:
                    raise ValueError(f"{var.name}={text!r}: {e}") from None
                given.add(var.name)
            group, _, attr = var.attr.rpartition(".")
            (groups[group] if group else top)[attr] = value
        top["broker_url"], top["beat_url"] = _broker_and_beat(
            top["redis_url"], top["broker_url"], top["beat_url"]
        )
        if top["stage_ttl"] is None:  # a claim-check payload must outlive every redelivery
            top["stage_ttl"] = max(86400, 4 * top["visibility_timeout"])
        top.update({g: cls_(**groups[g]) for g, cls_ in GROUPS.items()})
        limits = groups["limits"]
        if limits["dead_letter_prefix"] * 4 > limits["dead_letter_bytes"]:
            raise ValueError(
                f"CLAW_DEAD_LETTER_PREFIX={limits['dead_letter_prefix']} must be at most a "
                f"quarter of CLAW_DEAD_LETTER_BYTES={limits['dead_letter_bytes']} (a dead "
                "letter must fit the cap)"
            )
        return cls(**top, given=frozenset(given))

    def is_set(self, name: str) -> bool:
        """True if the environment set variable ``name`` (else its default applies)."""
        return name in self.given

    def broker_for(self, redis_url: str | None = None) -> str:
        """The Celery broker a client of the data store at ``redis_url`` (None:
        ``CLAW_REDIS_URL``) sends to, unless it is given a broker URL itself.

        The rule, the one every client, command, adapter, the gateway and the web app
        follow: ``CLAW_BROKER_URL`` when it is set, whatever store the client was given
        (a deployment has one broker, the one its workers listen on; the Compose file puts
        it on its own Redis db, or RabbitMQ); otherwise the store's own server (the
        ``redis_url`` given, else ``CLAW_REDIS_URL``), except that a Redis Cluster cannot
        be a broker: without ``CLAW_BROKER_URL`` that is an error.
        """
        if self.is_set("CLAW_BROKER_URL") or redis_url is None:
            return self.broker_url
        return _broker_and_beat(redis_url, None, None)[0]


def _broker_and_beat(redis_url: str, broker: str | None, beat: str | None) -> tuple[str, str]:
    """The broker and RedBeat URLs: both default to the data store's server, except that
    neither kombu nor RedBeat can use a Redis Cluster."""
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


_current: Settings | None = None


def get_settings() -> Settings:
    """This process's settings: read from ``os.environ`` at the first call, then kept."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def use_settings(settings: Settings | None = None) -> None:
    """Make ``settings`` this process's (the CLI, with its flags merged in), or with none
    have the next ``get_settings()`` read the environment again (tests that change it)."""
    global _current
    _current = settings


def markdown_table() -> str:
    """The README's configuration table, one row per variable in ``VARIABLES``' order."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default_text} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


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


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
