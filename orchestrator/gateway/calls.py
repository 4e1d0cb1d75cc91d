"""A call as the gateway's handlers hand it to the recorder (``Call``), the trajectories
it records into, the errors the recorder answers with, and the call's turns as captured
and checked before they are numbered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from claw_tasks.format.schema import SchemaError
from claw_tasks.format.turns import turn_fields
from orchestrator.gateway.capture import CaptureError, Retokenizer, Turn, capture_all

POLICY_VERSION_HEADER = "x-claw-policy-version"
"""A reply header the upstream may set: the policy version that generated the reply (an
inference server whose weights a trainer updates knows it; the gateway does not)."""


class TrajectoryError(ValueError):
    """A call or reward the trajectory's state does not allow (the message says why)."""


class RecorderError(RuntimeError):
    """The recorder thread is dead or stuck: a reward cannot wait for its turns."""


CHOICE_SEPARATOR = "~"
"""Choice i of a call with n > 1 to trajectory T is trajectory ``T~i`` (``~`` is not in
the ids agents choose, so these never collide with theirs)."""


def choice_trajectories(trajectory_uid: str, n: int) -> tuple[str, ...]:
    """The trajectories one call records: itself, or with n > 1 ``T~0 .. T~(n-1)``."""
    if n == 1:
        return (trajectory_uid,)
    return tuple(f"{trajectory_uid}{CHOICE_SEPARATOR}{i}" for i in range(n))


@dataclass
class Call:
    """A successful upstream call, as the handler saw it. ``trajectories``: the one each
    choice is recorded into (:func:`choice_trajectories`)."""

    trajectory_uid: str
    prompt_uid: str | None
    kind: str
    request: dict[str, Any]
    reply: bytes
    streamed: bool
    tags: dict[str, str]
    policy_version: str | None = None  # the upstream's X-Claw-Policy-Version, unchecked
    call_id: str = ""
    trajectories: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.trajectories:
            self.trajectories = (self.trajectory_uid,)


def call_record(call: Call) -> bytes:
    """The call's fields but its reply, as the spool keeps them (JSON; the reply is the
    record's body, raw)."""
    return orjson.dumps(
        {
            "call_id": call.call_id,
            "trajectory_uid": call.trajectory_uid,
            "prompt_uid": call.prompt_uid,
            "kind": call.kind,
            "request": call.request,
            "streamed": call.streamed,
            "tags": call.tags,
            "policy_version": call.policy_version,
            "trajectories": list(call.trajectories),
        }
    )


def call_of_record(meta: bytes, reply: bytes) -> Call:
    """The :class:`Call` a spool record holds (:func:`call_record`)."""
    d = orjson.loads(meta)
    return Call(
        d["trajectory_uid"],
        d["prompt_uid"],
        d["kind"],
        d["request"],
        reply,
        bool(d["streamed"]),
        dict(d["tags"]),
        d["policy_version"],
        d["call_id"],
        tuple(d["trajectories"]),
    )


def policy_version_of(call: Call, default: int | None) -> int | None:
    """The upstream's policy version header if it sent one, else ``default``
    (``--policy-version``; else None: the turn script records the trainer's declared
    version, if any)."""
    raw = call.policy_version
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) > 2**31 - 1:
        raise CaptureError(
            f"the upstream's {POLICY_VERSION_HEADER} header {raw[:20]!r} is not an "
            "integer in 0..2^31-1"
        )
    return int(raw)


def capture_call(
    call: Call, retokenizer: Retokenizer | None, default_version: int | None
) -> list[Turn]:
    """The call's turns, checked as ``llm_turn`` will check them, before they are given
    turn indices (an index handed out and never recorded would be a gap)."""
    turns = capture_all(
        call.kind,
        call.request,
        call.reply,
        call.streamed,
        retokenizer,
        n=len(call.trajectories),
    )
    version = policy_version_of(call, default_version)
    for turn in turns:
        turn.policy_version = version
        try:
            turn_fields(
                turn.prompt_ids,
                turn.response_ids,
                turn.response_logprobs,
                None,
                False,
                f"a call of trajectory {call.trajectory_uid!r}",
            )
        except SchemaError as e:
            raise CaptureError(str(e)) from None
    return turns
