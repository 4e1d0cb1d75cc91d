"""The documentation site's generated pages, and the MkDocs hook that adds them to a build.

Where the code is the source, the reference is generated from it, so it cannot drift:
every ``CLAW_*`` setting from ``claw_tasks.settings``, every ``claw`` command's help from
the Typer app, every metric from the Prometheus exporter (one scrape of an empty embedded
Redis, which yields every family), every recipe key from the pydantic model, and the
changelog from ``CHANGELOG.md``. ``mkdocs.yml`` names this file as a hook; the pages exist
only in the build (``on_files``), never in ``docs/``. ``python -m tools.docsgen DIR`` writes
them to ``DIR`` to read them without a build.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # mkdocs loads this file by path: import the tree it sits in
    sys.path.insert(0, str(ROOT))

COLUMNS = 80


def settings_page() -> str:
    from claw_tasks.settings import markdown_table

    return (
        "# Settings\n\n"
        "Every process reads the `CLAW_*` variables once, through one typed `Settings`\n"
        "(`claw_tasks/settings/`, where each is declared with its type, default and\n"
        "meaning); `claw --redis-url URL` stands for `CLAW_REDIS_URL`. This table is\n"
        "generated from those declarations.\n\n"
        "**Which broker a client uses** (an `Ingestor`, a `BatchClient`, the adapters,\n"
        "`claw gateway`, `claw web`, `claw metrics`, `claw up`): the `broker_url` it is given,\n"
        "else `CLAW_BROKER_URL` when that is set, whatever store the client writes to (the\n"
        "broker is where the workers listen: the Compose file puts it on Redis db 1, or\n"
        "RabbitMQ), else the store's own server. A Redis Cluster cannot be a broker, so with a\n"
        "cluster store `CLAW_BROKER_URL` is required.\n\n"
        f"{markdown_table()}\n"
        "`FLOWER_BASIC_AUTH` (`user:password`, Flower's own variable) guards Flower; Compose\n"
        "requires it.\n"
    )


def cli_commands() -> list[str]:
    """The `claw` commands, in the order the app registers them."""
    import typer

    import orchestrator.cli.commands  # noqa: F401  (registers every command)
    from orchestrator.cli.app import app

    group = typer.main.get_command(app)
    return list(getattr(group, "commands", {}))


def cli_help(*args: str) -> str:
    """`claw ARGS --help` as an 80-column terminal shows it."""
    from typer.testing import CliRunner

    from orchestrator.cli.app import app

    result = CliRunner().invoke(app, [*args, "--help"], prog_name="claw", terminal_width=COLUMNS)
    if result.exit_code != 0:
        raise RuntimeError(f"claw {' '.join(args)} --help failed: {result.output}")
    return result.output


def cli_page() -> str:
    parts = [
        "# Command line\n\n"
        "Every `claw` command's `--help`, generated from the Typer app. The options before\n"
        "the command (`claw --redis-url URL COMMAND`) apply to every command.\n\n"
        f"```text\n{cli_help()}```\n"
    ]
    for name in cli_commands():
        parts.append(f"## claw {name}\n\n```text\n{cli_help(name)}```\n")
    return "\n".join(parts)


def metric_families() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(exposed name, type, labels, help) of every family the exporter serves, from one
    scrape of a fresh embedded Redis (store and broker): the exporter yields each family
    whether or not it has samples."""
    from claw_tasks.connection.server import RedisServer
    from orchestrator.cli.exporter import ClawCollector

    with RedisServer() as server:
        families = list(ClawCollector(server.url, server.url).collect())
    out = []
    for f in families:
        name = f"{f.name}_total" if f.type == "counter" else f.name
        # prometheus_client keeps a family's declared labels only as `_labelnames`
        labels = tuple(getattr(f, "_labelnames", ()))
        if not labels:  # a family built without labelnames: its samples carry them
            labels = tuple(dict.fromkeys(k for s in f.samples for k in s.labels if k != "le"))
        out.append((name, f.type, labels, f.documentation))
    return out


