"""``GatewayConfig``: everything ``claw gateway`` is configured with, the bounds it leaves
unset taken from the settings."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from claw_tasks.settings import get_settings

SPOOL_OFF = "off"
"""The spool setting (``--spool``, CLAW_GATEWAY_SPOOL) that turns the spool off."""


def spool_dir(setting: str | None, namespace: str, port: int) -> str | None:
    """The spool directory ``claw gateway`` uses: ``setting`` (``--spool``, else
    CLAW_GATEWAY_SPOOL) if given, None if it is ``off``, else one per namespace and port
    under the temporary directory (a gateway restarted on its port takes its
    predecessor's spool over)."""
    setting = setting or get_settings().http.gateway_spool
    if setting == SPOOL_OFF:
        return None
    if setting:
        return setting
    base = Path(tempfile.gettempdir()) / f"claw-gateway-{os.getuid()}"
    return str(base / f"{namespace}-{port}")


@dataclass
class GatewayConfig:
    """Everything ``claw gateway`` is configured with. ``token`` authenticates agents
    (their OpenAI API key); ``reward_token`` the reward endpoint (defaults to ``token``);
    ``metrics_token`` ``/metrics`` (CLAW_METRICS_TOKEN, as for ``claw metrics``; defaults
    to ``token``: the page names trajectories' traffic, so it is never open);
    ``upstream_key`` is what the gateway sends upstream (agents never see it);
    ``admin_token`` opens ``POST /sessions`` (defaults to ``reward_token``, then ``token``).
    ``admission``: admit new trajectories against the staleness budget a trainer declares
    (waiting up to ``admission_wait`` seconds, then 429 with ``Retry-After:
    retry_after``), and give an admitted trajectory's slots back once it went
    ``admission_expiry`` seconds without a turn or its reward (0: never); ``session_ttl``
    bounds a session's life; ``turn_discount``, when
    given, is set as the namespace's (every gateway of it applies the same one).
    ``redis_url`` and ``broker_url`` default as every client's do
    (``Settings.broker_for``: the workers' broker, ``CLAW_BROKER_URL``, when it is set).
    The bounds left None come from the settings (``claw_tasks.settings.HttpLimits``): the
    upstream timeout, the reply bytes kept to record one call, the bytes of replies
    waiting for the recorder, and how long the recorder may spend on one batch before
    /healthz fails. ``spool``: the directory of this process's spool (docs/llm.md,
    Spool; None: no spool), holding at most ``spool_bytes``, fsynced per call with
    ``spool_fsync``."""

    upstream: str
    namespace: str
    token: str
    redis_url: str | None = None
    broker_url: str | None = None
    reward_token: str | None = None
    metrics_token: str | None = None
    upstream_key: str | None = None
    admin_token: str | None = None
    tokenizer: str | None = None
    vllm_options: bool = True
    max_body_bytes: int = 8 * 1024 * 1024
    max_turns: int = 256
    max_n: int = 64
    policy_version: int | None = None
    admission: bool = True
    admission_wait: float | None = None
    admission_expiry: float | None = None
    retry_after: float = 1.0
    session_ttl: int = 7 * 86400
    turn_discount: float | None = None
    queue_size: int = 10_000
    upstream_timeout: float | None = None
    max_reply_bytes: int | None = None
    queue_bytes: int | None = None
    recorder_stall: float | None = None
    spool: str | None = None
    spool_bytes: int | None = None
    spool_fsync: bool | None = None

    def resolved(self) -> GatewayConfig:
        """This config with every bound left None taken from the settings."""
        d = get_settings().http
        return replace(
            self,
            upstream_timeout=self.upstream_timeout or d.gateway_upstream_timeout,
            max_reply_bytes=self.max_reply_bytes or d.gateway_reply_bytes,
            queue_bytes=self.queue_bytes or d.gateway_queue_bytes,
            recorder_stall=self.recorder_stall or d.gateway_recorder_stall,
            spool_bytes=self.spool_bytes or d.gateway_spool_bytes,
            spool_fsync=d.gateway_spool_fsync if self.spool_fsync is None else self.spool_fsync,
            admission_wait=(
                d.gateway_admission_wait if self.admission_wait is None else self.admission_wait
            ),
            admission_expiry=(
                d.gateway_admission_expiry
                if self.admission_expiry is None
                else self.admission_expiry
            ),
        )
