"""The orchestrator's subpackages import only downward, and claw_tasks never imports the
orchestrator: the tree shows the data flow, and no cycle can form."""

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


def test_the_where_language_never_imports_the_store() -> None:
    """The store's settings (retention's protect filters) use the where language, so the
    where language, and the leaf modules both read (durations, step metadata), must not
    import the store package: that was an import cycle, worked around by a lazy import."""
    paths = [*(ROOT / "claw_tasks" / "where").glob("*.py")]
    paths += [ROOT / "claw_tasks" / "durations.py", ROOT / "claw_tasks" / "stepmeta.py"]
    bad = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted(paths)
        for module in _imports(path)
        if module == "claw_tasks.store" or module.startswith("claw_tasks.store.")
    ]
    assert bad == []


@pytest.mark.parametrize(
    "module", ["claw_tasks.where", "claw_tasks.store.retention", "claw_tasks.store"]
)
def test_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """Whichever of the two is imported first, neither finds the other half-initialized."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
