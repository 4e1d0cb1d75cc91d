"""``Ingestor``: the producing API (episodes, LLM turns, column batches) and its checks;
the buffer, the sending thread, ``flush`` and ``close`` are in
:mod:`claw_tasks.client.buffering`, publishing and confirmation in
:mod:`claw_tasks.client.sending`."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.broker.app import client_app
from claw_tasks.client.backpressure import MemoryGate
from claw_tasks.client.buffering import Buffering
from claw_tasks.client.checks import (
    Step,
    add_tag,
    as_array,
    check_fields,
    check_int32,
    column,
    field_column,
    opt_column,
    schema_of_step,
    step_meta,
    steps_to_batch,
    str_column,
    tag_kinds,
)
from claw_tasks.client.columns import StepColumns
from claw_tasks.client.episode import Episode
from claw_tasks.client.sending import Deliver, FlushResult, Inflight
from claw_tasks.format.batch import (
    STR_META,
    StepBatch,
    as_stored,
    check_batch_id,
    info_problem,
    tag_value_problem,
)
from claw_tasks.format.schema import MAX_STEP_BYTES, Schema, SchemaError
from claw_tasks.format.turns import prompt_key, turn_fields, turn_info
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.store.config import DEFAULT_CAPACITY
from claw_tasks.store.retention import Retention

log = logging.getLogger(__name__)


class Ingestor(Buffering):
    """Buffers steps and sends them in batches (by count and by time) to ``ingest``.

    Where the steps go:

    - ``namespace``: the namespace written to (default ``CLAW_NAMESPACE``); created on
      first use with ``capacity``, ``n_shards``, ``schema`` and ``retention``.
    - ``redis_url``: the data store (default ``CLAW_REDIS_URL``).
    - ``broker_url``: the Celery broker the ingest tasks are published to (default: the
      rule of :func:`claw_tasks.settings.broker_for`, from ``redis_url``); the ingest
      workers must listen on the same one.

    The namespace, when this Ingestor creates it (an existing one keeps its own):

    - ``capacity``: steps the ring keeps (default 1,000,000); ``n_shards``: shards they
      are spread over by episode (default 1). Given for an existing namespace, both
      must match it (NamespaceError otherwise).
    - ``schema``: the fields and tags (default: inferred from the first step or batch);
      for an existing namespace it is checked against the stored one (new tags added).
    - ``retention``: the retention policy
      (:class:`~claw_tasks.store.retention.Retention` or its dict form); replaces the
      stored one when it differs.
    - ``codecs``: field -> codec text (e.g. ``{"obs": "png"}``), applied to the given or
      inferred schema (docs/architecture.md, "Compressed fields").

    Batching and sending:

    - ``flush_steps``: buffered steps that make a batch (and the most ``add_batch`` puts
      in one message).
    - ``flush_interval``: seconds after which a non-empty buffer is sent anyway, by a
      background thread that also collects confirmations; None: no thread (send on
      ``flush_steps``, ``flush`` and ``close`` only).
    - ``claim_check_bytes``: above this many fixed-shape payload bytes a batch's payload
      is written in place (``Store.allocate``/``place``) and the message carries only its
      metadata; a message still above it (such a batch's: above 16 KiB) travels by claim
      check (a staging key with a TTL, ``CLAW_STAGE_TTL``, named in the message).
    - ``resend_after``: seconds without a confirmation after which a batch is published
      again (its message may have been lost with a worker; commits are idempotent).
    - ``compress_at``: who encodes compressed fields, ``"producer"`` (here: less to send)
      or ``"worker"`` (the ingest worker: spares this CPU); default ``CLAW_COMPRESS_AT``,
      else ``"producer"``. A ``schema`` may carry codecs itself.
    - ``codec_threads``: threads this process encodes frames in (``compress_at="producer"``).

    Checks and backpressure:

    - ``max_step_bytes``: payload bytes a step may have (default 16 MiB); a larger one
      raises SchemaError before it is buffered.
    - ``ragged``: fields whose leading dimension varies from step to step (token ids).
    - ``on_full``, ``memory_high_water``, ``full_timeout``: above ``memory_high_water`` of
      Redis ``maxmemory`` a send blocks (``on_full="block"``, up to ``full_timeout`` s,
      then StoreFullError) or raises StoreFullError at once (``on_full="raise"``); the
      steps are kept either way (:mod:`claw_tasks.client.backpressure`).
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
        codecs: Mapping[str, str | None] | None = None,
        compress_at: str | None = None,
        codec_threads: int = 1,
    ) -> None:
        settings = get_settings()
        retention = Retention.of(retention)
        self.compress_at = compress_at or settings.compress_at
        if self.compress_at not in ("producer", "worker"):
            raise ValueError(f"compress_at={self.compress_at!r}: 'producer' or 'worker'")
        self.codec_threads = codec_threads
        self.codecs = dict(codecs or {})
        if schema is not None and self.codecs:
            schema = schema.with_codecs(self.codecs)
        self.namespace = namespace or settings.namespace
        self.redis_url = redis_url or settings.redis_url
        self.app = client_app(broker_url or settings.broker_for(redis_url))
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
        if self.schema is not None and self.codecs:  # the namespace's codecs must be these
            self.schema = self.store.ensure_schema(self.schema.with_codecs(self.codecs))
        self.flush_steps = flush_steps
        self.flush_interval = flush_interval
        self.claim_check_bytes = claim_check_bytes
        self.max_step_bytes = max_step_bytes
        self.ragged = tuple(ragged)  # fields with a variable leading dimension
        self._ttl = settings.stage_ttl
        self._steps: list[Step] = []
        self._first_at = 0.0
        self.resend_after = resend_after
        self._inflight: dict[str, Inflight] = {}  # sent, not yet confirmed by the store
        self._confirmed = FlushResult()
        self._unsent: list[StepBatch] = []  # built, not yet handed to the broker
        self._lock = threading.RLock()
        self._sending = 0  # batches taken from the buffer (or the unsent list) not yet sent
        self._closed = threading.Event()
        self._episodes = 0
        self._writers: list[StepColumns] = []  # flushed with the Ingestor, as long as it lives
        self._queue: deque[StepBatch] = deque()  # full columns for the sending thread
        self._queued = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None
        self._timer: threading.Thread | None = None
        if flush_interval:
            self._timer = threading.Thread(target=self._tick, name="claw-ingest-flush", daemon=True)
            self._timer.start()

    # ---- producing -----------------------------------------------------------------
    def new_episode_id(self) -> str:
        """A fresh unique episode id (what :meth:`episode` names an episode by default)."""
        with self._lock:
            self._episodes += 1
            return f"{time.time_ns():x}-{id(self):x}-{self._episodes}"

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
            episode_id = self.new_episode_id()
        meta = step_meta(task_id, agent_id, skill_tag, reward_source, policy_version)
        return Episode(self._check_step, self._buffer, str(episode_id), meta, tags)

    def columns(
        self,
        *,
        task_id: str | None = None,
        agent_id: str | None = None,
        skill_tag: str | None = None,
        reward_source: str | None = None,
        policy_version: int | None = None,
        **tags: Any,
    ) -> StepColumns:
        """A column writer of steps of this Ingestor's schema (known: given, stored or
        inferred; fixed-shape fields), ``flush_steps`` rows a batch, with these metadata
        and tags on every step: :meth:`StepColumns.append` copies a step into its columns,
        and full batches are encoded and published by this Ingestor's sending thread (a
        failed send is kept and retried; :meth:`flush` raises if it still fails). The
        Ingestor keeps every writer it made: its rows go out with the Ingestor's flushes
        and ``close``, whether or not the caller still holds it."""
        if self.schema is None:
            raise SchemaError(
                "Ingestor.columns needs the namespace's schema: pass schema= (or add a "
                "first step through an episode)"
            )
        meta = step_meta(task_id, agent_id, skill_tag, reward_source, policy_version)
        self.schema = self.schema.with_tags(tag_kinds(tags))
        writer = StepColumns(self.schema, self.flush_steps, self._submit, meta, tags)
        with self._lock:
            self._writers.append(writer)
        return writer

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
        self._buffer(
            self.llm_step(
                trajectory_uid,
                turn,
                prompt_ids,
                response_ids,
                response_logprobs,
                prompt_uid=prompt_uid,
                response_mask=response_mask,
                reward=reward,
                is_last=is_last,
                truncated=truncated,
                policy_version=policy_version,
                reward_source=reward_source,
                task_id=task_id,
                agent_id=agent_id,
                messages=messages,
                tool_calls=tool_calls,
                retokenized=retokenized,
                info=info,
                **tags,
            )
        )

    def llm_step(
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
    ) -> Step:
        """The checked step :meth:`llm_turn` buffers (SchemaError on bad input), for
        :meth:`send_steps`."""
        if self.schema is None:
            self.schema = Schema.llm(response_mask=response_mask is not None)
        where = f"turn {turn} of trajectory {trajectory_uid!r}"
        fields = turn_fields(
            prompt_ids,
            response_ids,
            response_logprobs,
            response_mask,
            "response_mask" in self.schema.fields,
            where,
        )
        if prompt_uid is not None:
            tags["prompt_uid"] = prompt_key(prompt_uid)
        tags["retokenized"] = 1.0 if retokenized else 0.0
        meta = {
            "task_id": task_id,
            "agent_id": agent_id,
            "skill_tag": None,
            "reward_source": reward_source,
            "policy_version": policy_version,
        }
        step = self._check_step(
            str(trajectory_uid),
            int(turn),
            fields,
            reward,
            None,
            turn_info(prompt_uid, messages, tool_calls, info),
            meta,
            tags,
            None,
            is_last,
            truncated,
        )
        return step

    def send_steps(self, steps: Sequence[Step], batch_id: str) -> list[str]:
        """Publish checked steps (:meth:`llm_step`) now as one batch named ``batch_id``,
        past the buffer, tracked like every batch (re-sent until confirmed; ``flush``
        waits for it). A producer that may send the same steps again after a restart
        names the batch so: the ingest worker commits a batch id once. Returns the ids of
        the messages it goes in (``batch_id``, or its parts' past a shard's capacity): it is
        stored once each has its done record. A publish that fails (broker or Redis
        unreachable) is logged, and the batch kept and re-sent under the same ids."""
        if self.schema is None:
            raise SchemaError("send_steps takes steps made by llm_step (no schema yet)")
        batch = steps_to_batch(steps, self.schema)
        batch.batch_id = check_batch_id(batch_id)
        ids = self.message_ids(batch)
        with self._lock:
            self._sending += 1
        try:
            self._send_or_keep(batch)
        except Exception as e:
            log.warning("publishing batch %s failed (kept and re-sent): %s", batch_id, e)
        finally:
            with self._lock:
                self._sending -= 1
        return ids

    def add_batch(self, columns: Mapping[str, Any], *, deliver: Deliver | None = None) -> int:
        """Add many steps at once from columns (vectorized producers).

        Required: ``obs``, ``action``, ``reward``, ``episode_id`` (one id, one per row, or a
        :class:`~claw_tasks.format.columns.StrColumn` of them), ``step_index``. Optional:
        ``terminated``, ``truncated``, ``priority``, ``policy_version``,
        ``agent_id``/``task_id``/``skill_tag``/``reward_source`` (one value or one per
        row), ``tags`` (name -> value or column), further payload arrays
        under ``fields``. Raises before sending anything if any row is bad.

        ``deliver``: called with each message's task args instead of publishing it
        (:data:`~claw_tasks.client.sending.Deliver`), by a caller that commits the
        batch itself with the ingest worker's code and waits for it (an on-policy learner
        committing a rollout's last steps: ``ClawRolloutBuffer(form_here=True)``); a
        message it returns False for is published.
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
            episode=str_column(cols.pop("episode_id"), n, "episode_id"),
            step_index=column(cols.pop("step_index"), n, np.int64, "step_index"),
            reward=column(cols.pop("reward"), n, np.float32, "reward"),
            terminated=column(cols.pop("terminated", False), n, bool, "terminated"),
            truncated=column(cols.pop("truncated", False), n, bool, "truncated"),
            fields={k: field_column(k, v, n, self.schema, self.ragged) for k, v in fields.items()},
            priority=opt_column(cols.pop("priority", None), n, np.float32),
            policy_version=opt_column(cols.pop("policy_version", None), n, np.int64),
        )
        for k in STR_META:
            if k in cols:
                batch.strs[k] = str_column(cols.pop(k), n, k)
        for name, v in dict(cols.pop("tags", {})).items():
            add_tag(batch, name, v, n)
        if cols:
            raise ValueError(f"add_batch: unknown column(s) {', '.join(sorted(cols))}")
        self._check_batch(batch)
        for start in range(0, n, self.flush_steps):
            stop = min(n, start + self.flush_steps)
            part = batch if stop - start == n else batch.take(slice(start, stop))  # views
            part.batch_id = f"{batch.batch_id}.{start}"
            self._send_or_keep(part, deliver)
        return n

    # ---- validation ----------------------------------------------------------------
    def _check_step(
        self,
        episode_id: str,
        step_index: int,
        raw: dict[str, Any],
        reward: Any,
        next_obs: Any,
        info: Mapping[str, Any] | None,
        meta: dict[str, Any],
        tags: dict[str, Any],
        priority: float | None,
        terminated: bool,
        truncated: bool,
    ) -> Step:
        where = f"step {step_index} of episode {episode_id!r}"
        fields = {k: as_array(v, f"field '{k}' of {where}") for k, v in raw.items()}
        schema = self.schema
        if schema is None:
            schema = schema_of_step(fields, tags, self.ragged)
            if self.codecs:  # stored now: the first batch's raw rows would imply none
                schema = self.store.ensure_schema(schema.with_codecs(self.codecs))
            self.schema = schema
        check_fields(schema, fields, where)
        # Each value is checked in the type it is stored and used in (float32 for the
        # reward, the priority and the rollout tags), before anything is buffered.
        r = _float(reward, f"{where}: reward")
        if not np.isfinite(as_stored(np.array([r]), np.float32))[0]:
            raise SchemaError(f"{where}: reward is {r} (must be finite as float32)")
        if priority is not None:
            priority = _float(priority, f"{where}: priority")
            p32 = as_stored(np.array([priority]), np.float32)[0]
            if not (np.isfinite(p32) and priority >= 0):
                raise SchemaError(
                    f"{where}: priority is {priority} (must be finite and >= 0 as float32)"
                )
        for name, v in tags.items():
            if not isinstance(v, str) and (problem := tag_value_problem(name, v)) is not None:
                raise SchemaError(f"{where}: {problem}")
        check_int32(step_index, f"{where}: step_index")
        nbytes = sum(a.nbytes for a in fields.values())
        if nbytes > self.max_step_bytes:
            raise SchemaError(f"{where}: {nbytes} payload bytes > limit {self.max_step_bytes}")
        nx = None
        if next_obs is not None:
            nx = as_array(next_obs, f"next_obs of {where}")
            check_fields(schema, {"obs": nx}, where, label="next_obs")
        try:
            self.schema = schema.with_tags(tag_kinds(tags))
        except SchemaError as e:
            raise SchemaError(f"{where}: {e}") from None
        if info:
            problem = info_problem(dict(info))
            if problem is not None:
                raise SchemaError(f"{where}: {problem}")
        return Step(
            episode_id,
            step_index,
            fields,
            r,
            bool(terminated),
            bool(truncated),
            nx,
            dict(info) if info else None,
            meta,
            tags,
            priority,
        )

    def _check_batch(self, batch: StepBatch) -> None:
        batch.check_columns()
        implied = batch.schema()
        if self.schema is None:
            self.schema = implied
            if self.codecs:
                self.schema = self.store.ensure_schema(implied.with_codecs(self.codecs))
        self.schema = self.schema.merged(implied)
        errors = batch.row_errors(self.max_step_bytes)
        if errors:
            first = sorted(errors)[:5]
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise SchemaError("; ".join(errors[i] for i in first) + more)

    def __enter__(self) -> Ingestor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _float(value: Any, what: str) -> float:
    """``value`` as a float; a one-line SchemaError naming ``what`` when it is not a number
    (or an int past float64)."""
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):
        raise SchemaError(f"{what} is {str(value)[:40]!r} (must be a finite number)") from None
