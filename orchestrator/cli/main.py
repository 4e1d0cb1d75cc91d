"""The `claw` command line: dev stack, demo, and tools to look into the step store."""

from __future__ import annotations

import functools
import json
import os
import platform
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import click
import redis
import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from claw_tasks.acl import setuser_command
from claw_tasks.app import QUEUES
from claw_tasks.redis_server import ensure_redis
from claw_tasks.schema import Schema, tag_key
from claw_tasks.settings import load_settings, redact_url
from claw_tasks.store import NamespaceError, Store
from orchestrator.cli import archival
from orchestrator.cli import demo as demo_run
from orchestrator.cli import metrics as metrics_server
from orchestrator.cli.devstack import (
    DevStack,
    beat_service,
    default_log_dir,
    flower_service,
    web_service,
    worker_service,
)
from orchestrator.cli.doctor import CHECKS, Report, check_namespace
from orchestrator.cli.retention import retention_policy
from orchestrator.cli.schedule import beat_entries
from orchestrator.cli.steplog import dead_letters, newest_ids, parse_ids, step_lines
from orchestrator.inspect.namespaces import (
    NamespaceStats,
    UnreadableNamespace,
    memory_by_namespace,
    namespace_stats,
    scan_keys,
)
from orchestrator.maintenance.lifecycle import drop_namespace, list_namespaces, namespace_keys

