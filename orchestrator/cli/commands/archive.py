"""Commands that move steps out of Redis and back: archive, restore, Minari export/import."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.cli import archive_progress
from orchestrator.cli.app import app, friendly, redis_client


@app.command()
@friendly
def archive(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace to archive")],
    to: Annotated[Path, typer.Option("--to", help="Archive directory (ns=<name>/ goes in it)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Archive the steps not archived yet to Parquet (what the nightly task does).

    \b
    Examples:
      claw archive cartpole --to /data/claw-archive
    """
    with redis_client(ctx) as (_, r):
        archive_progress.archive(r, namespace, to, Console(), as_json)


@app.command(short_help="Bring archived steps back, bit-exact, with new ids, and their snapshots.")
@friendly
def restore(
    ctx: typer.Context,
    archive_dir: Annotated[Path, typer.Argument(help="Archive directory (or its ns=<name>/)")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Restore into this")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Bring archived steps back, bit-exact, with new ids (tags.orig_id holds the old),
    then the archive's snapshots, laid over the new ids.

    \b
    Examples:
      claw restore /data/claw-archive --namespace cartpole-restored
    """
    with redis_client(ctx) as (_, r):
        archive_progress.restore_archive(r, archive_dir, namespace, Console(), as_json)


_MinariRoot = Annotated[
    Path | None,
    typer.Option(
        "--minari-root",
        envvar="MINARI_DATASETS_PATH",
        show_default=False,
        help="Minari datasets directory (default ~/.minari/datasets)",
    ),
]


def _only_minari(fmt: str) -> None:
    if fmt != "minari":
        raise typer.BadParameter(
            f"format {fmt!r}: only 'minari' is supported", param_hint="--format"
        )


@app.command(
    short_help="Export a namespace's episodes as a Minari dataset, or its archive as Parquet."
)
@friendly
def export(
    ctx: typer.Context,
    namespace: Annotated[str, typer.Argument(help="Namespace to export")],
    to: Annotated[
        str,
        typer.Option(
            "--to", help="Minari dataset id (e.g. claw/grasp-v0), or a directory for parquet"
        ),
    ],
    fmt: Annotated[str, typer.Option("--format", help="'minari' or 'parquet'")] = "minari",
    archive_dir: Annotated[
        Path | None,
        typer.Option(
            "--archive", help="parquet: the namespace's archive (claw archive NS --to DIR)"
        ),
    ] = None,
    minari_root: _MinariRoot = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Export for other tools, compressed fields decoded: the namespace's complete episodes
    as a Minari dataset, or its archive as plain Parquet (--format parquet --archive DIR)."""
    if fmt == "parquet":
        if archive_dir is None:
            raise typer.BadParameter(
                "--format parquet copies the namespace's archive: give --archive DIR "
                "(`claw archive NS --to DIR` writes it)",
                param_hint="--archive",
            )
        archive_progress.export_plain(namespace, archive_dir, Path(to), Console(), as_json)
        return
    _only_minari(fmt)
    with redis_client(ctx) as (_, r):
        archive_progress.export(r, namespace, to, minari_root, Console(), as_json)


@app.command("import")
@friendly
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
    with redis_client(ctx) as (_, r):
        archive_progress.import_dataset(r, dataset, namespace, minari_root, Console(), as_json)
