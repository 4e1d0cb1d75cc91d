"""Commands over a namespace's versions: snapshots, rollback, diffs, lineage and replay."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import TYPE_CHECKING, Annotated, Any

import redis
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from claw_tasks.store import NamespaceError, Store
from orchestrator.cli.app import app, clipped, friendly, redis_client
from orchestrator.maintenance import snapshots as versions

if TYPE_CHECKING:
    from orchestrator.delivery.lineage import LineageLog


def _store(r: redis.Redis, namespace: str) -> Store:
    store = Store(r, namespace)
    if not store.exists():
        raise NamespaceError(f"namespace {namespace!r} does not exist")
    return store


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
@friendly
def snapshot(
    ctx: typer.Context,
    namespace: str,
    name: str,
    delete: Annotated[bool, typer.Option("--delete", help="Delete the snapshot instead")] = False,
) -> None:
    """Record a version of a namespace: labels, priorities, tags, recipes and params.

    Cheap: no payload is copied (the mutable columns, compressed). Roll back to it with
    `claw rollback NS --to NAME`; sample it with a recipe's `as_of: NAME`."""
    with redis_client(ctx) as (_, r):
        store = _store(r, namespace)
        if delete:
            gone = store.drop_snapshot(name)
            Console().print(
                escape(f"snapshot {name!r} {'deleted' if gone else 'did not exist'}"),
                highlight=False,
            )
            return
        info = versions.take(store, name)
    Console().print(
        f"snapshot [bold]{escape(name)}[/] of {namespace!r}: {info.steps:,} steps, "
        f"{len(info.extra.get('recipes', {}))} recipe(s), {info.bytes:,} bytes",
        highlight=False,
    )