app = typer.Typer(
    name="claw",
    help="Claw: step-level RL experience middleware on Redis and Celery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
err = Console(stderr=True)
P = ParamSpec("P")
R = TypeVar("R")
_MAX_PROBLEMS = 50

LogDir = Annotated[
    Path | None, typer.Option(help="Service logs (default: ~/.cache/claw/logs)", show_default=False)
]


def _friendly(func: Callable[P, R]) -> Callable[P, R]:
    """Expected failures (Redis down, unknown namespace, bad input) exit 1 with one line."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (redis.RedisError, OSError, LookupError, ValueError, RuntimeError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            err.print(f"[bold red]error:[/] {message}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


@app.callback()
def _root(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="CLAW_REDIS_URL",
            help="The step store. Unset: redis://127.0.0.1:6379/0 if it answers, else an "
            "embedded redis-server with its data in ~/.cache/claw/redis.",
        ),
    ] = None,
) -> None:
    ctx.obj = redis_url


@contextmanager
def _redis(ctx: typer.Context) -> Iterator[tuple[str, redis.Redis]]:
    """The store's URL (fit to print) and a client; an embedded server started here is
    stopped after."""
    url, server = ensure_redis(ctx.obj)
    client = redis.Redis.from_url(url)
    try:
        yield redact_url(url), client
    finally:
        client.close()
        if server is not None:
            server.stop()


def _stop_on_sigterm() -> None:
    """SIGTERM (docker stop, kill) and SIGINT shut down like Ctrl-C. SIGINT is set too: a
    process started in the background by a non-interactive shell (`cmd &`, CI) inherits it
    ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---- services -------------------------------------------------------------------------
@app.command()
@_friendly
def up(
    ctx: typer.Context,
    concurrency: Annotated[int, typer.Option(min=1, help="Pool processes per worker")] = 1,
    per_queue: Annotated[
        bool, typer.Option(help="One worker per queue instead of one for all three")
    ] = False,
    beat: Annotated[bool, typer.Option(help="Run Celery beat (RedBeat)")] = True,
    flower: Annotated[bool, typer.Option(help="Run Flower")] = True,
    flower_port: int = 5555,
    metrics: Annotated[bool, typer.Option(help="Serve Prometheus metrics")] = True,
    metrics_port: int = 9808,
    web: Annotated[bool, typer.Option(help="Run the web inspector (claw web)")] = True,
    web_port: int = 8808,
    log_dir: LogDir = None,
) -> None:
    """Run the dev stack: Redis, Celery workers, beat, Flower, metrics, the web inspector.
    Ctrl-C stops it."""
    logs = log_dir or default_log_dir()
    console = Console()
    web_password = None  # made here (and printed once) unless one is configured
    configured = os.environ.get("CLAW_WEB_PASSWORD") or os.environ.get("CLAW_WEB_PASSWORD_FILE")
    if web and not configured:
        web_password = secrets.token_urlsafe(18)
    _stop_on_sigterm()
    with DevStack(logs) as stack:
        try:
            with console.status("starting the stack…"):
                stack.start_redis(ctx.obj)
                if metrics:
                    server = metrics_server.serve(
                        metrics_port, stack.redis_url, stack.broker_url, "127.0.0.1",
                        os.environ.get("CLAW_METRICS_TOKEN") or None,
                    )  # fmt: skip
                    stack.on_stop(server.shutdown)
                groups = [[q] for q in QUEUES] if per_queue else [list(QUEUES)]
                services = [worker_service(logs, g, concurrency) for g in groups]
                services += [beat_service(logs)] if beat else []
                services += [flower_service(logs, flower_port)] if flower else []
                services += [web_service(logs, web_port, web_password)] if web else []
                stack.start(services)
            console.print(_stack_table(stack, metrics_port if metrics else None))
            if web_password:
                user = os.environ.get("CLAW_WEB_USER") or "claw"
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
            stack.watch(on_restart=lambda svc, code: console.print(
                f"[yellow]{svc.name} stopped (exit code {code}); started again[/] "
                f"(its previous log: {svc.log}.1)", highlight=False,
            ))  # fmt: skip
        except KeyboardInterrupt:
            console.print("stopping…")
    console.print("stopped.")


@app.command()
@_friendly
def web(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="Port to serve on")] = 8808,
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface)")] = (
        "127.0.0.1"
    ),
    read_only: Annotated[bool, typer.Option(help="Refuse every write (curation, params)")] = False,
    password_file: Annotated[
        Path | None,
        typer.Option(envvar="CLAW_WEB_PASSWORD_FILE", help="File holding the password or its "
                     "scrypt$ hash (else CLAW_WEB_PASSWORD; else one is made and printed once)"),
    ] = None,
    certfile: Annotated[Path | None, typer.Option(help="TLS certificate (serve HTTPS)")] = None,
    keyfile: Annotated[Path | None, typer.Option(help="TLS private key")] = None,
) -> None:
    """The web inspector: namespaces, search, episodes, curation, recipes (login required)."""
    from orchestrator.web.auth import load_credentials
    from orchestrator.web.server import serve

    credentials, generated = load_credentials(password_file)
    url, server = ensure_redis(ctx.obj)
    broker = os.environ.get("CLAW_BROKER_URL") or url
    scheme = "https" if certfile else "http"
    console = Console()
    console.print(f"Claw inspector on {scheme}://{host}:{port}/ (store {redact_url(url)})")
    if generated:
        console.print(f"user [bold]{credentials.user}[/], password [bold]{generated}[/] "
                      "(printed once; set CLAW_WEB_PASSWORD to choose one)", highlight=False)
    else:
        console.print(f"user [bold]{credentials.user}[/], password as configured", highlight=False)
    _stop_on_sigterm()
    try:
        serve(url, broker, credentials, host=host, port=port, read_only=read_only,
              certfile=str(certfile) if certfile else None,
              keyfile=str(keyfile) if keyfile else None)  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()


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
@_friendly
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
    """Train agents through Claw end to end: Ape-X DQN on CartPole, then pixels.

    Actor processes record CartPole-v1 through RecordSteps; the learner pops prioritized
    3-step batches made by prefetch workers, sends priorities back and publishes its
    weights through Redis. Then pixel observations, augmented by the workers, timed against
    augmenting in the training loop. Redis: --redis-url / CLAW_REDIS_URL, else the demo's
    own embedded server."""
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
    _stop_on_sigterm()
    demo_run.run(cfg, Console())


