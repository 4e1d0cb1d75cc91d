"""The documentation speaks of the software as it is: no issue numbers, session numbers
or diaries of how a figure moved in the product's text, and every test, benchmark, example or module
path the README and the docs name exists."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import ROOT

HISTORY = re.compile(r"\b([Ii]ssue|[Ss]ession|[Ff]inding) [0-9]+|Before" r"/after")
PRODUCT = ("README.md", "docs", "claw_tasks", "orchestrator", "tests", "tools", "bench")
SUFFIXES = (".md", ".py", ".lua", ".html", ".yml", ".yaml", ".toml")

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# A repository path in backticks or a link: tests/..., bench/..., examples/... (a file,
# optionally with ::test), or a directory ending in /.
PATH = re.compile(r"(?<![\w/.-])((?:tests|bench|examples|ops)/[\w./-]*\w/?)(?:::(\w+))?")
# A dotted module path of Claw's packages, optionally ending in an attribute.
DOTTED = re.compile(r"(?<![\w./-])((?:claw_tasks|orchestrator)(?:\.\w+)+)")


def _product_files() -> list[Path]:
    files: list[Path] = []
    for name in PRODUCT:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        else:
            files += [
                p for p in path.rglob("*") if p.suffix in SUFFIXES and "__pycache__" not in p.parts
            ]
    return sorted(files)


def test_the_history_check_finds_history() -> None:
    # Built from parts: the controls must not themselves be what the scan refuses.
    number, pair = " 3", "Before" + "/after"
    assert HISTORY.search("as measured in session" + number)
    assert HISTORY.search("Issue" + number + "'s goals")
    assert HISTORY.search("## " + pair)
    assert HISTORY.search("Finding 9: the lock used to stay held")
    assert not HISTORY.search("a session key per trajectory; issue the token")


def test_no_issue_numbers_sessions_or_diaries() -> None:
    this = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _product_files()
        if path.resolve() != this
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, "state the decision and its reason instead:\n" + "\n".join(found)


@cache
def _defines(module: Path) -> frozenset[str]:
    """Top-level names a module defines or imports (a package: its __init__)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If):  # TYPE_CHECKING imports, lazily exported names
            names |= {
                (a.asname or a.name)
                for n in ast.walk(node)
                if isinstance(n, ast.ImportFrom)
                for a in n.names
            }
    if "__getattr__" in names:  # lazy exports: every name in __all__
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names |= set(ast.literal_eval(node.value))
    return frozenset(names)


def resolve_dotted(dotted: str) -> str | None:
    """None if `dotted` names a module of the tree, or a module and a name it defines
    (one level, or a class and its attribute); else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            rest = parts[i:]
            if not rest:
                return None
            if rest[0] in _defines(module) or (base.is_dir() and (base / rest[0]).exists()):
                return None
            return f"{'.'.join(parts[:i])} has no {rest[0]!r}"
    return "no such module"


def test_the_dotted_check_resolves() -> None:
    assert resolve_dotted("orchestrator.sample") is None
    assert resolve_dotted("orchestrator.BatchClient") is None
    assert resolve_dotted("claw_tasks.client.gym.RecordSteps") is None
    assert resolve_dotted("claw_tasks.client.Ingestor.episode") is None
    assert resolve_dotted("orchestrator.delivery.batch.MAX_BATCH_ID") is not None
    assert resolve_dotted("orchestrator.nowhere") is not None


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, int, re.Match[str]]]:
    return [
        (doc.relative_to(ROOT).as_posix(), n, m)
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for m in pattern.finditer(line)
    ]


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc, n, m in _mentions(PATH):
        path, test = m.group(1).rstrip("."), m.group(2)
        if "*" in path or "<" in path:
            continue
        target = ROOT / path
        if not target.exists():
            missing.append(f"{doc}:{n}: {path}")
        elif test and f"def {test}(" not in target.read_text():
            missing.append(f"{doc}:{n}: {path}::{test}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", [d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_module_path_the_docs_name_exists(doc: str) -> None:
    """Celery task names (`claw_tasks.ingest`) are names, not modules: the broker's routes
    declare them."""
    text = (ROOT / doc).read_text()
    routes = (ROOT / "claw_tasks" / "broker" / "app.py").read_text()
    missing = {
        f"{m.group(1)}: {why}"
        for m in DOTTED.finditer(text)
        if f'"{m.group(1)}"' not in routes
        and (why := resolve_dotted(m.group(1).rstrip("."))) is not None
    }
    assert not missing, "\n".join(sorted(missing))


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs make it (lowercase, punctuation dropped,
    spaces to hyphens)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", text)


def test_the_readme_links_resolve() -> None:
    """The README is read on GitHub, outside the site's strict build: its links to files
    and their headings are checked here."""
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://", "#")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, broken


LIST_ITEM = re.compile(r"^\s*([-*+] |\d+[.)] )")
LONGEST = 2000  # characters of one paragraph or list item: about 25 lines of 80


def test_no_paragraph_is_a_wall() -> None:
    """Every paragraph and list item of the README and the docs reads in one go: split
    a longer one into paragraphs or sections (tables and code blocks are exempt)."""
    walls = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for block in re.split(r"\n\s*\n", text):
            lines = block.strip("\n").split("\n")
            if lines[0].startswith(("|", "#", "<", "!")):
                continue
            items: list[list[str]] = [[]]
            for line in lines:
                if LIST_ITEM.match(line) and items[-1]:
                    items.append([])
                items[-1].append(line)
            walls += [
                f"{doc.relative_to(ROOT)}: {len(chars)} characters from {item[0][:60]!r}"
                for item in items
                if len(chars := "\n".join(item)) > LONGEST
            ]
    assert not walls, "\n".join(walls)
