"""The packages of both halves import only downward — the orchestrator's stages and
claw_tasks' layers — and claw_tasks never imports the orchestrator: the tree shows the data
flow, and no cycle can form between packages. Within them no two modules import each
other, and none uses another's ``_private`` names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.support.paths import ROOT

# Lowest first: a package may import the ones before it, never the ones after.
LAYERS = [
    "transforms",
    "recipe",
    "sampling",
    "retrieval",
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
SIBLINGS = {("worker", "client"), ("client", "worker")}


def _task_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "claw_tasks" or len(parts) == 1:
        return None
    return parts[1]


def test_claw_tasks_top_level_is_small() -> None:
    modules = sorted(p.stem for p in (ROOT / "claw_tasks").glob("*.py") if p.stem != "__init__")
    assert len(modules) <= 8, modules
    assert set(modules) <= set(TASK_LAYERS), modules
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
            if target not in rank:
                bad.append(f"{path.relative_to(ROOT)} imports {module} (no layer)")
            elif rank[target] > rank[layer] or (layer, target) in SIBLINGS:
                bad.append(f"{path.relative_to(ROOT)} imports {module} (up: {target})")
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


# ---- no cycles, no borrowed privates ----------------------------------------------------
PROJECT = ("claw_tasks", "orchestrator")
ALLOWED_CYCLES: list[set[str]] = []
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _modules(tops: tuple[str, ...]) -> dict[str, Path]:
    """Dotted name -> file of every module under ``tops`` (a package is its __init__)."""
    out = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(tree: ast.AST, package: str) -> tuple[set[str], dict[str, str]]:
    """Every dotted name an import in ``tree`` (a module of ``package``) names, nested and
    ``TYPE_CHECKING`` ones included, relative ones resolved; and local name -> the dotted
    name it binds."""
    names: set[str] = set()
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.name)
                local = alias.asname or alias.name.partition(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                names.add(f"{base}.{alias.name}")
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names, bound


def _parsed(module: str, path: Path) -> tuple[ast.AST, str]:
    """A module's syntax tree and the package its relative imports start from."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return ast.parse(path.read_text()), package


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from m import name`` counts as m, or as
    the submodule m.name when there is one; a package's own __init__ is not implied)."""
    modules = _modules(PROJECT)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in _imported(*_parsed(module, path))[0]}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [{"a", "b", "c"}]


def test_no_import_cycle_between_modules() -> None:
    """No two modules of claw_tasks/ or orchestrator/ import each other, directly or round
    a loop, by any import (lazy and ``TYPE_CHECKING`` ones too): what a module needs sits
    below it, so it can be read, tested and imported first on its own."""
    cycles = _cycles(_import_graph())
    unexpected = [sorted(c) for c in cycles if c not in ALLOWED_CYCLES]
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in cycles]
    assert unexpected == [], f"import cycles: {unexpected}"
    assert stale == [], f"no longer cycles: remove them from ALLOWED_CYCLES: {stale}"


OURS = ("claw_tasks", "orchestrator", "bench", "examples", "tests")


def _private_uses(tree: ast.AST, package: str) -> set[str]:
    """Dotted names of the ``_private`` names of our modules that ``tree`` uses: imported
    (``from m import _x``) or reached through an imported module or name (``m._x``,
    ``SomeClass._y``)."""
    names, bindings = _imported(tree, package)
    found = {n for n in names if n.split(".")[0] in OURS and _is_private(n.rpartition(".")[2])}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bindings:
            dotted = bindings[value.id]
            if dotted.split(".")[0] in OURS:
                found.add(".".join([dotted, *reversed(chain)]))
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_private_finder_finds_borrowed_privates() -> None:
    source = """
from claw_tasks.x import _a, b
from . import _z
import orchestrator.y as y
import claw_tasks.w
import os
y._c, b._d, b.e._f, claw_tasks.w._g, os._exit, self._h, b.public, __name__
"""
    found = _private_uses(ast.parse(source), "orchestrator.m")
    assert found == {
        "claw_tasks.x._a",
        "orchestrator.m._z",
        "orchestrator.y._c",
        "claw_tasks.x.b._d",
        "claw_tasks.x.b.e._f",
        "claw_tasks.w._g",
    }


