"""What one ingest message may carry and cost (workers; docs/reliability.md): the
``limits.*`` variables and the ``IngestLimits`` they build."""

from __future__ import annotations

from dataclasses import dataclass

from .variable import MIB, Variable, at_least_one, count, flag

INGEST: tuple[Variable, ...] = (
    Variable(
        "CLAW_MAX_MESSAGE_BYTES",
        "limits.message_bytes",
        count,
        256 * MIB,
        "bytes of one ingest batch's payload, inline or claim-checked",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_MAX_DECOMPRESSED_BYTES",
        "limits.decompressed_bytes",
        count,
        256 * MIB,
        "bytes decompressing one batch may hold: all its frames' declared sizes, the "
        "largest twice (docs/reliability.md)",
        shown="256 MiB",
    ),
    Variable(
        "CLAW_MAX_BATCH_STEPS",
        "limits.batch_steps",
        count,
        65536,
        "steps in one ingest batch (and never more than a shard's capacity)",
    ),
    Variable(
        "CLAW_VERIFY_FRAMES",
        "limits.verify_frames",
        flag,
        True,
        "`0`: the ingest worker checks a producer's frame headers but does not trial-decode them",
    ),
    Variable(
        "CLAW_DEAD_LETTER_BYTES",
        "limits.dead_letter_bytes",
        count,
        64 * MIB,
        "dead letters kept per namespace (oldest trimmed first)",
        shown="64 MiB",
    ),
    Variable(
        "CLAW_DEAD_LETTER_PREFIX",
        "limits.dead_letter_prefix",
        count,
        MIB,
        "payload bytes one dead letter keeps (at most a quarter of `CLAW_DEAD_LETTER_BYTES`)",
        shown="1 MiB",
    ),
    Variable(
        "CLAW_INGEST_REPLICAS",
        "limits.replicas",
        count,
        0,
        "replicas that must hold each shard's commit of a batch (`WAIT` on its master) "
        "before the batch is confirmed; 1 on a Redis with replicas makes an acknowledged "
        "step survive a failover; with too few replicas up the batch is retried, never "
        "confirmed (docs/reliability.md)",
    ),
    Variable(
        "CLAW_INGEST_REPLICA_TIMEOUT_MS",
        "limits.replica_timeout_ms",
        at_least_one,
        1000,
        "how long one commit waits for `CLAW_INGEST_REPLICAS` replicas before the batch is retried",
    ),
    Variable(
        "CLAW_INGEST_RETRIES",
        "limits.retries",
        count,
        10,
        "retries of a transient Redis error in ingest (exponential backoff)",
    ),
)


@dataclass(frozen=True)
class IngestLimits:
    """What one ingest message may carry and cost; the worker dead-letters a batch past
    these before it reads a claim check, decompresses or allocates anything (the
    ``limits.*`` entries of ``VARIABLES``)."""

    message_bytes: int
    decompressed_bytes: int
    batch_steps: int
    dead_letter_bytes: int
    dead_letter_prefix: int
    retries: int
    verify_frames: bool = True
    replicas: int = 0
    replica_timeout_ms: int = 1000
