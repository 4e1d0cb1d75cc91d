"""Every `claw` command, with a hostile value in each of its arguments and options.

The commands are enumerated from the Typer app, so a new command (or option) is covered
without touching this file. For each, Hypothesis picks one parameter and puts a hostile
value in it — an integer past int64 or negative, NaN, inf, a newline, non-ASCII text, a
1 MiB string — with every other required parameter given a working value, against a
private redis-server holding a namespace with steps, a vector index and a snapshot. The
outcome must be a valid result (exit 0) or a clean refusal: exit 1 or 2 with no
traceback, its error line(s) short. Commands that serve (``up``, ``web``, ``gateway``,
``metrics``, ``demo``) run as their own process: either they refuse and exit, or they are
still running when their startup is over and are stopped with SIGINT, and their output
holds no traceback either way.

The CI variant draws a few values per command; ``-m slow`` draws many more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from claw_tasks.connection.server import RedisServer
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.maintenance import snapshots
from orchestrator.maintenance.vectors import update_indexes
from orchestrator.retrieval import define_index
from tests.stack.test_retrieval import steps
from tests.support.paths import ROOT

COMMANDS: dict[str, click.Command] = typer.main.get_command(app).commands  # type: ignore[attr-defined]
SERVING = {"up", "web", "gateway", "metrics", "demo"}
"""Commands that run until stopped: each runs in its own process (see the module docstring)."""
MIB = 1 << 20

# A working value for a parameter, by command and parameter name, then by name alone.
NAMESPACE = "hostile"
WORKING: dict[str, str] = {
    "namespace": NAMESPACE,
    "name": "snap",
    "a": "snap",
    "to": "snap",
    "ids": "1",
    "user": "u",
    "upstream": "http://127.0.0.1:9/v1",
    "dataset": "no-such/dataset-v0",
}


def working(command: str, param: click.Parameter, tmp: Path) -> str | None:
    """A value that works for ``param`` (None: leave it out)."""
    name = param.name or ""
    if (command in ("archive", "export") and name == "to") or name == "archive_dir":
        return str(tmp / "archive")
    if command == "demo" and name == "steps":
        return "200"
    return WORKING.get(name)


# ---- hostile values ------------------------------------------------------------------------
huge = st.one_of(
    st.integers(min_value=2**63, max_value=2**200),
    st.just(10**20),
    st.integers(min_value=2**31, max_value=2**63 - 1),
)
negative = st.one_of(st.integers(max_value=-1, min_value=-(2**70)), st.just(-1))
special = st.sampled_from(["nan", "inf", "-inf", "-0", "1e999", "0x10", "", " "])
newline = st.text(max_size=8).map(lambda s: f"x{s}\n") | st.just("a\nb")
non_ascii = st.text(st.characters(min_codepoint=128, exclude_categories=["Cs"]), min_size=1)
markup = st.sampled_from(["[/]", "[bold]x", "[link=x]y[/link]", "%s%n", "{0}", "'\"`$(id)"])
HOSTILE = st.one_of(
    huge.map(str),
    negative.map(str),
    special,
    newline,
    non_ascii,
    markup,
    st.just("x" * MIB),
)


@dataclass
class Outcome:
    code: int
    output: str
    exception: BaseException | None


def check(command: str, argv: list[str], out: Outcome) -> None:
    """A valid result or a clean refusal (see the module docstring)."""
    shown = f"claw {' '.join(a[:60] for a in argv)}\n{out.output[-3000:]}"
    assert "Traceback" not in out.output, shown
    assert out.exception is None or isinstance(out.exception, SystemExit), (
        f"{shown}\n{out.exception!r}"
    )
    assert out.code in (0, 1, 2), shown
    if out.code:
        # The error says what is wrong in a line or a box, not 1 MiB of the argument back.
        assert len(out.output) < 20_000, shown


def params(command: str) -> list[click.Parameter]:
    """What can carry a value: arguments and non-flag options."""
    return [
        p for p in COMMANDS[command].params if not getattr(p, "is_flag", False) and p.expose_value
    ]


def argv_for(command: str, target: click.Parameter, value: str, tmp: Path) -> list[str]:
    """``command`` with ``value`` in ``target`` and a working value in every other
    required parameter (a serving command: in every one that has one). Options come first,
    then ``--`` and the arguments (a hostile argument may start with ``-``)."""
    options: list[str] = []
    arguments: list[str] = []
    for p in COMMANDS[command].params:
        if getattr(p, "is_flag", False):
            continue
        given = value if p is target else None
        if given is None and (p.required or command in SERVING):
            given = working(command, p, tmp)
        if given is None:
            continue
        if p.param_type_name == "argument":
            arguments.append(given)
        else:
            options += [p.opts[0], given]
    return [command, *options, "--", *arguments]


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A private redis-server with namespace ``hostile``: 300 steps, an exact vector index
    built, a snapshot ``snap`` and an archive directory."""
    tmp = tmp_path_factory.mktemp("hostile")
    with RedisServer() as server:
        store = Store(server.url, NAMESPACE)
        store.create(capacity=1000, n_shards=2)
        x = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
        store.commit(steps(x, "e0", "expert"))
        define_index(store, {"name": "default", "field": "obs", "kind": "exact"})
        while update_indexes(store).get("default", {}).get("pending", 1):
            pass
        snapshots.take(store, "snap")
        yield server.url, tmp


