"""Forwarding an agent's call: the gate's verdict, the upstream request, the reply passed
back byte for byte (streamed or whole, relayed unkept past the bound), then handed to the
recorder."""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from orchestrator.gateway.calls import (
    POLICY_VERSION_HEADER,
    Call,
    TrajectoryError,
    choice_trajectories,
)
from orchestrator.gateway.capture import RESPONSES, CaptureError, upstream_body
from orchestrator.gateway.config import GatewayConfig
from orchestrator.gateway.gate import Gate, Principal
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import Recorder
from orchestrator.gateway.requests import (
    CALL_ID_HEADER,
    Refused,
    caller,
    error,
    forbidden,
    identity,
    json_object,
    read_body,
    tags_of,
    unauthorized,
)
from orchestrator.gateway.upstream import Reply, Upstream, UpstreamError

log = logging.getLogger(__name__)

TRAJECTORY_HEADER = "x-claw-trajectory"
_RESPONSE_ENDS = (b"event: response.completed", b"event: response.incomplete")


@dataclass(frozen=True)
class _Incoming:
    """A call admitted to go upstream: who sent it, its request and the serialized body."""

    traj: str
    group: str | None
    kind: str
    payload: dict[str, Any]
    body: bytes
    tags: dict[str, Any]
    trajectories: tuple[str, ...]

    def call(self, reply: bytes, streamed: bool, version: str | None, call_id: str) -> Call:
        """The :class:`Call` the recorder gets once ``reply`` came back whole."""
        return Call(
            self.traj,
            self.group,
            self.kind,
            self.payload,
            reply,
            streamed,
            self.tags,
            version,
            call_id,
            self.trajectories,
        )


