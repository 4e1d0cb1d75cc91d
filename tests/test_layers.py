"""The packages of both halves import only downward — the orchestrator's stages and
claw_tasks' layers — and claw_tasks never imports the orchestrator: the tree shows the data
flow, and no cycle can form between packages."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import the ones before it, never the ones after.
LAYERS = [
    "transforms",
    "recipe",
    "sampling",
    "delivery",
    "maintenance",
    "adapters",
    "inspect",
    "web",
    "gateway",
    "cli",
]


def _imports(path: Path) -> set[str]:
    """Every module named by an import in ``path``, nested (lazy) imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "orchestrator":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "orchestrator"


def test_every_module_is_in_a_layer() -> None:
    loose = [p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside the stage packages: {loose}"


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_point_down(layer: str) -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for path in sorted((ROOT / "orchestrator" / layer).rglob("*.py")):
        for module in _imports(path):
            target = _layer(module)
            if target is None:
                continue
            if target == "orchestrator":  # the facade sits on top of everything
                bad.append(f"{path.relative_to(ROOT)} imports the top-level {module}")
            elif rank[target] > rank[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {module} (up: {target})")
    assert bad == []


def test_claw_tasks_never_imports_orchestrator() -> None:
    bad = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / "claw_tasks").rglob("*.py"))
        for module in _imports(path)
        if module.split(".")[0] == "orchestrator"
    ]
    assert bad == []


def test_public_imports() -> None:
    orchestrator = importlib.import_module("orchestrator")
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None
    from orchestrator import BatchClient, Recipe, sample  # noqa: F401
    from orchestrator.adapters.sb3 import ClawReplayBuffer  # noqa: F401
    from orchestrator.adapters.torch import ClawIterableDataset  # noqa: F401


# claw_tasks' layers, lowest first (claw_tasks/__init__.py describes each). ``client`` and
# ``worker`` are siblings: neither imports the other (the SDK must not build a worker app).
TASK_LAYERS = [
    "codecs",
    "settings",
    "durations",
    "format",
    "where",
    "connection",
    "store",
    "broker",
    "client",
    "worker",
]
ALIASES = {"app", "gym"}  # old import paths kept until 0.3; nothing in the repo uses them
SIBLINGS = {("worker", "client"), ("client", "worker")}


def _task_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "claw_tasks" or len(parts) == 1:
        return None
    return parts[1]


def test_claw_tasks_top_level_is_small() -> None:
    modules = sorted(p.stem for p in (ROOT / "claw_tasks").glob("*.py") if p.stem != "__init__")
    assert len(modules) <= 8, modules
    assert set(modules) <= set(TASK_LAYERS) | ALIASES, modules
    packages = sorted(p.parent.name for p in (ROOT / "claw_tasks").glob("*/__init__.py"))
    assert set(packages) <= set(TASK_LAYERS), packages
    for package in packages:  # each says what it holds and what it may import
        assert ast.get_docstring(
            ast.parse((ROOT / "claw_tasks" / package / "__init__.py").read_text())
        )


@pytest.mark.parametrize("layer", TASK_LAYERS)
def test_claw_tasks_imports_point_down(layer: str) -> None:
    rank = {name: i for i, name in enumerate(TASK_LAYERS)}
    base = ROOT / "claw_tasks"
    paths = (
        sorted((base / layer).rglob("*.py")) if (base / layer).is_dir() else [base / f"{layer}.py"]
    )
    bad = []
    for path in paths:
        for module in _imports(path):
            target = _task_layer(module)
            if target is None or target == layer:
                continue
            if target in ALIASES or target not in rank:
                bad.append(f"{path.relative_to(ROOT)} imports {module} (an alias or no layer)")
            elif rank[target] > rank[layer] or (layer, target) in SIBLINGS:
                bad.append(f"{path.relative_to(ROOT)} imports {module} (up: {target})")
    assert bad == []


def test_nothing_in_the_repo_uses_the_old_import_paths() -> None:
    bad = []
    for top in ("claw_tasks", "orchestrator", "tests", "bench", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.parent == ROOT / "claw_tasks" and path.stem in ALIASES:
                continue
            for module in _imports(path):
                if module in {f"claw_tasks.{a}" for a in ALIASES}:
                    bad.append(f"{path.relative_to(ROOT)}: {module}")
    assert bad == []


def test_the_client_sdk_builds_no_worker_app() -> None:
    import subprocess
    import sys

    code = (
        "import sys, claw_tasks.client, claw_tasks.client.gym\n"
        "loaded = [m for m in sys.modules if m.startswith('claw_tasks.worker')]\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    "module", ["claw_tasks.where", "claw_tasks.store.retention", "claw_tasks.store"]
)
def test_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """Whichever of the two is imported first, neither finds the other half-initialized."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