@app.command()
@_friendly
def metrics(
    ctx: typer.Context,
    port: int = 9808,
    address: Annotated[str, typer.Option(help="Address to bind")] = "0.0.0.0",
) -> None:
    """Serve Prometheus metrics of the store and the Celery queues at /metrics. With
    CLAW_METRICS_TOKEN set, a scrape must send it as ``Authorization: Bearer <token>``."""
    url = ctx.obj or load_settings().redis_url
    broker = os.environ.get("CLAW_BROKER_URL") or url
    token = os.environ.get("CLAW_METRICS_TOKEN") or None
    server = metrics_server.serve(port, url, broker, address, token)
    Console().print(
        f"serving http://{address}:{port}/metrics (store {redact_url(url)}, "
        f"broker {redact_url(broker)}; "
        f"{'bearer token required' if token else 'no token: set CLAW_METRICS_TOKEN'}); "
        "Ctrl-C stops"
    )
    _stop_on_sigterm()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


@app.command()
@_friendly
def gateway(
    ctx: typer.Context,
    upstream: Annotated[str, typer.Option(help="The inference server's base URL (no /v1)")],
    namespace: Annotated[str, typer.Option(help="Namespace the turns are recorded into")],
    port: int = 8100,
    address: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="tokenizer.json for upstreams that return no token ids"),
    ] = None,
    vllm_options: Annotated[
        bool, typer.Option(help="Ask for token ids with vLLM's return_token_ids options")
    ] = True,
    max_body_bytes: int = 8 * 1024 * 1024,
    max_turns: Annotated[int, typer.Option(help="Calls allowed per trajectory")] = 256,
    policy_version: Annotated[
        int | None, typer.Option(help="Recorded as each turn's policy_version")
    ] = None,
) -> None:
    """OpenAI-compatible capture gateway: agents call it (base_url
    http://HOST:PORT/t/<trajectory>/g/<group>/v1, api_key = CLAW_GATEWAY_TOKEN), it forwards
    to UPSTREAM and records every call as a step; POST /t/<trajectory>/reward (token
    CLAW_GATEWAY_REWARD_TOKEN, default CLAW_GATEWAY_TOKEN) attaches rewards. docs/llm.md."""
    from orchestrator.gateway import GatewayConfig, serve

    token = os.environ.get("CLAW_GATEWAY_TOKEN")
    if not token:
        raise ValueError(
            "CLAW_GATEWAY_TOKEN is not set: the gateway needs a token agents send as their "
            "API key (e.g. export CLAW_GATEWAY_TOKEN=$(openssl rand -hex 16))"
        )
    if tokenizer is not None and not tokenizer.is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    url, server = ensure_redis(ctx.obj)
    config = GatewayConfig(
        upstream=upstream, namespace=namespace, token=token, redis_url=url,
        reward_token=os.environ.get("CLAW_GATEWAY_REWARD_TOKEN") or None,
        upstream_key=os.environ.get("CLAW_UPSTREAM_API_KEY") or None,
        tokenizer=str(tokenizer) if tokenizer else None, vllm_options=vllm_options,
        max_body_bytes=max_body_bytes, max_turns=max_turns, policy_version=policy_version,
    )  # fmt: skip
    Console().print(
        f"gateway on http://{address}:{port} -> {upstream}, recording into {namespace!r} "
        f"(store {redact_url(url)}); Ctrl-C stops"
    )
    _stop_on_sigterm()
    try:
        serve(config, address, port)
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()


@app.command()
def acl(
    namespace: str,
    user: str,
    db: Annotated[int, typer.Option(help="The broker's database number")] = 0,
) -> None:
    """Print the Redis ACL SETUSER line that confines USER (a producer or trainer) to
    NAMESPACE; give it a password with `ACL SETUSER USER >password` (never printed here)."""
    typer.echo(setuser_command(namespace, user, db=db))


