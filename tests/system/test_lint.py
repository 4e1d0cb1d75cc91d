"""The code stays `ruff` clean: lint rules and formatting (pyproject.toml's [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import ROOT


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff_is_clean(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"ruff {' '.join(args)}:\n{done.stdout}{done.stderr}"
