"""Server side of ingest: validate a batch, commit the good steps, dead-letter the rest."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis

from claw_tasks.batch import Placed, StepBatch
from claw_tasks.codec import CodecError, packb, unpackb
from claw_tasks.schema import MAX_BATCH_BYTES, SchemaError
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.layout import row_episode_codes

log = logging.getLogger(__name__)
DONE_TTL = 86400
DEAD_MAXLEN = 100_000


@dataclass
class IngestOutcome:
    """What became of one batch (also stored under the batch's ``done`` key)."""

    batch_id: str
    committed: int = 0
    replayed: int = 0
    expired: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        return packb(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> IngestOutcome:
        return cls(**unpackb(data))


def dead_letter(
    store: Store, batch_id: str, reason: str, payload: bytes | None, rows: list[int] | None
) -> None:
    """Record a rejected batch (or rows of it) with the reason, once per batch."""
    fields: list[Any] = ["batch_id", batch_id, "reason", reason, "at", repr(time.time())]
    if rows is not None:
        fields += ["rows", packb(rows)]
    if payload is not None:
        fields += ["payload", payload]
    store.scripts.deadletter(
        keys=[store.keys.dead, store.keys.base + f"dl:{batch_id}"],
        args=[DONE_TTL, DEAD_MAXLEN, *fields],
    )


def process(
    store: Store, batch_id: str, payload: bytes | None, stage_key: str | None
) -> IngestOutcome:
    """Validate and commit one batch. Idempotent: a redelivery writes nothing twice. Raises
    NamespaceDropped, writing nothing, if the namespace was dropped."""
    store.revalidate()  # NamespaceDropped: nothing written (no done record, no dead letter)
    done_key = store.keys.done(batch_id)
    prior = store.r.get(done_key)
    if prior is not None:
        return IngestOutcome.from_bytes(prior)
    outcome = IngestOutcome(batch_id)
    raw = payload if payload is not None else (store.r.get(stage_key) if stage_key else None)
    if raw is None:
        reason = f"claim check {stage_key!r} is gone (expired before the batch was processed)"
        return _finish(store, outcome, reason, None, stage_key)
    try:
        if len(raw) > MAX_BATCH_BYTES:
            raise SchemaError(f"batch of {len(raw)} bytes > limit {MAX_BATCH_BYTES}")
        batch = StepBatch.decode(raw)
    except (CodecError, SchemaError) as e:
        return _finish(store, outcome, f"undecodable batch: {e}", raw, stage_key)
    try:
        return _commit(store, batch, outcome, raw, stage_key)
    except redis.RedisError:
        raise  # transient: the task retries (the commit is idempotent)
    except Exception as e:  # a bug must not loop forever or lose the batch: dead-letter it
        log.exception("ingest of batch %s failed", batch_id)
        outcome.rejected = batch.n
        reason = f"internal error: {type(e).__name__}: {e}"
        return _finish(store, outcome, reason, raw, stage_key)


def _commit(
    store: Store, batch: StepBatch, outcome: IngestOutcome, raw: bytes, stage_key: str | None
) -> IngestOutcome:
    try:
        store.ensure_schema(batch.schema())
    except NamespaceError:
        pass  # a new namespace: the commit creates it
    except SchemaError as e:
        outcome.rejected = batch.n
        return _finish(store, outcome, f"schema mismatch: {e}", raw, stage_key)
    errors = batch.row_errors()
    placed = [k for k, v in batch.fields.items() if isinstance(v, Placed)]
    bad = sorted(errors)
    good, dead = batch, []
    if bad:
        outcome.rejected = len(bad)
        outcome.errors = [errors[i] for i in bad]
        rejected = batch.take(np.array(bad))
        if placed:  # rows written in place: commit them not alive, keep their data here
            rejected.fields.update(_read_back(store, batch, bad, placed))
            dead = bad
        else:
            good = batch.take(np.setdiff1d(np.arange(batch.n), bad))
        reason = "; ".join(outcome.errors[:20])
        dead_letter(store, outcome.batch_id, reason, rejected.encode(), bad)
    res = store.commit(good, dead_rows=dead)
    outcome.committed, outcome.replayed, outcome.expired = res.committed, res.replayed, res.expired
    return _finish(store, outcome, None, None, stage_key)


def _read_back(
    store: Store, batch: StepBatch, rows: list[int], names: list[str]
) -> dict[str, np.ndarray]:
    """Payload of ``rows`` of a batch written in place (for its dead letter)."""
    codes = row_episode_codes(batch.episode.values, batch.episode.index[:1])
    shard = int(codes[0]) % store.config().n_shards
    seq0, _ = store.allocate(shard, batch.batch_id, batch.n)  # idempotent: the same seq0
    slots = (seq0 - 1 + np.asarray(rows, np.int64)) % store.config().cap
    return store.read_fields(np.full(len(rows), shard), slots, names)


def _finish(
    store: Store,
    outcome: IngestOutcome,
    reason: str | None,
    payload: bytes | None,
    stage_key: str | None,
) -> IngestOutcome:
    if reason is not None:
        outcome.errors.insert(0, reason)
        dead_letter(store, outcome.batch_id, reason, payload, None)
    with store.r.pipeline() as pipe:
        pipe.set(store.keys.done(outcome.batch_id), outcome.to_bytes(), ex=DONE_TTL)
        if stage_key:
            pipe.delete(stage_key)
        pipe.execute()
    return outcome