@app.command()
def version() -> None:
    """Print the versions of Claw and what it runs on."""
    parts = [f"{name} {dist_version(name)}" for name in ("celery", "redis", "numpy")]
    typer.echo(
        f"claw {dist_version('claw')} ({', '.join(parts)}, python {platform.python_version()})"
    )


# ---- store tools ----------------------------------------------------------------------
@app.command()
@_friendly
def stats(
    ctx: typer.Context,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="One namespace (default: all)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Steps, capacity, memory, dead letters, schema and counts per namespace."""
    with _redis(ctx) as (url, r):
        names = [namespace] if namespace else list_namespaces(r)
        if namespace and not Store(r, namespace).exists():
            raise NamespaceError(f"namespace {namespace!r} does not exist at {url}")
        memory = memory_by_namespace(r, namespace)
        found, unreadable = [], {}
        for n in names:
            try:
                found.append(namespace_stats(Store(r, n), memory.get(n, 0), bool(namespace)))
            except UnreadableNamespace as e:
                if namespace:
                    raise
                unreadable[n] = str(e)
        used = int(r.info("memory")["used_memory"])
    if as_json:
        doc = {
            "redis": {"url": url, "used_memory": used},
            "namespaces": [s.to_json() for s in found],
            "unreadable": unreadable,
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    console = Console()
    if not names:
        console.print(f"no namespaces at {url}")
        return
    for table in _summary_table(found, url, used, console.width):
        console.print(table)
    for message in unreadable.values():
        err.print(f"[bold red]unreadable:[/] {message}", highlight=False)
    if len(found) == 1 and not unreadable:
        _print_details(console, found[0])


_WIDE = 110  # below this many columns the per-namespace summary is printed vertically


def _summary_table(
    found: list[NamespaceStats], url: str, used: int, width: int
) -> list[Table]:
    """One row per namespace on a wide terminal; on a narrow one (80 columns) one small
    table per namespace, so that no value is cut."""
    heads = ("namespace", "steps", "capacity", "shards", "committed", "episodes", "dead letters",
             "memory", "B/step", "reward mean ± std")  # fmt: skip
    rows = []
    for s in found:
        i = s.info
        per_step = "-" if s.bytes_per_step is None else f"{s.bytes_per_step:,.0f}"
        reward = "-" if s.reward_mean is None else f"{s.reward_mean:.4g} ± {s.reward_std:.4g}"
        dead = f"[red]{i['dead_letters']:,}[/]" if i["dead_letters"] else "0"
        rows.append((
            s.namespace, f"{i['steps']:,}", f"{i['capacity']:,}", str(i["n_shards"]),
            f"{i['committed_total']:,}", f"{s.episodes:,}", dead, _mib(s.memory_bytes),
            per_step, reward,
        ))  # fmt: skip
    title = f"{url} · Redis used memory {_mib(used)}"
    if width >= _WIDE:
        table = Table(title=title)
        for h in heads:
            table.add_column(h, justify="left" if h == "namespace" else "right")
        for row in rows:
            table.add_row(*row)
        return [table]
    tables = []
    for n, row in enumerate(rows):
        t = Table(title=title if n == 0 else None, show_header=False)
        t.add_column(style="bold")
        t.add_column(overflow="fold")
        for h, v in zip(heads, row, strict=True):
            t.add_row(h, v)
        tables.append(t)
    return tables


def _print_details(console: Console, s: NamespaceStats) -> None:
    schema = Schema.from_dict(s.info["schema"]) if s.info["schema"] else Schema(fields={})
    table = Table(title=f"schema of {s.namespace!r}")
    table.add_column("name")
    table.add_column("kind")
    table.add_column("type")
    for name, spec in schema.fields.items():
        table.add_row(name, "field", spec.describe())
    for name, kind in schema.tags.items():
        table.add_row(tag_key(name), "tag", kind)
    console.print(table)
    policy = "none" if s.retention is None else s.retention.describe()
    console.print(f"retention: {policy}", highlight=False)
    evicted = ", ".join(f"{k} {v:,}" for k, v in s.evictions.items())
    console.print(f"evicted so far: {evicted}", highlight=False)
    cap = s.retention.max_steps if s.retention else None
    if s.protected is not None and cap is not None and s.protected > cap:
        err.print(
            f"[yellow]warning:[/] {s.protected:,} protected steps alone exceed the cap of "
            f"{cap:,}: loosen --protect or raise --max-steps",
            highlight=False,
        )
    for column, counts in (("task_id", s.by_task_id), ("agent_id", s.by_agent_id)):
        t = Table(title=f"steps per {column}")
        t.add_column(column)
        t.add_column("steps", justify="right")
        for value, n in counts.items():
            t.add_row("[dim](none)[/]" if value is None else value, f"{n:,}")
        console.print(t)


@app.command()
@_friendly
def recipes(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Registered recipes and their prefetch state, rate limit included.

    Queue depth, batches produced and popped, rows sampled against steps inserted, and
    whether the rate limiter makes prefetch wait (and why)."""
    from orchestrator.delivery.client import BatchClient

    with _redis(ctx) as (url, r):
        if not Store(r, namespace).exists():
            raise NamespaceError(f"namespace {namespace!r} does not exist at {redact_url(url)}")
        client = BatchClient(namespace, url)
        try:
            found = client.stats()
        finally:
            client.close()
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    console = Console()
    if not found:
        console.print(f"no recipes registered in {namespace!r}")
        return
    inserted = next(iter(found.values()))["inserted_steps"]  # the namespace's, not a recipe's
    table = Table(title=f"recipes of {namespace!r} ({inserted:,} steps inserted)")
    heads = ("recipe", "version", "queue", "produced", "popped", "sampled rows")
    for h in heads:
        table.add_column(h, justify="left" if h == "recipe" else "right", overflow="fold")
    for name, st in found.items():
        table.add_row(
            name, str(st["version"]), f"{st['depth']}/{st['max_depth']}", f"{st['produced']:,}",
            f"{st['popped']:,}", f"{st['sampled_rows']:,}",
        )  # fmt: skip
    console.print(table)
    for name, st in found.items():  # below the table: a state is a sentence
        state = f"[yellow]{st['rate_limit']}[/]" if st["rate_limited"] else st["state"] or "-"
        console.print(f"[bold]{name}[/]: {state}", highlight=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


@app.command("inspect")
@_friendly
def inspect_steps(
    ctx: typer.Context,
    namespace: str,
    episode: Annotated[str | None, typer.Option(help="All steps of this episode id")] = None,
    ids: Annotated[str | None, typer.Option(help="Step ids, e.g. 1,2,3")] = None,
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Steps to show (default: the newest 20, or a whole episode)"),
    ] = None,
) -> None:
    """Steps as log lines: metadata, field shapes and dtypes, small previews."""
    if episode is not None and ids is not None:
        raise typer.BadParameter("give --episode or --ids, not both")
    with _redis(ctx) as (_, r):
        store = Store(r, namespace)
        schema = store.schema()
        if schema is None:
            Console().print(f"namespace {namespace!r} has no steps yet")
            return
        fields = [*schema.fields, "next_obs"]
        if episode is not None:
            steps = store.episode(episode, fields)
        elif ids is not None:
            steps = store.get(parse_ids(ids), fields)
        else:
            steps = store.get(newest_ids(store, limit or 20), fields)
    total = len(steps["id"])
    shown = min(total, limit) if limit else total
    console = Console()
    described = ", ".join(f"{k} {v.describe()}" for k, v in schema.fields.items())
    console.print(f"[bold]{namespace}[/] · {described}", highlight=False)
    for line in step_lines(_head(steps, shown), fields):
        console.print(line, soft_wrap=True, highlight=False)
    if shown < total:
        console.print(f"[dim]… {total - shown} more (raise --limit)[/]")


def _head(steps: dict[str, Any], n: int) -> dict[str, Any]:
    return {k: v[:n] for k, v in steps.items()}


@app.command()
@_friendly
def query(
    ctx: typer.Context,
    namespace: str,
    expression: Annotated[
        str, typer.Argument(help="A where expression, e.g. \"task_id == 'grasp' and reward > 0\"")
    ] = "",
    group_by: Annotated[
        str | None, typer.Option(help="Keys to group by, e.g. task_id,agent_id")
    ] = None,
    agg: Annotated[
        str, typer.Option(help="Aggregates: count, mean/sum/min/max/std/pNN(key)")
    ] = "count",
    since: Annotated[str | None, typer.Option(help="Only steps younger than this, e.g. 1h")] = None,
    hist: Annotated[str | None, typer.Option(help="Write a histogram of this key")] = None,
    png: Annotated[Path | None, typer.Option(help="Where --hist writes (NS-KEY.png)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Ask questions of step metadata, answered from the sampling index.

    Example: claw query grasp "task_id == 'grasp' and reward > 0.5" --group-by agent_id
    --agg 'count,mean(reward),p95(reward)' --since 1h (quote the aggregates: the shell
    reads parentheses)"""
    from orchestrator.inspect import query as q

    keys = [k.strip() for k in group_by.split(",") if k.strip()] if group_by else []
    with _redis(ctx) as (_, r):
        result = q.Query(Store(r, namespace)).run(
            expression, group_by=keys, aggs=q.parse_aggs(agg), since=since,
            keep=[hist] if hist else [],
        )  # fmt: skip
    if hist:
        path = q.histogram(result, hist, png or Path(f"{namespace}-{hist}.png"))
    if as_json:
        typer.echo(json.dumps(result.to_json() | ({"png": str(path)} if hist else {}), indent=2))
        return
    console = Console()
    if not result.matched:
        console.print(f"no steps of {namespace!r} match ({result.steps:,} steps)")
    else:
        console.print(q.table(result))
    if hist:
        console.print(f"histogram of {hist} over {result.matched:,} steps: [bold]{path}[/]")


@app.command()
@_friendly
def dead(
    ctx: typer.Context,
    namespace: str,
    limit: Annotated[int, typer.Option(min=1, help="Newest entries to show")] = 20,
) -> None:
    """Dead letters: rejected batches and steps, with the reason."""
    with _redis(ctx) as (_, r):
        store = Store(r, namespace)
        total, letters = dead_letters(store, limit)
        if not total and not store.exists():
            raise NamespaceError(f"namespace {namespace!r} does not exist")
    console = Console()
    if not total:
        console.print(f"no dead letters in {namespace!r}")
        return
    table = Table(title=f"dead letters of {namespace!r}: {total:,} (newest {len(letters)})")
    for col in ("time (UTC)", "batch", "rows", "steps", "payload", "reason"):
        table.add_column(col, overflow="fold")
    for d in letters:
        table.add_row(
            d.when, d.batch_id, d.rows_text, "-" if d.steps is None else str(d.steps),
            f"{d.payload_bytes:,} B", d.reason,
        )  # fmt: skip
    console.print(table)


@app.command()
@_friendly
def retention(
    ctx: typer.Context,
    namespace: str,
    max_age: Annotated[
        str | None, typer.Option(help="Evict steps committed longer ago, e.g. 12h, 7d")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(min=0, help="Soft step cap below capacity")
    ] = None,
    max_bytes: Annotated[
        str | None, typer.Option(help="Redis memory budget of the namespace, e.g. 2GiB")
    ] = None,
    evict: Annotated[
        str | None, typer.Option(help="Over a cap, evict lowest-priority or oldest first")
    ] = None,
    protect: Annotated[
        list[str] | None,
        typer.Option(help="A filter whose steps are never evicted (repeatable; replaces)"),
    ] = None,
    archive_before_evict: Annotated[
        bool | None, typer.Option(help="Evict only steps that are archived already")
    ] = None,
    clear: Annotated[bool, typer.Option(help="Remove the policy")] = False,
) -> None:
    """Show or set a namespace's retention policy (run by claw.maintenance.evict).

    Without options it prints the policy; options change those settings and keep the rest
    (--clear first to start over)."""
    changes = {
        "max_age": max_age, "max_steps": max_steps, "max_bytes": max_bytes, "evict": evict,
        "protect": protect, "archive_before_evict": archive_before_evict,
    }  # fmt: skip
    given = {k: v for k, v in changes.items() if v is not None}
    with _redis(ctx) as (_, r):
        store = Store(r, namespace)
        cfg = store.config()
        if clear:
            cfg = store.set_retention(None)
        if given:
            tags = cfg.schema.tags if cfg.schema else {}
            cfg = store.set_retention(retention_policy(cfg.retention, given, tags))
    text = "none" if cfg.retention is None else cfg.retention.describe()
    Console().print(f"retention of {namespace!r}: {text}", highlight=False)


@app.command("evict")
@_friendly
def evict_steps(
    ctx: typer.Context,
    namespace: str,
    ids: Annotated[str, typer.Option(help="Step ids, e.g. 1,2,3")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask")] = False,
) -> None:
    """Evict steps by id now (counted as 'manual')."""
    wanted = parse_ids(ids)
    if not yes:
        typer.confirm(f"evict {len(wanted)} step(s) of {namespace!r}?", abort=True)
    with _redis(ctx) as (_, r):
        done = Store(r, namespace).evict(wanted, "manual")
    Console().print(f"evicted {done} of {len(wanted)} step(s) (the others were gone already)")


@app.command()
@_friendly
def drop(
    ctx: typer.Context,
    namespace: str,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask")] = False,
) -> None:
    """Delete a namespace: every step, recipe, queue and counter, in bounded chunks.

    Running workers stop writing to it at once (they check before every commit) and do
    not create it again; a new Ingestor or `Store.create` does."""
    with _redis(ctx) as (url, r):
        if not any(True for _ in namespace_keys(r, namespace)):
            raise NamespaceError(f"namespace {namespace!r} has no keys at {url}")
        if not yes:
            typer.confirm(
                f"drop namespace {namespace!r} at {url}? This cannot be undone", abort=True
            )
        with Progress(
            SpinnerColumn(), TextColumn("dropping {task.description}"),
            TextColumn("{task.completed:,} keys"), TimeElapsedColumn(), console=err,
        ) as progress:  # fmt: skip
            task = progress.add_task(namespace, total=None)
            deleted = drop_namespace(r, namespace, lambda n: progress.advance(task, n))
    Console().print(f"dropped {namespace!r}: {deleted:,} keys deleted")


@app.command("schedule")
@_friendly
def show_schedule(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Beat's entries (maintenance tasks) with their next run (CLAW_SCHEDULE overrides)."""
    with _redis(ctx) as (_, r):
        found = beat_entries(r)
    if as_json:
        typer.echo(json.dumps([e.to_json() for e in found], indent=2))
        return
    table = Table(title="beat schedule (UTC)")
    for col in ("entry", "task", "schedule", "next run", "last run", "runs"):
        table.add_column(col, justify="right" if col == "runs" else "left")
    for e in found:
        nxt = e.next_run.strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            e.name, e.task, e.schedule, nxt if e.scheduled else f"~{nxt} (beat not running)",
            "-" if e.last_run is None else e.last_run.strftime("%Y-%m-%d %H:%M:%S"), str(e.runs),
        )  # fmt: skip
    Console().print(table)


@app.command(
    help="Check the store and its indexes for consistency; exit 1 on problems.\n\n"
    + "\n\n".join(f"{name}: {what}" for name, what in CHECKS.items())
)
@_friendly
def doctor(
    ctx: typer.Context,
    namespace: Annotated[
        str | None, typer.Argument(help="One namespace (default: every namespace)")
    ] = None,
) -> None:
    with _redis(ctx) as (url, r):
        names = [namespace] if namespace else sorted({k.namespace for k in scan_keys(r)})
        if namespace and not any(True for _ in scan_keys(r, namespace)):
            raise NamespaceError(f"namespace {namespace!r} has no keys at {url}")
        reports = [check_namespace(r, n) for n in names]
    console = Console()
    if not reports:
        console.print(f"no namespaces at {url}")
        return
    console.print(_checks_table(reports))
    problems = [(rep.namespace, p) for rep in reports for p in rep.problems]
    if not problems:
        console.print("[green]no problems found.[/]")
        return
    table = Table(title=f"{len(problems):,} problem(s)")
    for col in ("namespace", "check", "where", "problem"):
        table.add_column(col, overflow="fold")
    for ns, p in problems[:_MAX_PROBLEMS]:
        table.add_row(ns, p.check, p.where, p.detail)
    console.print(table)
    if len(problems) > _MAX_PROBLEMS:
        console.print(f"[dim]… and {len(problems) - _MAX_PROBLEMS:,} more[/]")
    raise typer.Exit(1)


def _checks_table(reports: list[Report]) -> Table:
    """A row per namespace, a column per check (`claw doctor --help` says what each is)."""
    table = Table(title="claw doctor")
    table.add_column("namespace", overflow="fold")
    for check in CHECKS:
        table.add_column(check, justify="center")
    for rep in reports:
        cells = []
        for check in CHECKS:
            failed = rep.failed(check)
            if check not in rep.checked:
                cells.append("[dim]-[/]")
            else:
                cells.append(f"[red]✗ {failed}[/]" if failed else "[green]✓[/]")
        table.add_row(rep.namespace, *cells)
    return table


# ---- archive, restore, offline datasets -----------------------------------------------
@app.command()
@_friendly
def archive(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace to archive")],
    to: Annotated[Path, typer.Option("--to", help="Archive directory (ns=<name>/ goes in it)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Archive the steps not archived yet to Parquet (what the nightly task does)."""
    with _redis(ctx) as (_, r):
        archival.archive(r, namespace, to, Console(), as_json)


@app.command()
@_friendly
def restore(
    ctx: typer.Context,
    archive_dir: Annotated[Path, typer.Argument(help="Archive directory (or its ns=<name>/)")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Restore into this")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Bring archived steps back, bit-exact, with new ids (tags.orig_id holds the old)."""
    with _redis(ctx) as (_, r):
        archival.restore_archive(r, archive_dir, namespace, Console(), as_json)


_MinariRoot = Annotated[
    Path | None,
    typer.Option(
        "--minari-root", envvar="MINARI_DATASETS_PATH", show_default=False,
        help="Minari datasets directory (default ~/.minari/datasets)",
    ),
]  # fmt: skip


def _only_minari(fmt: str) -> None:
    if fmt != "minari":
        raise typer.BadParameter(
            f"format {fmt!r}: only 'minari' is supported", param_hint="--format"
        )


@app.command()
@_friendly
def export(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace to export")],
    to: Annotated[str, typer.Option("--to", help="Minari dataset id, e.g. claw/grasp-v0")],
    fmt: Annotated[str, typer.Option("--format", help="Only 'minari'")] = "minari",
    minari_root: _MinariRoot = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Export a namespace's complete episodes as an offline dataset (Minari)."""
    _only_minari(fmt)
    with _redis(ctx) as (_, r):
        archival.export(r, namespace, to, minari_root, Console(), as_json)


@app.command("import")
@_friendly
def import_(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Argument(help="Minari dataset id or directory")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Import into this")],
    fmt: Annotated[str, typer.Option("--format", help="Only 'minari'")] = "minari",
    minari_root: _MinariRoot = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Import an offline dataset (Minari) as steps tagged origin=offline."""
    _only_minari(fmt)
    with _redis(ctx) as (_, r):
        archival.import_dataset(r, dataset, namespace, minari_root, Console(), as_json)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
