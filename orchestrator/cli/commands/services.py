"""Commands that run things: the dev stack (`claw up`), the web inspector, the demo, the
metrics server, the capture gateway; and `claw acl` and `claw version`."""

from __future__ import annotations

import os
import platform
import secrets
import time
from collections.abc import Callable
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from claw_tasks import __version__ as claw_version
from claw_tasks.broker.app import QUEUES
from claw_tasks.connection.server import ensure_redis
from claw_tasks.settings import METRICS_PORT, WEB_PORT, get_settings, redact_url
from claw_tasks.store.acl import setuser_command
from orchestrator.cli import demo as demo_run
from orchestrator.cli import exporter as metrics_server
from orchestrator.cli import gateway_options as opt
from orchestrator.cli.app import LogDir, app, check_bind, friendly, stop_on_sigterm
from orchestrator.cli.devstack import (
    DevStack,
    beat_service,
    default_log_dir,
    flower_service,
    web_service,
    worker_service,
)

Port = Annotated[int, typer.Option(min=0, max=65535)]
"""A TCP port (0: any free one)."""


@app.command()
@friendly
def up(
    ctx: typer.Context,
    concurrency: Annotated[int, typer.Option(min=1, help="Pool processes per worker")] = 1,
    per_queue: Annotated[
        bool, typer.Option(help="One worker per queue instead of one for all three")
    ] = False,
    beat: Annotated[bool, typer.Option(help="Run Celery beat (RedBeat)")] = True,
    flower: Annotated[bool, typer.Option(help="Run Flower")] = True,
    flower_port: Port = 5555,
    metrics: Annotated[bool, typer.Option(help="Serve Prometheus metrics")] = True,
    metrics_port: Port = METRICS_PORT,
    web: Annotated[bool, typer.Option(help="Run the web inspector (claw web)")] = True,
    web_port: Port = WEB_PORT,
    log_dir: LogDir = None,
) -> None:
    """Run the dev stack: Redis, Celery workers, beat, Flower, metrics, the web inspector.
    Ctrl-C stops it.

    \b
    Examples:
      claw up
      claw up --per-queue --concurrency 2 --no-flower
    """
    logs = log_dir or default_log_dir()
    console = Console()
    settings = get_settings()
    web_password = None  # made here (and printed once) unless one is configured
    configured = settings.web_password or settings.web_password_file
    if web and not configured:
        web_password = secrets.token_urlsafe(18)
    stop_on_sigterm()
    with DevStack(logs) as stack:
        try:
            with console.status("starting the stack…"):
                stack.start_redis(ctx.obj)
                if metrics:
                    server = metrics_server.serve(
                        metrics_port,
                        stack.redis_url,
                        stack.broker_url,
                        "127.0.0.1",
                        settings.metrics_token,
                    )
                    stack.on_stop(server.shutdown)
                groups = [[q] for q in QUEUES] if per_queue else [list(QUEUES)]
                services = [worker_service(logs, g, concurrency) for g in groups]
                services += [beat_service(logs)] if beat else []
                services += [flower_service(logs, flower_port)] if flower else []
                services += [web_service(logs, web_port, web_password)] if web else []
                stack.start(services)
            console.print(_stack_table(stack, metrics_port if metrics else None))
            if web_password:
                user = settings.web_user
                console.print(
                    f"web inspector: http://127.0.0.1:{web_port}/ user [bold]{user}[/], password "
                    f"[bold]{web_password}[/] (printed once; set CLAW_WEB_PASSWORD to choose one)",
                    highlight=False,
                )
            if flower and not os.environ.get("FLOWER_BASIC_AUTH"):
                console.print(
                    f"[yellow]warning:[/] Flower on port {flower_port} runs without auth (it "
                    "shows every task's arguments); set FLOWER_BASIC_AUTH=user:password "
                    "before `claw up` to require a login",
                    highlight=False,
                )
            console.print(f"[dim]Earlier runs' logs are kept as *.log.1 … in {logs}.[/]")
            console.print("[dim]Ctrl-C stops everything.[/]")
            stack.watch(
                on_restart=lambda svc, code: console.print(
                    f"[yellow]{svc.name} stopped (exit code {code}); started again[/] "
                    f"(its previous log: {svc.log}.1)",
                    highlight=False,
                )
            )
        except KeyboardInterrupt:
            console.print("stopping…")
    console.print("stopped.")


