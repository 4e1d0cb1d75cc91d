"""``Settings``: the variables of ``VARIABLES`` read from the environment (the only reader
of ``CLAW_*`` in Claw), the broker rule, and the process's one settings object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .connection import is_cluster_url, redact_url
from .http_limits import HttpLimits
from .ingest_limits import IngestLimits
from .table import GROUPS, VARIABLES
from .variable import names


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
    worker_cache_bytes: int
    nearest_max_k: int
    plan_cache_size: int
    lineage_maxlen: int
    shared_index: bool
    readahead: int
    readahead_process: bool
    index_payload_bytes: int
    compress_at: str
    codec_threads: int
    limits: IngestLimits
    http: HttpLimits = HttpLimits()  # noqa: RUF009 (frozen: one shared instance is safe)
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
            if text is not None and (text.strip() or var.read is names):
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
