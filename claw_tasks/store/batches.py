"""What the sender, the ingest worker and its dead letters share of a batch outside the
step data: its claim-check staging key, its done record, a placed batch's marker, and the
names outside every namespace (the worker-level rejects, the namespace directory, the
beat's schedule). Named here so that only the store knows its key layout; callers pass
the names to their own pipelines, so the ingest path keeps its round trips."""

from __future__ import annotations

import redis

from claw_tasks.store.layout import Keys

REJECTS = "claw:rejects"
"""Dead letters of messages that name no existing namespace."""
REJECTS_OUTCOMES = "{claw:rejects}:outcomes"
"""In ``claw:rejects``'s slot (hash tag of the whole name): one script updates both."""
ACTIVE = "claw:active"
"""The namespaces a fill serves (a set): the beat tops each up."""
SCHEDULE_PREFIX = "claw:redbeat:"
"""Prefix of the beat's schedule entries (redbeat's ``redbeat_key_prefix``)."""


def staging_key(namespace: str, batch_id: str) -> str:
    """A batch's claim-check value: a message may name only its own."""
    return Keys(namespace).stage(batch_id)


def done_key(namespace: str, batch_id: str) -> str:
    """A batch's done record (its outcome): what the sender polls."""
    return Keys(namespace).done(batch_id)


def dead_letter_keys(namespace: str) -> tuple[str, str]:
    """A namespace's (outcome counters, dead-letter stream)."""
    keys = Keys(namespace)
    return keys.outcomes, keys.dead


def namespace_exists(r: redis.Redis, namespace: str) -> bool:
    """Whether ``namespace`` has a config record (one round trip); ValueError if it is not
    a namespace name."""
    return bool(r.exists(Keys(namespace).config))


def placed_marker(r: redis.Redis, namespace: str, shard: int, batch_id: str) -> bytes | None:
    """The allocation marker a sender left for a batch whose fields it wrote in place."""
    return r.get(Keys(namespace).shard_key(shard, f"b:{batch_id}"))


def shard_home_key(namespace: str, shard: int) -> str:
    """A key in ``shard``'s hash slot: which Cluster master holds it holds the shard."""
    return Keys(namespace).shard_key(shard, "seq")


def snapshot_keys(namespace: str, name: str, n_shards: int) -> list[str]:
    """The keys one snapshot occupies: the namespace's snapshot record and each shard's."""
    keys = Keys(namespace)
    return [keys.snapshots] + [keys.snapshot(s, name) for s in range(n_shards)]
