"""The capture gateway: an OpenAI-compatible HTTP server in front of an inference server.
Agents set their client's ``base_url`` to ``http://gateway/t/<trajectory>/g/<group>/v1``
(or send ``X-Claw-Trajectory`` / ``X-Claw-Group`` headers to ``/v1``); each call is
forwarded, its reply passed back byte for byte, and afterwards recorded as one step.
docs/llm.md is the reference (routes, auth, limits, the reward rule)."""

from __future__ import annotations

import hmac
import math
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from claw_tasks.client import IngestError, Ingestor
from claw_tasks.format.schema import Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.gateway.capture import CHAT, COMPLETION, CaptureError, Retokenizer, upstream_body
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import (
    POLICY_VERSION_HEADER,
    Call,
    Recorder,
    RecorderError,
    TrajectoryError,
)
from orchestrator.gateway.upstream import Reply, Upstream, UpstreamError

UID = re.compile(r"^[A-Za-z0-9._:@+=-]{1,200}$")
TAG_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
MAX_TAGS = 8
NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


@dataclass
class GatewayConfig:
    """Everything ``claw gateway`` is configured with. ``token`` authenticates agents
    (their OpenAI API key); ``reward_token`` the reward endpoint (defaults to ``token``);
    ``metrics_token`` ``/metrics`` (CLAW_METRICS_TOKEN, as for ``claw metrics``; defaults
    to ``token``: the page names trajectories' traffic, so it is never open);
    ``upstream_key`` is what the gateway sends upstream (agents never see it).
    ``redis_url`` and ``broker_url`` default as every client's do
    (``Settings.broker_for``: the workers' broker, ``CLAW_BROKER_URL``, when it is set).
    The bounds left None come from the settings (``claw_tasks.settings.HttpLimits``): the
    upstream timeout, the reply bytes kept to record one call, the bytes of replies
    waiting for the recorder, and how long the recorder may spend on one batch before
    /healthz fails."""

    upstream: str
    namespace: str
    token: str
    redis_url: str | None = None
    broker_url: str | None = None
    reward_token: str | None = None
    metrics_token: str | None = None
    upstream_key: str | None = None
    tokenizer: str | None = None
    vllm_options: bool = True
    max_body_bytes: int = 8 * 1024 * 1024
    max_turns: int = 256
    policy_version: int | None = None
    queue_size: int = 10_000
    upstream_timeout: float | None = None
    max_reply_bytes: int | None = None
    queue_bytes: int | None = None
    recorder_stall: float | None = None

    def resolved(self) -> GatewayConfig:
        """This config with every bound left None taken from the settings."""
        d = get_settings().http
        return replace(
            self,
            upstream_timeout=self.upstream_timeout or d.gateway_upstream_timeout,
            max_reply_bytes=self.max_reply_bytes or d.gateway_reply_bytes,
            queue_bytes=self.queue_bytes or d.gateway_queue_bytes,
            recorder_stall=self.recorder_stall or d.gateway_recorder_stall,
        )


def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body (what OpenAI clients parse into their exceptions)."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status
    )


class _Refused(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def _bearer(request: Request, expected: str, which: str = "CLAW_GATEWAY_TOKEN") -> None:
    given = request.headers.get("authorization", "")  # decoded as latin-1: any bytes
    scheme, _, token = given.partition(" ")
    sent = token.strip().encode("latin-1")  # compared as bytes: a str must be ASCII
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, expected.encode()):
        raise _Refused(
            error(
                401,
                f"missing or wrong bearer token (Authorization: Bearer ${which}; "
                "the gateway's token, CLAW_GATEWAY_TOKEN, is the agents' API key)",
                "authentication_error",
                "invalid_api_key",
            )
        )


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Refused(_too_large(limit))
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise _Refused(_too_large(limit))
    return bytes(buf)


