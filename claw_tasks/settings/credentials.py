"""The services' secrets (tokens, the inspector's login), never printed: ``Settings``
keeps them out of its repr."""

from __future__ import annotations

from .variable import Variable

CREDENTIALS: tuple[Variable, ...] = (
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
