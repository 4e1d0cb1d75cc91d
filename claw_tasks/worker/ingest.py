"""Server side of ingest: check a message whole, then commit the good steps and dead-letter
the rest. Nothing is allocated, read from a claim check or decompressed before the part it
depends on is checked, and every message ends committed, dead-lettered or retried."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import redis
from redis.exceptions import (
    AskError,
    ClusterError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

from claw_tasks.codecs import CodecError
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Placed
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.message import IngestArgs, IngestOutcome, Rejected, parse_args
from claw_tasks.format.schema import Schema, SchemaError
from claw_tasks.settings import IngestLimits
from claw_tasks.store import NamespaceDropped, NamespaceError, Store, row_episode_codes
from claw_tasks.store.batches import done_key, namespace_exists, placed_marker, staging_key
from claw_tasks.store.replication import NotReplicated, Replication
from claw_tasks.worker.deadletter import Letter, Target, finish

log = logging.getLogger(__name__)
MAX_ERRORS = 20  # step errors kept in a done record and a dead letter's reason
DONE_REASON = 512  # characters of a rejection's reason in its done record (the letter has all)

# Worth retrying: the server is away, busy loading, or out of memory for now; on a Redis
# Cluster also a master down or its slots not served yet (a restart, a failover), or a
# slot moved (MOVED/ASK reach here from a commit sent to a master directly, to WAIT on it);
# a commit that too few replicas acknowledged (CLAW_INGEST_REPLICAS). Any other Redis
# error is about this message (a size or type the server refuses): dead-lettered.
TRANSIENT = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    ClusterError,
    TryAgainError,
    SlotNotCoveredError,
    AskError,
    NotReplicated,
)


def is_transient(e: BaseException) -> bool:
    if isinstance(e, RedisClusterException):  # also a caller's error (e.g. cross-slot)
        return "cannot be connected" in str(e) or isinstance(e, SlotNotCoveredError)
    return isinstance(e, TRANSIENT) or (
        isinstance(e, redis.ResponseError) and str(e).startswith(("OOM", "LOADING", "TRYAGAIN"))
    )


def parse_message(args: Any, kwargs: Any, limits: IngestLimits) -> IngestArgs:
    """:func:`~claw_tasks.format.message.parse_args`, and a claim check must be this
    batch's own staging key (a message may not read another batch's or namespace's)."""
    a = parse_args(args, kwargs, limits)
    expected = staging_key(a.namespace, a.batch_id)
    if a.stage_key is not None and a.stage_key != expected:
        raise Rejected(
            "claim-check",
            f"claim check {a.stage_key!r:.120} is not this batch's staging key {expected!r}: a "
            "message may name only its own namespace's staging key for its batch id",
            a.namespace,
            a.batch_id,
        )
    return a


def reject(r: redis.Redis, e: Rejected, limits: IngestLimits, **extra: Any) -> bool:
    """Dead-letter a whole message: in its namespace when it names an existing one (with its
    done key when the batch id is valid, so the sender learns why), else in ``claw:rejects``."""
    namespace = e.namespace
    try:
        if namespace is not None and not namespace_exists(r, namespace):
            namespace = None
    except ValueError:  # not a namespace name at all
        namespace = None
    target = Target.of(namespace)
    done_key = target.done_key(e.batch_id)
    done = None
    if done_key is not None:
        reason = e.reason[:DONE_REASON]  # done records are one per message: kept small
        outcome = IngestOutcome(e.batch_id or "", rejected=e.steps, errors=[reason])
        done = (done_key, outcome.to_bytes())
    payload = extra.pop("payload", None)
    letter = Letter(e.code, e.reason, payload, None, e.batch_id, extra)
    written = finish(r, target, "rejected", limits, done, letter)
    if done is not None and e.batch_id is not None:  # its own claim check is moot now
        r.delete(staging_key(target.namespace, e.batch_id))
    return written


def run(
    r: redis.Redis,
    args: Any,
    kwargs: Any,
    limits: IngestLimits,
    store_for: Callable[[str], Store] | None = None,
) -> IngestOutcome:
    """Check and process one ingest message (its args as sent); ``store_for`` may cache
    a Store (and its config) per namespace."""
    try:
        a = parse_message(args, kwargs, limits)
    except Rejected as e:
        payload = args[3] if isinstance(args, list) and len(args) > 3 else None
        reject(r, e, limits, payload=payload if isinstance(payload, bytes) else None)
        return IngestOutcome(e.batch_id or "", errors=[e.reason])
    return process((store_for or partial(Store, r))(a.namespace), a, limits)