def run_in_process(argv: list[str], url: str) -> Outcome:
    """``claw argv`` in this process, in an empty directory of its own (a hostile value
    may be a path: what a command writes there is removed with it), answering "n" to a
    confirmation."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as cwd:
        env = {
            "CLAW_REDIS_URL": url,
            "COLUMNS": "120",
            "CLAW_BROKER_URL": url,
            "MINARI_DATASETS_PATH": cwd,  # an export named by a hostile value lands here
        }
        os.chdir(cwd)
        try:
            done = CliRunner().invoke(app, argv, env=env, input="n\n")
        finally:
            os.chdir(here)
    return Outcome(done.exit_code, done.output, done.exception)


def run_serving(argv: list[str], url: str, tmp: Path, startup: float | None = None) -> Outcome:
    """``claw argv`` in its own process: its exit, or SIGINT once its startup is over
    (``startup`` seconds, STARTUP by default)."""
    env = {
        **os.environ,
        "CLAW_REDIS_URL": url,
        "CLAW_BROKER_URL": url,
        "CLAW_WEB_PASSWORD": "pw-pw-pw-pw",
        "CLAW_GATEWAY_TOKEN": "t" * 32,
        "PYTHONPATH": str(ROOT),
    }
    if argv[0] in ("up", "demo"):
        argv = [*argv, "--log-dir", str(tmp / "logs")] if "--log-dir" not in argv else argv
    # Linux refuses one argv string over 128 KiB (MAX_ARG_STRLEN): the longest it passes.
    # and no NUL byte (C strings end there).
    argv = [a[:ARG_MAX].replace("\x00", "") for a in argv]
    args = [sys.executable, "-m", "orchestrator.cli.main", *argv]
    with subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=STARTUP if startup is None else startup)
        except subprocess.TimeoutExpired:  # serving: stop it as Ctrl-C would
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=120)
            if output.rstrip().endswith("KeyboardInterrupt"):
                # Our SIGINT reached it before its handler was set (a slow start under
                # load): that traceback is the interrupt's, not the arguments'.
                output = output[: output.find("Traceback")]
            return Outcome(0, output, None)
    return Outcome(proc.returncode, output, None)


ARG_MAX = 128 * 1024 - 1
STARTUP = 15.0
"""Seconds a serving command is given to refuse its arguments before it counts as serving."""
REFUSED = 180.0
"""Seconds a serving command whose address or TLS file cannot serve is given to exit."""


def hostile_run(command: str, data: st.DataObject, store: tuple[str, Path]) -> None:
    url, tmp = store
    candidates = params(command)
    if not candidates:  # nothing takes a value: the command as it is
        check(command, [command], run_in_process([command], url))
        return
    target = data.draw(st.sampled_from(candidates), label="parameter")
    value = data.draw(HOSTILE, label="value")
    argv = argv_for(command, target, value, tmp)
    if command in SERVING:
        check(command, argv, run_serving(argv, url, tmp))
    else:
        check(command, argv, run_in_process(argv, url))


QUICK = sorted(set(COMMANDS) - SERVING)


@pytest.mark.parametrize("command", QUICK)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_arguments(hostile_store, command, data):
    hostile_run(command, data, hostile_store)


@pytest.mark.parametrize("command", sorted(SERVING & set(COMMANDS)))
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_arguments_of_serving_commands(hostile_store, command, data):
    hostile_run(command, data, hostile_store)


@pytest.mark.slow
@pytest.mark.parametrize("command", QUICK)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_arguments_many(hostile_store, command, data):
    hostile_run(command, data, hostile_store)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(SERVING & set(COMMANDS)))
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_arguments_of_serving_commands_many(hostile_store, command, data):
    hostile_run(command, data, hostile_store)


def test_every_command_is_covered():
    """The enumeration sees the whole app (a command registered elsewhere would show)."""
    assert {"nearest", "lineage", "snapshot", "inspect", "up"} <= set(COMMANDS)
    assert set(COMMANDS) >= SERVING


@pytest.mark.parametrize("step", ["100000000000000000000", "-1", "0", str(2**63)])
def test_lineage_names_a_step_id_out_of_range(hostile_store, step):
    """`claw lineage NS --step 100000000000000000000` raised OverflowError converting the
    ids to int64: a traceback."""
    url, _ = hostile_store
    out = run_in_process(["lineage", NAMESPACE, "--step", step], url)
    assert out.code == 2 and "--step" in out.output and "1..2**63-1" in out.output
    check("lineage", ["lineage"], out)


def test_an_overflow_is_one_line_naming_the_number():
    """The net under a missing check: OverflowError and MemoryError are one line, exit 1."""
    from orchestrator.cli.app import friendly

    def raising(exc: BaseException):
        @friendly
        def boom() -> None:
            raise exc

        return boom

    for exc, text in [
        (OverflowError("int too large to convert"), "a number given is too large"),
        (MemoryError(), "more memory than this process can hold"),
        (ValueError("bad\nvalue [/] " + "x" * MIB), "bad\\nvalue [/] xxx"),
    ]:
        cmd = typer.Typer()
        cmd.command()(raising(exc))
        done = CliRunner().invoke(cmd, [])
        assert done.exit_code == 1 and text in done.output, done.output
        assert "Traceback" not in done.output and done.output.count("\n") == 1
        assert len(done.output) < 3000
    # Any other exception is a bug in Claw: it is not turned into a line, its traceback
    # is what a report needs.
    cmd = typer.Typer()
    cmd.command()(raising(TypeError("a bug")))
    done = CliRunner().invoke(cmd, [])
    assert done.exit_code == 1 and isinstance(done.exception, TypeError)
    assert "error:" not in done.output


# Each unchecked: a traceback (the comment says which) or a refusal not naming the argument.
@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["nearest", "--define", "[1]", "--", NAMESPACE], "--define"),  # a TypeError
        (["nearest", "--of", str(10**20), "--", NAMESPACE], "--of"),  # an OverflowError
        (["inspect", "--ids", str(10**20), "--", NAMESPACE], "--ids"),
        (["evict", "--ids", str(2**63), "--", NAMESPACE], "--ids"),
        (["acl", "--db", "-1", "--", "ns", "u"], "--db"),  # an ACL for db -1
        (["acl", "--db", str(10**20), "--", "ns", "u"], "--db"),
        (["dead", "--limit", str(10**20), "--", NAMESPACE], "--limit"),  # a Redis error
        (["retention", "--max-steps", str(10**20), "--", NAMESPACE], "--max-steps"),
        (["acl", "--", "a\nb", "u"], "namespace 'a\\nb'"),  # a ValueError traceback
        (["acl", "--", "ns", "u +@all"], "user 'u +@all'"),  # a second word: a rule
        (["import", "--namespace", NAMESPACE, "--", "[/]"], "[/]"),  # a MarkupError
        (["evict", "--ids", "1", "--", "x:" * MIB], "namespace 'x:x:x:"),  # asked first
    ],
)
def test_found_by_the_fuzz_each_refusal_names_its_argument(hostile_store, argv, names):
    url, _ = hostile_store
    out = run_in_process(argv, url)
    check(argv[0], argv, out)
    assert out.code in (1, 2) and names in out.output, out.output


def test_a_declined_confirmation_and_an_exit_print_no_empty_error(hostile_store):
    """typer's ``Abort`` and ``Exit`` are ``RuntimeError``s: the one-line net printed an
    empty ``error:`` line for each (a declined `claw evict`, `claw doctor` finding
    problems)."""
    url, _ = hostile_store
    out = run_in_process(["evict", "--ids", "1", "--", NAMESPACE], url)  # answers n
    assert out.code == 1 and "Aborted" in out.output and "error:" not in out.output


@pytest.mark.parametrize(
    "argv",
    [
        ["lineage", "--policy", "[/]", "--", NAMESPACE],  # a MarkupError
        ["diff", "--where", "[/]", "--", NAMESPACE, "snap"],
        ["evict", "--ids", "1", "--", "x" * MIB],  # the prompt quoted 1 MiB back
        ["export", "--to", "x", "--", NAMESPACE],  # no -vN: Minari's parse raised TypeError
    ],
)
def test_user_text_is_shown_as_text_and_short(hostile_store, argv):
    url, _ = hostile_store
    out = run_in_process(argv, url)
    check(argv[0], argv, out)
    assert "[/]" in out.output or "x" * 50 in out.output or "name-vN" in out.output
    assert len(out.output) < 4096  # a 1 MiB argument is never quoted back whole


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        # Each case is a process (~3-7 s under load): the two that take check_bind's
        # path again with another value run in the slow variant.
        pytest.param(["web", "--host", "23415834080"], "--host", marks=pytest.mark.slow),
        (["web", "--host", "x" * 300], "--host"),  # idna: label too long, a traceback
        pytest.param(
            ["metrics", "--address", "no.such.host.invalid"], "--host", marks=pytest.mark.slow
        ),
        (["web", "--keyfile", "k.pem"], "--keyfile"),  # uvicorn asserted a certfile
        (["web", "--certfile", "nope.pem"], "--certfile"),
        (
            [
                "gateway",
                "--address",
                "x" * 300,
                "--upstream",
                "http://127.0.0.1:9",
                "--namespace",
                "n",
            ],
            "--address",
        ),
    ],
)
def test_an_address_or_tls_file_that_cannot_serve_is_refused_before_serving(
    hostile_store, argv, option
):
    url, tmp = hostile_store
    # Each of these must exit: it is given until REFUSED to (a resolver's answer and the
    # web app's imports took 39 s at load 28), not STARTUP.
    out = run_serving([*argv, "--"], url, tmp, startup=REFUSED)
    check(argv[0], argv, out)
    assert out.code == 2 and option in out.output, out.output[-2000:]