def test_no_private_name_is_used_across_modules() -> None:
    """What another module needs is public and documented: a ``_name`` is free to change
    without reading the rest of the tree. Tests are exempt."""
    found = {
        (str(path.relative_to(ROOT)), name)
        for module, path in _modules(("claw_tasks", "orchestrator", "bench", "examples")).items()
        for name in _private_uses(*_parsed(module, path))
    }
    assert sorted(found - ALLOWED_PRIVATE) == []
    stale = sorted(ALLOWED_PRIVATE - found)
    assert stale == [], f"no longer used: remove them from ALLOWED_PRIVATE: {stale}"


# ---- the store's layout stays in the store ----------------------------------------------

# Everything but the store itself: the orchestrator, the rest of claw_tasks, benches and
# examples (tests may build keys to check what the store wrote).
OUTSIDE_THE_STORE = ("orchestrator", "claw_tasks", "bench", "examples")
LAYOUT_MODULE = "claw_tasks.store.layout"
KEY_BUILDER = "layout_keys"  # StoreCore's attribute: a name nothing else uses


def _top_level_names(module: str) -> dict[str, ast.AST]:
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id: node for t in targets if isinstance(t, ast.Name)}
    return {n: node for n, node in names.items() if not n.startswith("_")}


def _spells_a_key(node: ast.AST) -> bool:
    return any(
        isinstance(c, ast.Constant) and isinstance(c.value, str) and _is_key(c.value)
        for c in ast.walk(node)
    )


def _is_key(text: str) -> bool:
    return text.startswith(("claw:", "{claw:"))


def _layout_names() -> set[str]:
    """What only the store may name: ``Keys``, the layout's constants and helpers (what
    ``claw_tasks.store`` exports of the layout, e.g. ``meta_spans``, is its API), and the
    config record's key builders (``dropped_key``) with their TTLs."""
    exported = set(importlib.import_module("claw_tasks.store").__all__)
    layout = set(_top_level_names(LAYOUT_MODULE)) - exported
    config = _top_level_names("claw_tasks.store.config")
    builders = {n for n, node in config.items() if isinstance(node, ast.FunctionDef)}
    builders = {n for n in builders if _spells_a_key(config[n])}
    return layout | builders | {n for n in config if n.endswith("_TTL") and "DROPPED" in n}


def _key_builders() -> set[str]:
    from claw_tasks.store.layout import Keys

    return {name for name in vars(Keys) if not name.startswith("_")} | {"base", "ns"}


def _store_names() -> set[str]:
    """The first part of every namespace-level key the store names (``config``, ``done``,
    ...): an ``owned_key`` of one of them would reach the store's data."""
    import inspect

    from claw_tasks.store.layout import Keys

    keys, names = Keys("n"), set()
    for name, member in vars(Keys).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            key = getattr(keys, name)
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters.values())[1:]
            args = [0 if p.annotation in (int, "int") else "x" for p in params]
            key = getattr(keys, name)(*args)
        else:
            continue
        if isinstance(key, str) and key.startswith(keys.base):
            names.add(key[len(keys.base) :].split(":")[0])
    return names