class Forwarder:
    """The chat, completions and Responses routes: one call in, its reply out."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        gate: Gate,
        recorder: Recorder,
        upstream: Upstream,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.gate = gate
        self.recorder = recorder
        self.upstream = upstream

    async def _admit(
        self, principal: Principal, trajectories: tuple[str, ...], group: str | None, split: int
    ) -> str | None:
        """The gate's verdict as a refusal, or the call's group (a session's by default)."""
        verdict = await self.gate.enter(principal, trajectories, group, split)
        if verdict.status == "ok":
            if verdict.session is not None and group is None:
                return verdict.session.group
            return group
        if verdict.status == "bad_key":
            raise unauthorized("CLAW_GATEWAY_TOKEN or a session key")
        if verdict.status == "ended":
            raise Refused(
                error(
                    409,
                    f"trajectory {principal.session!r} has its reward: its session key "
                    "opens nothing more",
                    "invalid_request_error",
                    "session_ended",
                )
            )
        if verdict.status == "not_choice":
            made = verdict.session.choices if verdict.session else 0
            raise Refused(
                forbidden(
                    f"trajectory {trajectories[0]!r} is not a choice of this session's "
                    f"n > 1 calls (they made {made})"
                )
            )
        if verdict.status == "bad_group":
            want = verdict.session.group if verdict.session else None
            raise Refused(forbidden(f"this session key is scoped to group {want!r}"))
        retry = self.config.retry_after
        raise Refused(
            error(
                429,
                f"the staleness budget is full ({verdict.budget} trajectories: "
                "(max_staleness + trainer version + 1) x batch); a new trajectory starts once "
                f"the trainer moves on: retry after {retry:g} s",
                "rate_limit_error",
                "admission",
                headers={
                    "retry-after": str(max(1, math.ceil(retry))),
                    "retry-after-ms": str(int(retry * 1000)),
                },
            )
        )

    async def forward(self, request: Request, kind: str, path: str) -> Response:
        """Forward one call of ``kind`` upstream to ``path``, pass its reply back, and hand
        it to the recorder (or refund, or count it unrecorded)."""
        try:
            incoming = await self._incoming(request, kind)
        except Refused as r:
            self.metrics.requests.labels(kind, r.response.status_code).inc()
            return r.response
        trajectories, stream = incoming.trajectories, bool(incoming.payload.get("stream"))
        limit = self.config.max_reply_bytes
        assert limit is not None
        call_id = secrets.token_hex(8)
        ours = {CALL_ID_HEADER: call_id, TRAJECTORY_HEADER: incoming.traj}
        t0 = time.perf_counter()
        try:
            resp = await self.upstream.post(path, incoming.body, "application/json")
            content, head, whole = b"", [], True
            if resp.status != 200 or not stream:
                head, whole = await resp.read_upto(limit)
                if whole:
                    content, head = b"".join(head), []
                    await resp.close()
        except UpstreamError as e:
            self.recorder.refund(trajectories)
            self.metrics.requests.labels(kind, 502).inc()
            return error(502, f"upstream {self.config.upstream} failed: {e}", "upstream_error")
        self.metrics.upstream_seconds.observe(time.perf_counter() - t0)
        media = resp.headers.get("content-type", "application/json")
        self.metrics.requests.labels(kind, resp.status).inc()
        if not whole:  # over the bound: the rest passed through as it comes, not recorded
            return StreamingResponse(
                self._relay_rest(trajectories, resp, head, resp.status == 200),
                resp.status,
                media_type=media,
                headers=ours,
            )
        if resp.status != 200:  # passed through, recorded as nothing
            self.recorder.refund(trajectories)
            return Response(content, resp.status, media_type=media)
        version = resp.headers.get(POLICY_VERSION_HEADER)
        if not stream:
            call = incoming.call(content, False, version, call_id)
            self.recorder.keep(call)  # spooled before the agent has the reply

            async def record() -> None:  # after the response is sent
                self.recorder.submit(call)

            return Response(
                content, 200, media_type=media, headers=ours, background=BackgroundTask(record)
            )
        relay = self._relay(incoming, resp, version, call_id, limit)
        return StreamingResponse(relay, 200, media_type=media, headers=ours)

    async def _incoming(self, request: Request, kind: str) -> _Incoming:
        """The call ``request`` makes, checked and admitted; :class:`Refused` (with the
        response to send) when it may not go upstream."""
        principal = caller(request, (self.config.token,), "CLAW_GATEWAY_TOKEN")
        traj, group = identity(request, principal)
        tags = tags_of(request)
        payload = json_object(await read_body(request, self.config.max_body_bytes))
        try:
            # serialized here: a value orjson cannot write (an int past 64 bits, a
            # non-string key) is the request's fault
            body = orjson.dumps(
                upstream_body(kind, payload, self.config.vllm_options, self.config.max_n)
            )
        except (CaptureError, TypeError, ValueError, OverflowError) as e:
            raise Refused(error(400, str(e), "invalid_request_error")) from None
        n = int(payload.get("n") or 1)
        if n > 1 and "~" in traj:
            raise Refused(
                error(
                    400,
                    f"n > 1 starts n trajectories {traj}~0.. of a new call; trajectory "
                    f"{traj!r} is itself a choice of one",
                    "invalid_request_error",
                    "bad_trajectory",
                )
            )
        trajectories = choice_trajectories(traj, n)
        if n > 1 and group is None and principal.session is None:
            group = traj  # n samples of one prompt: one group, named by the call
        split = n if n > 1 and principal.session is not None else 0
        group = await self._admit_call(principal, trajectories, group, split)
        return _Incoming(traj, group, kind, payload, body, tags, trajectories)

    async def _admit_call(
        self, principal: Principal, trajectories: tuple[str, ...], group: str | None, split: int
    ) -> str | None:
        """``trajectories`` admitted by the recorder and the gate (refunded when the gate
        refuses): the call's group, or :class:`Refused`."""
        try:
            self.recorder.admit(trajectories)
        except TrajectoryError as e:
            raise Refused(error(409, str(e), "invalid_request_error", "trajectory")) from None
        try:
            return await self._admit(principal, trajectories, group, split)
        except Refused:
            self.recorder.refund(trajectories)
            raise
        except (RedisError, OSError, TimeoutError) as e:
            # The store does not answer. A session key cannot be checked: refused. A
            # shared-token call goes on unadmitted (counted): its turns wait in the
            # recorder like every turn then, and what is served is still bounded by
            # the recipe's where; its next call asks the budget again.
            if principal.session is not None:
                self.recorder.refund(trajectories)
                raise Refused(
                    error(503, f"session check failed: {type(e).__name__}", "store_unavailable")
                ) from None
            log.warning("admission unchecked (the store does not answer): %s", e)
            self.metrics.unchecked.inc()
            return group

    async def _relay(
        self, incoming: _Incoming, resp: Reply, version: str | None, call_id: str, limit: int
    ) -> AsyncIterator[bytes]:
        """A streamed 200 reply, passed on chunk by chunk and recorded once complete.
        Clients close the connection once they read [DONE], which may cancel this generator
        at its last yield: a reply whose final event arrived is complete. Past the bound
        the stream is relayed on and nothing more is kept."""
        buf: bytearray | None = bytearray()
        tail = b""  # the stream's last bytes, to see a final [DONE]
        done = ended = False  # ended: a Responses stream's final event went by
        kept = None  # the call, spooled once its final event is in (before that goes out)
        try:
            async for chunk in resp.chunks():
                if buf is not None:
                    buf += chunk
                    if len(buf) > limit:
                        buf = None
                if incoming.kind == RESPONSES and not ended:
                    ended = any(e in tail + chunk for e in _RESPONSE_ENDS)
                tail = (tail + chunk)[-64:]
                final = ended or tail.rstrip().endswith(b"data: [DONE]")
                if final and kept is None and buf is not None:
                    kept = incoming.call(bytes(buf), True, version, call_id)
                    self.recorder.keep(kept)
                yield chunk
            done = True
        finally:
            complete = done or ended or tail.rstrip().endswith(b"data: [DONE]")
            if kept is not None:  # recorded as spooled (bytes past the final event aside)
                self.recorder.submit(kept)
            elif complete and buf is not None:  # a stream that ended without its final event
                call = incoming.call(bytes(buf), True, version, call_id)
                self.recorder.keep(call)
                self.recorder.submit(call)
            elif complete:
                self.recorder.unrecorded(incoming.trajectories, "too_large")
            else:
                self.recorder.refund(incoming.trajectories)
            await resp.close()

    async def _relay_rest(
        self, trajectories: tuple[str, ...], resp: Reply, head: list[bytes], ok: bool
    ) -> AsyncIterator[bytes]:
        """A reply over ``--max-reply-bytes``: the pieces read (each let go once sent),
        then the rest as it arrives; counted unrecorded (``too_large``) if it was a 200,
        else refunded like any error."""
        head.reverse()
        try:
            while head:
                yield head.pop()
            async for chunk in resp.chunks():
                yield chunk
        finally:
            if ok:
                self.recorder.unrecorded(trajectories, "too_large")
            else:
                self.recorder.refund(trajectories)
            await resp.close()
