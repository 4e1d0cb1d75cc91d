"""The sending half of the Ingestor: publishing batches (in place or by claim check),
keeping what could not be sent, collecting the store's confirmations and re-sending
batches whose message went missing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from claw_tasks.client.backpressure import MemoryGate
from claw_tasks.codecs import encode
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import Placed
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.message import TASK, IngestArgs, IngestOutcome
from claw_tasks.format.schema import Schema
from claw_tasks.store import Store, row_episode_codes
from claw_tasks.store.batches import done_key, staging_key

INLINE_BYTES = 16 * 1024
"""Above this, the metadata of a batch written in place goes by claim check too (one SET
here, a GET and a DEL in the worker): a message body inline costs far more on its way,
kombu base64-encoding it into the broker and Celery carrying it through its task events
and the pool's pipe (docs/benchmarks.md, "Vector and image steps")."""


class IngestError(RuntimeError):
    """Batches were rejected or not confirmed in time; ``result`` says which."""

    def __init__(self, message: str, result: FlushResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class FlushResult:
    """What the store confirmed for the batches sent so far."""

    committed: int = 0  # stored (including by an earlier delivery of the same batch)
    rejected: int = 0
    expired: int = 0
    resent: int = 0  # re-publications of batches whose message went missing
    pending: int = 0  # batches not confirmed before the timeout
    errors: list[str] = field(default_factory=list)


Deliver = Callable[[list[Any]], bool]
"""What :meth:`Ingestor.add_batch`'s ``deliver`` is: called with a message's task args (as
the ingest task receives them) instead of publishing them; True once the batch is
delivered (committed: its done record is written), False to have it published after all."""


@dataclass
class Inflight:
    args: list[Any]
    sent_at: float
    resent: int = 0


class Sender:
    """Publishes batches and tracks them until the store confirms them. A base of
    :class:`~claw_tasks.client.Ingestor`, whose ``__init__`` sets these attributes."""

    namespace: str
    app: Any
    store: Store
    schema: Schema | None
    claim_check_bytes: int
    compress_at: str
    codec_threads: int
    resend_after: float
    _ttl: int
    _gate: MemoryGate
    _lock: threading.RLock
    _inflight: dict[str, Inflight]
    _confirmed: FlushResult
    _unsent: list[StepBatch]
    _sending: int

    def _send_or_keep(self, batch: StepBatch, deliver: Deliver | None = None) -> None:
        """Send (``deliver``: see :data:`Deliver`); if that fails (broker or Redis down),
        keep the batch for the next try (published then)."""
        try:
            self._send(batch, deliver)
        except Exception:
            with self._lock:
                self._unsent.append(batch)
            raise

    def _retry_unsent(self) -> None:
        while True:
            with self._lock:
                if not self._unsent:
                    return
                batch = self._unsent.pop(0)
                self._sending += 1
            try:
                self._send_or_keep(batch)  # same batch id: idempotent if it got through before
            finally:
                with self._lock:
                    self._sending -= 1

    def _send(self, batch: StepBatch, deliver: Deliver | None = None) -> None:
        """Publish a batch, in messages of at most a shard's capacity (``cap`` steps): a
        message of more would take every slot of its shard's ring and overwrite its own
        steps, so the ingest worker refuses one whole (dead letter ``size``). Split here,
        the ring keeps the newest ``cap`` steps, as with any run of smaller batches. The
        parts' ids derive from the batch's, so a re-send stays idempotent."""
        cap = self.store.config().cap
        if batch.n <= cap:
            self._send_message(batch, deliver)
            return
        for start in range(0, batch.n, cap):
            part = batch.take(slice(start, min(batch.n, start + cap)))  # views
            part.batch_id = _chunk_id(batch.batch_id, start)
            self._send_message(part, deliver)

    def message_ids(self, batch: StepBatch) -> list[str]:
        """The batch ids of the messages :meth:`_send` publishes ``batch`` in (itself, or
        its parts): the batch is stored once the store holds a done record for each."""
        cap = self.store.config().cap
        if batch.n <= cap:
            return self._message_ids(batch)
        out = []
        for start in range(0, batch.n, cap):
            part = batch.take(slice(start, min(batch.n, start + cap)))
            part.batch_id = _chunk_id(batch.batch_id, start)
            out += self._message_ids(part)
        return out

    def _message_ids(self, batch: StepBatch) -> list[str]:
        """The ids :meth:`_send_message` publishes a batch that fits a shard under."""
        if sum(v.nbytes for v in self._fixed(batch).values()) <= self.claim_check_bytes:
            return [batch.batch_id]
        return [part.batch_id for _, part in self._by_shard(batch)]

    def _fixed(self, batch: StepBatch) -> dict[str, np.ndarray]:
        """The batch's fixed-shape payloads that may be written in place (a compressed
        field travels in the message, encoded here or by the worker)."""
        codecs = self.schema.codecs if self.schema is not None else {}
        return {
            k: v for k, v in batch.fields.items() if isinstance(v, np.ndarray) and k not in codecs
        }

    def _send_message(self, batch: StepBatch, deliver: Deliver | None = None) -> None:
        """Publish a batch that fits a shard. Large fixed-shape payloads skip the message
        entirely: they are written in place into freshly allocated slots (one SETRANGE per
        chunk run), and the task carries only metadata, which the commit makes visible
        atomically."""
        self._gate.wait()
        codecs = self.schema.codecs if self.schema is not None else {}
        if codecs and self.compress_at == "producer":
            batch = encode_batch(batch, self.schema, self.codec_threads)  # type: ignore[arg-type]  # codecs come from a schema: it is set
        fixed = self._fixed(batch)
        if sum(v.nbytes for v in fixed.values()) <= self.claim_check_bytes:
            self._publish_batch(batch, None, deliver)
            return
        self.store.revalidate()  # never write in place into a dropped namespace
        self.schema = self.store.ensure_schema(batch.schema())
        for shard, part in self._by_shard(batch):
            row_bytes = {k: self.schema.fields[k].row_bytes for k in fixed}
            seq0, _ = self.store.allocate(shard, part.batch_id, part.n, row_bytes)
            self.store.place(shard, seq0, {k: cast(np.ndarray, part.fields[k]) for k in fixed})
            for k, v in fixed.items():
                part.fields[k] = Placed(v.dtype, (part.n, *v.shape[1:]))
            self._publish_batch(part, INLINE_BYTES, deliver)

    def _by_shard(self, batch: StepBatch) -> list[tuple[int, StepBatch]]:
        n_shards = self.store.config().n_shards
        shards = row_episode_codes(batch.episode.values, batch.episode.index) % n_shards
        if (shards == shards[0]).all():
            part = StepBatch(**batch.__dict__)
            part.fields = dict(batch.fields)
            return [(int(shards[0]), part)]
        parts = []
        for shard in np.unique(shards).tolist():
            part = batch.take(np.flatnonzero(shards == shard))
            part.batch_id = f"{batch.batch_id}.s{shard}"
            parts.append((shard, part))
        return parts

    def _publish_batch(
        self, batch: StepBatch, inline_bytes: int | None = None, deliver: Deliver | None = None
    ) -> None:
        """Publish ``batch``'s message (or hand it to ``deliver``); a payload over
        ``inline_bytes`` (default: ``claim_check_bytes``) goes by claim check. A delivered
        batch is tracked as a published one: its done record confirms it."""
        payload = batch.encode()
        if len(payload) > min(self.claim_check_bytes, inline_bytes or self.claim_check_bytes):
            key = staging_key(self.namespace, batch.batch_id)
            self.store.r.set(key, payload, ex=self._ttl)
            args = IngestArgs(self.namespace, batch.batch_id, None, key).to_args()
        else:
            args = IngestArgs(self.namespace, batch.batch_id, payload, None).to_args()
        if deliver is None or not deliver(args):
            self._publish(args)
        with self._lock:
            self._inflight[batch.batch_id] = Inflight(args, time.monotonic())

    def _publish(self, args: list[Any]) -> None:
        """Send the task; on Redis its LPUSH and its ``task-sent`` event (what Flower shows
        of a sent job) go in one round trip (kombu's publish batch; RabbitMQ publishes at
        once). Should that round trip fail, the batch is kept and sent again, idempotently."""
        with self.app.producer_or_acquire() as producer, producer.batch():
            self.app.send_task(TASK, args=args, queue="ingest", producer=producer)

    def _poll(self) -> int:
        """Collect confirmations; re-send batches unconfirmed for ``resend_after`` seconds
        (a message can be lost if a worker dies between taking and registering it; the
        commit is idempotent, so a duplicate is harmless). Returns how many are in flight."""
        self._retry_unsent()
        with self._lock:
            pending = list(self._inflight)
        if not pending:
            return 0
        replies = self.store.r.mget([done_key(self.namespace, b) for b in pending])
        now = time.monotonic()
        for batch_id, raw in zip(pending, replies, strict=True):
            with self._lock:
                entry = self._inflight.get(batch_id)
                if entry is None:
                    continue
                if raw is not None:
                    del self._inflight[batch_id]
                    out = IngestOutcome.from_bytes(cast(bytes, raw))
                    res = self._confirmed
                    res.committed += out.committed + out.replayed
                    res.rejected += out.rejected
                    res.expired += out.expired
                    res.resent += entry.resent
                    res.errors += out.errors
                    continue
                stale = now - entry.sent_at > self.resend_after
                if stale:
                    entry.sent_at = now
                    entry.resent += 1
            if stale:
                self._publish(entry.args)
        with self._lock:
            return len(self._inflight) + len(self._unsent)


def _chunk_id(batch_id: str, start: int) -> str:
    """The id of the part of batch ``batch_id`` from its step ``start`` (over a shard's
    capacity): derived, so a re-send of the batch sends the same parts."""
    return f"{batch_id}.c{start}"


def encode_batch(batch: StepBatch, schema: Schema, threads: int = 1) -> StepBatch:
    """``batch`` with its compressed fields (and an explicit next_obs of a compressed
    obs) as frames: the producer compresses (``Ingestor(compress_at="producer")``)."""
    codecs = schema.codecs
    out = StepBatch(**batch.__dict__)
    out.fields = dict(batch.fields)
    for name, codec in codecs.items():
        v = out.fields[name]
        if isinstance(v, Encoded | Placed):
            continue
        spec = schema.fields[name]
        rows = v if isinstance(v, np.ndarray) else [v.row(i) for i in range(len(v))]
        out.fields[name] = Encoded(
            codec, np.dtype(spec.dtype), (len(v), *spec.shape), encode(codec, rows, threads)
        )
    nx = batch.next_obs
    if "obs" in codecs and nx is not None and not isinstance(nx, Encoded | Placed):
        spec = schema.fields["obs"]
        rows = nx if isinstance(nx, np.ndarray) else [nx.row(i) for i in range(len(nx))]
        frames = encode(codecs["obs"], rows, threads)
        out.next_obs = Encoded(codecs["obs"], np.dtype(spec.dtype), (len(nx), *spec.shape), frames)
    return out
