"""How an argument check quotes a refused value: whole when short, its start when long."""

from __future__ import annotations

import pytest

from orchestrator.cli.app import clipped
from orchestrator.cli.steplog import parse_ids


def test_a_short_value_is_whole_and_a_long_one_its_start():
    assert clipped("x" * 60) == "x" * 60
    assert clipped("x" * 61) == "x" * 60 + "..."
    assert clipped("abcdef", limit=3) == "abc..."


def test_parse_ids_quotes_a_long_value_clipped():
    with pytest.raises(ValueError) as e:
        parse_ids("1,x" + "y" * 100_000)
    assert f"--ids {clipped('1,x' + 'y' * 100)!r}" in str(e.value)
    assert len(str(e.value)) < 200
