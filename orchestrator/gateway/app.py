"""The capture gateway: an OpenAI-compatible HTTP server in front of an inference server.
Agents set their client's ``base_url`` to ``http://gateway/t/<trajectory>/g/<group>/v1``
(or send ``X-Claw-Trajectory`` / ``X-Claw-Group`` headers to ``/v1``); each call is
forwarded, its reply passed back byte for byte, and afterwards recorded as one step (n
steps of n trajectories with n > 1). Before a new trajectory's first call is forwarded, the
gate (:mod:`orchestrator.gateway.gate`) admits it against the trainer's staleness budget
and checks a session key. docs/llm.md is the reference (routes, auth, sessions, admission,
limits, the reward rule and credit)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.gateway import credit
from orchestrator.gateway.capture import CHAT, COMPLETION, RESPONSES, Retokenizer
from orchestrator.gateway.config import GatewayConfig
from orchestrator.gateway.forward import Forwarder
from orchestrator.gateway.gate import STORE_TIMEOUT_S, Gate
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import Recorder
from orchestrator.gateway.requests import Refused, bearer, error
from orchestrator.gateway.spool import Spool
from orchestrator.gateway.trajectories import TrajectoryRoutes
from orchestrator.gateway.upstream import Upstream

log = logging.getLogger(__name__)

BUDGET_FRESH_S = 1.0
"""Scrapes within this of the last budget read show that read (scrapers that ask at once,
several Prometheus servers, cost the store one read)."""


class Gateway:
    """The app's state: config, upstream client, recorder, gate, metrics, and the two
    groups of routes (agents' calls, and what is about a trajectory) that share them."""

    def __init__(
        self, config: GatewayConfig, ingestor: Ingestor | None = None, spool: Spool | None = None
    ) -> None:
        if not config.token:
            raise ValueError("the gateway needs a token (CLAW_GATEWAY_TOKEN)")
        config = config.resolved()
        if spool is None and config.spool:
            assert config.spool_bytes is not None
            spool = Spool(
                config.spool,
                config.spool_bytes,
                fsync=bool(config.spool_fsync),
                owner=config.namespace,
            )
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
            spool=spool,
        )
        self.metrics.track_backlog(lambda: self.recorder.backlog)
        if spool is not None:
            self.metrics.track_spool(lambda: spool.size)
            self.recorder.replay(spool.found)  # before the app serves: rewards wait for them
            spool.found = []
        headers = {"accept-encoding": "identity"}
        if config.upstream_key:
            headers["authorization"] = f"Bearer {config.upstream_key}"
        self.upstream = Upstream(
            config.upstream,
            headers,
            timeout=config.upstream_timeout,
            connect_timeout=min(10.0, config.upstream_timeout),
        )
        self.forwarder = Forwarder(config, self.metrics, self.gate, self.recorder, self.upstream)
        self.trajectories = TrajectoryRoutes(config, self.metrics, store, self.gate, self.recorder)
        self._budget_read: asyncio.Task[None] | None = None  # the one read in flight
        self._budget_at = -BUDGET_FRESH_S  # when the last read ended (monotonic)

    async def close(self) -> None:
        if self._budget_read is not None:
            self._budget_read.cancel()
        await self.upstream.aclose()
        await self.gate.aclose()
        await run_in_threadpool(self.recorder.close)

    # ---- routes -------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self.forwarder.forward(request, CHAT, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self.forwarder.forward(request, COMPLETION, "/v1/completions")

    async def responses(self, request: Request) -> Response:
        return await self.forwarder.forward(request, RESPONSES, "/v1/responses")

    async def reward(self, request: Request) -> Response:
        return await self.trajectories.reward(request)

    async def trajectory(self, request: Request) -> Response:
        return await self.trajectories.trajectory(request)

    async def sessions(self, request: Request) -> Response:
        return await self.trajectories.sessions(request)

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
        await self.read_budget()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read_budget(self) -> None:
        """Refresh the admission gauges, waiting at most ``STORE_TIMEOUT_S``: a store that
        does not answer costs a scrape that, and the page shows this process's own figures
        without the budget. One read at a time; a slow one goes on after the page is out."""
        if time.monotonic() - self._budget_at < BUDGET_FRESH_S:
            return
        if self._budget_read is None or self._budget_read.done():
            self._budget_read = asyncio.create_task(self._read_budget())
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._budget_read), STORE_TIMEOUT_S)
            return
        self.metrics.budget.update(None, known=False)

    async def _read_budget(self) -> None:
        try:
            self.metrics.budget.update(await self.gate.budget())
        except Exception as e:  # the store is away or its hash malformed: the page goes on
            log.warning("gateway metrics: the admission budget is unreadable: %s", e)
            self.metrics.budget.update(None, known=False)
        finally:
            self._budget_at = time.monotonic()


def create_app(
    config: GatewayConfig, ingestor: Ingestor | None = None, spool: Spool | None = None
) -> Starlette:
    """The Starlette app; the gateway (Redis connection, recorder thread, upstream
    client) starts with the app's lifespan and is closed, flushed, with it. ``spool``: an
    open spool (else ``config.spool`` is opened, if set)."""
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
        holder["gw"] = await run_in_threadpool(Gateway, config, ingestor, spool)
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