@app.command()
@friendly
def web(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to serve on")] = WEB_PORT,
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface)")] = (
        "127.0.0.1"
    ),
    read_only: Annotated[bool, typer.Option(help="Refuse every write (curation, params)")] = False,
    password_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the password or its scrypt$ hash (default "
            "CLAW_WEB_PASSWORD_FILE; else CLAW_WEB_PASSWORD; else one is made and printed once)",
        ),
    ] = None,
    certfile: Annotated[Path | None, typer.Option(help="TLS certificate (serve HTTPS)")] = None,
    keyfile: Annotated[Path | None, typer.Option(help="TLS private key")] = None,
) -> None:
    """The web inspector: namespaces, search, episodes, curation, recipes (login required)."""
    from orchestrator.web.auth import load_credentials
    from orchestrator.web.server import serve

    if keyfile is not None and certfile is None:
        raise typer.BadParameter("a key needs its certificate (--certfile)", param_hint="--keyfile")
    for option, path in (("--certfile", certfile), ("--keyfile", keyfile)):
        if path is not None and not path.is_file():
            raise typer.BadParameter(f"{str(path)[:200]!r}: no such file", param_hint=option)
    check_bind(host, port)
    credentials, generated = load_credentials(password_file)
    url, server = ensure_redis(ctx.obj)
    broker = get_settings().broker_for(url)
    scheme = "https" if certfile else "http"
    console = Console()
    console.print(
        escape(f"Claw inspector on {scheme}://{host}:{port}/ (store {redact_url(url)})"),
        highlight=False,
    )
    if generated:
        console.print(
            f"user [bold]{credentials.user}[/], password [bold]{generated}[/] "
            "(printed once; set CLAW_WEB_PASSWORD to choose one)",
            highlight=False,
        )
    else:
        console.print(f"user [bold]{credentials.user}[/], password as configured", highlight=False)
    _until_interrupted(
        lambda: serve(
            url,
            broker,
            credentials,
            host=host,
            port=port,
            read_only=read_only,
            certfile=str(certfile) if certfile else None,
            keyfile=str(keyfile) if keyfile else None,
        ),
        None if server is None else server.stop,
    )


def _until_interrupted(run: Callable[[], object], stop: Callable[[], object] | None) -> None:
    """``run()`` until Ctrl-C or SIGTERM, then ``stop()`` (the embedded Redis, if one was
    started; the metrics server)."""
    stop_on_sigterm()
    try:
        run()
    except KeyboardInterrupt:
        pass
    finally:
        if stop is not None:
            stop()


def _forever() -> None:
    while True:
        time.sleep(3600)


def _stack_table(stack: DevStack, metrics_port: int | None) -> Table:
    table = Table(title="claw dev stack")
    for col in ("service", "pid", "where", "log"):
        table.add_column(col, overflow="fold")
    server = stack.redis_server
    table.add_row(
        "redis",
        "embedded" if server else "external",
        redact_url(stack.redis_url),
        str(server.log_path) if server else "",
    )
    if stack.broker_url != stack.redis_url:
        table.add_row("broker", "external", redact_url(stack.broker_url), "")
    for svc in stack.services:
        table.add_row(svc.name, str(svc.pid), svc.where, str(svc.log))
    if metrics_port is not None:
        table.add_row("metrics", str(os.getpid()), f"http://127.0.0.1:{metrics_port}/metrics", "")
    return table


