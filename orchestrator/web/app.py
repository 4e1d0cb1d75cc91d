"""The inspector's routes: Starlette, Jinja2 templates (autoescaped) and security headers.

Every page needs a session (``/login``); every POST needs the session's CSRF token too,
and is refused in read-only mode. Writes are audited in the namespace's audit stream.
Every request body is bounded before anything reads it (:class:`BodyLimit`), tightest
without a session, and so is a form's field count; a path parameter that cannot name
anything (a namespace name no namespace can have, a step id past int64) is a 404."""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from claw_tasks.format.names import check_namespace
from claw_tasks.settings import HttpLimits, get_settings
from claw_tasks.store import NamespaceError
from claw_tasks.where import FilterError
from orchestrator.inspect.query import QueryError
from orchestrator.web import views
from orchestrator.web.auth import Credentials, Session, Sessions
from orchestrator.web.thumbs import NotAnImage

HERE = Path(__file__).parent
COOKIE = "claw_session"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[Request, Session], Awaitable[Response]]
LOGIN_FIELDS = 16  # form fields of a request without a session (the login form has 2)
MAX_STEP_ID = 2**63 - 1


class BodyLimit:
    """ASGI middleware: a request body over ``limit(scope)`` bytes is refused with 413 —
    at once when its Content-Length says so, else as soon as the bytes read pass it — so
    no handler or form parser ever holds more."""

    def __init__(self, app: ASGIApp, limit: Callable[[Scope], int]) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _too_large(limit)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, _over(limit))
            return message

        await self.app(scope, bounded, send)


def _over(limit: int) -> str:
    return (
        f"request body over {limit} bytes (CLAW_WEB_MAX_BODY_BYTES, or "
        "CLAW_WEB_LOGIN_BODY_BYTES before logging in)"
    )


def _too_large(limit: int) -> Response:
    return PlainTextResponse(_over(limit), 413, headers={"Connection": "close"})


def _when(ts: float | None) -> str:
    if ts is None or not math.isfinite(ts) or ts <= 0:
        return ""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _num(v: Any, fmt: str = ".4g") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def make_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(when=_when, num=_num, size=_bytes, q=lambda s: quote(str(s), safe=""))
    env.globals["urlencode"] = urlencode
    return Jinja2Templates(env=env)