def process(store: Store, a: IngestArgs, limits: IngestLimits) -> IngestOutcome:
    """Validate and commit one batch. Idempotent: a redelivery writes nothing twice. Raises
    NamespaceDropped, writing nothing to the namespace, if it was dropped."""
    r, target = store.r, Target.of(a.namespace)
    try:  # the batch's done record read in the same round trip
        (prior,) = store.revalidate(also=[done_key(a.namespace, a.batch_id)])
    except NamespaceDropped as e:  # nothing written to it: counted in claw:rejects
        reject(r, Rejected("dropped", str(e)), limits)
        raise
    if prior is not None:
        finish(r, target, "duplicate", limits)
        return IngestOutcome.from_bytes(prior)
    raw = a.payload
    try:
        try:
            store.config()
        except NamespaceError:
            raise Rejected(
                "namespace",
                f"namespace {a.namespace!r} does not exist: create it (Ingestor does) first",
            ) from None
        if raw is None:
            raw = r.get(a.stage_key)  # parse_message checked it is this batch's staging key
            if raw is None:
                raise Rejected("claim-check", f"claim check {a.stage_key!r} is gone (expired)")
            if len(raw) > limits.message_bytes:
                raise Rejected("size", f"batch of {len(raw)} bytes > limit {limits.message_bytes}")
        outcome = _commit(store, _checked(store, a, raw, limits), a.batch_id, limits)
    except NamespaceDropped as e:  # since the first check: the commit wrote nothing
        reject(r, Rejected("dropped", str(e)), limits)
        raise
    except Rejected as e:
        e.namespace, e.batch_id = a.namespace, a.batch_id
        outcome = IngestOutcome(a.batch_id, rejected=e.steps, errors=[e.reason])
        if not reject(r, e, limits, payload=raw):  # another delivery finished it first
            outcome = _recorded(r, done_key(a.namespace, a.batch_id), outcome)
    except Exception as e:
        if isinstance(e, NotReplicated):
            _count_unreplicated(store, target, a.batch_id, e, limits)
        if is_transient(e):
            raise  # the task retries with backoff (the commit is idempotent)
        log.exception("ingest of batch %s failed", a.batch_id)
        code = "redis" if isinstance(e, redis.RedisError) else "internal"
        reason = f"{'Redis refused the batch' if code == 'redis' else 'internal error'}: "
        reject(
            r,
            Rejected(code, reason + f"{type(e).__name__}: {e}", a.namespace, a.batch_id),
            limits,
            payload=raw,
        )
        outcome = IngestOutcome(a.batch_id, errors=[reason])
    if a.stage_key is not None:
        r.delete(a.stage_key)
    return outcome


def _count_unreplicated(
    store: Store, target: Target, batch_id: str, e: NotReplicated, limits: IngestLimits
) -> None:
    """Count a commit too few replicas acknowledged (outcome ``unreplicated``); it is not
    confirmed, and the task retries it. Best effort: the master that counts may be the
    one failing over."""
    log.warning("batch %s not confirmed, retried: %s", batch_id, e)
    with contextlib.suppress(redis.RedisError):
        finish(store.r, target, "unreplicated", limits)


def _checked(store: Store, a: IngestArgs, raw: bytes, limits: IngestLimits) -> StepBatch:
    """The batch, once everything that does not depend on row values is known to fit."""
    try:
        batch = StepBatch.decode(raw, limits.decompressed_bytes)
    except (CodecError, SchemaError) as e:
        raise Rejected("decode", f"undecodable batch: {e}") from None
    if batch.batch_id != a.batch_id:
        raise Rejected("args", f"payload of batch {batch.batch_id!r} sent as {a.batch_id!r}")
    cfg = store.config()
    if batch.n > cfg.cap:
        raise _steps(
            batch,
            Rejected(
                "size",
                f"batch of {batch.n} steps > the {cfg.cap} a shard of {store.namespace!r} holds "
                f"(capacity {cfg.capacity} over {cfg.n_shards} shard(s)): its steps would "
                "overwrite each other in the ring, so none is kept; send at most "
                f"{cfg.cap} steps per message (the Ingestor splits its batches to fit)",
            ),
        )
    if batch.n > limits.batch_steps:
        raise _steps(
            batch,
            Rejected(
                "size",
                f"batch of {batch.n} steps > CLAW_MAX_BATCH_STEPS={limits.batch_steps} of the "
                "ingest workers: send smaller batches (Ingestor flush_steps) or raise it",
            ),
        )
    try:  # checked, not stored: the commit stores it, only if a step commits
        schema = batch.schema() if cfg.schema is None else cfg.schema.merged(batch.schema())
    except SchemaError as e:
        raise _steps(batch, Rejected("schema", f"schema mismatch: {e}")) from None
    problem = compressed_problem(batch, schema)
    if problem is not None:
        raise _steps(batch, Rejected("schema", problem))
    return batch


