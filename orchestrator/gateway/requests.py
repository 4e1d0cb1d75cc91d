"""What a request to the gateway says, read and refused before anything else runs: the
bearer token or session key, the bounded body, the trajectory and group ids, the free tags,
and the session and reward bodies. Every refusal is an OpenAI-style error (``Refused``
carries it), so an agent's client raises the matching exception."""

from __future__ import annotations

import hmac
import math
import re
import secrets
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse

from orchestrator.gateway.gate import SESSION_PREFIX, Principal, key_hash

# Every pattern is used with ``fullmatch``: ``$`` would also match before a final newline.
UID = re.compile(r"[A-Za-z0-9._:@+=-]{1,200}")
"""Trajectory and group ids agents choose."""
TRAJECTORY = re.compile(r"[A-Za-z0-9._:@+=-]{1,200}(~(0|[1-9][0-9]{0,3}))?")
"""A trajectory id in a path or header: an agent's, or choice i of an n > 1 call (``T~i``,
i written as :func:`~orchestrator.gateway.calls.choice_trajectories` writes it)."""
CALL_ID = re.compile(r"[0-9a-f]{16}")
CALL_ID_HEADER = "x-claw-call-id"
"""The reply header naming the call (its interaction id, for rewards by call)."""
TAG_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
MAX_TAGS = 8
NUMBER = re.compile(r"-?\d+(\.\d+)?")


def error(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error body (what OpenAI clients parse into their exceptions)."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status,
        headers=headers,
    )


