"""The tests' own layout: every test module in unit/, stack/, system/ or soak/ (what it
needs decides which; soak/ runs Claw over simulated hosts), helpers in support/, unit/
mirroring the packages, and a package marker in every directory so two test modules may
share a name."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import ROOT

TESTS = ROOT / "tests"
KINDS = ("unit", "stack", "system", "soak")


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_flat_in_tests() -> None:
    flat = sorted(p.name for p in TESTS.glob("*.py"))
    assert flat == ["__init__.py", "conftest.py"], (
        f"move {sorted(set(flat) - {'__init__.py', 'conftest.py'})} into tests/unit/<package>/ "
        "(no services), tests/stack/ (Redis, workers, RabbitMQ), tests/system/ (browser, "
        "Compose, README, examples, demo, load) or tests/support/ (helpers)"
    )


def test_every_test_module_is_in_a_kind() -> None:
    tests = [p.relative_to(TESTS) for p in _python_files() if p.name.startswith("test_")]
    assert tests, "no test modules found"
    assert [str(p) for p in tests if p.parts[0] not in KINDS] == []


def test_every_directory_is_a_package() -> None:
    dirs = {p.parent for p in _python_files()}
    assert sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").exists()) == []


def test_unit_mirrors_the_packages() -> None:
    """tests/unit/claw_tasks/where/ holds the tests of claw_tasks/where/, and so on."""
    unit = TESTS / "unit"
    dirs = [d for d in unit.rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert dirs
    strays = [d.relative_to(unit) for d in dirs if not (ROOT / d.relative_to(unit)).is_dir()]
    assert [str(d) for d in strays] == []


def test_no_conftest_among_the_helpers() -> None:
    """pytest loads every ``conftest.py`` of the tree it collects, in every test process: a
    plugin among the helpers (one that swaps a library's classes, say) would act on the
    whole suite. A helper plugin is a module loaded with ``-p`` where it is meant to run."""
    found = sorted((TESTS / "support").rglob("conftest.py"))
    assert [str(p.relative_to(ROOT)) for p in found] == []
