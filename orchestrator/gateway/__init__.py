"""The capture gateway (``claw gateway``): OpenAI-compatible calls in, steps out.

``app`` builds the Starlette app on a ``Gateway`` (``config``: what it is configured
with); ``forward`` relays agents' calls past the ``gate`` (admission, session keys) to the
``upstream``; ``trajectories`` serves rewards, reads and sessions; the ``recorder`` turns
``calls`` into steps off the response path (``capture``: replies into turns; ``rewards``:
what a reward reads of the store; ``spool``: answered calls on local disk until the store
has them). ``requests``, ``metrics`` and ``credit`` are what they
share; the response path's Redis client is ``claw_tasks.connection.resp``'s."""

from __future__ import annotations

from orchestrator.gateway.app import create_app
from orchestrator.gateway.config import GatewayConfig
from orchestrator.gateway.spool import Spool


def serve(
    config: GatewayConfig, host: str = "127.0.0.1", port: int = 8100, spool: Spool | None = None
) -> None:
    """Run the gateway until interrupted (uvicorn, one process; the recorder flushes on
    shutdown); ``spool``: its open spool (else ``config.spool``'s)."""
    import uvicorn

    uvicorn.run(
        create_app(config, spool=spool),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
    )


__all__ = ["GatewayConfig", "create_app", "serve"]
