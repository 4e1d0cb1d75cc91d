"""The public modules type-check: mypy over pyproject.toml's [tool.mypy] files (what the
guide imports and the modules defining it) finds nothing, and both packages ship
``py.typed`` so that users' type checkers read these hints. A cold run (the cache is kept
in the temporary directory) takes ~6 s of CPU (a minute of wall time on a loaded 2-core
machine); a warm one ~1 s."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.paths import ROOT


def test_public_modules_type_check() -> None:
    cache = Path(tempfile.gettempdir()) / "claw-mypy-cache"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_both_packages_are_typed() -> None:
    assert (ROOT / "claw_tasks" / "py.typed").exists()
    assert (ROOT / "orchestrator" / "py.typed").exists()


IGNORE = re.compile(r"# type: ignore(\[[a-z, -]+\]  # \S.*)?$")


def _unexplained(line: str) -> bool:
    if "# type: ignore" not in line:
        return False
    m = IGNORE.search(line)
    return m is None or m.group(1) is None


def test_type_ignores_give_their_code_and_reason() -> None:
    """A ``# type: ignore`` names the error it silences (``[code]``, so any other error on
    that line is still reported) and says why: ``# type: ignore[code]  # reason``."""
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("claw_tasks", "orchestrator")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _unexplained(line)
    ]
    assert not bare, bare
