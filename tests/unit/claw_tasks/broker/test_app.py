"""The worker app imports exactly the modules that define a task: the read path's are
named by string (claw_tasks never imports orchestrator), so this is what shows a task
module missing from the list."""

from __future__ import annotations

import ast
from pathlib import Path

from claw_tasks.broker.app import READ_PATH_TASKS, WRITE_PATH_TASKS
from tests.support.paths import ROOT


def _defines_a_task(path: Path) -> bool:
    """Whether ``path`` has a function decorated with ``@app.task(...)``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                call = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(call, ast.Attribute) and call.attr == "task":
                    return True
    return False


def _task_modules(package: str) -> set[str]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / package).rglob("*.py"))
        if _defines_a_task(path)
    }


def test_the_worker_imports_every_read_path_task_module() -> None:
    assert set(READ_PATH_TASKS) == _task_modules("orchestrator")


def test_the_worker_imports_every_write_path_task_module() -> None:
    assert set(WRITE_PATH_TASKS) == _task_modules("claw_tasks")
