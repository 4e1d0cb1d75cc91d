"""The capture gateway: an OpenAI-compatible HTTP server in front of an inference server.
Agents set their client's ``base_url`` to ``http://gateway/t/<trajectory>/g/<group>/v1``
(or send ``X-Claw-Trajectory`` / ``X-Claw-Group`` headers to ``/v1``); each call is
forwarded, its reply passed back byte for byte, and afterwards recorded as one step (n
steps of n trajectories with n > 1). Before a new trajectory's first call is forwarded, the
gate (:mod:`orchestrator.gateway.gate`) admits it against the trainer's staleness budget
and checks a session key. docs/llm.md is the reference (routes, auth, sessions, admission,
limits, the reward rule and credit)."""

from __future__ import annotations

import hmac
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
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
from orchestrator.delivery import admission
from orchestrator.gateway import credit
from orchestrator.gateway.capture import (
    CHAT,
    COMPLETION,
    RESPONSES,
    CaptureError,
    Retokenizer,
    upstream_body,
)
from orchestrator.gateway.gate import SESSION_PREFIX, Gate, Principal, key_hash
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import (
    POLICY_VERSION_HEADER,
    TURN,
    Call,
    Recorder,
    RecorderError,
    TrajectoryError,
    choice_trajectories,
)
from orchestrator.gateway.requests import (
    CALL_ID_HEADER,
    Refused,
    bearer,
    caller,
    error,
    forbidden,
    given_token,
    identity,
    json_object,
    read_body,
    reward_body,
    session_body,
    tags_of,
    unauthorized,
)
from orchestrator.gateway.upstream import Reply, Upstream, UpstreamError

log = logging.getLogger(__name__)