@app.command()
@friendly
def demo(
    ctx: typer.Context,
    steps: Annotated[
        int, typer.Option(min=1, help="CartPole env steps at most (it stops once solved)")
    ] = 100_000,
    actors: Annotated[int, typer.Option(min=1, help="Actor processes")] = 2,
    images: Annotated[
        bool, typer.Option("--images/--no-images", help="Run the pixel phase")
    ] = True,
    keep: Annotated[
        bool, typer.Option(help="Leave the stack (with Flower) and the data up until Ctrl-C")
    ] = False,
    out: Annotated[
        Path, typer.Option(help="Where the learning-curve PNG goes", show_default="current dir")
    ] = Path("."),
    namespace: str = "demo",
    seed: int = 0,
    log_dir: LogDir = None,
) -> None:
    """Train agents through Claw end to end: Ape-X DQN on CartPole, PPO, then pixels.

    Actor processes record CartPole-v1 through RecordSteps; the learner pops prioritized
    3-step batches made by prefetch workers, sends priorities back and publishes its
    weights through Redis. Then a few on-policy PPO rollouts, each formed and served once
    by the workers for its policy version. Then pixel observations, augmented by the
    workers, timed against augmenting in the training loop. Redis: --redis-url /
    CLAW_REDIS_URL, else the demo's own embedded server.

    \b
    Examples:
      claw demo
      claw demo --keep --out results/
    """
    cfg = demo_run.DemoConfig(
        log_dir=log_dir or default_log_dir(),
        out=out,
        namespace=namespace,
        steps=steps,
        actors=actors,
        images=images,
        keep=keep,
        seed=seed,
        redis_url=ctx.obj,
    )
    stop_on_sigterm()
    demo_run.run(cfg, Console())


@app.command()
@friendly
def metrics(
    ctx: typer.Context,
    port: Port = METRICS_PORT,
    address: Annotated[
        str,
        typer.Option(
            "--host",
            "--address",
            help="Address to bind (0.0.0.0: every interface; set CLAW_METRICS_TOKEN then)",
        ),
    ] = "127.0.0.1",
) -> None:
    """Serve Prometheus metrics of the store and the Celery queues at /metrics (loopback
    unless --host widens it). With CLAW_METRICS_TOKEN set, a scrape must send it as
    ``Authorization: Bearer <token>``."""
    settings = get_settings()
    url = ctx.obj or settings.redis_url
    broker = settings.broker_for(url)
    token = settings.metrics_token
    check_bind(address, port)
    server = metrics_server.serve(port, url, broker, address, token)
    Console().print(
        f"serving http://{address}:{port}/metrics (store {redact_url(url)}, "
        f"broker {redact_url(broker)}; "
        f"{'bearer token required' if token else 'no token: set CLAW_METRICS_TOKEN'}); "
        "Ctrl-C stops"
    )
    _until_interrupted(_forever, server.shutdown)