@app.command()
@friendly
def snapshots(
    ctx: typer.Context,
    namespace: str,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """A namespace's snapshots, oldest first."""
    with redis_client(ctx) as (_, r):
        found = _store(r, namespace).snapshots()
    rows = [
        {
            "name": s.name,
            "created": s.created,
            "steps": s.steps,
            "bytes": s.bytes,
            "recipes": sorted(s.extra.get("recipes", {})),
            "seqs": list(s.seqs),
        }
        for s in found
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        Console().print(f"no snapshots of {namespace!r}")
        return
    table = Table(title=f"snapshots of {namespace!r}")
    for h in ("name", "taken (UTC)", "steps", "bytes", "recipes"):
        table.add_column(h, justify="right" if h in ("steps", "bytes") else "left")
    for row in rows:
        table.add_row(
            escape(row["name"]),
            _when(row["created"]),
            f"{row['steps']:,}",
            f"{row['bytes']:,}",
            ", ".join(row["recipes"]) or "-",
        )
    Console().print(table)


@app.command()
@friendly
def rollback(
    ctx: typer.Context,
    namespace: str,
    to: Annotated[str, typer.Option("--to", help="The snapshot to go back to")],
    drop_new: Annotated[
        bool, typer.Option(help="Also evict the steps committed since the snapshot")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Put a snapshot's labels, priorities, tags, recipes and params back.

    Steps committed since stay (unless --drop-new); steps evicted since cannot come back:
    the command says how many."""
    from orchestrator.delivery.client import BatchClient

    with redis_client(ctx) as (url, r):
        store = _store(r, namespace)
        client = BatchClient(namespace, ctx.obj or url)
        try:
            report = versions.rollback(store, to, client, drop_new=drop_new)
        finally:
            client.close()
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    lab = report.labels
    console = Console()
    written = ", ".join(f"{k} {v:,}" for k, v in lab.changed.items() if v) or "nothing differed"
    console.print(f"rolled {namespace!r} back to [bold]{escape(to)}[/]: {written}", highlight=False)
    for n, v in report.restored.items():
        console.print(f"recipe {n}: the snapshot's, now version {v}", highlight=False)
    for n, v in report.bumped.items():
        console.print(f"recipe {n}: registered since, kept (version {v})", highlight=False)
    if lab.evicted:
        console.print(
            f"[yellow]{lab.evicted:,} steps of the snapshot were evicted since and cannot "
            "come back[/]",
            highlight=False,
        )
    if lab.added:
        what = f"evicted ({lab.dropped:,})" if drop_new else "kept (--drop-new evicts them)"
        console.print(f"{lab.added:,} steps committed since: {what}", highlight=False)


@app.command()
@friendly
def diff(
    ctx: typer.Context,
    namespace: str,
    a: Annotated[str, typer.Argument(help="A snapshot")],
    b: Annotated[str, typer.Argument(help="A later snapshot, or 'now'")] = "now",
    where: Annotated[
        str | None, typer.Option(help="Only steps matching this filter, e.g. \"task_id == 'x'\"")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """What changed between two snapshots, or one and now.

    Steps added and evicted; of the steps in both, labels, priorities and tags changed."""
    with redis_client(ctx) as (_, r):
        d = versions.diff_states(_store(r, namespace), a, b, where)
    if as_json:
        typer.echo(json.dumps(d.to_json(), indent=2))
        return
    title = f"{namespace!r}: {a} → {b}" + (f" where {where}" if where else "")
    table = Table(title=escape(title))
    table.add_column("what")
    table.add_column("steps", justify="right")
    rows = [
        ("added", d.added),
        ("evicted", d.evicted),
        ("kept", d.kept),
        ("made untrainable", d.untrainable),
        ("made trainable", d.trainable),
        ("quality changed", d.quality),
        ("priority changed", d.priority),
        *((f"tags.{c[2:]} changed", n) for c, n in d.tags.items()),
    ]
    for what, n in rows:
        table.add_row(what, f"{n:,}")
    Console().print(table)


@app.command()
@friendly
def lineage(
    ctx: typer.Context,
    namespace: str,
    policy: Annotated[
        str | None, typer.Option(help="Which data trained this policy/update version")
    ] = None,
    step: Annotated[
        list[int] | None, typer.Option(help="Which policies trained on this step id (repeatable)")
    ] = None,
    episode: Annotated[
        str | None, typer.Option(help="Which policies trained on this episode's steps")
    ] = None,
    ids: Annotated[bool, typer.Option("--ids", help="With --policy: print the step ids")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Which data trained which policy, from the lineage log of popped batches.

    Trainers declare what a batch trains: BatchClient.pop(name, policy_version=v). Without
    options: the policies the log holds and how many batches each."""
    from orchestrator.delivery.lineage import LineageLog

    if sum(x is not None and x != [] for x in (policy, step, episode)) > 1:
        raise typer.BadParameter("give one of --policy, --step, --episode")
    for s in step or []:
        if not 1 <= s < 2**63:  # step ids are int64 > 0
            raise typer.BadParameter(f"a step id is in 1..2**63-1, got {s}", param_hint="--step")
    with redis_client(ctx) as (_, r):
        store = _store(r, namespace)
        log = LineageLog(store)
        if policy is not None:
            doc = _policy_lineage(log, policy, ids)
        elif step or episode is not None:
            doc = _steps_lineage(store, log, step or [], episode)
        else:
            counts = log.counts()
            doc = {"batches": sum(counts.values()), "policies": counts}
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        _print_lineage(doc, namespace, policy, ids)


def _policy_lineage(log: LineageLog, policy: str, ids: bool) -> dict[str, Any]:
    """What trained ``policy``: its batches, rows, distinct steps and recipes (and the
    step ids with ``ids``)."""
    import numpy as np

    found = log.trained(policy)
    all_ids = np.sort(np.concatenate([e.ids for e in found])) if found else np.zeros(0)
    doc = {
        "policy": policy,
        "batches": len(found),
        "rows": len(all_ids),
        "steps": len(np.unique(all_ids)),
        "recipes": sorted({f"{e.recipe}@v{e.recipe_version}" for e in found}),
        "entries": [e.to_json() for e in found],
    }
    if ids:
        doc["ids"] = all_ids.astype(np.int64).tolist()
    return doc


def _steps_lineage(
    store: Store, log: LineageLog, step: list[int], episode: str | None
) -> dict[str, Any]:
    """The policies that trained on steps ``step``, or on ``episode``'s stored steps."""
    import numpy as np

    from claw_tasks.format.stepmeta import episode_code
    from orchestrator.maintenance.lifecycle import synced_index

    wanted = np.asarray(step, np.int64)
    if episode is not None:
        index, _ = synced_index(store)
        cols = index.columns
        rows = (cols["episode"] == episode_code(episode)) & (cols["id"] > 0)
        wanted = cols["id"][rows]
        if not len(wanted):
            raise NamespaceError(f"episode {episode!r} has no stored steps in {store.namespace!r}")
    per_step = log.policies(wanted)
    policies: dict[str, int] = {}
    for seen in per_step.values():
        for p, n in seen.items():
            policies[p] = policies.get(p, 0) + n
    return {
        "episode": episode,
        "steps": {str(k): v for k, v in per_step.items()},
        "policies": policies,
    }


def _print_lineage(doc: dict[str, Any], namespace: str, policy: str | None, ids: bool) -> None:
    console = Console()
    if policy is not None:
        console.print(
            f"policy {escape(repr(policy))} of {namespace!r}: {doc['batches']:,} batches, "
            f"{doc['rows']:,} rows, {doc['steps']:,} distinct steps "
            f"({escape(', '.join(doc['recipes'])) or '-'})",
            highlight=False,
        )
        if ids:
            console.print(" ".join(map(str, doc["ids"])), highlight=False, soft_wrap=True)
        return
    table = Table(title=f"lineage of {namespace!r}")
    table.add_column("policy")
    table.add_column("batches" if "batches" in doc else "rows", justify="right")
    for p, n in sorted(doc["policies"].items()):
        table.add_row(escape(p) or "(undeclared)", f"{n:,}")
    console.print(table)


_STREAM_ID = r"(\d{1,20})(?:-(\d{1,20}))?"


def _entry_id(option: str, value: str) -> str:
    """``value`` as a lineage entry id (``ms-seq``, each part below 2**64; ``-``/``+``: the
    log's ends), or a one-line error naming ``option``."""
    m = None if value in ("-", "+") else re.fullmatch(_STREAM_ID, value)
    if value not in ("-", "+") and (m is None or any(int(g) >= 2**64 for g in m.groups("0"))):
        raise typer.BadParameter(f"{option}: a lineage entry id (ms-seq), not {clipped(value)!r}")
    return value


@app.command(short_help="Make the batches that trained a policy again, bit for bit.")
@friendly
def replay(
    ctx: typer.Context,
    namespace: str,
    policy: Annotated[
        str | None, typer.Option(help="The batches declared as training this policy version")
    ] = None,
    start: Annotated[
        str, typer.Option("--from", help="Or the entries from this lineage entry id on")
    ] = "-",
    end: Annotated[str, typer.Option("--to", help="... up to this lineage entry id")] = "+",
    archive: Annotated[
        str | None, typer.Option(help="The archive directory (claw archive) for evicted steps")
    ] = None,
    out: Annotated[
        str | None, typer.Option(help="Write each batch to DIR/<entry>.npz (fields, ids, ...)")
    ] = None,
    max_restore_mb: Annotated[
        int,
        typer.Option(
            min=1,
            max=1 << 20,
            help="Archive MiB restored into Redis at most at once (a batch needing more "
            "is listed as not replayed)",
        ),
    ] = 1024,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Make the batches that trained a policy again, bit for bit, from the lineage log:
    rows in the order the trainer got them, weights, assembly and augmentation; steps from
    Redis, or from --archive once evicted. Rows that cannot be replayed exactly are
    listed with the reason; exits 1 if any."""
    from pathlib import Path

    import numpy as np

    from orchestrator.inspect.replay import replay as run

    start, end = _entry_id("--from", start), _entry_id("--to", end)
    if policy is not None and (start, end) != ("-", "+"):
        raise typer.BadParameter("--policy: or --from/--to, not both")
    target = None if out is None else Path(out)
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    docs, inexact = [], 0
    with redis_client(ctx) as (_, r):
        store = _store(r, namespace)
        batches = run(
            store,
            policy=policy,
            start=start,
            end=end,
            archive=archive,
            max_restore=max_restore_mb << 20,
        )
        for got in batches:
            docs.append(got.to_json())
            inexact += not got.exact
            if got.batch is not None and target is not None:
                b = got.batch
                arrays = {f"field.{k}": np.asarray(v) for k, v in b.fields.items()}
                np.savez(
                    target / f"{got.entry.entry_id}.npz",
                    ids=b.ids,
                    weights=b.weights,
                    source_index=b.source_index,
                    **arrays,
                )
    if as_json:
        typer.echo(json.dumps({"batches": docs, "inexact": inexact}, indent=2))
    else:
        console = Console()
        for d in docs:
            where = d["source"] or "-"
            console.print(
                f"{d['entry']}  {d['recipe']}@v{d['recipe_version']}  policy {d['policy']!r}  "
                f"{d['rows']} rows  {'exact from ' + where if d['exact'] else 'NOT replayed'}",
                highlight=False,
            )
            for m in d["missing"]:
                rows = f"  rows {m['rows']} (ids {m['ids']})"
                console.print(f"{rows}: {m['reason']}", highlight=False)
        console.print(f"{len(docs)} batches, {inexact} not replayed exactly", highlight=False)
    if inexact:
        raise typer.Exit(1)
