"""``StepColumns``: steps of a known schema copied straight into preallocated columns.

``Episode.add`` checks a step, builds a ``Step`` of it, and the Ingestor turns a list of
those into columns when it sends, on the producer's thread: ~40-100 µs of the producer's
time per step (docs/benchmarks.md). A ``StepColumns`` runs the same checks on the step's
values as scalars and attributes (shape and dtype against the schema, finite reward and
priority, step index range) and copies it into the next row of its columns; a full batch
goes to the Ingestor's sending thread, which encodes and publishes it. What stays on the
producer's thread is the copy (a few µs a step).

For the fixed-shape fields of a schema known up front (the replay-buffer adapters);
ragged fields, per-step tags or ``info`` go through :class:`~claw_tasks.client.Episode`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from claw_tasks.client.checks import check_fields, check_int32
from claw_tasks.format.batch import STR_META, StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import Schema, SchemaError, tag_column

Submit = Callable[[StepBatch], None]
"""Takes a full (or flushed) batch: the columns are its own from then on."""
GROW_ROWS = 1024
"""Rows allocated at first; the columns double from there up to a batch's rows."""


class StepColumns:
    """Steps of ``schema`` (fixed-shape fields only) appended into columns of ``rows``
    rows; each full batch goes to ``submit``. ``meta`` (``task_id``, ``agent_id``,
    ``skill_tag``, ``reward_source``, ``policy_version``) and ``tags`` go on every step.
    Safe to :meth:`flush` from another thread than the one appending."""

    def __init__(
        self,
        schema: Schema,
        rows: int,
        submit: Submit,
        meta: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> None:
        ragged = [k for k, spec in schema.fields.items() if spec.ragged]
        if ragged:
            raise SchemaError(f"StepColumns takes fixed-shape fields; {ragged} are ragged")
        if "obs" not in schema.fields or "action" not in schema.fields:
            raise SchemaError("StepColumns needs a schema with 'obs' and 'action' fields")
        self.schema, self.rows, self.submit = schema, max(1, rows), submit
        self.meta = {k: v for k, v in (meta or {}).items() if v is not None}
        self.tags = dict(tags or {})
        self.names = tuple(schema.fields)
        self._specs = {
            k: (tuple(spec.shape), np.dtype(spec.dtype)) for k, spec in schema.fields.items()
        }
        self._obs_spec = self._specs["obs"]
        self._lock = threading.Lock()
        self.first_at = 0.0
        """When the oldest row not yet submitted was appended (monotonic; 0: none)."""
        self._new()

    def _new(self) -> None:
        self._codes: dict[str, int] = {}
        self._next_rows: list[int] = []
        self._next: list[np.ndarray] = []
        self._priority: np.ndarray | None = None
        self._n = 0
        n = min(self.rows, GROW_ROWS)
        self._fields = {k: np.empty((n, *shape), dt) for k, (shape, dt) in self._specs.items()}
        self._episode = np.empty(n, np.int32)
        self._step = np.empty(n, np.int64)
        self._reward = np.empty(n, np.float32)
        self._terminated = np.empty(n, bool)
        self._truncated = np.empty(n, bool)

    def _grow(self) -> None:
        """Twice the rows (up to a batch's): a batch may be far larger than what one
        producer fills before a timed flush, so the columns start small."""
        old = self._n
        n = min(self.rows, 2 * old)

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((n, *a.shape[1:]), a.dtype)
            out[:old] = a
            return out

        self._fields = {k: grown(v) for k, v in self._fields.items()}
        self._episode, self._step, self._reward = map(
            grown, (self._episode, self._step, self._reward)
        )
        self._terminated, self._truncated = grown(self._terminated), grown(self._truncated)
        if self._priority is not None:
            self._priority = np.concatenate([self._priority, np.full(n - old, np.nan, np.float32)])

    def __len__(self) -> int:
        return self._n

    def append(
        self,
        episode_id: str,
        step_index: int,
        obs: Any,
        action: Any,
        reward: float,
        *,
        terminated: bool = False,
        truncated: bool = False,
        next_obs: Any = None,
        priority: float | None = None,
        **fields: Any,
    ) -> None:
        """Copy one step into the next row (``fields``: the schema's other fields).
        Raises SchemaError, before anything is written, on a value the schema or the store
        would refuse: arrays of another shape or dtype (no silent casts), a reward that is
        not finite (as float32), a priority that is not finite and >= 0, a step index
        outside [0, 2**31)."""
        where = f"step {step_index} of episode {episode_id!r}"
        values = {"obs": obs, "action": action, **fields}
        if len(values) != len(self.names):
            check_fields(self.schema, {k: np.asarray(v) for k, v in values.items()}, where)
        arrays = []
        for name in self.names:
            a = values[name]
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
            shape, dtype = self._specs[name]
            if a.shape != shape or a.dtype != dtype:
                check_fields(self.schema, {name: a}, where, label=name)
            arrays.append(a)
        if next_obs is not None:
            if not isinstance(next_obs, np.ndarray):
                next_obs = np.asarray(next_obs)
            if (next_obs.shape, next_obs.dtype) != self._obs_spec:
                check_fields(self.schema, {"obs": next_obs}, where, label="next_obs")
        r = float(reward)
        if not _finite32(r):
            raise SchemaError(f"{where}: reward is {r} (must be finite as float32)")
        if priority is not None:
            priority = float(priority)
            if not (_finite32(priority) and priority >= 0):
                raise SchemaError(f"{where}: priority is {priority} (must be finite and >= 0)")
        if step_index.__class__ is not int or not 0 <= step_index < 1 << 31:
            check_int32(step_index, f"{where}: step_index")
        with self._lock:
            i = self._n
            if not i:
                self.first_at = time.monotonic()
            if i == len(self._step):
                self._grow()
            for name, a in zip(self.names, arrays, strict=True):
                self._fields[name][i] = a
            code = self._codes.get(episode_id)
            if code is None:
                code = self._codes[episode_id] = len(self._codes)
            self._episode[i] = code
            self._step[i] = step_index
            self._reward[i] = r
            self._terminated[i] = terminated
            self._truncated[i] = truncated
            if priority is not None or self._priority is not None:
                if self._priority is None:
                    self._priority = np.full(len(self._step), np.nan, np.float32)
                self._priority[i] = np.nan if priority is None else priority
            if next_obs is not None:
                self._next_rows.append(i)
                self._next.append(next_obs.copy())
            self._n = i + 1
            batch = self._take() if self._n == self.rows else None
        if batch is not None:
            self.submit(batch)

    def flush(self) -> None:
        """Submit the rows appended so far (none: nothing)."""
        with self._lock:
            batch = self._take() if self._n else None
        if batch is not None:
            self.submit(batch)

    def _take(self) -> StepBatch:
        """The rows so far as a batch (its columns), and fresh columns for the next."""
        n = self._n
        batch = StepBatch(
            episode=StrColumn(list(self._codes), self._episode[:n]),
            step_index=self._step[:n],
            reward=self._reward[:n],
            terminated=self._terminated[:n],
            truncated=self._truncated[:n],
            fields={k: v[:n] for k, v in self._fields.items()},
            priority=None if self._priority is None else self._priority[:n],
            policy_version=np.full(n, self.meta.get("policy_version") or 0, np.int32),
            next_rows=np.array(self._next_rows, np.int32),
            next_obs=np.stack(self._next) if self._next else None,
        )
        for k in STR_META:
            if k in self.meta:
                batch.strs[k] = StrColumn.constant(self.meta[k], n)
        for name, v in self.tags.items():
            if isinstance(v, str):
                batch.strs[tag_column(name)] = StrColumn.constant(v, n)
            else:
                batch.nums[tag_column(name)] = np.full(n, float(v))
        self._new()
        self.first_at = 0.0
        return batch


def _finite32(x: float) -> bool:
    """Finite once stored as float32 (what the store refuses otherwise)."""
    if abs(x) < 3.4e38:  # the common case, without a numpy scalar
        return True
    with np.errstate(over="ignore"):
        return math.isfinite(x) and bool(np.isfinite(np.float32(x)))