def metrics_page() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, doc in metric_families():
        label_text = ", ".join(f"`{x}`" for x in labels) or "-"
        rows.append(f"| `{name}` | {kind} | {label_text} | {doc.replace('|', '/')} |")
    return (
        "# Metrics\n\n"
        "What `claw metrics` (and `claw up`'s endpoint on :9808) serves, computed from the\n"
        "store on each scrape; generated from the exporter. How to scrape and alert on them:\n"
        "[Monitoring](../operations/monitoring.md).\n\n" + "\n".join(rows) + "\n"
    )


def _type_name(annotation: Any) -> str:
    """A recipe field's type as a reader writes it in YAML."""
    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(names)) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return " or ".join(f"`{a!r}`" if isinstance(a, str) else str(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly, optionally or as a list), if any."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def recipe_keys(
    model: type[BaseModel] | None = None, prefix: str = ""
) -> Iterator[tuple[str, str, str]]:
    """(dotted key, type, default) of every recipe key, nested sections depth first."""
    from orchestrator.recipe.model import Recipe

    model = model or Recipe
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        ann = field.annotation
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True, validated_data={})
            value = value.model_dump() if hasattr(value, "model_dump") else value
            default = f"`{value!r}`"
        yield key, _type_name(ann), default
        nested = _nested_model(ann)
        if nested is not None and nested is not model:
            list_of = typing.get_origin(ann) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(ann)
            )
            yield from recipe_keys(nested, f"{key}[]." if list_of else f"{key}.")
            yield from _kind_keys(nested, f"{key}[]." if list_of else f"{key}.")


def _kind_keys(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str]]:
    """A section whose keys depend on its `kind` (a source's sampler): each kind's own keys,
    from the registry of kinds."""
    import orchestrator  # noqa: F401  (registers the sampler kinds)
    from orchestrator.recipe.sources import SAMPLER_KINDS, SamplerSpec

    if model is not SamplerSpec:
        return
    for kind, spec in SAMPLER_KINDS.items():
        for key, kind_type, default in recipe_keys(spec, prefix):
            if key != f"{prefix}kind":
                yield key, f"{kind_type} (kind `{kind}`)", default


def recipe_keys_page() -> str:
    rows = ["| key | type | default |", "|---|---|---|"]
    rows += [
        f"| `{k}` | {t.replace('|', '/')} | {d.replace('|', '/')} |" for k, t, d in recipe_keys()
    ]
    return (
        "# Recipe keys\n\n"
        "Every key a recipe accepts, with its type and default, generated from the recipe\n"
        "model (`orchestrator.recipe`). What each one does, with examples:\n"
        "[Recipes](../recipes.md). A key not in this table is refused.\n\n" + "\n".join(rows) + "\n"
    )


def schedule_page() -> str:
    from claw_tasks.broker.schedule import DEFAULTS

    rows = ["| entry | task | runs |", "|---|---|---|"]
    for name, entry in DEFAULTS.items():
        when = f"every {entry['every']} s" if "every" in entry else f"cron `{entry['cron']}` (UTC)"
        rows.append(f"| `{name}` | `{entry['task']}` | {when} |")
    return (
        "# Maintenance schedule\n\n"
        "What beat (RedBeat) runs, generated from `claw_tasks.broker.schedule`; `claw schedule`\n"
        "shows each entry's next run. `CLAW_SCHEDULE` overrides an entry's period, adds an\n"
        "entry (with its `task`) or removes one (`null`), e.g.\n"
        '`{claw-evict: {every: 10s}, claw-archive: {cron: "30 1 * * *"}}`.\n\n'
        + "\n".join(rows)
        + "\n"
    )


def changelog_page() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
    "reference/recipe-keys.md": recipe_keys_page,
    "reference/schedule.md": schedule_page,
    "changelog.md": changelog_page,
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs hook: add the generated pages to the build."""
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else ROOT / "tmp" / "docsgen"  # tmp/ is git-ignored
    for path, make in PAGES.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(make())
        print(target)


if __name__ == "__main__":
    main(sys.argv[1:])
