"""Durations, one spelling everywhere: a number and a unit — ``s``, ``m``, ``h``, ``d``,
``w`` — in the where language (``age < 5m``, ``claw query --since 1h``), retention
(``max_age: 7d``), the priorities' ``half_life`` and the beat schedule (``every: 30s``).

A leaf module (nothing of Claw's imported): the where language and the store's settings
both use it, and neither has to import the other for it."""

from __future__ import annotations

import re

UNITS: dict[str, int] = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
"""Seconds per unit."""

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_TOKEN = re.compile(rf"(-?{_NUMBER})([smhdw])")
_PART = re.compile(rf"({_NUMBER})\s*([smhdw]?)")
HINT = "use e.g. 90s, 15m, 12h, 7d, 2w"


class DurationError(ValueError):
    """Text that is not a duration; the message shows it and the spelling to use."""


def duration(text: str) -> int | float | None:
    """Seconds of one duration token like ``30s``, ``1.5h`` or ``-7d`` (the where
    language's values); None if ``text`` is not one."""
    m = _TOKEN.fullmatch(text)
    if m is None:
        return None
    seconds = float(m.group(1)) * UNITS[m.group(2)]
    return int(seconds) if seconds.is_integer() else seconds


def parse_duration(text: str | float) -> float:
    """Seconds of a setting: a number (seconds), ``90s``, ``15m``, ``12h``, ``7d``, ``2w``,
    or a sum of such parts (``1d12h``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip().lower()
    parts = _PART.findall(s)
    if not s or not parts or _PART.sub("", s).strip():
        raise DurationError(f"duration {text!r}: {HINT}")
    return float(sum(float(v) * UNITS[u or "s"] for v, u in parts))


def format_duration(seconds: float) -> str:
    """The shortest whole spelling: ``7d``, ``12h``, ``15m``, else seconds."""
    for unit in ("d", "h", "m"):
        if seconds >= UNITS[unit] and seconds % UNITS[unit] == 0:
            return f"{int(seconds // UNITS[unit])}{unit}"
    return f"{seconds:g}s"
