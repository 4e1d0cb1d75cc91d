"""Delivery and maintenance: redelivery, claim-check staging, the beat schedule, the
archive, and the code and transforms workers may be asked to run."""

from __future__ import annotations

from .variable import Variable, count, names

DELIVERY: tuple[Variable, ...] = (
    Variable(
        "CLAW_VISIBILITY_TIMEOUT",
        "visibility_timeout",
        count,
        600,
        "seconds before an unacknowledged task is redelivered (Redis broker; RabbitMQ "
        "redelivers when the worker's connection closes)",
    ),
    Variable(
        "CLAW_STAGE_TTL",
        "stage_ttl",
        count,
        None,
        "TTL of claim-check staging keys for large ingest batches (it must outlive every "
        "redelivery)",
        shown="`max(86400, 4 x CLAW_VISIBILITY_TIMEOUT)`",
    ),
    Variable(
        "CLAW_SCHEDULE",
        "schedule",
        str,
        "",
        "beat schedule overrides: a YAML file, or inline YAML such as `{claw-evict: {every: "
        '10s}, claw-archive: {cron: "30 1 * * *"}}` (docs/architecture.md, Maintenance)',
    ),
    Variable(
        "CLAW_ARCHIVE_DIR",
        "archive_dir",
        str,
        None,
        "where `claw.maintenance.archive` writes (workers)",
    ),
    Variable(
        "CLAW_ARCHIVE_LOCK_TTL",
        "archive_lock_ttl",
        float,
        60.0,
        "seconds an archive run's lock outlives a killed run",
        shown="`60`",
    ),
    Variable(
        "CLAW_SCORERS",
        "scorers",
        names,
        (),
        "priority scorers (`module:function`, comma-separated) that namespaces may name: "
        "whoever configures a namespace must not pick code for workers",
    ),
    Variable(
        "CLAW_FEATURES",
        "features",
        names,
        (),
        "feature functions (`module:function`, comma-separated) that vector indexes may "
        "name (docs/retrieval.md): whoever defines an index must not pick code for workers",
    ),
    Variable(
        "CLAW_ALBUMENTATIONS",
        "albumentations",
        names,
        ("pixel", "spatial"),
        "Albumentations transforms a recipe may name (comma-separated names, or the groups "
        "`pixel` and `spatial`; empty: none)",
    ),
    Variable(
        "CLAW_LINEAGE_MAXLEN",
        "lineage_maxlen",
        count,
        100_000,
        "popped batches a namespace's lineage log keeps (the oldest trimmed first; "
        "docs/architecture.md, Lineage), and with them the recipe versions they name, "
        "so each can be replayed (docs/replay.md)",
    ),
)
