"""`claw retention`: a retention policy from command-line options, checked before it is
stored (a filter that does not compile would make every eviction pass fail)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from claw_tasks.durations import parse_duration
from claw_tasks.store.retention import Retention, parse_bytes
from claw_tasks.where import Where


def protect_filter(text: str, tags: Mapping[str, str]) -> str | dict[str, Any]:
    """A ``--protect`` filter: the where language's string form (``"quality == 'golden'"``)
    or a mapping in YAML/JSON flow form (``"{quality: golden}"``), checked against the
    namespace's tags."""
    where: str | dict[str, Any] = text
    if text.lstrip().startswith("{"):
        where = yaml.safe_load(text)
        if not isinstance(where, dict):
            raise ValueError(f"--protect {text!r}: not a mapping")
    Where(where, tags or None)
    return where


def retention_policy(
    current: Retention | None, given: Mapping[str, Any], tags: Mapping[str, str]
) -> Retention:
    """``current`` (or an empty policy) with the options ``given`` on the command line."""
    out = (current or Retention()).to_dict()
    for key, value in given.items():
        if key in ("max_age", "snapshot_max_age"):
            value = parse_duration(value)
        elif key == "max_bytes":
            value = parse_bytes(value)
        elif key == "protect":
            value = [protect_filter(p, tags) for p in value]
        out[key] = value
    return Retention.from_dict(out)