class Refused(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def bearer(request: Request, expected: str, which: str = "CLAW_GATEWAY_TOKEN") -> None:
    """Refused unless the request carries the bearer token ``expected`` (named ``which``)."""
    sent = given_token(request)  # compared as bytes: a str must be ASCII
    if sent is None or not hmac.compare_digest(sent, expected.encode()):
        raise Refused(
            error(
                401,
                f"missing or wrong bearer token (Authorization: Bearer ${which}; "
                "the gateway's token, CLAW_GATEWAY_TOKEN, is the agents' API key)",
                "authentication_error",
                "invalid_api_key",
            )
        )


def given_token(request: Request) -> bytes | None:
    """The bearer token's bytes (the header decoded as latin-1: any bytes), or None."""
    given = request.headers.get("authorization", "")  # decoded as latin-1: any bytes
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip().encode("latin-1")


def unauthorized(which: str) -> Refused:
    return Refused(
        error(
            401,
            f"missing or wrong bearer token (Authorization: Bearer ${which}; "
            "the gateway's token, CLAW_GATEWAY_TOKEN, or a session key is the agents' API key)",
            "authentication_error",
            "invalid_api_key",
        )
    )


def caller(request: Request, shared: tuple[str, ...], which: str) -> Principal:
    """The caller: one of the ``shared`` tokens (any trajectory), else a session key
    (``cs~<trajectory>~<secret>``: checked against Redis by the gate)."""
    sent = given_token(request)
    if sent is None:
        raise unauthorized(which)
    ok = False
    for token in shared:  # compared as bytes in constant time: a str must be ASCII
        ok |= hmac.compare_digest(sent, token.encode())
    if ok:
        return Principal()
    key = sent.decode("latin-1")
    if key.startswith(SESSION_PREFIX):
        traj, sep, secret = key[len(SESSION_PREFIX) :].rpartition("~")
        if sep and UID.fullmatch(traj) and 16 <= len(secret) <= 128:
            return Principal(traj, key_hash(key))
    raise unauthorized(which)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(too_large(limit))
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise Refused(too_large(limit))
    return bytes(buf)


def too_large(limit: int) -> JSONResponse:
    return error(
        413,
        f"request body over {limit} bytes (claw gateway --max-body-bytes)",
        "invalid_request_error",
        "body_too_large",
    )


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise Refused(error(400, f"body is not JSON: {e}", "invalid_request_error")) from None
    if not isinstance(obj, dict):
        raise Refused(error(400, "body must be a JSON object", "invalid_request_error"))
    return obj


def identity(request: Request, principal: Principal | None = None) -> tuple[str, str | None]:
    traj = request.path_params.get("trajectory") or request.headers.get("x-claw-trajectory")
    group = request.path_params.get("group") or request.headers.get("x-claw-group")
    if not traj and principal is not None and principal.session is not None:
        traj = principal.session  # a session key names its trajectory
    if not traj:
        raise Refused(
            error(
                400,
                "no trajectory id: call /t/<trajectory>/g/<group>/v1/... or send an "
                "X-Claw-Trajectory header",
                "invalid_request_error",
                "missing_trajectory",
            )
        )
    for what, v, rule in (("trajectory", traj, TRAJECTORY), ("group", group, UID)):
        if v is not None and not rule.fullmatch(v):
            raise Refused(
                error(
                    400,
                    f"{what} id {v[:40]!r} must be 1-200 characters of A-Z a-z 0-9 . _ : @ + = -",
                    "invalid_request_error",
                    f"bad_{what}",
                )
            )
    if principal is not None and not principal.allows(traj):
        scope = principal.session
        raise Refused(forbidden(f"this session key is scoped to trajectory {scope!r}"))
    return traj, group


def forbidden(message: str) -> JSONResponse:
    return error(403, message, "permission_error", "session_scope")


def tags_of(request: Request) -> dict[str, Any]:
    """Free tags from ``X-Claw-Tags: task=math,difficulty=2`` (numbers are numeric)."""
    raw = request.headers.get("x-claw-tags")
    if not raw:
        return {}
    tags: dict[str, Any] = {}
    for part in raw.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not TAG_NAME.fullmatch(name) or not value or len(value) > 200:
            raise Refused(
                error(
                    400,
                    f"X-Claw-Tags entry {part[:60]!r}: write name=value, names lower-case "
                    "a-z0-9_, values up to 200 characters",
                    "invalid_request_error",
                    "bad_tags",
                )
            )
        tags[name] = float(value) if NUMBER.fullmatch(value) else value
    if len(tags) > MAX_TAGS:
        raise Refused(error(400, f"at most {MAX_TAGS} tags", "invalid_request_error", "bad_tags"))
    return tags


def session_body(body: dict[str, Any], max_ttl: int) -> tuple[str, str | None, bool, int]:
    unknown = set(body) - {"trajectory", "group", "reward", "ttl_s"}
    if unknown:
        raise Refused(
            error(
                400,
                'session body: {"group": id (optional), "trajectory": id (optional: one is '
                'made), "reward": bool (default true: the key may post its reward), "ttl_s": '
                "seconds (optional)}",
                "invalid_request_error",
                "bad_session",
            )
        )
    traj = body.get("trajectory")
    if traj is None:
        traj = f"s-{secrets.token_hex(12)}"
    group = body.get("group")
    for what, v in (("trajectory", traj), ("group", group)):
        if v is not None and (not isinstance(v, str) or not UID.fullmatch(v)):
            raise Refused(
                error(
                    400,
                    f"{what} must be 1-200 characters of A-Z a-z 0-9 . _ : @ + = -",
                    "invalid_request_error",
                    f"bad_{what}",
                )
            )
    may_reward = body.get("reward", True)
    if not isinstance(may_reward, bool):
        raise Refused(error(400, "reward must be true or false", "invalid_request_error"))
    ttl = body.get("ttl_s", max_ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= max_ttl:
        raise Refused(
            error(400, f"ttl_s must be an integer from 1 to {max_ttl}", "invalid_request_error")
        )
    return traj, group, may_reward, ttl


def reward_body(
    body: dict[str, Any], max_turns: int
) -> tuple[float, list[float] | None, dict[str, float] | None, str | None]:
    def number(v: Any, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise Refused(
                error(400, f"{what} must be a finite number", "invalid_request_error", "bad_reward")
            )
        return float(v)

    unknown = set(body) - {"final_reward", "turn_rewards", "call_rewards", "reward_source"}
    if unknown or "final_reward" not in body:
        raise Refused(
            error(
                400,
                'reward body: {"final_reward": number, "turn_rewards": [numbers] '
                '(optional, one per recorded turn), "call_rewards": {call id: number} '
                '(optional: by the X-Claw-Call-Id of the calls), "reward_source": string '
                "(optional)}",
                "invalid_request_error",
                "bad_reward",
            )
        )
    final = number(body["final_reward"], "final_reward")
    turns = body.get("turn_rewards")
    if turns is not None:
        if not isinstance(turns, list) or len(turns) > max_turns:
            raise Refused(
                error(
                    400,
                    f"turn_rewards must be a list of at most {max_turns}",
                    "invalid_request_error",
                )
            )
        turns = [number(v, "each turn reward") for v in turns]
    calls = body.get("call_rewards")
    if calls is not None:
        if turns is not None:
            raise Refused(
                error(400, "give turn_rewards or call_rewards, not both", "invalid_request_error")
            )
        if not isinstance(calls, dict) or len(calls) > max_turns:
            raise Refused(
                error(
                    400,
                    f"call_rewards must be an object of at most {max_turns} call ids",
                    "invalid_request_error",
                )
            )
        for k in calls:
            if not CALL_ID.fullmatch(k):
                raise Refused(
                    error(
                        400,
                        f"call id {k[:40]!r} is not one the gateway gives ({CALL_ID_HEADER})",
                        "invalid_request_error",
                        "bad_reward",
                    )
                )
        calls = {k: number(v, "each call reward") for k, v in calls.items()}
    source = body.get("reward_source")
    if source is not None and (not isinstance(source, str) or not 0 < len(source) <= 64):
        raise Refused(
            error(400, "reward_source must be a string of 1-64 characters", "invalid_request_error")
        )
    return final, turns, calls, source
