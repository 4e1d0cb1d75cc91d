"""The version commands' argument checks, which run before anything is connected."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import orchestrator.cli.commands  # noqa: F401  (registers every command)
from orchestrator.cli.app import app


@pytest.mark.parametrize("option", ["--from", "--to"])
def test_a_long_lineage_entry_id_is_refused_without_echoing_it_whole(option):
    done = CliRunner().invoke(app, ["replay", "ns", option, "7" * 30 + "x" * 100_000])
    assert done.exit_code == 2
    assert f"{option}: a lineage entry id (ms-seq), not '777" in done.output
    assert len(done.output) < 2000
