"""A namespace's retention policy: what the ``claw.maintenance.evict`` task may remove.

Stored in the namespace config (``Store.set_retention``, ``Ingestor(retention=...)``,
``claw retention NS ...``). Every limit is optional; an empty policy evicts nothing (the
ring still overwrites the oldest steps at capacity):

- ``max_age``: seconds; steps committed longer ago are evicted (reason ``ttl``);
- ``max_steps``: a soft cap below capacity; the excess goes, lowest priority first
  (``evict: lowest-priority``, unset priorities count as the current maximum, as the
  sampler draws them) or oldest first (``evict: oldest``) (reason ``cap``);
- ``max_bytes``: Redis memory of the namespace's keys; turned into a step cap from the
  measured bytes per step (reason ``cap``);
- ``protect``: filters in the where language (:mod:`claw_tasks.where`, a mapping or a
  string such as ``"quality == 'golden'"``); a step matching any is never evicted, but
  counts against the caps;
- ``archive_before_evict``: only steps at or below a shard's archive watermark (the
  highest archived seq in ``claw:{ns:<shard>}:archived``) may go;
- ``max_snapshots``, ``snapshot_max_age``: snapshots (``claw snapshot``) kept, newest
  first, and how old one may get (deleted by the same beat pass; steps are not affected).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from claw_tasks.durations import DurationError, format_duration, parse_duration
from claw_tasks.where import FilterError, Where

ORDERS = ("lowest-priority", "oldest")
_BYTES = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class RetentionError(ValueError):
    """A retention policy that cannot be applied; the message names the setting."""


@dataclass(frozen=True)
class Retention:
    max_age: float | None = None
    max_steps: int | None = None
    max_bytes: int | None = None
    evict: str = "lowest-priority"
    protect: tuple[Mapping[str, Any] | str, ...] = field(default_factory=tuple)
    archive_before_evict: bool = False
    max_snapshots: int | None = None
    snapshot_max_age: float | None = None

    def __post_init__(self) -> None:
        if self.max_age is not None and not self.max_age > 0:
            raise RetentionError(f"max_age must be > 0 seconds, got {self.max_age}")
        if self.snapshot_max_age is not None and not self.snapshot_max_age > 0:
            raise RetentionError(
                f"snapshot_max_age must be > 0 seconds, got {self.snapshot_max_age}"
            )
        for name in ("max_steps", "max_bytes", "max_snapshots"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise RetentionError(f"{name} must be an integer >= 0, got {v!r}")
        if self.evict not in ORDERS:
            raise RetentionError(f"evict must be one of {ORDERS}, got {self.evict!r}")
        for p in self.protect:
            if not isinstance(p, Mapping | str) or not p:
                raise RetentionError(f"protect: each filter is a non-empty where: {p!r}")
            try:
                Where(p)
            except FilterError as e:
                raise RetentionError(f"protect {p!r}: {e}") from None

    @property
    def empty(self) -> bool:
        return self.max_age is None and self.max_steps is None and self.max_bytes is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_age": self.max_age,
            "max_steps": self.max_steps,
            "max_bytes": self.max_bytes,
            "evict": self.evict,
            "protect": [p if isinstance(p, str) else dict(p) for p in self.protect],
            "archive_before_evict": self.archive_before_evict,
            "max_snapshots": self.max_snapshots,
            "snapshot_max_age": self.snapshot_max_age,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Retention:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise RetentionError(f"unknown retention setting(s) {sorted(unknown)}")
        d = dict(d)
        for key in ("max_age", "snapshot_max_age"):
            if isinstance(d.get(key), str):
                try:
                    d[key] = parse_duration(d[key])
                except DurationError as e:
                    raise RetentionError(f"{key}: {e}") from None
        if isinstance(d.get("max_bytes"), str):
            d["max_bytes"] = parse_bytes(d["max_bytes"])
        protect = d.get("protect") or ()
        d["protect"] = tuple([protect] if isinstance(protect, Mapping | str) else protect)
        return cls(**d)

    @classmethod
    def of(cls, value: Retention | Mapping[str, Any] | None) -> Retention | None:
        """A policy from itself, its dict form (durations and sizes may be strings), or None."""
        if value is None or isinstance(value, Retention):
            return value
        if not isinstance(value, Mapping):
            raise RetentionError(f"retention must be a mapping, got {type(value).__name__}")
        return cls.from_dict(value)

    def describe(self) -> str:
        parts = []
        if self.max_age is not None:
            parts.append(f"max age {format_duration(self.max_age)}")
        if self.max_steps is not None:
            parts.append(f"max {self.max_steps:,} steps ({self.evict} first)")
        if self.max_bytes is not None:
            parts.append(f"max {self.max_bytes / 2**20:,.1f} MiB")
        if self.protect:
            shown = (p if isinstance(p, str) else str(dict(p)) for p in self.protect)
            parts.append("protect " + " or ".join(shown))
        if self.archive_before_evict:
            parts.append("archive before evict")
        if self.max_snapshots is not None:
            parts.append(f"keep {self.max_snapshots:,} snapshots")
        if self.snapshot_max_age is not None:
            parts.append(f"snapshots for {format_duration(self.snapshot_max_age)}")
        return ", ".join(parts) or "none"


def parse_bytes(text: str | int) -> int:
    """Bytes from ``5000000``, ``500MB``, ``2GiB`` (decimal and binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _BYTES:
        raise RetentionError(f"size {text!r}: use e.g. 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _BYTES[m.group(2).lower()])
