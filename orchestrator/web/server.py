"""Serving the inspector with uvicorn (``claw web``; ``claw up`` runs it as a child)."""

from __future__ import annotations

from claw_tasks.settings import WEB_PORT
from orchestrator.web.app import create_app
from orchestrator.web.auth import Credentials


def serve(
    redis_url: str,
    broker_url: str,
    credentials: Credentials,
    *,
    host: str = "127.0.0.1",
    port: int = WEB_PORT,
    read_only: bool = False,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> None:
    """Run until interrupted. With ``certfile``/``keyfile`` it serves HTTPS and session
    cookies are marked Secure."""
    import uvicorn

    app = create_app(redis_url, broker_url, credentials, read_only=read_only)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        server_header=False,
    )
