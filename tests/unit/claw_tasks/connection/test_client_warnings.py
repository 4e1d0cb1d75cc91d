"""Importing the data store client warns of nothing under the pinned redis-py: routing
scripts by their keys on a cluster touches a policy table only where redis-py still
reads it (8.0), never the deprecated copy later releases serve with a warning."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import ROOT


def test_importing_the_client_raises_no_deprecation_warning() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::DeprecationWarning",
            "-c",
            "import claw_tasks.connection.client, claw_tasks.client, orchestrator",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