class WebApp:
    """The app and its state: credentials, sessions, the data layer, read-only mode."""

    def __init__(
        self,
        inspector: views.Inspector,
        credentials: Credentials,
        *,
        read_only: bool = False,
        limits: HttpLimits | None = None,
    ) -> None:
        self.inspector, self.credentials, self.read_only = inspector, credentials, read_only
        self.limits = limits or get_settings().http
        self.sessions = Sessions()
        self.templates = make_templates()
        routes = [
            Route("/login", self.login, methods=["GET", "POST"]),
            Route("/logout", self.guard(self.logout), methods=["POST"]),
            Route("/", self.guard(self.home)),
            Route("/ns/{ns}/search", self.guard(self.search)),
            Route("/ns/{ns}/episode", self.guard(self.episode)),
            Route("/ns/{ns}/thumb/{step_id}/{field}.png", self.guard(self.thumb)),
            Route("/ns/{ns}/curate", self.guard(self.curate), methods=["POST"]),
            Route("/ns/{ns}/recipes", self.guard(self.recipes)),
            Route("/ns/{ns}/recipes/{name}", self.guard(self.edit_recipe), methods=["POST"]),
            Route("/ns/{ns}/audit", self.guard(self.audit)),
            Route("/ns/{ns}/snapshots", self.guard(self.snapshots)),
            Route("/ns/{ns}/quality", self.guard(self.quality)),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            yield
            inspector.close()

        middleware = [
            Middleware(BaseHTTPMiddleware, dispatch=self._headers),
            Middleware(BodyLimit, limit=self._body_limit),
        ]
        self.app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)

    def _body_limit(self, scope: Scope) -> int:
        logged_in = self.sessions.get(HTTPConnection(scope).cookies.get(COOKIE)) is not None
        return self.limits.web_body_bytes if logged_in else self.limits.web_login_body_bytes

    async def form(self, request: Request, session: Session | None) -> FormData:
        """The request's form, its field count bounded (no file uploads)."""
        fields = self.limits.web_form_fields if session is not None else LOGIN_FIELDS
        return await request.form(max_files=0, max_fields=fields)

    async def _headers(self, request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        for k, v in HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    # ---- auth --------------------------------------------------------------------------
    def guard(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """A session for every request; for a POST also its CSRF token, and not read-only."""

        async def endpoint(request: Request) -> Response:
            session = self.sessions.get(request.cookies.get(COOKIE))
            if session is None:
                if request.method != "GET":
                    return self.error(request, None, 403, "log in first")
                return RedirectResponse(f"/login?{urlencode({'next': request.url.path})}", 303)
            problem = _path_problem(request)
            if problem is not None:
                return self.error(request, session, 404, problem)
            if request.method == "POST":
                form = await self.form(request, session)
                sent = str(form.get("csrf", "")).encode()
                if not hmac.compare_digest(sent, session.csrf.encode()):
                    return self.error(request, session, 403, "missing or wrong CSRF token")
                if self.read_only and handler != self.logout:
                    return self.error(request, session, 403, "the inspector runs read-only")
            return await handler(request, session)

        return endpoint

    async def login(self, request: Request) -> Response:
        nxt = request.query_params.get("next", "/")
        if not nxt.startswith("/") or nxt.startswith("//"):
            nxt = "/"
        error = None
        if request.method == "POST":
            form = await self.form(request, None)
            user, password = str(form.get("user", "")), str(form.get("password", ""))
            if self.credentials.check(user, password):
                token, _ = self.sessions.new(user)
                response = RedirectResponse(nxt, 303)
                response.set_cookie(
                    COOKIE,
                    token,
                    httponly=True,
                    samesite="strict",
                    secure=request.url.scheme == "https",
                    path="/",
                )
                return response
            error = "wrong user or password"
        return self.render(
            request,
            None,
            "login.html",
            {"error": error, "next": nxt},
            status=401 if error else 200,
        )

    async def logout(self, request: Request, session: Session) -> Response:
        self.sessions.end(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # ---- rendering ---------------------------------------------------------------------
    def render(
        self,
        request: Request,
        session: Session | None,
        name: str,
        ctx: dict[str, Any],
        status: int = 200,
    ) -> HTMLResponse:
        base = {"session": session, "read_only": self.read_only, "ns": None}
        return self.templates.TemplateResponse(request, name, {**base, **ctx}, status_code=status)

    def error(self, request: Request, session: Session | None, status: int, message: str):
        return self.render(request, session, "error.html", {"message": message}, status)

    # ---- pages -------------------------------------------------------------------------
    async def home(self, request: Request, session: Session) -> Response:
        p = request.query_params
        prefix, page = p.get("prefix", ""), _int(p.get("page"), 0)
        result = await _run(self.inspector.namespaces, prefix, page)
        return self.render(request, session, "namespaces.html", {"result": result})

    async def search(self, request: Request, session: Session) -> Response:
        ns = request.path_params["ns"]
        p = request.query_params
        expression, since = p.get("where", ""), p.get("since", "")
        view = "steps" if p.get("view") == "steps" else "episodes"
        page = _int(p.get("page"), 0)
        ctx: dict[str, Any] = {"ns": ns, "where": expression, "since": since, "view": view}
        try:
            result = await _run(self.inspector.search, ns, expression, since, view, page)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        except (FilterError, QueryError) as e:
            return self.render(
                request, session, "search.html", {**ctx, "result": None, "problem": str(e)}, 400
            )
        return self.render(
            request, session, "search.html", {**ctx, "result": result, "problem": None}
        )

    async def episode(self, request: Request, session: Session) -> Response:
        ns, name = request.path_params["ns"], request.query_params.get("e", "")
        page = _int(request.query_params.get("page"), 0)
        try:
            ep = await _run(self.inspector.episode, ns, name, page)
        except (NamespaceError, KeyError) as e:
            return self.error(request, session, 404, _message(e))
        return self.render(request, session, "episode.html", {"ns": ns, "ep": ep})

    async def thumb(self, request: Request, session: Session) -> Response:
        p = request.path_params
        try:
            png = await _run(self.inspector.thumbnail, p["ns"], int(p["step_id"]), p["field"])
        except (NamespaceError, KeyError, NotAnImage) as e:
            return Response(_message(e), 404, media_type="text/plain")
        cache = {"Cache-Control": "private, max-age=3600"}  # a step id never changes content
        return Response(png, media_type="image/png", headers=cache)

    async def curate(self, request: Request, session: Session) -> Response:
        ns = request.path_params["ns"]
        form = await request.form()
        episodes = [str(v) for v in form.getlist("episode")]
        try:
            ids = [int(v) for v in form.getlist("id")]
        except ValueError:
            return self.error(request, session, 400, "step ids are integers")
        trainable = {"true": True, "false": False}.get(str(form.get("trainable", "")))
        quality = str(form.get("quality", "")).strip() or None
        tag, tag_value = str(form.get("tag", "")).strip(), str(form.get("tag_value", "")).strip()
        tags = {tag: tag_value} if tag else {}
        if not episodes and not ids:
            return self.error(request, session, 400, "select steps or episodes to label first")
        if trainable is None and quality is None and not tags:
            return self.error(request, session, 400, "choose a label: trainable, quality or a tag")
        try:
            done = await _run(
                self.inspector.curate,
                ns,
                session.user,
                episodes=episodes,
                ids=ids,
                trainable=trainable,
                quality=quality,
                tags=tags,
            )
        except (NamespaceError, KeyError, ValueError) as e:
            return self.error(request, session, 400, _message(e))
        labels = {"trainable": trainable, "quality": quality, "tags": tags}
        return self.render(
            request,
            session,
            "curated.html",
            {"ns": ns, "done": done, "labels": labels, "episodes": episodes, "ids": ids},
        )

    async def recipes(self, request: Request, session: Session, errors=None, status=200):
        ns = request.path_params["ns"]
        try:
            rows = await _run(self.inspector.recipes, ns)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        return self.render(
            request,
            session,
            "recipes.html",
            {"ns": ns, "recipes": rows, "errors": errors or {}},
            status,
        )

    async def edit_recipe(self, request: Request, session: Session) -> Response:
        ns, name = request.path_params["ns"], request.path_params["name"]
        form = await request.form()
        raw = {k[2:]: str(v) for k, v in form.items() if k.startswith("p.")}
        new_name, new_value = str(form.get("new_param", "")).strip(), form.get("new_value", "")
        if new_name:
            raw[new_name] = str(new_value)
        try:
            await _run(self.inspector.set_params, ns, session.user, name, raw)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        except ValidationError as e:
            problems = "; ".join(err["msg"] for err in e.errors())
            return await self.recipes(request, session, {name: problems}, 400)
        except (KeyError, ValueError) as e:
            return await self.recipes(request, session, {name: _message(e)}, 400)
        return RedirectResponse(f"/ns/{quote(ns, safe='')}/recipes", 303)

    async def audit(self, request: Request, session: Session) -> Response:
        ns = request.path_params["ns"]
        try:
            entries = self.inspector.store(ns).audit_log(100)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        return self.render(request, session, "audit.html", {"ns": ns, "entries": entries})

    async def quality(self, request: Request, session: Session) -> Response:
        ns = request.path_params["ns"]
        try:
            q = await _run(self.inspector.quality, ns)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        return self.render(request, session, "quality.html", {"ns": ns, "q": q})

    async def snapshots(self, request: Request, session: Session) -> Response:
        ns = request.path_params["ns"]
        try:
            compare = request.query_params.get("compare") or None
            rows = await _run(self.inspector.snapshots, ns, compare)
        except NamespaceError as e:
            return self.error(request, session, 404, str(e))
        context = {"ns": ns, "rows": rows, "compare": compare}
        return self.render(request, session, "snapshots.html", context)


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Blocking work (Redis, numpy) off the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args, **kwargs)


def _path_problem(request: Request) -> str | None:
    """Why the path's parameters cannot name anything, or None."""
    p = request.path_params
    if "ns" in p:
        try:
            check_namespace(p["ns"])
        except ValueError as e:
            return f"no such namespace: {e}"
    step = p.get("step_id", "0")  # not Starlette's int: it parses 5,000 digits (and fails)
    if not (step.isascii() and step.isdigit() and len(step) <= 19 and int(step) <= MAX_STEP_ID):
        return f"no step {step[:40]!r}: step ids are integers in 0..2**63-1"
    return None


def _int(text: str | None, default: int) -> int:
    try:
        return max(0, int(text or default))
    except ValueError:
        return default


def _message(e: Exception) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def create_app(
    redis_url: str, broker_url: str, credentials: Credentials, *, read_only: bool = False
) -> Starlette:
    return WebApp(views.Inspector(redis_url, broker_url), credentials, read_only=read_only).app
