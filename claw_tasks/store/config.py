"""A namespace's config record in Redis (capacity, shards, schema, ...): its format, its
errors, and the limits every part of a ``Store`` shares (``LOG_MAXLEN``, ``MARKER_TTL``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.format.schema import Schema
from claw_tasks.store.retention import Retention

MARKER_TTL = 7 * 86400
LOG_MAXLEN = 100_000
DEFAULT_CAPACITY = 1_000_000


DROPPED_TTL = 86400

FORMAT = 3
"""Version of a namespace's stored layout (this record, its keys and columns). A Claw
reads the formats it knows (:data:`READS`) and refuses any other instead of misreading
it; bump this with any change to the layout an older Claw would misread. 2: compressed
fields (a field with a codec, its frames in ``z:`` hashes). 3: ``timestamp`` as run
tables (``mr:`` keys, ``layout.RUN_COLUMNS``), not a per-slot ``m:`` column."""
READS = (3,)
OLDER_FIX = (
    "it was written by an older Claw: archive it with that Claw (claw archive NS --to DIR), "
    "then restore the archive with this one (claw restore DIR -n NS), or recreate it "
    "(claw drop, then ingest)"
)
"""What to do with a namespace of a format before :data:`READS` (the archive keeps every
step's own commit time; its restore writes this format)."""


class NamespaceError(LookupError):
    """The namespace does not exist or is configured differently."""


class NamespaceDropped(NamespaceError):
    """The namespace was dropped (``claw drop``): nothing is written to it until it is
    created again explicitly (``Store.create``, a new ``Ingestor``)."""


def dropped_key(namespace: str) -> str:
    """The tombstone ``claw drop`` leaves for a day; outside the namespace's keys."""
    return f"claw:dropped:{namespace}"


@dataclass(frozen=True)
class NamespaceConfig:
    capacity: int
    n_shards: int
    schema: Schema | None
    created: float
    retention: Retention | None = None
    priorities: dict[str, Any] | None = None  # recomputation rules (orchestrator.maintenance)
    # Observation and action spaces (Minari's JSON serialization), when a recorder knew them.
    spaces: dict[str, str] | None = None
    # Index each episode's step ids at commit (``Store.trajectory_ids``): the capture
    # gateway turns it on, so a reward post finds its turns without a column scan.
    episode_index: bool = False

    @property
    def cap(self) -> int:
        """Slots per shard."""
        return math.ceil(self.capacity / self.n_shards)

    def to_bytes(self) -> bytes:
        return packb(
            {
                "capacity": self.capacity,
                "n_shards": self.n_shards,
                "schema": None if self.schema is None else self.schema.to_dict(),
                "created": self.created,
                "retention": None if self.retention is None else self.retention.to_dict(),
                "priorities": self.priorities,
                "spaces": self.spaces,
                "format": FORMAT,
                "episode_index": self.episode_index,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, namespace: str = "") -> NamespaceConfig:
        """Parse a stored config; a format this Claw does not know is a NamespaceError."""
        d = unpackb(data)
        _check_format(d.get("format"), namespace)
        schema = None if d["schema"] is None else Schema.from_dict(d["schema"])
        retention = Retention.of(d.get("retention"))
        priorities = d.get("priorities")
        return cls(
            d["capacity"],
            d["n_shards"],
            schema,
            d["created"],
            retention,
            priorities,
            d.get("spaces"),
            episode_index=bool(d.get("episode_index", False)),
        )


def _check_format(found: Any, namespace: str) -> None:
    if type(found) is int and found in READS:
        return
    ns = f"namespace {namespace!r}" if namespace else "the namespace"
    if type(found) is int and found > FORMAT:
        fix = "it was written by a newer Claw: upgrade Claw (pip install -U claw) to read it"
    elif type(found) is int and 1 <= found < min(READS):
        fix = OLDER_FIX
    else:
        fix = "it was not written by a released Claw: recreate it (claw drop, then ingest)"
    raise NamespaceError(
        f"{ns} has store format {found!r}; this Claw reads format "
        f"{' and '.join(map(str, READS))} only: {fix}"
    )
