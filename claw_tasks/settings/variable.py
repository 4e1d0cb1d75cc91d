"""One ``CLAW_*`` variable's declaration (``Variable``) and the readers that turn its text
into a value; each section module of this package declares its variables with these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r}: expected an integer") from None
    if value < 0:
        raise ValueError(f"{value}: must be >= 0")
    return value


def at_least_one(text: str) -> int:
    """A count, 0 read as 1."""
    return max(1, count(text))


def flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list."""
    return tuple(filter(None, map(str.strip, text.split(","))))


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"{value}: must be a finite number of seconds > 0")
    return value


def seconds_or_never(text: str) -> float:
    """Seconds >= 0; 0 turns the thing off."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"{value}: must be a finite number of seconds >= 0 (0: never)")
    return value


def compress_at(text: str) -> str:
    if text not in ("producer", "worker"):
        raise ValueError(f"{text!r}: 'producer' or 'worker'")
    return text


@dataclass(frozen=True)
class Variable:
    """One ``CLAW_*`` variable: the ``Settings`` attribute it sets (``limits.x``: an
    ``IngestLimits`` one), how its text is read, its default and what it means.

    Unset or empty means the default, except for lists, where empty is the empty list."""

    name: str
    attr: str
    read: Callable[[str], Any]
    default: Any
    doc: str
    shown: str | None = None
    """The default as the docs show it, when it is derived or a size."""

    @property
    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None or self.default in ("", ()):
            return "none"
        if isinstance(self.default, tuple):
            return f"`{','.join(self.default)}`"
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        return f"`{self.default}`"
