"""The beat schedule: defined here only, overridable per deployment.

``CLAW_SCHEDULE`` is a YAML file's path, or YAML/JSON text (starting with ``{``), mapping
entry names to ``{every: <seconds or 30s/5m/...>}`` or ``{cron: "m h dom mon dow"}``
(UTC), optionally with ``task`` (a new entry needs one) and ``queue``; ``null`` removes an
entry. For example, archival at 01:30 and eviction every 10 s::

    claw-archive: {cron: "30 1 * * *"}
    claw-evict: {every: 10s}

Beat runs RedBeat (its entries and lock live in Redis under ``claw:redbeat:``; the lock
keeps one beat active however many are started). The refill entry is a safety net only:
pops ask for fills when a queue runs low, so it runs every 15 s, not every second.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from celery.schedules import crontab, schedule

from claw_tasks.durations import DurationError, parse_duration
from claw_tasks.settings import get_settings

DEFAULTS: dict[str, dict[str, Any]] = {
    "claw-refill": {"task": "claw.maintenance.refill", "every": 15},
    "claw-evict": {"task": "claw.maintenance.evict", "every": 30},
    "claw-priorities": {"task": "claw.maintenance.priorities", "every": 60},
    "claw-quality": {"task": "claw.maintenance.quality", "every": 30},
    "claw-lineage": {"task": "claw.maintenance.lineage", "every": 30},
    "claw-archive": {"task": "claw.maintenance.archive", "cron": "0 3 * * *"},
    "claw-vectors": {"task": "claw.maintenance.vectors", "every": 10},
    "claw-clean": {"task": "claw.maintenance.clean", "every": 10},
}


class ScheduleError(ValueError):
    """A schedule override that cannot be used; the message names the entry."""


def overrides(text: str | None = None) -> dict[str, Any]:
    """The deployment's overrides: ``text`` in ``CLAW_SCHEDULE``'s form, default that
    setting's (empty: none)."""
    text = (get_settings().schedule if text is None else text).strip()
    if not text:
        return {}
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ScheduleError(f"CLAW_SCHEDULE={text!r}: no such file (a YAML mapping)")
        text = path.read_text()
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise ScheduleError("CLAW_SCHEDULE: expected a mapping of entry name -> settings")
    return doc


def entries(text: str | None = None) -> dict[str, dict[str, Any]]:
    """The defaults with the overrides ``text`` (default ``CLAW_SCHEDULE``) applied (name ->
    settings)."""
    out = {k: dict(v) for k, v in DEFAULTS.items()}
    for name, spec in overrides(text).items():
        if spec is None:
            out.pop(name, None)
            continue
        if not isinstance(spec, dict) or not {"every", "cron"} & spec.keys():
            raise ScheduleError(f"schedule entry {name!r}: give every: or cron: ({spec!r})")
        base = out.get(name, {})
        base = {k: v for k, v in base.items() if k not in ("every", "cron")}
        out[name] = {**base, **spec}
        if "task" not in out[name]:
            raise ScheduleError(f"schedule entry {name!r} is new: give its task")
    return out


def when(spec: Mapping[str, Any]) -> schedule | crontab:
    """The Celery schedule of one entry."""
    if "cron" in spec:
        parts = str(spec["cron"]).split()
        if len(parts) != 5:
            raise ScheduleError(f"cron {spec['cron']!r}: five fields, 'm h dom mon dow'")
        m, h, dom, mon, dow = parts
        return crontab(minute=m, hour=h, day_of_month=dom, month_of_year=mon, day_of_week=dow)
    return schedule(_seconds(spec["every"]))


def _seconds(every: Any) -> float:
    try:
        seconds = parse_duration(every)
    except DurationError:
        seconds = 0.0
    if not seconds > 0:
        raise ScheduleError(f"every {every!r}: a positive number of seconds, or 30s, 5m, 1h")
    return seconds


def beat_schedule(text: str | None = None) -> dict[str, dict[str, Any]]:
    """Celery's ``beat_schedule``: every entry on the maintenance queue (or its own
    ``queue``), expiring if not started within its interval (no pile-up after downtime)."""
    out = {}
    for name, spec in entries(text).items():
        sched = when(spec)
        options: dict[str, Any] = {"queue": spec.get("queue", "maintenance")}
        if isinstance(sched, schedule):
            options["expires"] = max(5.0, sched.run_every.total_seconds())
        out[name] = {"task": spec["task"], "schedule": sched, "options": options}
    return out
