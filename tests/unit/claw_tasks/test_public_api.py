"""The public import paths: what the guide imports, shallow (``claw_tasks.client``,
``orchestrator``), each name in its module's ``__all__`` and the same object as where it
is defined; the version ``claw version`` prints is the package's."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib

import pytest

import claw_tasks
from tests.support.paths import ROOT

SHALLOW = {
    "claw_tasks.client": {
        "Ingestor": "claw_tasks.client.ingestor",
        "Episode": "claw_tasks.client.episode",
        "Schema": "claw_tasks.format.schema",
        "FieldSpec": "claw_tasks.format.schema",
        "RecordSteps": "claw_tasks.client.gym",
        "RecordParallelSteps": "claw_tasks.client.pettingzoo",
    },
    "orchestrator": {
        "BatchClient": "orchestrator.delivery.client",
        "Recipe": "orchestrator.recipe.model",
        "sample": "orchestrator.sampling.sample",
        "nearest": "orchestrator.retrieval.query",
        "define_index": "orchestrator.retrieval.storage",
        "update_indexes": "orchestrator.maintenance.vectors",
        "define_source": "orchestrator.maintenance.cleaning",
    },
}


@pytest.mark.parametrize("module", sorted(SHALLOW))
def test_shallow_names_are_the_defined_objects(module: str) -> None:
    if module == "claw_tasks.client":
        pytest.importorskip("pettingzoo")
    mod = importlib.import_module(module)
    for name, home in SHALLOW[module].items():
        assert name in mod.__all__, (module, name)
        assert getattr(mod, name) is getattr(importlib.import_module(home), name), name
    for name in mod.__all__:
        assert getattr(mod, name) is not None


def test_importing_orchestrator_builds_no_celery_app() -> None:
    code = (
        "import sys, orchestrator; "
        "assert not [m for m in sys.modules if m.startswith(('celery', 'faiss'))]"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_version_is_one_number() -> None:
    """pyproject.toml reads it from ``claw_tasks.__version__``; ``claw version`` prints it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "claw_tasks.__version__"}
    assert claw_tasks.__version__ == "0.2.0"
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    out = CliRunner().invoke(app, ["version"]).output
    assert out.startswith(f"claw {claw_tasks.__version__} ("), out


PUBLIC = [
    "claw_tasks",
    "claw_tasks.client",
    "claw_tasks.client.gym",
    "claw_tasks.format.schema",
    "claw_tasks.store",
    "claw_tasks.settings",
    "claw_tasks.where",
    "claw_tasks.codecs",
    "orchestrator",
    "orchestrator.recipe",
    "orchestrator.sampling.batch",
    "orchestrator.sampling.sample",
    "orchestrator.delivery.client",
    "orchestrator.retrieval",
    "orchestrator.adapters.options",
]


@pytest.mark.parametrize("module", PUBLIC)
def test_public_modules_say_what_they_export(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__all__, module
    assert [n for n in mod.__all__ if not hasattr(mod, n)] == []
