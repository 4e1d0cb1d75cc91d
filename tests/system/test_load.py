"""The load run (bench/load.py): 4 producer processes and 2 trainers against real workers;
every produced step committed exactly once. 30 s here; ``-m slow`` runs the 10 minutes
whose numbers docs/reliability.md reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT


def _load_run(duration: int, tmp_path: Path) -> dict:
    report = tmp_path / "load.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "load.py"),
            "--duration",
            str(duration),
            "--json",
            str(report),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=duration + 900,
    )
    assert report.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


def _check(report: dict) -> None:
    assert report["errors"] == []
    assert report["produced_steps"] > 0 and report["pops"] > 0
    assert len(report["redis_used_memory_mb"]) > 0


def test_load_30s_every_step_committed_once(tmp_path):
    _check(_load_run(30, tmp_path))


@pytest.mark.slow
def test_load_10min_every_step_committed_once(tmp_path):
    _check(_load_run(600, tmp_path))
