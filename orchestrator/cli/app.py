"""The `claw` Typer app and what every command shares: the --redis-url option (the one
place a flag overrides the settings), the one-line error for expected failures, the Redis
client, signal handling. The commands live in orchestrator.cli.commands and register on
this app when that package is imported (orchestrator.cli.main does)."""

from __future__ import annotations

import functools
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, ParamSpec, TypeVar

import click
import redis
import typer
from rich.console import Console
from rich.markup import escape

from claw_tasks.connection import client as connect
from claw_tasks.connection.server import ensure_redis
from claw_tasks.settings import DEFAULT_REDIS_URL, Settings, redact_url, use_settings

SUMMARY_CHARS = 1_000  # no cut: tests/unit/orchestrator/cli/test_help.py bounds the lines


class ClawGroup(typer.core.TyperGroup):
    """`claw --help` lists each command with its first sentence whole, wrapped to the
    terminal: Click's own list cuts a summary to what fits on one line and ends it with
    "...". A command whose first sentence is long gives a `short_help` instead."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=SUMMARY_CHARS)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    name="claw",
    help="Claw: step-level RL experience middleware on Redis and Celery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Click's own help layout: it re-flows every docstring paragraph to the terminal and
    # never truncates an option's name, where rich's table cut `--no-vllm-options` to
    # `--no-vllm-optio…` at 80 columns and kept later paragraphs' hard line breaks.
    rich_markup_mode=None,
    cls=ClawGroup,
)
err = Console(stderr=True)
P = ParamSpec("P")
R = TypeVar("R")

LogDir = Annotated[
    Path | None, typer.Option(help="Service logs (default: ~/.cache/claw/logs)", show_default=False)
]


PASS_THROUGH: tuple[type[BaseException], ...] = (
    click.ClickException,
    click.exceptions.Exit,
    click.Abort,
    typer.TyperException,  # typer's own click: its usage errors (BadParameter ...)
    typer.Exit,
    typer.Abort,
)
"""What the CLI framework prints and exits on itself (an ``Exit`` or ``Abort`` is a
``RuntimeError``: caught below, it would print an empty error line)."""


def friendly(func: Callable[P, R]) -> Callable[P, R]:
    """Expected failures (Redis down, unknown namespace, bad input) exit 1 with one line.

    A number too large for the type it is used in (``OverflowError``) or a size no process
    can hold (``MemoryError``) is the argument's fault too: one line, exit 1. Each command
    checks its arguments first and names the bad one (``typer.BadParameter``, exit 2); this
    is the net under a check that is missing. Any other exception is a bug in Claw and keeps
    its traceback (the line that fails is what a report needs)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except PASS_THROUGH:
            raise
        except (redis.RedisError, OSError, LookupError, ValueError, RuntimeError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e
            fail(str(message))
        except OverflowError as e:
            fail(f"a number given is too large: {e}")
        except MemoryError:
            fail("an argument asks for more memory than this process can hold")

    return wrapper


def fail(message: str) -> NoReturn:
    """Print ``message`` as the one error line (newlines and control characters of user
    input shown escaped, so the line stays one) and exit 1."""
    err.print(
        f"[bold red]error:[/] {one_line(message)}", highlight=False, soft_wrap=True, emoji=False
    )
    raise typer.Exit(1)


def clipped(value: str, limit: int = 60) -> str:
    """``value``, or its first ``limit`` characters and ``...``: how an argument check
    quotes a refused value (``{clipped(value)!r}``; a 1 MiB argument quoted back is not
    an error message)."""
    return value if len(value) <= limit else f"{value[:limit]}..."


def one_line(text: str, limit: int = 2000) -> str:
    """``text`` on one line: control characters escaped, rich markup escaped, at most
    ``limit`` characters (a 1 MiB argument quoted back is not an error message)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text):,} characters)"
    return escape(text)


@app.callback()
def _root(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None,
        typer.Option(
            help=f"The step store (default CLAW_REDIS_URL). Unset: {DEFAULT_REDIS_URL} if "
            "it answers, else an embedded redis-server with its data in ~/.cache/claw/redis.",
        ),
    ] = None,
) -> None:
    """Every command reads this process's settings (claw_tasks/settings/): the
    environment, with ``--redis-url`` standing for ``CLAW_REDIS_URL`` (so the broker
    and beat defaults follow it). ``ctx.obj`` is the store URL configured, if any."""
    flag = None if redis_url is None else {"CLAW_REDIS_URL": redis_url}
    settings = Settings.from_env(overrides=flag)
    use_settings(settings)
    ctx.obj = settings.redis_url if settings.is_set("CLAW_REDIS_URL") else None


@contextmanager
def redis_client(ctx: typer.Context) -> Iterator[tuple[str, redis.Redis]]:
    """The store's URL (fit to print) and a client; an embedded server started here is
    stopped after."""
    url, server = ensure_redis(ctx.obj)
    client = connect.redis_client(url)
    try:
        yield redact_url(url), client
    finally:
        client.close()
        if server is not None:
            server.stop()


def check_bind(host: str, port: int, option: str = "--host") -> None:
    """Refuse, naming ``option``, an address this process cannot listen on (a name that
    does not resolve, a label too long, a port in use): here in one line rather than
    from inside the server's startup. The test socket is closed at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, where = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(where)
    except (OSError, UnicodeError, ValueError) as e:
        raise typer.BadParameter(
            f"cannot listen on {host[:200]!r} port {port}: {e}", param_hint=option
        ) from None


def stop_on_sigterm() -> None:
    """SIGTERM (docker stop, kill) and SIGINT shut down like Ctrl-C. SIGINT is set too: a
    process started in the background by a non-interactive shell (`cmd &`, CI) inherits it
    ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
