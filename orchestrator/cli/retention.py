"""`claw retention`: a retention policy from command-line options, checked before it is
stored (a filter that does not compile would make every eviction pass fail)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from claw_tasks.store.retention import Retention, parse_bytes, parse_duration
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
    max_age: str | None,
    max_steps: int | None,
    max_bytes: str | None,
    evict: str,
    protect: list[str],
    archive_before_evict: bool,
    tags: Mapping[str, str],
) -> Retention:
    return Retention(
        max_age=None if max_age is None else parse_duration(max_age),
        max_steps=max_steps,
        max_bytes=None if max_bytes is None else parse_bytes(max_bytes),
        evict=evict,
        protect=tuple(protect_filter(p, tags) for p in protect),
        archive_before_evict=archive_before_evict,
    )
