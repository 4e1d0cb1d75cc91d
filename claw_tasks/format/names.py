"""What a namespace may be called: its name becomes part of every key
(``claw:{<namespace>:<shard>}:…``), of the web's paths and of file names in the archive,
so it is letters, digits, '-', '_' and '.' only (checked with ``fullmatch``: ``$`` would
pass a final newline)."""

from __future__ import annotations

import re

NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def check_namespace(namespace: str) -> None:
    """Raise ``ValueError`` naming the rule when ``namespace`` cannot be a namespace name."""
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise ValueError(
            f"namespace {str(namespace)[:80]!r}: use 1-200 letters, digits, '-', '_' or '.'"
        )