def _imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _layout_uses(
    tree: ast.AST, layout_names: set[str], builders: set[str], store_names: set[str]
) -> list[tuple[int, str]]:
    """(line, what) wherever ``tree`` imports the store's layout (in any form), names one of
    ``layout_names``, reaches a store's key builder (``.layout_keys`` by attribute or by
    ``getattr``, or a key builder on any ``.keys``), asks ``owned_key`` for a store name or
    the bare prefix, or spells a store key (a ``str`` starting ``claw:``, docstrings aside;
    f-strings and concatenations included)."""
    found: list[tuple[int, str]] = []
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        for name in _imported_names(node):
            last = name.rpartition(".")[2]
            if name == LAYOUT_MODULE or name.startswith(LAYOUT_MODULE + "."):
                found.append((line, f"imports {LAYOUT_MODULE}"))
            elif name.startswith("claw_tasks.store.") and last in layout_names:
                found.append((line, f"imports {name}"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            if _is_key(node.value):
                found.append((line, f"spells a store key ({node.value!r})"))
            elif node.value == KEY_BUILDER or node.value.startswith(LAYOUT_MODULE):
                found.append((line, f"names {node.value}"))
        elif isinstance(node, ast.Name) and node.id in layout_names:
            found.append((line, f"names {node.id}"))
        elif isinstance(node, ast.Attribute):
            if node.attr in layout_names or node.attr == KEY_BUILDER:
                found.append((line, f"names {node.attr}"))
            elif node.attr in builders and _is_keys(node.value):
                found.append((line, f"builds a key (.keys.{node.attr})"))
        elif isinstance(node, ast.Call):
            found += [(line, what) for what in _call_uses(node, builders, store_names)]
        elif isinstance(node, ast.Subscript) and _is_owned_key(node.value):
            found.append((line, "cuts an owned_key"))
    return found


def _is_keys(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in ("keys", KEY_BUILDER)


def _is_owned_key(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "owned_key") or (
        isinstance(func, ast.Attribute) and func.attr == "owned_key"
    )


def _call_uses(node: ast.Call, builders: set[str], store_names: set[str]) -> list[str]:
    """``getattr(x.keys, "meta")``; ``owned_key("")`` or ``owned_key("config")``."""
    func = node.func
    if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
        target, name = node.args[0], node.args[1]
        if _is_keys(target) or (isinstance(name, ast.Constant) and name.value == "keys"):
            return ["reaches a key builder by getattr"]
        return []
    if _is_owned_key(node) and node.args:
        name = node.args[-1]
        value = name.value if isinstance(name, ast.Constant) else None
        if isinstance(value, str) and value.split(":")[0] in store_names | {""}:
            return [f"asks owned_key for a store name ({value!r})"]
    return []


def test_the_layout_finder_finds_layout_uses() -> None:
    source = """
from claw_tasks.store.layout import META_CHUNK_SLOTS
import claw_tasks.store.layout
store.layout_keys.meta(0, "id", 0)
k = self.store.layout_keys
n = SPARSE_CHUNK_SLOTS
Keys("ns")
f"claw:{{{ns}}}:config"
from claw_tasks.store import layout
ks = st.layout_keys; ks.shard_key(0, "seq")
Store(r, ns).layout_keys.meta(0, "id", 0)
"claw:" + "{" + ns + "}:config"
store.owned_key("config")
store.owned_key("")[:-2] + ":0}:seq"
getattr(store.layout_keys, "meta")
from claw_tasks.store.config import dropped_key
r.set(dropped_key(ns), 1)
getattr(store, "layout_keys")
store.keys.meta(0, "id", 0)
owned_key(ns, "done:b1")
REJECTS = "{claw:rejects}:outcomes"
importlib.import_module("claw_tasks.store.layout")
store.owned_key("prio")
d.keys()
where.keys
"The store's keys start with claw:"
"""
    uses = _layout_uses(ast.parse(source), _layout_names(), _key_builders(), _store_names())
    lines = sorted({line for line, _ in uses})
    assert lines == list(range(2, 23)), uses


def test_only_the_store_knows_its_layout() -> None:
    """No module outside the store builds a store key, reads a layout constant or reaches
    a store's key names: it asks the store (``claw_tasks.store``) for what it needs, so a
    layout change touches one package."""
    layout_names = _layout_names()
    assert {"Keys", "META_CHUNK_SLOTS", "SPARSE_CHUNK_SLOTS", "payload_chunk_slots"} <= (
        layout_names
    )
    assert "dropped_key" in layout_names
    assert {"config", "dead", "done", "dict", "rdict", "dpend"} <= _store_names()
    store = ROOT / "claw_tasks" / "store"
    found = set()
    for top in OUTSIDE_THE_STORE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if store in path.parents:
                continue
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text())
            uses = _layout_uses(tree, layout_names, _key_builders(), _store_names())
            found |= {(rel, what) for _, what in uses}
    assert sorted(found) == []
