"""The routes about a trajectory rather than one call: its reward (``POST
/t/{trajectory}/reward``), its state (``GET /t/{trajectory}``) and a new one with its
session key (``POST /sessions``)."""

from __future__ import annotations

import hmac
import secrets

from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from claw_tasks.client import IngestError
from claw_tasks.store import Store
from orchestrator.delivery import admission
from orchestrator.gateway.calls import RecorderError, TrajectoryError
from orchestrator.gateway.config import GatewayConfig
from orchestrator.gateway.gate import SESSION_PREFIX, Gate, Principal, key_hash
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import TURN, Recorder
from orchestrator.gateway.requests import (
    Refused,
    caller,
    error,
    forbidden,
    given_token,
    identity,
    json_object,
    read_body,
    reward_body,
    session_body,
    unauthorized,
)

MAX_SESSION_BODY = 4096


class TrajectoryRoutes:
    """Rewards, reads and sessions: for scorer tokens and session keys, not agents' calls."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        store: Store,
        gate: Gate,
        recorder: Recorder,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.store = store
        self.gate = gate
        self.recorder = recorder

    @property
    def admin_token(self) -> str:
        c = self.config
        return c.admin_token or c.reward_token or c.token

    @property
    def _scorers(self) -> tuple[str, ...]:
        """Tokens that may post any trajectory's reward and read any trajectory."""
        c = self.config
        return tuple(dict.fromkeys([c.reward_token or c.token, self.admin_token]))

    async def _scorer_or_session(self, request: Request, reward: bool) -> tuple[str, Principal]:
        """A reward post's or a read's trajectory and caller: a scorer token, or a session
        key for its trajectory or one of its choices (a reward with a key created with
        ``"reward": false``, or of a choice once the session's trajectory has its reward, is
        refused)."""
        principal = caller(request, self._scorers, "CLAW_GATEWAY_REWARD_TOKEN (or a session key)")
        traj, _ = identity(request, principal)
        if principal.session is None:
            return traj, principal
        choice = principal.choice(traj)
        try:
            info = await self.gate.session(principal, 0 if choice is None else choice + 1)
        except Exception as e:
            raise Refused(
                error(503, f"session check failed: {type(e).__name__}", "store_unavailable")
            ) from None
        if info is None:
            raise unauthorized("CLAW_GATEWAY_REWARD_TOKEN (or a session key)")
        if choice is not None and choice >= info.choices:
            raise Refused(
                forbidden(
                    f"trajectory {traj!r} is not a choice of this session's n > 1 calls "
                    f"(they made {info.choices})"
                )
            )
        if reward and not info.may_reward:
            raise Refused(forbidden("this session key may not post rewards"))
        if reward and info.ended and choice is not None:
            raise TrajectoryError(
                f"trajectory {principal.session!r} has its reward: its session key opens "
                "nothing more"
            )
        return traj, principal

    async def reward(self, request: Request) -> Response:
        try:
            traj, _ = await self._scorer_or_session(request, reward=True)
            body = json_object(await read_body(request, self.config.max_body_bytes))
            final, turns, calls, source = reward_body(body, self.config.max_turns)
        except Refused as r:
            self.metrics.requests.labels("reward", r.response.status_code).inc()
            return r.response
        except TrajectoryError as e:
            return self._count("reward", error(409, str(e), "invalid_request_error", "trajectory"))
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
        self.gate.ended(traj)  # a key of its session, trusted here, opens nothing more
        return self._count("reward", JSONResponse({"trajectory_uid": traj, "turns": n}))

    async def trajectory(self, request: Request) -> Response:
        """``GET /t/{trajectory}``: its state in the gateway (turns, finished, the policy
        versions of its turns, its calls' interaction ids)."""
        try:
            traj, _ = await self._scorer_or_session(request, reward=False)
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
