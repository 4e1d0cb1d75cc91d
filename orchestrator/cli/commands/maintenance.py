"""Commands that change or check a namespace: retention, evict, drop, the beat schedule,
doctor."""

from __future__ import annotations

import json
from typing import Annotated

import redis
import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from claw_tasks.connection.client import is_cluster
from claw_tasks.format import names
from claw_tasks.settings import get_settings
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.check import CHECKS, Report, check_namespace
from claw_tasks.store.keyscan import namespace_keys, scan_keys
from orchestrator.cli.app import app, err, friendly, redis_client
from orchestrator.cli.retention_options import retention_policy
from orchestrator.cli.schedule import beat_entries
from orchestrator.cli.steplog import parse_ids
from orchestrator.maintenance.lifecycle import drop_namespace

_MAX_PROBLEMS = 50


@app.command()
@friendly
def retention(
    ctx: typer.Context,
    namespace: str,
    max_age: Annotated[
        str | None, typer.Option(help="Evict steps committed longer ago, e.g. 12h, 7d")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(min=0, max=2**63 - 1, help="Soft step cap below capacity")
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
    max_snapshots: Annotated[
        int | None, typer.Option(min=0, max=2**31, help="Snapshots kept (the oldest go first)")
    ] = None,
    snapshot_max_age: Annotated[
        str | None, typer.Option(help="Delete snapshots older than this, e.g. 30d")
    ] = None,
    clear: Annotated[bool, typer.Option(help="Remove the policy")] = False,
) -> None:
    """Show or set a namespace's retention policy (run by claw.maintenance.evict).

    Without options it prints the policy; options change those settings and keep the rest
    (--clear first to start over)."""
    changes = {
        "max_age": max_age,
        "max_steps": max_steps,
        "max_bytes": max_bytes,
        "evict": evict,
        "protect": protect,
        "archive_before_evict": archive_before_evict,
        "max_snapshots": max_snapshots,
        "snapshot_max_age": snapshot_max_age,
    }
    given = {k: v for k, v in changes.items() if v is not None}
    with redis_client(ctx) as (_, r):
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
@friendly
def evict_steps(
    ctx: typer.Context,
    namespace: str,
    ids: Annotated[str, typer.Option(help="Step ids, e.g. 1,2,3")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask")] = False,
) -> None:
    """Evict steps by id now (counted as 'manual')."""
    names.check_namespace(namespace)  # before asking about it
    wanted = parse_ids(ids)
    if not yes:
        typer.confirm(f"evict {len(wanted)} step(s) of {namespace[:200]!r}?", abort=True)
    with redis_client(ctx) as (_, r):
        done = Store(r, namespace).evict(wanted, "manual")
    Console().print(f"evicted {done} of {len(wanted)} step(s) (the others were gone already)")


@app.command()
@friendly
def drop(
    ctx: typer.Context,
    namespace: str,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask")] = False,
) -> None:
    """Delete a namespace: every step, recipe, queue and counter, in bounded chunks.

    Running workers stop writing to it at once (they check before every commit) and do
    not create it again; a new Ingestor or `Store.create` does."""
    with redis_client(ctx) as (url, r):
        if not any(True for _ in namespace_keys(r, namespace)):
            raise NamespaceError(f"namespace {namespace!r} has no keys at {url}")
        if not yes:
            typer.confirm(
                f"drop namespace {namespace!r} at {url}? This cannot be undone", abort=True
            )
        with Progress(
            SpinnerColumn(),
            TextColumn("dropping {task.description}"),
            TextColumn("{task.completed:,} keys"),
            TimeElapsedColumn(),
            console=err,
        ) as progress:
            task = progress.add_task(namespace, total=None)
            deleted = drop_namespace(r, namespace, lambda n: progress.advance(task, n))
    Console().print(f"dropped {namespace!r}: {deleted:,} keys deleted")


@app.command("schedule")
@friendly
def show_schedule(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Beat's entries (maintenance tasks) with their next run (CLAW_SCHEDULE overrides)."""
    with redis_client(ctx) as (_, r):
        if is_cluster(r):  # RedBeat keeps the schedule on a standalone Redis (settings)
            beat = redis.Redis.from_url(get_settings().beat_url)
            found = beat_entries(beat)
            beat.close()
        else:
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
            e.name,
            e.task,
            e.schedule,
            nxt if e.scheduled else f"~{nxt} (beat not running)",
            "-" if e.last_run is None else e.last_run.strftime("%Y-%m-%d %H:%M:%S"),
            str(e.runs),
        )
    Console().print(table)


@app.command(
    help="Check the store and its indexes for consistency; exit 1 on problems.\n\n"
    + "\n\n".join(f"{name}: {what}" for name, what in CHECKS.items())
)
@friendly
def doctor(
    ctx: typer.Context,
    namespace: Annotated[
        str | None, typer.Argument(help="One namespace (default: every namespace)")
    ] = None,
) -> None:
    with redis_client(ctx) as (url, r):
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
