"""Redis ACL rules that confine a producer or trainer to one namespace.

A client (``Ingestor``, ``BatchClient``) touches only its namespace's keys
(``claw:{ns}:*`` and the shard keys ``claw:{ns:<shard>}:*``), the namespace's drop
tombstone, and — when the broker is this same Redis — the Celery queues it publishes to.
Workers, beat and the CLI's admin commands keep a full-access user. Lua scripts pass every
key they touch in KEYS, so the key patterns hold inside scripts too.

The broker part is two selectors: the user may push to and count the ``ingest`` and
``prefetch`` queues and declare their bindings, but not pop or read them (that would show
other namespaces' messages in flight).
"""

from __future__ import annotations

import re

from claw_tasks.store.config import dropped_key
from claw_tasks.store.layout import Keys

CLIENT_QUEUES = ("ingest", "prefetch")


def _literal(text: str) -> str:
    """``text`` as a Redis glob that matches only itself (a namespace may hold ``*?[``)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def namespace_rules(namespace: str, *, db: int = 0) -> list[str]:
    """``ACL SETUSER`` rules (after ``reset on >password``) for a client of ``namespace``;
    ``db`` is the broker's database number (its event channel is named after it)."""
    keys = Keys(namespace)  # validates the name
    shard_prefix = keys.shard(0).removesuffix("0}:")  # claw:{ns: then the shard number
    return [
        f"~{_literal(keys.base)}*",
        f"~{_literal(shard_prefix)}*",
        f"~{_literal(dropped_key(namespace))}",
        # Every command on those keys; nothing that lists or flushes the keyspace.
        "+@all",
        "-@dangerous",
        "+info",
        "-scan",
        "-randomkey",
        f"&/{db}.celeryev/*",  # task-sent events, for Flower
        "(" + " ".join(f"~{q}*" for q in CLIENT_QUEUES) + " +lpush +llen)",
        "(~_kombu.binding* +sadd +smembers)",
    ]


USER = re.compile(r"[A-Za-z0-9_.@-]{1,128}")
"""A user name ``setuser_command`` puts in a line of rules."""


def setuser_command(namespace: str, user: str, *, db: int = 0) -> str:
    """The ``ACL SETUSER`` line for ``user`` (the password is set separately: it is never
    printed). ``user`` is one word: a space or newline in it would add rules to the line."""
    if not USER.fullmatch(user):
        raise ValueError(f"user {user[:60]!r}: use 1-128 letters, digits, '-', '_', '.' or '@'")
    return " ".join(["ACL SETUSER", user, "reset", "on", *namespace_rules(namespace, db=db)])
