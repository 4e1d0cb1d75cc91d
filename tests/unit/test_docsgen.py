"""The site's generated reference (tools/docsgen.py) holds everything its source has:
every recipe key (and each sampler kind's), every beat entry, every `claw` command and
every setting. The metrics page needs a redis-server: tests/system/test_readme.py checks
it against what /metrics serves."""

from __future__ import annotations

from claw_tasks.broker.schedule import DEFAULTS
from claw_tasks.settings.table import VARIABLES
from orchestrator.recipe.model import Recipe
from orchestrator.recipe.sources import SAMPLER_KINDS
from tools import docsgen


def test_recipe_keys_name_every_key() -> None:
    page = docsgen.recipe_keys_page()
    keys = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    assert set(Recipe.model_fields) <= keys
    assert {"sources[].where", "sources[].sampler.alpha", "prefetch.depth"} <= keys
    for kind, spec in SAMPLER_KINDS.items():
        for name in set(spec.model_fields) - {"kind"}:
            assert f"sources[].sampler.{name}" in keys, (kind, name)


def test_schedule_lists_every_entry() -> None:
    page = docsgen.schedule_page()
    for name, entry in DEFAULTS.items():
        assert f"| `{name}` | `{entry['task']}` |" in page


def test_cli_page_has_every_command() -> None:
    page = docsgen.cli_page()
    for name in docsgen.cli_commands():
        assert f"\n## claw {name}\n" in page
        assert f"Usage: claw {name}" in page


def test_settings_page_has_every_variable() -> None:
    page = docsgen.settings_page()
    for variable in VARIABLES:
        assert f"| `{variable.name}` |" in page


def test_every_generated_page_is_in_the_nav() -> None:
    nav = (docsgen.ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    for path in docsgen.PAGES:
        assert f": {path}" in nav, path
