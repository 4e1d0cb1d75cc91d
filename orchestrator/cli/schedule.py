"""`claw schedule`: the beat entries (claw_tasks/broker/schedule.py plus CLAW_SCHEDULE) with their
next run, as RedBeat keeps it in Redis once beat runs (estimated from now before that)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from redbeat.schedulers import RedBeatSchedulerEntry

from claw_tasks.broker.schedule import entries, when
from claw_tasks.store.batches import SCHEDULE_PREFIX

PREFIX = SCHEDULE_PREFIX  # redbeat_key_prefix in claw_tasks/broker/app.py


@dataclass(frozen=True)
class Entry:
    name: str
    task: str
    schedule: str  # "every 30s" or "cron 0 3 * * *"
    next_run: datetime
    scheduled: bool  # True: the next run is beat's own (in Redis), False: an estimate
    last_run: datetime | None
    runs: int

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "task": self.task,
            "schedule": self.schedule,
            "next_run": self.next_run.isoformat(),
            "scheduled": self.scheduled,
            "last_run": None if self.last_run is None else self.last_run.isoformat(),
            "runs": self.runs,
        }


def beat_entries(r: redis.Redis, now: datetime | None = None) -> list[Entry]:
    """Every configured entry, soonest first."""
    now = now or datetime.now(UTC)
    due = {k.decode(): v for k, v in r.zrange(PREFIX + ":schedule", 0, -1, withscores=True)}
    out = []
    for name, spec in entries().items():
        key = PREFIX + name
        meta = RedBeatSchedulerEntry.decode_meta(r.hget(key, "meta"))
        last = meta.get("last_run_at")
        if last is not None and last.tzinfo is None:
            last = last.replace(tzinfo=UTC)
        if last is not None and last.year < 2000:  # RedBeat's "never ran"
            last = None
        sched = when(spec)
        every = None if "cron" in spec else sched.run_every.total_seconds()  # type: ignore[union-attr]  # not cron: an interval schedule with run_every
        text = f"cron {spec['cron']}" if every is None else f"every {every:g}s"
        scheduled = key in due
        if scheduled and every is not None:
            at = due[key]
        else:  # RedBeat's score for a crontab is only a wake-up hint: ask the crontab
            at = (now + sched.remaining_estimate(last or now)).timestamp()
        step = 60 if every is None else 1  # cron fires on minute boundaries
        nxt = datetime.fromtimestamp(round(at / step) * step, UTC)  # estimates are ms early
        out.append(
            Entry(
                name, spec["task"], text, nxt, scheduled, last, int(meta.get("total_run_count", 0))
            )
        )
    return sorted(out, key=lambda e: e.next_run)
