"""Lua sources (store.scripts): included functions come before their callers."""

from __future__ import annotations

from claw_tasks.store.scripts import lua_source


def test_includes_come_first():
    src = lua_source("commit")
    assert src.index("local function slot_runs") < src.index("local function runs")