@app.command(
    short_help="OpenAI-compatible capture gateway: forwards agents' LLM calls to an "
    "inference server and records each call as a step."
)
@friendly
def gateway(
    ctx: typer.Context,
    upstream: Annotated[str, typer.Option(help="The inference server's base URL (no /v1)")],
    namespace: Annotated[str, typer.Option(help="Namespace the turns are recorded into")],
    port: Port = 8100,
    address: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    tokenizer: opt.Tokenizer = None,
    vllm_options: opt.VllmOptions = True,
    max_body_bytes: int = 8 * 1024 * 1024,
    max_reply_bytes: opt.MaxReplyBytes = None,
    upstream_timeout: opt.UpstreamTimeout = None,
    max_turns: opt.MaxTurns = 256,
    max_n: opt.MaxN = 64,
    policy_version: opt.DefaultPolicyVersion = None,
    admission: opt.Admission = True,
    admission_wait: opt.AdmissionWait = None,
    admission_expiry: opt.AdmissionExpiry = None,
    retry_after: opt.RetryAfter = 1.0,
    turn_discount: opt.TurnDiscount = None,
    session_ttl: opt.SessionTtl = 7 * 86400,
    spool: Annotated[
        str | None,
        typer.Option(
            help="Directory of the gateway's spool: answered calls wait there on local disk "
            "until the store has them, and a gateway started on it records what its "
            "predecessor left (default CLAW_GATEWAY_SPOOL, else one per namespace and port "
            "under the temporary directory); 'off': no spool"
        ),
    ] = None,
) -> None:
    """OpenAI-compatible capture gateway: agents call it (base_url
    http://HOST:PORT/t/<trajectory>/g/<group>/v1, api_key = CLAW_GATEWAY_TOKEN), it forwards
    to UPSTREAM and records every call as a step; POST /t/<trajectory>/reward (token
    CLAW_GATEWAY_REWARD_TOKEN, default CLAW_GATEWAY_TOKEN) attaches rewards; POST /sessions
    (CLAW_GATEWAY_ADMIN_TOKEN) makes per-trajectory keys; /metrics needs CLAW_METRICS_TOKEN
    (default CLAW_GATEWAY_TOKEN). New trajectories are admitted against the staleness
    budget a trainer's recipe declares (admission:). docs/llm.md.

    \b
    Examples:
      claw gateway --upstream http://127.0.0.1:8000 --namespace agents
    """
    from orchestrator.gateway import GatewayConfig, serve
    from orchestrator.gateway.config import spool_dir
    from orchestrator.gateway.spool import Spool
    from orchestrator.gateway.upstream import check_base_url

    try:
        check_base_url(upstream)  # here, not in the server's startup (a traceback there)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--upstream") from None
    check_bind(address, port, "--address")
    settings = get_settings()
    token = settings.gateway_token
    if not token:
        raise ValueError(
            "CLAW_GATEWAY_TOKEN is not set: the gateway needs a token agents send as their "
            "API key (e.g. export CLAW_GATEWAY_TOKEN=$(openssl rand -hex 16))"
        )
    if tokenizer is not None and not tokenizer.is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    url, server = ensure_redis(ctx.obj)
    config = GatewayConfig(
        upstream=upstream,
        namespace=namespace,
        token=token,
        redis_url=url,
        broker_url=settings.broker_for(url),
        reward_token=settings.gateway_reward_token,
        admin_token=settings.gateway_admin_token,
        metrics_token=settings.metrics_token,
        upstream_key=settings.upstream_api_key,
        tokenizer=str(tokenizer) if tokenizer else None,
        vllm_options=vllm_options,
        max_body_bytes=max_body_bytes,
        max_reply_bytes=max_reply_bytes,
        upstream_timeout=upstream_timeout,
        max_turns=max_turns,
        max_n=max_n,
        policy_version=policy_version,
        admission=admission,
        admission_wait=admission_wait,
        admission_expiry=admission_expiry,
        retry_after=retry_after,
        turn_discount=turn_discount,
        session_ttl=session_ttl,
        spool=spool_dir(spool, namespace, port),
    ).resolved()
    held = None
    if config.spool:
        assert config.spool_bytes is not None
        held = Spool(
            config.spool, config.spool_bytes, fsync=bool(config.spool_fsync), owner=namespace
        )
    Console().print(
        escape(
            f"gateway on http://{address}:{port} -> {upstream}, recording into {namespace!r} "
            f"(store {redact_url(url)}, broker {redact_url(config.broker_url or url)}, "
            f"spool {config.spool or 'off'}); Ctrl-C stops"
        ),
        highlight=False,
    )
    stop = None if server is None else server.stop
    _until_interrupted(lambda: serve(config, address, port, held), stop)


@app.command(short_help="Print the Redis ACL SETUSER line that confines a user to a namespace.")
@friendly
def acl(
    namespace: str,
    user: str,
    db: Annotated[int, typer.Option(min=0, max=2**31 - 1, help="The broker's database number")] = 0,
) -> None:
    """Print the Redis ACL SETUSER line that confines USER (a producer or trainer) to
    NAMESPACE; give it a password with `ACL SETUSER USER >password` (never printed here)."""
    typer.echo(setuser_command(namespace, user, db=db))


@app.command()
def version() -> None:
    """Print the versions of Claw and what it runs on."""
    parts = [f"{name} {dist_version(name)}" for name in ("celery", "redis", "numpy")]
    typer.echo(f"claw {claw_version} ({', '.join(parts)}, python {platform.python_version()})")