def compressed_problem(batch: StepBatch, schema: Schema) -> str | None:
    """What a batch does wrong with the namespace's compressed fields (None: nothing): a
    compressed field is never written in place, and an explicit next_obs sent as frames
    must be frames of obs's codec."""
    for name, v in batch.fields.items():
        if isinstance(v, Placed) and schema.fields[name].codec is not None:
            return (
                f"field '{name}' is compressed ({schema.fields[name].codec}): it travels in "
                "the message, never written in place"
            )
    nx, obs = batch.next_obs, schema.fields.get("obs")
    if isinstance(nx, Encoded) and (obs is None or not obs.fits(nx.spec) or obs.codec is None):
        want = "no explicit next_obs" if obs is None else obs.describe()
        return f"next_obs sent as {nx.spec.describe()}, the namespace's obs is {want}"
    return None


def _steps(batch: StepBatch, e: Rejected) -> Rejected:
    e.steps = batch.n
    return e


def _placed_at(store: Store, batch: StepBatch) -> tuple[int, int] | None:
    """(shard, seq0) of a batch whose fields were written in place, checked against the
    allocation the sender made: nothing is allocated (or evicted) here."""
    if not any(isinstance(v, Placed) for v in batch.fields.values()):
        return None
    cfg = store.config()
    shards = row_episode_codes(batch.episode.values, batch.episode.index) % cfg.n_shards
    if not len(shards) or (shards != shards[0]).any():
        raise _steps(batch, Rejected("placed", "fields written in place: one shard only"))
    shard = int(shards[0])
    marker = placed_marker(store.r, store.namespace, shard, batch.batch_id)
    parts = marker.decode().split(":") if marker else []
    if len(parts) < 2:
        raise _steps(
            batch,
            Rejected(
                "placed",
                f"fields written in place, but shard {shard} has no allocation for batch "
                f"{batch.batch_id!r} (expired or never made); nothing was allocated now",
            ),
        )
    if parts[0] == "alloc" and (len(parts) != 3 or int(parts[2]) != batch.n):
        got = parts[2] if len(parts) == 3 else "?"
        raise _steps(
            batch,
            Rejected(
                "placed", f"batch declares {batch.n} steps written in place, {got} were allocated"
            ),
        )
    return shard, int(parts[1])


def _commit(store: Store, batch: StepBatch, batch_id: str, limits: IngestLimits) -> IngestOutcome:
    """Commit the good steps and dead-letter the rest. A message whose every step is
    refused is ``rejected`` and changes nothing (no schema, tag or string code of it is
    stored) but what retires the slots a sender allocated for steps written in place."""
    outcome = IngestOutcome(batch_id)
    at = _placed_at(store, batch)
    errors = batch.row_errors(verify_frames=limits.verify_frames)
    bad = sorted(errors)
    good: StepBatch | None = batch
    dead: list[int] = []
    letter = None
    if bad:
        outcome.rejected = len(bad)
        outcome.errors = [errors[i] for i in bad[:MAX_ERRORS]]  # the done key stays small
        if len(bad) > MAX_ERRORS:
            outcome.errors.append(f"... and {len(bad) - MAX_ERRORS} more rejected step(s)")
        rejected = batch.take(np.array(bad))
        placed = [k for k, v in batch.fields.items() if isinstance(v, Placed)]
        if at is not None:  # rows written in place: commit them not alive, keep their data
            shard, seq0 = at
            slots = (seq0 - 1 + np.asarray(bad, np.int64)) % store.config().cap
            rejected.fields.update(store.read_fields(np.full(len(bad), shard), slots, placed))
            dead = bad
            if len(bad) == batch.n:  # nothing of it but its slots: no tags, strings, info
                good = replace(batch, strs={}, nums={}, info_rows=np.zeros(0, np.int32), info=[])
                good.next_rows, good.next_obs = np.zeros(0, np.int32), None
        elif len(bad) == batch.n:
            good = None
        else:
            good = batch.take(np.setdiff1d(np.arange(batch.n), bad))
        reason = "; ".join(outcome.errors)
        letter = Letter("rows", reason, rejected.encode(), bad, batch_id)
    if good is not None:
        try:
            res = store.commit(good, dead_rows=dead, replication=_replication(limits))
        except SchemaError as e:  # another message set the schema since: nothing written
            raise _steps(batch, Rejected("schema", f"schema mismatch: {e}")) from None
        outcome.committed, outcome.replayed = res.committed, res.replayed
        outcome.expired = res.expired
    kind = "committed" if not bad else "rejected" if len(bad) == batch.n else "partial"
    done = done_key(store.namespace, batch_id)
    if not finish(
        store.r, Target.of(store.namespace), kind, limits, (done, outcome.to_bytes()), letter
    ):
        return _recorded(store.r, done, outcome)
    return outcome


def _replication(limits: IngestLimits) -> Replication | None:
    if not limits.replicas:
        return None
    return Replication(limits.replicas, limits.replica_timeout_ms)


def _recorded(r: redis.Redis, done_key: str, fallback: IngestOutcome) -> IngestOutcome:
    """The outcome another delivery of the batch recorded first (this one is a duplicate)."""
    prior = r.get(done_key)
    return fallback if prior is None else IngestOutcome.from_bytes(prior)
