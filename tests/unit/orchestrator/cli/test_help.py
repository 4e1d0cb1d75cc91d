"""Every `claw` command's `--help`, rendered at 80 columns as a terminal shows it: lines
fit, no name is cut short, and no paragraph breaks where the next word would still have
fitted (a docstring's hard line break), so help reads as the paragraphs it was written as.
The commands are enumerated from the Typer app, so a new command is checked too."""

from __future__ import annotations

import itertools
import re

import pytest
import typer
from typer.testing import CliRunner

import orchestrator.cli.commands  # noqa: F401  (registers every command)
from orchestrator.cli.app import app

COLUMNS = 80
WRAP = COLUMNS - 2  # click wraps help to the terminal width less its right margin
CUT = re.compile(r"[^\]\s]\.\.\.$")  # a summary cut short, not `[ARGS]...`
MAIN = ("up", "demo", "query", "inspect", "stats", "archive", "restore", "gateway", "nearest")


def _commands() -> list[str]:
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", {})  # the app is a group: its commands by name
    return sorted(commands)


def _render(*args: str) -> str:
    runner = CliRunner(env={"COLUMNS": str(COLUMNS)})
    result = runner.invoke(app, [*args, "--help"], prog_name="claw", terminal_width=COLUMNS)
    assert result.exit_code == 0, result.output
    return result.output


def hard_breaks(text: str, width: int = WRAP) -> list[str]:
    """Line pairs of one paragraph where the next line's first word would have fitted on
    the line before: a re-flowing wrapper never leaves them, a hard-wrapped string does.
    Verbatim blocks (examples: lines that start with `claw ` or `$`) are exempt."""
    lines = text.splitlines()
    found = []
    for a, b in itertools.pairwise(lines):
        if not a.strip() or not b.strip():
            continue
        at, bt = len(a) - len(a.lstrip()), len(b) - len(b.lstrip())
        word = b.split()[0]
        # The same paragraph: a prose line and the next at its indent, or a definition
        # row and the next line of its help column (the column a's help starts at too).
        prose = bt == at and "  " not in a.strip()
        column = bt > at and len(a) > bt and a[bt - 2 : bt] == "  " and a[bt] != " "
        verbatim = word in ("claw", "$") or a.rstrip().endswith(":")
        if (prose or column) and not verbatim and len(a) + 1 + len(word) <= width:
            found.append(f"{a!r} / {b!r}")
    return found


def test_the_check_finds_a_hard_break() -> None:
    wrapped = "  Serve the metrics of the store\n  (loopback unless --host widens it)."
    assert hard_breaks(wrapped) != []
    flowed = "  " + "word " * 15 + "end\n  of the paragraph."
    assert hard_breaks(flowed.replace("end\n", "endless\n"), width=80) == []


def test_every_command_is_found() -> None:
    commands = _commands()
    assert {"up", "demo", "gateway", "query", "web", "metrics"} <= set(commands)


@pytest.mark.parametrize("command", [None, *_commands()])
def test_help_reads_at_80_columns(command: str | None) -> None:
    text = _render(*([command] if command else []))
    too_long = [line for line in text.splitlines() if len(line) > COLUMNS]
    assert not too_long, too_long
    assert "…" not in text, text
    cut = [line for line in text.splitlines() if CUT.search(line)]  # Click's "..." cut
    assert not cut, cut
    assert not hard_breaks(text), hard_breaks(text)


def test_claw_help_lists_each_command_with_its_whole_summary() -> None:
    """`claw --help` gives every command a summary of one sentence, at most two lines."""
    text = _render()
    listing = text.split("\nCommands:\n", 1)[1].splitlines()
    rows: dict[str, list[str]] = {}
    for line in listing:
        if line.startswith("  ") and not line.startswith("   "):
            name, summary = line.split(maxsplit=1)
            rows[name] = [summary]
        else:
            rows[list(rows)[-1]].append(line.strip())
    assert set(rows) == set(_commands())
    for name, lines in rows.items():
        assert len(lines) <= 2, (name, lines)
        summary = " ".join(lines)
        assert summary.endswith(".") and not summary.endswith("..."), (name, lines)


@pytest.mark.parametrize("command", MAIN)
def test_main_commands_show_an_example(command: str) -> None:
    text = _render(command)
    assert re.search(rf"^\s+claw {command}\b", text, re.M), text
