"""Commands that look into the step store: stats, recipes, inspect, query, dead letters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from claw_tasks.connection.server import ensure_redis
from claw_tasks.format.schema import Schema, tag_key
from claw_tasks.settings import redact_url
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.keyscan import list_namespaces
from orchestrator.cli.app import app, err, friendly, redis_client
from orchestrator.cli.steplog import dead_letters, newest_ids, parse_ids, step_lines
from orchestrator.inspect.stats import NamespaceStats, Statistics, UnreadableNamespace


@app.command()
@friendly
def stats(
    ctx: typer.Context,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="One namespace (default: all)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    quality: Annotated[
        bool,
        typer.Option(
            "--quality",
            help="Data quality instead (the last claw.maintenance.quality pass): per field "
            "counts, NaN/inf, min/max/mean/std; steps per task/skill/agent/source and their "
            "share in the newest window; reward per window",
        ),
    ] = False,
) -> None:
    """Steps, capacity, memory, dead letters, schema and counts per namespace.

    \b
    Examples:
      claw stats
      claw stats --namespace cartpole --quality
    """
    with redis_client(ctx) as (url, r):
        names = [namespace] if namespace else list_namespaces(r)
        if namespace and not Store(r, namespace).exists():
            raise NamespaceError(f"namespace {namespace!r} does not exist at {url}")
        if quality:
            found_q = {n: Statistics(r).quality(n) for n in names}
            if as_json:
                typer.echo(json.dumps(found_q, indent=2))
            else:
                for n, summary in found_q.items():
                    _print_quality(Console(), n, summary)
            return
        census = Statistics(r).collect(names, protected=bool(namespace))
        if namespace and census.unreadable:
            raise UnreadableNamespace(census.unreadable[namespace])
        found, unreadable, used = census.namespaces, census.unreadable, census.used_memory
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


def _summary_table(found: list[NamespaceStats], url: str, used: int, width: int) -> list[Table]:
    """One row per namespace on a wide terminal; on a narrow one (80 columns) one small
    table per namespace, so that no value is cut."""
    heads = (
        "namespace",
        "steps",
        "capacity",
        "shards",
        "committed",
        "episodes",
        "dead letters",
        "memory",
        "B/step",
        "reward mean ± std",
    )
    rows = []
    for s in found:
        i = s.info
        per_step = "-" if s.bytes_per_step is None else f"{s.bytes_per_step:,.0f}"
        reward = "-" if s.reward_mean is None else f"{s.reward_mean:.4g} ± {s.reward_std:.4g}"
        dead = f"[red]{i['dead_letters']:,}[/]" if i["dead_letters"] else "0"
        rows.append(
            (
                s.namespace,
                f"{i['steps']:,}",
                f"{i['capacity']:,}",
                str(i["n_shards"]),
                f"{i['committed_total']:,}",
                f"{s.episodes:,}",
                dead,
                _mib(s.memory_bytes),
                per_step,
                reward,
            )
        )
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


def _print_quality(console: Console, ns: str, q: dict[str, Any] | None) -> None:
    if q is None:
        console.print(f"{ns}: no quality pass yet (beat runs claw.maintenance.quality)")
        return
    table = Table(title=f"data quality of {ns!r}: {q['steps']:,} live steps")
    for h in ("field", "count", "NaN", "inf", "min", "max", "mean", "std"):
        table.add_column(h, justify="left" if h == "field" else "right")

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    for f, st in q["fields"].items():
        nan = f"[red]{st['nan']:,}[/]" if st["nan"] else "0"
        inf = f"[red]{st['inf']:,}[/]" if st["inf"] else "0"
        table.add_row(
            tag_key(f[2:]) if f.startswith("t:") else f,
            f"{st['count']:,}",
            nan,
            inf,
            *(num(st[k]) for k in ("min", "max", "mean", "std")),
        )
    console.print(table)
    minutes = q["window_s"] / 60
    for key, values in q["counts"].items():
        if list(values) == [""]:
            continue  # never set
        t = Table(title=f"steps per {key} (share of the last {minutes:g} min)")
        for h in (key, "steps", "recent", "share"):
            t.add_column(h, justify="left" if h == key else "right")
        recent = sum(w[0] for w in q["windows"][key].values())
        for value, n in values.items():
            got = q["windows"][key][value][0]
            share = f"{got / recent:.1%}" if recent else "-"
            t.add_row(value or "[dim](none)[/]", f"{n:,}", f"{got:,}", share)
        console.print(t)
    rewards = ", ".join(
        "-" if w["mean"] is None else f"{w['mean']:.3g}" for w in reversed(q["rewards"])
    )
    console.print(
        f"reward mean per {minutes:g} min window, oldest first: {rewards}", highlight=False
    )


def _print_details(console: Console, s: NamespaceStats) -> None:
    schema = Schema.from_dict(s.info["schema"]) if s.info["schema"] else Schema(fields={})
    table = Table(title=f"schema of {s.namespace!r}")
    table.add_column("name")
    table.add_column("kind")
    table.add_column("type")
    for head in ("stored B/step", "raw B/step", "ratio"):
        table.add_column(head, justify="right")
    for name, spec in schema.fields.items():
        size = s.payload.get(name)
        cells = (
            ("", "", "")
            if size is None
            else (
                f"{size['stored']:,.0f}",
                f"{size['raw']:,.0f}",
                "-" if size["ratio"] is None else f"{size['ratio']:.1f}x",
            )
        )
        table.add_row(name, "field", spec.describe(), *cells)
    for name, kind in schema.tags.items():
        table.add_row(tag_key(name), "tag", kind)
    console.print(table)
    policy = "none" if s.retention is None else s.retention.describe()
    console.print(f"retention: {policy}", highlight=False)
    evicted = ", ".join(f"{k} {v:,}" for k, v in s.evictions.items())
    console.print(f"evicted so far: {evicted}", highlight=False)
    if s.cleaning:
        cleaned = ", ".join(f"{k} {v:,}" for k, v in s.cleaning.items())
        console.print(
            f"cleaned (source:steps, quarantined source:rule): {cleaned}", highlight=False
        )
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
@friendly
def recipes(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Registered recipes and their prefetch state, rate limit included.

    Queue depth, batches produced and popped, rows sampled against steps inserted, and
    whether the rate limiter makes prefetch wait (and why); for a recipe with admission,
    the staleness budget, its counters and the staleness of the batches served."""
    from orchestrator.delivery.client import BatchClient

    url, server = ensure_redis(ctx.obj)  # the URL itself: a client must log in with it
    try:
        client = BatchClient(namespace, url)
        try:
            if not client.store.exists():
                raise NamespaceError(f"namespace {namespace!r} does not exist at {redact_url(url)}")
            found = client.stats()
        finally:
            client.close()
    finally:
        if server is not None:
            server.stop()
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
            name,
            str(st["version"]),
            f"{st['depth']}/{st['max_depth']}",
            f"{st['produced']:,}",
            f"{st['popped']:,}",
            f"{st['sampled_rows']:,}",
        )
    console.print(table)
    for name, st in found.items():  # below the table: a state is a sentence
        state = f"[yellow]{st['rate_limit']}[/]" if st["rate_limited"] else st["state"] or "-"
        console.print(f"[bold]{name}[/]: {state}", highlight=False)
        if (ro := st.get("rollout")) is not None:
            console.print(
                f"  rollouts {ro['rollouts']:,} (serving policy_version {ro['policy_version']}: "
                f"{ro['minibatches_pushed']}/{ro['minibatches']} minibatches pushed), "
                f"dropped stale {ro['dropped_stale']:,} steps, lost {ro['lost']:,}",
                highlight=False,
            )
        if (adm := st.get("admission")) is not None:
            served = adm.get("served_staleness")
            staleness = (
                f"served staleness mean {served['mean']:.2f}, max {served['max']} versions "
                f"over {served['batches']:,} batches"
                if served
                else "no batch served yet"
            )
            budget = (
                f"admission: budget {adm['budget']:,} trajectories (version {adm['version']}, "
                f"max_staleness {adm['max_staleness']}, {adm['batch']} per batch), admitted "
                f"{adm['admitted']:,}, started {adm['total']:,}, waited {adm['waited']:,}, "
                f"refused {adm['refused']:,}, released {adm['released']:,}, expired "
                f"{adm['expired']:,}, lapsed {adm['lapsed']:,} ({adm['open']:,} open, "
                f"{adm['waiting']:,} rewarded waiting)"
                if "budget" in adm
                else "admission: not declared"
            )
            console.print(f"  {budget}; {staleness}", highlight=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


@app.command("inspect")
@friendly
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
    """Steps as log lines: metadata, field shapes and dtypes, small previews.

    \b
    Examples:
      claw inspect cartpole --limit 5
      claw inspect cartpole --episode ep-17
    """
    if episode is not None and ids is not None:
        raise typer.BadParameter("give --episode or --ids, not both")
    with redis_client(ctx) as (_, r):
        store = Store(r, namespace)
        schema = store.schema()
        if schema is None:
            Console().print(f"namespace {namespace!r} has no steps yet")
            return
        fields = schema.default_fields
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
@friendly
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
    joint: Annotated[
        bool, typer.Option("--joint", help="Match joint steps; aggregate their agents' steps")
    ] = False,
    any_agent: Annotated[
        str | None, typer.Option(help="Joint steps where some agent's step matches (--joint)")
    ] = None,
    all_agents: Annotated[
        str | None, typer.Option(help="Joint steps where every agent's step matches (--joint)")
    ] = None,
    from_skill: Annotated[
        str | None, typer.Option(help="Only steps around a change from this skill_tag")
    ] = None,
    to_skill: Annotated[
        str | None, typer.Option(help="... to this skill_tag (with --from-skill)")
    ] = None,
    transition_window: Annotated[
        int | None, typer.Option(help="Steps each side of a change, 1 to 64 (default 1)")
    ] = None,
) -> None:
    """Ask questions of step metadata, answered from the sampling index.

    Quote the aggregates: the shell reads parentheses. With --any-agent or --all-agents
    (multi-agent data) the expression selects joint steps by their global state's tags,
    and the aggregates are over their agents' steps. With --from-skill, --to-skill and
    --transition-window it counts the changes from one skill to the other inside an
    episode and the steps within that many steps of one.

    \b
    Examples:
      claw query grasp "reward > 0.5" --group-by agent_id --agg 'mean(reward)'
      claw query spread "tags.covered >= 2" --any-agent "reward > 0"
      claw query arm --from-skill reach --to-skill grasp --transition-window 3
    """
    from orchestrator.inspect import query as q

    keys = [k.strip() for k in group_by.split(",") if k.strip()] if group_by else []
    jf = q.JointFilter(any_agent, all_agents) if joint or any_agent or all_agents else None
    tf = None
    if (from_skill is None) != (to_skill is None):
        raise q.QueryError("--from-skill and --to-skill: give both")
    if from_skill is not None and to_skill is not None:
        window = 1 if transition_window is None else transition_window
        tf = q.TransitionFilter(from_skill, to_skill, window)
    elif transition_window is not None:
        raise q.QueryError("--transition-window: only with --from-skill and --to-skill")
    with redis_client(ctx) as (_, r):
        result = q.Query(Store(r, namespace)).run(
            expression,
            group_by=keys,
            aggs=q.parse_aggs(agg),
            since=since,
            keep=[hist] if hist else [],
            joint=jf,
            transition=tf,
        )
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
    if result.joint is not None:
        j = result.joint
        console.print(
            f"{j['matched']:,} of {j['complete']:,} complete joint steps matched; "
            f"{j['partial']:,} partial (a record evicted) not counted"
        )
    if result.transition is not None:
        t = result.transition
        console.print(
            f"{t['windows']:,} {t['from']} -> {t['to']} changes; {result.matched:,} matching "
            f"steps within {t['window']} steps of one"
        )
    if hist:
        console.print(f"histogram of {hist} over {result.matched:,} steps: [bold]{path}[/]")


@app.command()
@friendly
def dead(
    ctx: typer.Context,
    namespace: str,
    limit: Annotated[int, typer.Option(min=1, max=2**31, help="Newest entries to show")] = 20,
) -> None:
    """Dead letters: rejected batches and steps, with the reason."""
    with redis_client(ctx) as (_, r):
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
            d.when,
            d.batch_id,
            d.rows_text,
            "-" if d.steps is None else str(d.steps),
            f"{d.payload_bytes:,} B",
            d.reason,
        )
    console.print(table)
