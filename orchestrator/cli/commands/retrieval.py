"""``claw nearest``: define, list and query a namespace's vector indexes from the shell."""

from __future__ import annotations

import json
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from claw_tasks.store import Store
from orchestrator.cli.app import app, friendly, redis_client
from orchestrator.cli.steplog import parse_ids
from orchestrator.retrieval import define_index, list_indexes, nearest
from orchestrator.retrieval.query import check_k


def _jsonable(values: np.ndarray, missing: np.ndarray) -> list[Any]:
    """``values`` (m, k, ...) as nested lists: a missing neighbour (``missing``, (m, k))
    is one null, whatever its field's shape; a NaN or infinity is null (JSON has neither)."""
    out = values.astype(object)
    if values.dtype.kind == "f":
        out[~np.isfinite(values)] = None
    rows = out.tolist()
    for i, j in np.argwhere(missing):
        rows[i][j] = None
    return rows


@app.command("nearest")
@friendly
def nearest_command(
    ctx: typer.Context,
    namespace: str,
    state: Annotated[
        list[str] | None,
        typer.Option(help="A query state, its numbers comma-separated (repeat for a batch)"),
    ] = None,
    of: Annotated[
        str | None, typer.Option("--of", help="Query with these stored steps' states: ids 1,2")
    ] = None,
    k: Annotated[int, typer.Option(help="Neighbours per state")] = 5,
    index: Annotated[str, typer.Option(help="The vector index")] = "default",
    where: Annotated[str, typer.Option(help="Only steps this where expression selects")] = "",
    fields: Annotated[str, typer.Option(help="Fields to show, e.g. action,reward")] = "",
    define: Annotated[
        str | None,
        typer.Option(help='Define the index: JSON, e.g. \'{"field": "obs", "metric": "cosine"}\''),
    ] = None,
    replace: Annotated[bool, typer.Option(help="With --define: drop and rebuild it")] = False,
    show: Annotated[bool, typer.Option("--list", help="List the namespace's indexes")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """The nearest stored steps of some states, by a vector index (docs/retrieval.md).

    --define makes an index (the maintenance beat builds it); --list shows them.

    \b
    Examples:
      claw nearest cartpole --of 1234 --k 5 --fields action
      claw nearest cartpole --define '{"field": "obs", "metric": "l2"}'
    """
    try:
        k = check_k(k, "--k")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--k") from None
    with redis_client(ctx) as (_, r):
        store = Store(r, namespace)
        if define is not None:
            given = json.loads(define)
            if not isinstance(given, dict):
                raise typer.BadParameter(
                    'a JSON object, e.g. \'{"field": "obs"}\'', param_hint="--define"
                )
            spec = define_index(store, {"name": index, **given}, replace=replace)
            typer.echo(f"vector index {spec.name!r} of {namespace!r}: {spec.model_dump_json()}")
            return
        if show:
            specs = {n: s.model_dump() for n, s in list_indexes(store).items()}
            typer.echo(json.dumps(specs, indent=2))
            return
        specs = list_indexes(store)
        if index not in specs:
            known = ", ".join(specs) or "none"
            raise ValueError(f"{namespace!r} has no vector index {index!r} (defined: {known})")
        if of:
            ids = parse_ids(of, "--of")
            states = store.get(ids, fields=[specs[index].field])[specs[index].field]
        elif state:
            states = np.array([[float(x) for x in s.split(",")] for s in state], np.float32)
        else:
            raise ValueError("give query states: --state 0.1,0.2,... (repeatable) or --of ID,ID")
        names = [f.strip() for f in fields.split(",") if f.strip()]
        got = nearest(store, np.asarray(states), k, index=index, where=where or None, fields=names)
    if as_json:
        # A state with fewer than k matches: id -1, distance and fields null, meta null.
        missing = got.ids < 0
        out: dict[str, Any] = {
            "ids": got.ids.tolist(),
            "distances": _jsonable(got.distances, missing),
        }
        out.update({n: _jsonable(v, missing) for n, v in got.fields.items()})
        out.update(got.meta)
        typer.echo(json.dumps(out, default=str, allow_nan=False))
        return
    console = Console()
    for i in range(len(got.ids)):
        table = Table(title=f"state {i}", title_justify="left")
        for col in ["rank", "id", "distance", *got.fields, *got.meta]:
            table.add_column(col)
        for j in range(got.ids.shape[1]):
            if got.ids[i, j] < 0:
                continue
            row = [str(j + 1), str(got.ids[i, j]), f"{got.distances[i, j]:.4g}"]
            row += [np.array2string(v[i, j], precision=3) for v in got.fields.values()]
            row += [str(v[i][j]) for v in got.meta.values()]
            table.add_row(*row)
        console.print(table)
