"""The client SDK: ``Ingestor`` buffers steps and ships them as Celery ingest tasks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.app import client_app
from claw_tasks.backpressure import MemoryGate
from claw_tasks.batch import (
    STEP_INDEX_LIMIT,
    STR_META,
    Placed,
    Ragged,
    StepBatch,
    StrColumn,
    info_problem,
)
from claw_tasks.codec import CodecError, check_dtype
from claw_tasks.ingest import IngestOutcome
from claw_tasks.llm import prompt_key, turn_fields, turn_info
from claw_tasks.message import TASK, IngestArgs
from claw_tasks.schema import (
    MAX_STEP_BYTES,
    FieldSpec,
    Schema,
    SchemaError,
    TagKind,
    tag_column,
    tag_key,
)
from claw_tasks.settings import load_settings
from claw_tasks.store import Store
from claw_tasks.store.config import DEFAULT_CAPACITY
from claw_tasks.store.layout import row_episode_codes
from claw_tasks.store.retention import Retention

log = logging.getLogger(__name__)


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


@dataclass
class _Inflight:
    args: list[Any]
    sent_at: float
    resent: int = 0


@dataclass
class _Step:
    episode_id: str
    step_index: int
    fields: dict[str, np.ndarray]
    reward: float
    terminated: bool
    truncated: bool
    next_obs: np.ndarray | None
    info: dict[str, Any] | None
    meta: dict[str, Any]
    tags: dict[str, Any]
    priority: float | None


class Episode:
    """Steps of one episode, added in order. Use as a context manager: leaving the block
    ends the episode (:meth:`end`)."""

    def __init__(
        self, ingestor: Ingestor, episode_id: str, meta: dict[str, Any], tags: dict[str, Any]
    ):
        self.ingestor = ingestor
        self.episode_id = episode_id
        self.meta = meta
        self.tags = tags
        self.step_index = 0
        self.ended = False

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """End the episode: a later :meth:`add` raises. Its steps go out with the
        Ingestor's next batch (by count, by ``flush_interval``, or ``flush``/``close``):
        batches span episodes, so ending one sends nothing by itself. The last step's
        ``terminated``/``truncated`` are the ones it was added with; nothing is marked."""
        self.ended = True

    def add(
        self,
        obs: Any,
        action: Any,
        reward: float,
        next_obs: Any = None,
        terminated: bool = False,
        truncated: bool = False,
        info: Mapping[str, Any] | None = None,
        skill_tag: str | None = None,
        priority: float | None = None,
        **fields_and_tags: Any,
    ) -> None:
        """Add the next step. Extra keyword arrays are payload fields (e.g. ``prompt_ids``);
        extra scalars (str/int/float) are tags. Raises before buffering on bad input."""
        if self.ended:
            raise RuntimeError(
                f"episode {self.episode_id!r} has ended (its with block exited, or end() was "
                "called); start the next one with ingestor.episode()"
            )
        fields = {"obs": obs, "action": action}
        tags = dict(self.tags)
        for k, v in fields_and_tags.items():
            if isinstance(v, str | int | float | bool | np.generic):  # a scalar: a tag
                tags[k] = v
            else:
                fields[k] = v
        meta = self.meta if skill_tag is None else {**self.meta, "skill_tag": skill_tag}
        step = self.ingestor._check_step(
            self.episode_id, self.step_index, fields, reward, next_obs, info, meta, tags,
            priority, terminated, truncated,
        )  # fmt: skip
        # Accepted: the step is buffered from here on, even if the send _buffer may start
        # fails (it is kept and re-sent), so it has its index now.
        self.step_index += 1
        self.ingestor._buffer(step)


class Ingestor:
    """Buffers steps and sends them in batches (by count and by time) to ``ingest``.

    Batches above ``claim_check_bytes`` travel by claim check: the payload goes to a
    staging key with a TTL and the task message carries the key. ``retention`` sets the
    namespace's retention policy (:class:`~claw_tasks.store.retention.Retention` or its
    dict form). Near Redis ``maxmemory`` (over ``memory_high_water`` of it) a send blocks
    (``on_full="block"``, up to ``full_timeout`` s) or raises ``StoreFullError``
    (``on_full="raise"``); the steps are kept either way (:mod:`claw_tasks.backpressure`).
    """

    def __init__(
        self,
        namespace: str | None = None,
        redis_url: str | None = None,
        *,
        broker_url: str | None = None,
        flush_steps: int = 4096,
        flush_interval: float | None = 1.0,
        claim_check_bytes: int = 128 * 1024,
        capacity: int | None = None,
        n_shards: int | None = None,
        schema: Schema | None = None,
        max_step_bytes: int = MAX_STEP_BYTES,
        ragged: Sequence[str] = (),
        resend_after: float = 30.0,
        retention: Retention | Mapping[str, Any] | None = None,
        on_full: str = "block",
        memory_high_water: float = 0.95,
        full_timeout: float = 300.0,
    ) -> None:
        settings = load_settings()
        retention = Retention.of(retention)
        self.namespace = namespace or settings.namespace
        self.redis_url = redis_url or settings.redis_url
        self.app = client_app(
            broker_url or (settings.broker_url if redis_url is None else redis_url)
        )
        self.store = Store(self.redis_url, self.namespace)
        if not self.store.exists():
            self.store.create(capacity or DEFAULT_CAPACITY, n_shards or 1, schema, retention)
        elif capacity is not None or n_shards is not None:  # must match the namespace
            cfg = self.store.config(refresh=True)
            self.store.create(capacity or cfg.capacity, n_shards or cfg.n_shards, schema)
        elif schema is not None:
            self.store.ensure_schema(schema)
        if retention is not None and self.store.config().retention != retention:
            self.store.set_retention(retention)
        self._gate = MemoryGate(self.store.r, memory_high_water, on_full, full_timeout)
        self.schema: Schema | None = self.store.config(refresh=True).schema
        self.flush_steps = flush_steps
        self.flush_interval = flush_interval
        self.claim_check_bytes = claim_check_bytes
        self.max_step_bytes = max_step_bytes
        self.ragged = tuple(ragged)  # fields with a variable leading dimension
        self._ttl = settings.stage_ttl
        self._steps: list[_Step] = []
        self._first_at = 0.0
        self.resend_after = resend_after
        self._inflight: dict[str, _Inflight] = {}  # sent, not yet confirmed by the store
        self._confirmed = FlushResult()
        self._unsent: list[StepBatch] = []  # built, not yet handed to the broker
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._episodes = 0
        self._timer: threading.Thread | None = None
        if flush_interval:
            self._timer = threading.Thread(target=self._tick, name="claw-ingest-flush", daemon=True)
            self._timer.start()

    # ---- producing -----------------------------------------------------------------
    def episode(
        self,
        episode_id: str | None = None,
        *,
        task_id: str | None = None,
        agent_id: str | None = None,
        skill_tag: str | None = None,
        reward_source: str | None = None,
        policy_version: int | None = None,
        **tags: Any,
    ) -> Episode:
        """A new episode writer; ``episode_id`` defaults to a fresh unique id."""
        if episode_id is None:
            with self._lock:
                self._episodes += 1
                episode_id = f"{time.time_ns():x}-{id(self):x}-{self._episodes}"
        if policy_version is not None:
            _check_int32(policy_version, "policy_version")
        meta = {
            "task_id": task_id, "agent_id": agent_id, "skill_tag": skill_tag,
            "reward_source": reward_source, "policy_version": policy_version,
        }  # fmt: skip
        return Episode(self, str(episode_id), meta, tags)

    def llm_turn(
        self,
        trajectory_uid: str,
        turn: int,
        prompt_ids: Any,
        response_ids: Any,
        response_logprobs: Any,
        *,
        prompt_uid: str | None = None,
        response_mask: Any = None,
        reward: float = 0.0,
        is_last: bool = False,
        truncated: bool = False,
        policy_version: int | None = None,
        reward_source: str | None = None,
        task_id: str | None = None,
        agent_id: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tool_calls: Sequence[Mapping[str, Any]] | None = None,
        retokenized: bool = False,
        info: Mapping[str, Any] | None = None,
        **tags: str | float,
    ) -> None:
        """Buffer one LLM agent turn (the ``Schema.llm`` preset; docs/llm.md): the
        trajectory is the episode, ``turn`` its step_index, ``prompt_uid`` the GRPO group
        key (stored hashed in ``tags.prompt_uid``, as written in ``info``), ``is_last``
        the terminated flag. Rewards known only later go through ``attach_rewards``.
        Extra keywords are free tags (task, dataset, difficulty). Raises before buffering
        on bad input; a namespace without a schema gets ``Schema.llm``."""
        if self.schema is None:
            self.schema = Schema.llm(response_mask=response_mask is not None)
        where = f"turn {turn} of trajectory {trajectory_uid!r}"
        fields = turn_fields(
            prompt_ids, response_ids, response_logprobs, response_mask,
            "response_mask" in self.schema.fields, where,
        )  # fmt: skip
        if prompt_uid is not None:
            tags["prompt_uid"] = prompt_key(prompt_uid)
        tags["retokenized"] = 1.0 if retokenized else 0.0
        meta = {
            "task_id": task_id, "agent_id": agent_id, "skill_tag": None,
            "reward_source": reward_source, "policy_version": policy_version,
        }  # fmt: skip
        step = self._check_step(
            str(trajectory_uid), int(turn), fields, reward, None,
            turn_info(prompt_uid, messages, tool_calls, info), meta, tags, None,
            is_last, truncated,
        )  # fmt: skip
        self._buffer(step)

    def add_batch(self, columns: Mapping[str, Any]) -> int:
        """Add many steps at once from columns (vectorized producers).

        Required: ``obs``, ``action``, ``reward``, ``episode_id`` (one id or one per row),
        ``step_index``. Optional: ``terminated``, ``truncated``, ``priority``,
        ``policy_version``, ``agent_id``/``task_id``/``skill_tag``/``reward_source`` (one
        value or one per row), ``tags`` (name -> value or column), further payload arrays
        under ``fields``. Raises before sending anything if any row is bad.
        """
        cols = dict(columns)
        missing = [
            k for k in ("obs", "action", "reward", "episode_id", "step_index") if k not in cols
        ]
        if missing:
            raise ValueError(f"add_batch: missing column(s) {', '.join(missing)}")
        n = len(cols["reward"])
        fields: dict[str, Any] = {"obs": cols.pop("obs"), "action": cols.pop("action")}
        fields.update(cols.pop("fields", {}))
        batch = StepBatch(
            episode=_str_column(cols.pop("episode_id"), n, "episode_id"),
            step_index=_column(cols.pop("step_index"), n, np.int64, "step_index"),
            reward=_column(cols.pop("reward"), n, np.float32, "reward"),
            terminated=_column(cols.pop("terminated", False), n, bool, "terminated"),
            truncated=_column(cols.pop("truncated", False), n, bool, "truncated"),
            fields={k: self._field_column(k, v, n) for k, v in fields.items()},
            priority=_opt_column(cols.pop("priority", None), n, np.float32),
            policy_version=_opt_column(cols.pop("policy_version", None), n, np.int64),
        )
        for k in STR_META:
            if k in cols:
                batch.strs[k] = _str_column(cols.pop(k), n, k)
        for name, v in dict(cols.pop("tags", {})).items():
            _add_tag(batch, name, v, n)
        if cols:
            raise ValueError(f"add_batch: unknown column(s) {', '.join(sorted(cols))}")
        self._check_batch(batch)
        for start in range(0, n, self.flush_steps):
            stop = min(n, start + self.flush_steps)
            part = batch if stop - start == n else batch.take(slice(start, stop))  # views
            part.batch_id = f"{batch.batch_id}.{start}"
            self._send_or_keep(part)
        return n

    def _field_column(self, name: str, v: Any, n: int) -> np.ndarray | Ragged:
        spec = self.schema.fields.get(name) if self.schema else None
        if isinstance(v, Ragged):
            return v
        if (spec is not None and spec.ragged) or name in self.ragged:
            return Ragged.of(list(v))
        arr = _as_array(v, f"field '{name}'")
        if arr.ndim == 0 or arr.shape[0] != n:
            raise SchemaError(f"field '{name}' has {arr.shape[:1]} rows, expected {n}")
        return arr

    # ---- validation ----------------------------------------------------------------
    def _check_step(
        self, episode_id: str, step_index: int, raw: dict[str, Any], reward: Any, next_obs: Any,
        info: Mapping[str, Any] | None, meta: dict[str, Any], tags: dict[str, Any],
        priority: float | None, terminated: bool, truncated: bool,
    ) -> _Step:  # fmt: skip
        where = f"step {step_index} of episode {episode_id!r}"
        fields = {k: _as_array(v, f"field '{k}' of {where}") for k, v in raw.items()}
        schema = self.schema
        if schema is None:
            schema = self.schema = _schema_of_step(fields, tags, self.ragged)
        _check_fields(schema, fields, where)
        r = float(reward)
        if not np.isfinite(r):
            raise SchemaError(f"{where}: reward is {r} (must be finite)")
        if priority is not None:
            priority = float(priority)
            if not (np.isfinite(priority) and priority >= 0):
                raise SchemaError(f"{where}: priority is {priority} (must be finite and >= 0)")
        _check_int32(step_index, f"{where}: step_index")
        nbytes = sum(a.nbytes for a in fields.values())
        if nbytes > self.max_step_bytes:
            raise SchemaError(f"{where}: {nbytes} payload bytes > limit {self.max_step_bytes}")
        nx = None
        if next_obs is not None:
            nx = _as_array(next_obs, f"next_obs of {where}")
            _check_fields(schema, {"obs": nx}, where, label="next_obs")
        try:
            self.schema = schema.with_tags(_tag_kinds(tags))
        except SchemaError as e:
            raise SchemaError(f"{where}: {e}") from None
        if info:
            problem = info_problem(dict(info))
            if problem is not None:
                raise SchemaError(f"{where}: {problem}")
        return _Step(
            episode_id, step_index, fields, r, bool(terminated), bool(truncated), nx,
            dict(info) if info else None, meta, tags, priority,
        )  # fmt: skip

    def _check_batch(self, batch: StepBatch) -> None:
        batch.check_columns()
        implied = batch.schema()
        if self.schema is None:
            self.schema = implied
        self.schema = self.schema.merged(implied)
        errors = batch.row_errors(self.max_step_bytes)
        if errors:
            first = sorted(errors)[:5]
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise SchemaError("; ".join(errors[i] for i in first) + more)

    # ---- buffering and sending -----------------------------------------------------
    def _buffer(self, step: _Step) -> None:
        with self._lock:
            if not self._steps:
                self._first_at = time.monotonic()
            self._steps.append(step)
            if len(self._steps) >= self.flush_steps:
                self._send_buffer()

    def _send_buffer(self) -> None:
        with self._lock:
            steps, self._steps = self._steps, []
        if steps:
            assert self.schema is not None
            self._send_or_keep(_steps_to_batch(steps, self.schema))

    def _send_or_keep(self, batch: StepBatch) -> None:
        """Send; if that fails (broker or Redis down), keep the batch for the next try."""
        try:
            self._send(batch)
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
            self._send_or_keep(batch)  # same batch id: idempotent if it got through before

    def _send(self, batch: StepBatch) -> None:
        """Publish a batch. Large fixed-shape payloads skip the message entirely: they are
        written in place into freshly allocated slots (one SETRANGE per chunk run), and
        the task carries only metadata, which the commit makes visible atomically."""
        self._gate.wait()
        fixed = {k: v for k, v in batch.fields.items() if isinstance(v, np.ndarray)}
        if sum(v.nbytes for v in fixed.values()) <= self.claim_check_bytes:
            self._publish_batch(batch)
            return
        self.store.revalidate()  # never write in place into a dropped namespace
        self.schema = self.store.ensure_schema(batch.schema())
        for shard, part in self._by_shard(batch):
            row_bytes = {k: self.schema.fields[k].row_bytes for k in fixed}
            seq0, _ = self.store.allocate(shard, part.batch_id, part.n, row_bytes)
            self.store.place(shard, seq0, {k: part.fields[k] for k in fixed})
            for k, v in fixed.items():
                part.fields[k] = Placed(v.dtype, (part.n, *v.shape[1:]))
            self._publish_batch(part)

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

    def _publish_batch(self, batch: StepBatch) -> None:
        payload = batch.encode()
        if len(payload) > self.claim_check_bytes:
            key = self.store.keys.stage(batch.batch_id)
            self.store.r.set(key, payload, ex=self._ttl)
            args = IngestArgs(self.namespace, batch.batch_id, None, key).to_args()
        else:
            args = IngestArgs(self.namespace, batch.batch_id, payload, None).to_args()
        self._publish(args)
        with self._lock:
            self._inflight[batch.batch_id] = _Inflight(args, time.monotonic())

    def _publish(self, args: list[Any]) -> None:
        with self.app.producer_or_acquire() as producer:
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
        replies = self.store.r.mget([self.store.keys.done(b) for b in pending])
        now = time.monotonic()
        for batch_id, raw in zip(pending, replies, strict=True):
            with self._lock:
                entry = self._inflight.get(batch_id)
                if entry is None:
                    continue
                if raw is not None:
                    del self._inflight[batch_id]
                    out = IngestOutcome.from_bytes(raw)
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

    def _tick(self) -> None:
        assert self.flush_interval
        last_poll = time.monotonic()
        while not self._closed.wait(self.flush_interval / 4):
            try:
                with self._lock:
                    due = self._steps and time.monotonic() - self._first_at >= self.flush_interval
                if due:
                    self._send_buffer()
                if time.monotonic() - last_poll > max(1.0, self.flush_interval):
                    last_poll = time.monotonic()
                    self._poll()
            except Exception:  # kept for the next tick; this thread must not die
                log.warning("background flush failed; will retry", exc_info=True)

    def flush(self, wait: bool = True, timeout: float = 60.0) -> FlushResult:
        """Send what is buffered; with ``wait``, block until the store confirms every batch
        sent so far and return what was committed (and rejected) since the last flush."""
        self._send_buffer()
        if not wait:
            return FlushResult()
        self._retry_unsent()
        deadline = time.monotonic() + timeout
        delay = 0.002
        while (left := self._poll()) and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        with self._lock:
            result, self._confirmed = self._confirmed, FlushResult()
        if left:
            result.pending = left
            raise IngestError(
                f"{left} batch(es) not confirmed within {timeout}s: no ingest worker stored "
                "them. Is the stack running? Start it with `claw up` in another terminal (it "
                "runs the workers). The batches stay in flight and are re-sent; flush again to "
                "keep waiting.",
                result,
            )
        return result

    def close(self, timeout: float = 60.0) -> FlushResult:
        """Flush, wait for confirmation, stop the timer, close the connections."""
        self._closed.set()
        if self._timer is not None:
            self._timer.join()
        try:
            return self.flush(wait=True, timeout=timeout)
        finally:
            if not self._unsent and not self._inflight:
                self.store.r.close()

    def __enter__(self) -> Ingestor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- helpers -------------------------------------------------------------------------
def _as_array(v: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(v)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{what}: cannot be an array ({e})") from None
    try:
        check_dtype(arr.dtype, what)
    except CodecError as e:
        raise SchemaError(str(e)) from None
    return arr


def _schema_of_step(
    fields: dict[str, np.ndarray], tags: dict[str, Any], ragged: Sequence[str]
) -> Schema:
    def shape(k: str, a: np.ndarray) -> tuple[int | None, ...]:
        return (None, *a.shape[1:]) if k in ragged else tuple(a.shape)

    schema = Schema(
        fields={k: FieldSpec(a.dtype.str, shape(k, a)) for k, a in fields.items()},
        tags=_tag_kinds(tags),
    )
    schema.check_self()
    return schema


def _tag_kinds(tags: Mapping[str, Any]) -> dict[str, TagKind]:
    return {k: "str" if isinstance(v, str) else "num" for k, v in tags.items()}


def _check_fields(
    schema: Schema, fields: dict[str, np.ndarray], where: str, label: str = ""
) -> None:
    if not label:
        unknown = set(fields) - set(schema.fields)
        if unknown:
            raise SchemaError(f"{where}: field(s) {', '.join(sorted(unknown))} not in the schema")
        missing = set(schema.fields) - set(fields)
        if missing:
            raise SchemaError(f"{where}: missing field(s) {', '.join(sorted(missing))}")
    for k, a in fields.items():
        spec = schema.fields[k]
        name = label or k
        if a.dtype.str != np.dtype(spec.dtype).str:
            raise SchemaError(
                f"{where}: field '{name}' has dtype {a.dtype.name}, schema says "
                f"{np.dtype(spec.dtype).name} (no silent casts)"
            )
        ok = (
            a.ndim == len(spec.shape) and tuple(a.shape[1:]) == tuple(spec.shape[1:])
            if spec.ragged
            else tuple(a.shape) == tuple(spec.shape)
        )
        if not ok:
            raise SchemaError(
                f"{where}: field '{name}' has shape {tuple(a.shape)}, schema says {spec.describe()}"
            )


def _check_int32(value: Any, what: str) -> None:
    """Stored as int32: refuse what would wrap instead of storing it wrapped."""
    if not isinstance(value, int | np.integer) or not 0 <= int(value) < STEP_INDEX_LIMIT:
        raise SchemaError(f"{what} {value!r} must be an integer in [0, 2**31)")


def _column(v: Any, n: int, dtype: Any, name: str) -> np.ndarray:
    arr = np.asarray(v)
    if arr.ndim == 0:
        return np.full(n, arr, dtype)
    if arr.shape != (n,):
        raise SchemaError(f"column '{name}' has shape {arr.shape}, expected ({n},)")
    if dtype is bool or np.dtype(dtype).kind == arr.dtype.kind or arr.dtype.kind in "biu":
        return arr.astype(dtype, copy=False)
    if np.dtype(dtype).kind == "f" and arr.dtype.kind == "f":
        return arr.astype(dtype, copy=False)
    raise SchemaError(f"column '{name}' has dtype {arr.dtype}, expected {np.dtype(dtype).name}")


def _opt_column(v: Any, n: int, dtype: Any) -> np.ndarray | None:
    return None if v is None else np.asarray(np.broadcast_to(np.asarray(v, dtype), (n,)))


def _str_column(v: Any, n: int, name: str) -> StrColumn:
    if isinstance(v, str | int) or v is None:
        return StrColumn.constant(v, n)
    if len(v) != n:
        raise SchemaError(f"column '{name}' has {len(v)} rows, expected {n}")
    return StrColumn.of(list(v))


def _add_tag(batch: StepBatch, name: str, v: Any, n: int) -> None:
    sample = v if np.ndim(v) == 0 else next(iter(v), None)
    if isinstance(sample, str):
        batch.strs[tag_column(name)] = _str_column(v, n, tag_key(name))
    else:
        batch.nums[tag_column(name)] = np.asarray(np.broadcast_to(np.asarray(v, np.float64), (n,)))


def _steps_to_batch(steps: Sequence[_Step], schema: Schema) -> StepBatch:
    n = len(steps)
    fields: dict[str, np.ndarray | Ragged] = {}
    for k, spec in schema.fields.items():
        rows = [s.fields[k] for s in steps]
        fields[k] = Ragged.of(rows, spec.dtype) if spec.ragged else np.stack(rows)
    nx_rows = [i for i, s in enumerate(steps) if s.next_obs is not None]
    nx_vals = [steps[i].next_obs for i in nx_rows]
    next_obs: np.ndarray | Ragged | None = None
    if nx_vals:
        ragged = schema.fields["obs"].ragged
        next_obs = Ragged.of(nx_vals) if ragged else np.stack(nx_vals)  # type: ignore[arg-type]
    info_rows = [i for i, s in enumerate(steps) if s.info]
    batch = StepBatch(
        episode=StrColumn.of([s.episode_id for s in steps]),
        step_index=np.fromiter((s.step_index for s in steps), np.int64, n),
        reward=np.fromiter((s.reward for s in steps), np.float32, n),
        terminated=np.fromiter((s.terminated for s in steps), bool, n),
        truncated=np.fromiter((s.truncated for s in steps), bool, n),
        fields=fields,
        priority=None
        if all(s.priority is None for s in steps)
        else np.array([np.nan if s.priority is None else s.priority for s in steps], np.float32),
        policy_version=np.array([s.meta.get("policy_version") or 0 for s in steps], np.int32),
        next_rows=np.array(nx_rows, np.int32),
        next_obs=next_obs,
        info_rows=np.array(info_rows, np.int32),
        info=[steps[i].info for i in info_rows],  # type: ignore[misc]
    )
    for k in STR_META:
        if any(s.meta.get(k) is not None for s in steps):
            batch.strs[k] = StrColumn.of([s.meta.get(k) for s in steps])
    tag_names = dict.fromkeys(k for s in steps for k in s.tags)
    for name in tag_names:
        vals = [s.tags.get(name) for s in steps]
        if any(isinstance(v, str) for v in vals):
            batch.strs[tag_column(name)] = StrColumn.of(vals)
        else:
            batch.nums[tag_column(name)] = np.array(
                [np.nan if v is None else v for v in vals], np.float64
            )
    return batch
