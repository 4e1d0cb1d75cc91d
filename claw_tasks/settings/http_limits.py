"""What one HTTP request may make the gateway or the inspector hold or wait for, and how
deep a where may nest (docs/reliability.md, HTTP surfaces): the ``http.*`` variables and
the ``HttpLimits`` they build."""

from __future__ import annotations

from dataclasses import dataclass

from .variable import MIB, Variable, at_least_one, count, flag, seconds, seconds_or_never

HTTP: tuple[Variable, ...] = (
    Variable(
        "CLAW_GATEWAY_MAX_REPLY_BYTES",
        "http.gateway_reply_bytes",
        count,
        32 * MIB,
        "`claw gateway`: bytes of one upstream reply or stream kept to record it; past them "
        "the rest is relayed as it arrives and the call is not recorded (`too_large`)",
        shown="32 MiB",
    ),
    Variable(
        "CLAW_GATEWAY_QUEUE_BYTES",
        "http.gateway_queue_bytes",
        count,
        256 * MIB,
        "`claw gateway`: bytes of replies waiting for the recorder, together (past them: "
        "`queue_full`)",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_GATEWAY_UPSTREAM_TIMEOUT",
        "http.gateway_upstream_timeout",
        seconds,
        300.0,
        "`claw gateway`: seconds to wait for the upstream's headers, and between its reads "
        "(then `502`)",
        shown="`300`",
    ),
    Variable(
        "CLAW_GATEWAY_RECORDER_STALL",
        "http.gateway_recorder_stall",
        seconds,
        120.0,
        "`claw gateway`: seconds the recorder may spend on one batch of calls before "
        "`/healthz` answers `503` (and rewards `503` rather than wait)",
        shown="`120`",
    ),
    Variable(
        "CLAW_GATEWAY_ADMISSION_WAIT",
        "http.gateway_admission_wait",
        seconds,
        10.0,
        "`claw gateway`: seconds a new trajectory's first call waits for the staleness budget "
        "(docs/llm.md, Admission) before it is answered `429` with `Retry-After`",
        shown="`10`",
    ),
    Variable(
        "CLAW_GATEWAY_ADMISSION_EXPIRY",
        "http.gateway_admission_expiry",
        seconds_or_never,
        3600.0,
        "`claw gateway`: seconds an admitted trajectory may go without a recorded turn or "
        "its reward before its staleness-budget slots come back (counted `expired`; "
        "docs/llm.md, Admission); `0`: never",
        shown="`3600`",
    ),
    Variable(
        "CLAW_GATEWAY_SPOOL",
        "http.gateway_spool",
        str,
        "",
        "`claw gateway`: the directory of its spool, where every answered call waits on "
        "local disk until the store has it, so a SIGKILLed gateway loses none (docs/llm.md, "
        "Spool); one per process (`--spool` overrides); `off`: no spool",
        shown="`$TMPDIR/claw-gateway-<uid>/<namespace>-<port>`",
    ),
    Variable(
        "CLAW_GATEWAY_SPOOL_BYTES",
        "http.gateway_spool_bytes",
        count,
        1024 * MIB,
        "`claw gateway`: bytes the spool may hold; a call past them is recorded from memory "
        "only (counted `claw_gateway_spool_dropped_calls`)",
        shown="1 GiB",
    ),
    Variable(
        "CLAW_GATEWAY_SPOOL_FSYNC",
        "http.gateway_spool_fsync",
        flag,
        False,
        "`claw gateway`: fsync the spool after each call (survives power loss too, at a "
        "disk flush per call); off, a call survives the process's SIGKILL, not the machine's",
        shown="`0`",
    ),
    Variable(
        "CLAW_WEB_LOGIN_BODY_BYTES",
        "http.web_login_body_bytes",
        count,
        4096,
        "`claw web`: bytes of a request body without a session (the login form; `413`)",
        shown="4 KiB",
    ),
    Variable(
        "CLAW_WEB_MAX_BODY_BYTES",
        "http.web_body_bytes",
        count,
        MIB,
        "`claw web`: bytes of a request body with a session (`413`)",
        shown="1 MiB",
    ),
    Variable(
        "CLAW_WEB_MAX_FORM_FIELDS",
        "http.web_form_fields",
        count,
        1000,
        "`claw web`: form fields of a request with a session (16 without one; `400`)",
    ),
    Variable(
        "CLAW_WHERE_MAX_DEPTH",
        "where_max_depth",
        at_least_one,
        32,
        "how deep a `where` may nest (parentheses, `not`, `and`/`or` lists) in the "
        "inspector, `claw query`, recipes and retention rules; deeper is refused",
    ),
)


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
    gateway_spool: str = ""
    gateway_spool_bytes: int = 1024 * MIB
    gateway_spool_fsync: bool = False
    web_login_body_bytes: int = 4096
    web_body_bytes: int = MIB
    web_form_fields: int = 1000
