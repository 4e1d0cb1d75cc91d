"""What a namespace may be called: its name becomes part of every key
(``claw:{<namespace>:<shard>}:…``), so the characters that delimit keys and hash tags are
refused."""

from __future__ import annotations


def check_namespace(namespace: str) -> None:
    """Raise ``ValueError`` naming the rule when ``namespace`` cannot be a namespace name."""
    if not namespace or any(c in namespace for c in "{}: \n"):
        raise ValueError(f"namespace {namespace!r}: use letters, digits, '-', '_' or '.'")
