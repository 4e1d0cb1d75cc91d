"""The beat schedule (broker.schedule): defaults, and overrides from CLAW_SCHEDULE."""

from __future__ import annotations

import pytest

from claw_tasks.broker.schedule import ScheduleError, beat_schedule, entries


def test_schedule_defaults_and_overrides():
    names = entries("")
    assert names["claw-archive"] == {"task": "claw.maintenance.archive", "cron": "0 3 * * *"}
    assert names["claw-evict"]["every"] == 30
    sched = beat_schedule('{"claw-archive": {"cron": "30 1 * * *"}, "claw-refill": null}')
    assert "claw-refill" not in sched
    assert sched["claw-archive"]["schedule"].hour == {1} and sched["claw-archive"]["task"]
    with pytest.raises(ScheduleError, match="is new: give its task"):
        entries("{mine: {every: 5}}")
    with pytest.raises(ScheduleError, match="every 'soon'"):
        beat_schedule("{claw-evict: {every: soon}}")