def _too_large(limit: int) -> JSONResponse:
    return error(
        413,
        f"request body over {limit} bytes (claw gateway --max-body-bytes)",
        "invalid_request_error",
        "body_too_large",
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _Refused(error(400, f"body is not JSON: {e}", "invalid_request_error")) from None
    if not isinstance(obj, dict):
        raise _Refused(error(400, "body must be a JSON object", "invalid_request_error"))
    return obj


def _identity(request: Request) -> tuple[str, str | None]:
    traj = request.path_params.get("trajectory") or request.headers.get("x-claw-trajectory")
    group = request.path_params.get("group") or request.headers.get("x-claw-group")
    if not traj:
        raise _Refused(
            error(
                400,
                "no trajectory id: call /t/<trajectory>/g/<group>/v1/... or send an "
                "X-Claw-Trajectory header",
                "invalid_request_error",
                "missing_trajectory",
            )
        )
    for what, v in (("trajectory", traj), ("group", group)):
        if v is not None and not UID.match(v):
            raise _Refused(
                error(
                    400,
                    f"{what} id {v[:40]!r} must be 1-200 characters of A-Z a-z 0-9 . _ : @ + = -",
                    "invalid_request_error",
                    f"bad_{what}",
                )
            )
    return traj, group


def _tags(request: Request) -> dict[str, Any]:
    """Free tags from ``X-Claw-Tags: task=math,difficulty=2`` (numbers are numeric)."""
    raw = request.headers.get("x-claw-tags")
    if not raw:
        return {}
    tags: dict[str, Any] = {}
    for part in raw.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not TAG_NAME.match(name) or not value or len(value) > 200:
            raise _Refused(
                error(
                    400,
                    f"X-Claw-Tags entry {part[:60]!r}: write name=value, names lower-case "
                    "a-z0-9_, values up to 200 characters",
                    "invalid_request_error",
                    "bad_tags",
                )
            )
        tags[name] = float(value) if NUMBER.match(value) else value
    if len(tags) > MAX_TAGS:
        raise _Refused(error(400, f"at most {MAX_TAGS} tags", "invalid_request_error", "bad_tags"))
    return tags


class Gateway:
    """The app's state: config, upstream client, recorder, metrics."""

    def __init__(self, config: GatewayConfig, ingestor: Ingestor | None = None) -> None:
        if not config.token:
            raise ValueError("the gateway needs a token (CLAW_GATEWAY_TOKEN)")
        config = config.resolved()
        self.config = config
        self.metrics = GatewayMetrics()
        if ingestor is None:
            store = Store(config.redis_url or get_settings().redis_url, config.namespace)
            has_schema = store.exists() and store.config(refresh=True).schema is not None
            store.r.close()
            ingestor = Ingestor(
                config.namespace,
                config.redis_url,
                broker_url=config.broker_url,
                flush_interval=0.5,
                schema=None if has_schema else Schema.llm(),
            )
        ingestor.store.set_episode_index()  # a reward post reads its turns in O(turns)
        retok = Retokenizer(config.tokenizer) if config.tokenizer else None
        self.recorder = Recorder(
            ingestor,
            self.metrics,
            retokenizer=retok,
            max_turns=config.max_turns,
            queue_size=config.queue_size,
            queue_bytes=config.queue_bytes,
            stall_after=config.recorder_stall,
            policy_version=config.policy_version,
        )
        self.metrics.track_backlog(lambda: self.recorder.backlog)
        headers = {"accept-encoding": "identity"}
        if config.upstream_key:
            headers["authorization"] = f"Bearer {config.upstream_key}"
        self.upstream = Upstream(
            config.upstream,
            headers,
            timeout=config.upstream_timeout,
            connect_timeout=min(10.0, config.upstream_timeout),
        )

    async def close(self) -> None:
        await self.upstream.aclose()
        await run_in_threadpool(self.recorder.close)

    # ---- routes -------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._forward(request, CHAT, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._forward(request, COMPLETION, "/v1/completions")

    async def _forward(self, request: Request, kind: str, path: str) -> Response:
        try:
            _bearer(request, self.config.token)
            traj, group = _identity(request)
            tags = _tags(request)
            payload = _json_object(await _body(request, self.config.max_body_bytes))
            try:
                # serialized here: a value orjson cannot write (an int past 64 bits, a
                # non-string key) is the request's fault
                body = orjson.dumps(upstream_body(kind, payload, self.config.vllm_options))
            except (CaptureError, TypeError, ValueError, OverflowError) as e:
                raise _Refused(error(400, str(e), "invalid_request_error")) from None
            try:
                self.recorder.admit(traj)
            except TrajectoryError as e:
                raise _Refused(error(409, str(e), "invalid_request_error", "trajectory")) from None
        except _Refused as r:
            self.metrics.requests.labels(kind, r.response.status_code).inc()
            return r.response
        limit = self.config.max_reply_bytes
        assert limit is not None
        t0 = time.perf_counter()
        try:
            resp = await self.upstream.post(path, body, "application/json")
            content, head, whole = b"", [], True
            if resp.status != 200 or not payload.get("stream"):
                head, whole = await resp.read_upto(limit)
                if whole:
                    content, head = b"".join(head), []
                    await resp.close()
        except UpstreamError as e:
            self.recorder.refund(traj)
            self.metrics.requests.labels(kind, 502).inc()
            return error(502, f"upstream {self.config.upstream} failed: {e}", "upstream_error")
        self.metrics.upstream_seconds.observe(time.perf_counter() - t0)
        media = resp.headers.get("content-type", "application/json")
        self.metrics.requests.labels(kind, resp.status).inc()
        if not whole:  # over the bound: the rest passed through as it comes, not recorded
            return StreamingResponse(
                self._relay_rest(traj, resp, head, resp.status == 200),
                resp.status,
                media_type=media,
            )
        if resp.status != 200:  # passed through, recorded as nothing
            self.recorder.refund(traj)
            return Response(content, resp.status, media_type=media)

        version = resp.headers.get(POLICY_VERSION_HEADER)

        def call(reply: bytes, streamed: bool) -> Call:
            return Call(traj, group, kind, payload, reply, streamed, tags, version)

        if not payload.get("stream"):

            async def record() -> None:  # after the response is sent
                self.recorder.submit(call(content, False))

            return Response(content, 200, media_type=media, background=BackgroundTask(record))

        async def relay() -> AsyncIterator[bytes]:
            # Clients close the connection once they read [DONE], which may cancel this
            # generator at its last yield: a reply whose final event arrived is complete.
            # Past the bound the stream is relayed on and nothing more is kept.
            buf: bytearray | None = bytearray()
            tail = b""  # the stream's last bytes, to see a final [DONE]
            done = False
            try:
                async for chunk in resp.chunks():
                    if buf is not None:
                        buf += chunk
                        if len(buf) > limit:
                            buf = None
                    tail = (tail + chunk)[-64:]
                    yield chunk
                done = True
            finally:
                complete = done or tail.rstrip().endswith(b"data: [DONE]")
                if complete and buf is not None:
                    self.recorder.submit(call(bytes(buf), True))
                elif complete:
                    self.recorder.unrecorded(traj, "too_large")
                else:
                    self.recorder.refund(traj)
                await resp.close()

        return StreamingResponse(relay(), 200, media_type=media)

    async def _relay_rest(
        self, traj: str, resp: Reply, head: list[bytes], ok: bool
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
                self.recorder.unrecorded(traj, "too_large")
            else:
                self.recorder.refund(traj)
            await resp.close()

    async def reward(self, request: Request) -> Response:
        try:
            _bearer(request, self.config.reward_token or self.config.token)
            traj, _ = _identity(request)
            body = _json_object(await _body(request, self.config.max_body_bytes))
            final, turns, source = _reward_body(body)
        except _Refused as r:
            self.metrics.requests.labels("reward", r.response.status_code).inc()
            return r.response
        try:
            n = await run_in_threadpool(self.recorder.reward, traj, final, turns, source)
        except TrajectoryError as e:
            return self._count("reward", error(409, str(e), "invalid_request_error", "trajectory"))
        except (KeyError, ValueError) as e:
            msg = e.args[0] if e.args else str(e)
            return self._count("reward", error(409, msg, "invalid_request_error", "trajectory"))
        except IngestError as e:
            return self._count("reward", error(503, str(e), "store_unavailable"))
        except RecorderError as e:
            return self._count("reward", error(503, str(e), "recorder_unavailable"))
        return self._count("reward", JSONResponse({"trajectory_uid": traj, "turns": n}))

    def _count(self, route: str, response: Response) -> Response:
        self.metrics.requests.labels(route, response.status_code).inc()
        return response

    async def healthz(self, request: Request) -> Response:
        """200 while calls are recorded; 503 with the reason once the recorder is dead or
        stuck (a gateway that answers and records nothing is not healthy)."""
        problem = self.recorder.health()
        body = {
            "status": "ok" if problem is None else "failing",
            "namespace": self.config.namespace,
            "record_backlog": self.recorder.backlog,
        }
        if problem is not None:
            body["problem"] = problem
        return JSONResponse(body, 200 if problem is None else 503)

    async def metrics_page(self, request: Request) -> Response:
        token = self.config.metrics_token
        try:
            _bearer(
                request,
                token or self.config.token,
                "CLAW_METRICS_TOKEN" if token else "CLAW_GATEWAY_TOKEN",
            )
        except _Refused as r:
            return r.response
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _reward_body(body: dict[str, Any]) -> tuple[float, list[float] | None, str | None]:
    def number(v: Any, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise _Refused(
                error(400, f"{what} must be a finite number", "invalid_request_error", "bad_reward")
            )
        return float(v)

    unknown = set(body) - {"final_reward", "turn_rewards", "reward_source"}
    if unknown or "final_reward" not in body:
        raise _Refused(
            error(
                400,
                'reward body: {"final_reward": number, "turn_rewards": [numbers] '
                '(optional, one per recorded turn), "reward_source": string (optional)}',
                "invalid_request_error",
                "bad_reward",
            )
        )
    final = number(body["final_reward"], "final_reward")
    turns = body.get("turn_rewards")
    if turns is not None:
        if not isinstance(turns, list):
            raise _Refused(error(400, "turn_rewards must be a list", "invalid_request_error"))
        turns = [number(v, "each turn reward") for v in turns]
    source = body.get("reward_source")
    if source is not None and (not isinstance(source, str) or not 0 < len(source) <= 64):
        raise _Refused(
            error(400, "reward_source must be a string of 1-64 characters", "invalid_request_error")
        )
    return final, turns, source


def create_app(config: GatewayConfig, ingestor: Ingestor | None = None) -> Starlette:
    """The Starlette app; the gateway (Redis connection, recorder thread, upstream
    client) starts with the app's lifespan and is closed, flushed, with it."""
    holder: dict[str, Gateway] = {}

    def route(name: str) -> Any:
        async def handler(request: Request) -> Response:
            return await getattr(holder["gw"], name)(request)

        return handler

    routes = []
    for prefix in ("", "/t/{trajectory}", "/t/{trajectory}/g/{group}"):
        routes += [
            Route(prefix + "/v1/chat/completions", route("chat"), methods=["POST"]),
            Route(prefix + "/v1/completions", route("completions"), methods=["POST"]),
        ]
    routes += [
        Route("/t/{trajectory}/reward", route("reward"), methods=["POST"]),
        Route("/healthz", route("healthz"), methods=["GET"]),
        Route("/metrics", route("metrics_page"), methods=["GET"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        holder["gw"] = await run_in_threadpool(Gateway, config, ingestor)
        try:
            yield
        finally:
            await holder["gw"].close()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            "invalid_request_error",
        )

    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )
