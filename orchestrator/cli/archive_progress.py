"""`claw archive`, `claw restore`, `claw export` and `claw import`, with progress bars."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from claw_tasks.store import NamespaceError, Store

# pyarrow, Minari and gymnasium are imported by the commands that need them: `claw --help`
# and the other commands start without them.


@contextmanager
def _bar(console: Console, what: str, total: int | None) -> Iterator[Any]:
    """A progress bar; yields ``advance(n)``. ``what`` is shown as given (a name with
    ``[/]`` in it is text, not markup)."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(escape(what), total=total)
        yield lambda n, *_: progress.advance(task, n)


def _existing(r: redis.Redis, namespace: str) -> Store:
    store = Store(r, namespace)
    if not store.exists():
        raise NamespaceError(f"namespace {namespace!r} does not exist")
    return store


def archive(r: redis.Redis, namespace: str, to: Path, console: Console, as_json: bool) -> None:
    from orchestrator.maintenance.archive import Archiver, pending

    store = _existing(r, namespace)
    with _bar(console, f"archive {namespace}", pending(store)) as advance:
        result = Archiver(store, to, progress=advance).run()
    if as_json:
        console.print_json(json.dumps(result.to_json()))
        return
    console.print(
        f"{len(result.files)} file(s), {result.rows:,} steps, {result.bytes / 2**20:,.1f} MiB "
        f"-> {to / f'ns={namespace}'}"
    )
    if result.overwritten:
        console.print(
            f"[yellow]{result.overwritten:,} step(s) were overwritten by the ring before "
            "they were archived (archive more often, or raise the capacity)[/]"
        )
    for shard, seq in result.blocked.items():
        console.print(
            f"[dim]shard {shard}: stopped at seq {seq}, allocated but not committed yet "
            "(the next run goes on from there)[/]"
        )


def restore_archive(
    r: redis.Redis, archive_dir: Path, namespace: str, console: Console, as_json: bool
) -> None:
    from orchestrator.maintenance.archive_files import Manifest
    from orchestrator.maintenance.restore import find_archive, restore

    ns_dir = find_archive(archive_dir)
    manifest = Manifest.load(ns_dir)
    assert manifest is not None
    store = Store(r, namespace)
    with _bar(console, f"restore {manifest.namespace} -> {namespace}", manifest.rows) as advance:
        result = restore(ns_dir, store, progress=advance)
    if as_json:
        console.print_json(json.dumps(result.to_json()))
        return
    console.print(
        f"{result.rows:,} steps restored from {result.files} file(s) into {namespace!r}"
        + (f" ({result.replayed:,} were already there)" if result.replayed else "")
    )
    if result.expired:
        console.print(
            f"[yellow]{result.expired:,} step(s) did not fit: the namespace's capacity is "
            "smaller than the archive (restore into a new namespace)[/]"
        )
    for snap in result.snapshots:
        if snap.skipped:
            console.print(f"[yellow]snapshot {snap.name!r} not restored: {snap.skipped}[/]")
            continue
        console.print(
            f"snapshot {snap.name!r} restored: {snap.steps:,} steps with its labels"
            + (f" ({snap.missing:,} of its steps were not restored)" if snap.missing else ""),
            highlight=False,
        )


def export(
    r: redis.Redis, namespace: str, to: str, root: Path | None, console: Console, as_json: bool
) -> None:
    from orchestrator.adapters.minari import export_minari

    store = _existing(r, namespace)
    with _bar(console, f"export {namespace}", store.info()["steps"]) as advance:
        result = export_minari(store, to, root=root, progress=advance)
    if as_json:
        console.print_json(json.dumps(result.__dict__))
        return
    console.print(
        f"{result.episodes:,} episode(s), {result.steps:,} steps -> Minari dataset "
        f"{result.dataset_id!r} at {result.path}"
    )
    if result.skipped_episodes:
        console.print(
            f"[yellow]{result.skipped_episodes:,} incomplete episode(s) left out (a step "
            "missing, or no final next_obs: still running or partly evicted)[/]"
        )


def export_plain(namespace: str, archive: Path, to: Path, console: Console, as_json: bool) -> None:
    from orchestrator.maintenance.archive_files import namespace_dir
    from orchestrator.maintenance.plaincopy import plain_copy
    from orchestrator.maintenance.restore import ArchiveError, find_archive

    src = find_archive(archive)
    if src.name != namespace_dir(Path(), namespace).name:
        raise ArchiveError(f"{src} is not an archive of {namespace!r} (its ns=<name> differs)")
    result = plain_copy(src, to)
    if as_json:
        console.print_json(json.dumps(result.to_json()))
        return
    console.print(
        f"{len(result.files)} file(s), {result.rows:,} steps, {result.bytes / 2**20:,.1f} MiB, "
        f"compressed fields decoded -> {result.directory}"
    )


def import_dataset(
    r: redis.Redis,
    dataset: str,
    namespace: str,
    root: Path | None,
    console: Console,
    as_json: bool,
) -> None:
    from orchestrator.adapters.minari import import_minari

    store = Store(r, namespace)
    with _bar(console, f"import {dataset}", None) as advance:
        result = import_minari(dataset, store, root=root, progress=advance)
    if as_json:
        console.print_json(json.dumps(result.__dict__))
        return
    console.print(
        f"{result.episodes:,} episode(s), {result.steps:,} steps imported into {namespace!r} "
        "(tags.origin = offline)"
        + (f"; {result.replayed:,} were already there" if result.replayed else "")
    )