TRAJECTORY_HEADER = "x-claw-trajectory"
MAX_SESSION_BODY = 4096
_RESPONSE_ENDS = (b"event: response.completed", b"event: response.incomplete")


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
    /healthz fails."""

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

    def resolved(self) -> GatewayConfig:
        """This config with every bound left None taken from the settings."""
        d = get_settings().http
        return replace(
            self,
            upstream_timeout=self.upstream_timeout or d.gateway_upstream_timeout,
            max_reply_bytes=self.max_reply_bytes or d.gateway_reply_bytes,
            queue_bytes=self.queue_bytes or d.gateway_queue_bytes,
            recorder_stall=self.recorder_stall or d.gateway_recorder_stall,
            admission_wait=(
                d.gateway_admission_wait if self.admission_wait is None else self.admission_wait
            ),
            admission_expiry=(
                d.gateway_admission_expiry
                if self.admission_expiry is None
                else self.admission_expiry
            ),
        )


class Gateway:
    """The app's state: config, upstream client, recorder, gate, metrics."""

    def __init__(self, config: GatewayConfig, ingestor: Ingestor | None = None) -> None:
        if not config.token:
            raise ValueError("the gateway needs a token (CLAW_GATEWAY_TOKEN)")
        config = config.resolved()
        self.config = config
        self.metrics = GatewayMetrics()
        redis_url = config.redis_url or get_settings().redis_url
        if ingestor is None:
            store = Store(redis_url, config.namespace)
            has_schema = store.exists() and store.config(refresh=True).schema is not None
            store.r.close()
            ingestor = Ingestor(
                config.namespace,
                config.redis_url,
                broker_url=config.broker_url,
                flush_interval=0.5,
                schema=None if has_schema else Schema.llm(),
            )
        store = ingestor.store
        store.set_episode_index()  # a reward post reads its turns in O(turns)
        schema = store.schema() if store.exists() else None
        if schema is not None:  # a namespace made before these tags: its rewards set them
            store.ensure_schema(schema.with_tags({"min_version": "num", "max_version": "num"}))
        if config.turn_discount is not None:
            credit.set_discount(store, config.turn_discount)
        self.store = store
        self.gate = Gate(
            store,
            redis_url,
            self.metrics,
            enabled=config.admission,
            wait=config.admission_wait or 0.0,
            ttl=config.session_ttl,
            expiry=config.admission_expiry or 0.0,
        )
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
            trajectory_ttl=config.session_ttl,
            admission_expiry=config.admission_expiry or 0.0,
            who=self.gate.who,
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
        await self.gate.aclose()
        await run_in_threadpool(self.recorder.close)

    @property
    def admin_token(self) -> str:
        c = self.config
        return c.admin_token or c.reward_token or c.token

    @property
    def _scorers(self) -> tuple[str, ...]:
        """Tokens that may post any trajectory's reward and read any trajectory."""
        c = self.config
        return tuple(dict.fromkeys([c.reward_token or c.token, self.admin_token]))

    # ---- routes -------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._forward(request, CHAT, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._forward(request, COMPLETION, "/v1/completions")

    async def responses(self, request: Request) -> Response:
        return await self._forward(request, RESPONSES, "/v1/responses")

    async def _admit(
        self, principal: Principal, trajectories: tuple[str, ...], group: str | None
    ) -> str | None:
        """The gate's verdict as a refusal, or the call's group (a session's by default)."""
        verdict = await self.gate.enter(principal, trajectories, group)
        if verdict.status == "ok":
            if verdict.session is not None and group is None:
                return verdict.session.group
            return group
        if verdict.status == "bad_key":
            raise unauthorized("CLAW_GATEWAY_TOKEN or a session key")
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

    async def _forward(self, request: Request, kind: str, path: str) -> Response:
        trajectories: tuple[str, ...] = ()
        try:
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
            try:
                self.recorder.admit(trajectories)
            except TrajectoryError as e:
                raise Refused(error(409, str(e), "invalid_request_error", "trajectory")) from None
            try:
                group = await self._admit(principal, trajectories, group)
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
        except Refused as r:
            self.metrics.requests.labels(kind, r.response.status_code).inc()
            return r.response
        limit = self.config.max_reply_bytes
        assert limit is not None
        call_id = secrets.token_hex(8)
        ours = {CALL_ID_HEADER: call_id, TRAJECTORY_HEADER: traj}
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

        def call(reply: bytes, streamed: bool) -> Call:
            return Call(
                traj, group, kind, payload, reply, streamed, tags, version, call_id, trajectories
            )

        if not payload.get("stream"):

            async def record() -> None:  # after the response is sent
                self.recorder.submit(call(content, False))

            return Response(
                content, 200, media_type=media, headers=ours, background=BackgroundTask(record)
            )

        async def relay() -> AsyncIterator[bytes]:
            # Clients close the connection once they read [DONE], which may cancel this
            # generator at its last yield: a reply whose final event arrived is complete.
            # Past the bound the stream is relayed on and nothing more is kept.
            buf: bytearray | None = bytearray()
            tail = b""  # the stream's last bytes, to see a final [DONE]
            done = ended = False  # ended: a Responses stream's final event went by
            try:
                async for chunk in resp.chunks():
                    if buf is not None:
                        buf += chunk
                        if len(buf) > limit:
                            buf = None
                    if kind == RESPONSES and not ended:
                        ended = any(e in tail + chunk for e in _RESPONSE_ENDS)
                    tail = (tail + chunk)[-64:]
                    yield chunk
                done = True
            finally:
                complete = done or ended or tail.rstrip().endswith(b"data: [DONE]")
                if complete and buf is not None:
                    self.recorder.submit(call(bytes(buf), True))
                elif complete:
                    self.recorder.unrecorded(trajectories, "too_large")
                else:
                    self.recorder.refund(trajectories)
                await resp.close()

        return StreamingResponse(relay(), 200, media_type=media, headers=ours)

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

    async def _scorer_or_session(self, request: Request, reward: bool) -> Principal:
        """A reward post's or a read's caller: a scorer token, or a session key (a reward
        with a key created with ``"reward": false`` is refused)."""
        principal = caller(request, self._scorers, "CLAW_GATEWAY_REWARD_TOKEN (or a session key)")
        if principal.session is None:
            return principal
        try:
            info = await self.gate.session(principal)
        except Exception as e:
            raise Refused(
                error(503, f"session check failed: {type(e).__name__}", "store_unavailable")
            ) from None
        if info is None:
            raise unauthorized("CLAW_GATEWAY_REWARD_TOKEN (or a session key)")
        if reward and not info.may_reward:
            raise Refused(forbidden("this session key may not post rewards"))
        return principal

    async def reward(self, request: Request) -> Response:
        try:
            principal = await self._scorer_or_session(request, reward=True)
            traj, _ = identity(request, principal)
            body = json_object(await read_body(request, self.config.max_body_bytes))
            final, turns, calls, source = reward_body(body, self.config.max_turns)
        except Refused as r:
            self.metrics.requests.labels("reward", r.response.status_code).inc()
            return r.response
        try:
            n = await run_in_threadpool(
                self.recorder.reward, traj, final, turns, source, 60.0, calls
            )
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

    async def trajectory(self, request: Request) -> Response:
        """``GET /t/{trajectory}``: its state in the gateway (turns, finished, the policy
        versions of its turns, its calls' interaction ids)."""
        try:
            principal = await self._scorer_or_session(request, reward=False)
            traj, _ = identity(request, principal)
        except Refused as r:
            return self._count("read", r.response)
        try:
            raw = await self.gate.r.hgetall(admission.trajectory_key(self.store, traj))
        except (RedisError, OSError, TimeoutError) as e:
            return self._count(
                "read",
                error(503, f"the store did not answer: {type(e).__name__}", "store_unavailable"),
            )
        if not raw:
            return self._count(
                "read",
                error(404, f"no trajectory {traj!r} in the gateway", "invalid_request_error"),
            )
        d = {k.decode(): v.decode() for k, v in raw.items()}

        def num(field: str) -> int | None:
            v = d.get(field)
            return None if v in (None, "", "-") else int(float(v))

        calls = {k[2:]: int(v) for k, v in d.items() if k.startswith("c:")}
        return self._count(
            "read",
            JSONResponse(
                {
                    "trajectory_uid": traj,
                    "group": d.get("grp") or None,
                    "turns": num("turns") or 0,
                    "finished": "done" in d,
                    "min_version": num("vmin"),
                    "max_version": num("vmax"),
                    "admitted_version": num("adm"),
                    "session": "key" in d,
                    "calls": dict(sorted(calls.items(), key=lambda kv: kv[1])),
                }
            ),
        )

    async def sessions(self, request: Request) -> Response:
        """``POST /sessions`` (admin token): a new trajectory and a key scoped to it."""
        try:
            sent = given_token(request)
            if sent is None or not hmac.compare_digest(sent, self.admin_token.encode()):
                raise unauthorized("CLAW_GATEWAY_ADMIN_TOKEN")
            body = json_object(await read_body(request, MAX_SESSION_BODY))
            traj, group, may_reward, ttl = session_body(body, self.config.session_ttl)
        except Refused as r:
            return self._count("sessions", r.response)
        key = f"{SESSION_PREFIX}{traj}~{secrets.token_urlsafe(32)}"
        try:
            made = await self.gate.script(
                TURN,
                [admission.trajectory_key(self.store, traj), admission.admission_key(self.store)],
                ["session", ttl, key_hash(key), group or "", int(may_reward)],
            )
        except (RedisError, OSError, TimeoutError) as e:
            return self._count(
                "sessions",
                error(503, f"the store did not answer: {type(e).__name__}", "store_unavailable"),
            )
        if not int(made):
            return self._count(
                "sessions",
                error(
                    409,
                    f"trajectory {traj!r} exists already: a session starts a new one",
                    "invalid_request_error",
                    "trajectory",
                ),
            )
        self.metrics.sessions.inc()
        base = f"/t/{traj}/g/{group}/v1" if group else f"/t/{traj}/v1"
        return self._count(
            "sessions",
            JSONResponse(
                {
                    "trajectory_uid": traj,
                    "group": group,
                    "key": key,
                    "may_reward": may_reward,
                    "base_path": base,
                    "expires_in": ttl,
                },
                201,
            ),
        )

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
            bearer(
                request,
                token or self.config.token,
                "CLAW_METRICS_TOKEN" if token else "CLAW_GATEWAY_TOKEN",
            )
        except Refused as r:
            return r.response
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


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
            Route(prefix + "/v1/responses", route("responses"), methods=["POST"]),
        ]
    routes += [
        Route("/t/{trajectory}/reward", route("reward"), methods=["POST"]),
        Route("/t/{trajectory}", route("trajectory"), methods=["GET"]),
        Route("/sessions", route("sessions"), methods=["POST"]),
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
