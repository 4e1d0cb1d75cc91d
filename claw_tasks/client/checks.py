"""The value checks the client runs before anything is buffered (a producer's mistake is
raised at its call, naming the step and field), the step metadata, the column builders
of ``add_batch``, and the buffered step and its conversion to a ``StepBatch``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from claw_tasks.codecs import CodecError
from claw_tasks.format.arrays import check_dtype
from claw_tasks.format.batch import STEP_INDEX_LIMIT, STR_META, StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.schema import FieldSpec, Schema, SchemaError, TagKind, tag_column, tag_key


@dataclass
class Step:
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


def as_array(v: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(v)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{what}: cannot be an array ({e})") from None
    try:
        check_dtype(arr.dtype, what)
    except CodecError as e:
        raise SchemaError(str(e)) from None
    return arr


def schema_of_step(
    fields: dict[str, np.ndarray], tags: dict[str, Any], ragged: Sequence[str]
) -> Schema:
    def shape(k: str, a: np.ndarray) -> tuple[int | None, ...]:
        return (None, *a.shape[1:]) if k in ragged else tuple(a.shape)

    schema = Schema(
        fields={k: FieldSpec(a.dtype.str, shape(k, a)) for k, a in fields.items()},
        tags=tag_kinds(tags),
    )
    schema.check_self()
    return schema


def tag_kinds(tags: Mapping[str, Any]) -> dict[str, TagKind]:
    return {k: "str" if isinstance(v, str) else "num" for k, v in tags.items()}


def check_fields(
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


def check_int32(value: Any, what: str) -> None:
    """Stored as int32: refuse what would wrap instead of storing it wrapped."""
    if not isinstance(value, int | np.integer) or not 0 <= int(value) < STEP_INDEX_LIMIT:
        raise SchemaError(f"{what} {value!r} must be an integer in [0, 2**31)")


def step_meta(
    task_id: str | None,
    agent_id: str | None,
    skill_tag: str | None,
    reward_source: str | None,
    policy_version: int | None,
) -> dict[str, Any]:
    """The metadata an episode or column writer puts on every step (``policy_version``
    checked: the store keeps it as an int32)."""
    if policy_version is not None:
        check_int32(policy_version, "policy_version")
    return {
        "task_id": task_id,
        "agent_id": agent_id,
        "skill_tag": skill_tag,
        "reward_source": reward_source,
        "policy_version": policy_version,
    }


def field_column(
    name: str, v: Any, n: int, schema: Schema | None, ragged: Sequence[str]
) -> np.ndarray | Ragged:
    """``add_batch``'s payload column ``name`` of ``n`` rows: ragged when the schema or
    the Ingestor's ``ragged`` says so, else one array."""
    spec = schema.fields.get(name) if schema else None
    if isinstance(v, Ragged):
        return v
    if (spec is not None and spec.ragged) or name in ragged:
        return Ragged.of(list(v))
    arr = as_array(v, f"field '{name}'")
    if arr.ndim == 0 or arr.shape[0] != n:
        raise SchemaError(f"field '{name}' has {arr.shape[:1]} rows, expected {n}")
    return arr


def column(v: Any, n: int, dtype: Any, name: str) -> np.ndarray:
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


def opt_column(v: Any, n: int, dtype: Any) -> np.ndarray | None:
    return None if v is None else np.asarray(np.broadcast_to(np.asarray(v, dtype), (n,)))


def str_column(v: Any, n: int, name: str) -> StrColumn:
    """A column of strings: one value, one per row, or a :class:`StrColumn` as it is (a
    vocabulary and per-row codes: no Python step per row; its codes are checked with the
    batch's columns)."""
    if isinstance(v, str | int) or v is None:
        return StrColumn.constant(v, n)
    if isinstance(v, StrColumn):
        if len(v.index) != n:
            raise SchemaError(f"column '{name}' has {len(v.index)} rows, expected {n}")
        return StrColumn([str(s) for s in v.values], np.asarray(v.index, np.int32))
    if len(v) != n:
        raise SchemaError(f"column '{name}' has {len(v)} rows, expected {n}")
    return StrColumn.of(v if isinstance(v, np.ndarray) else list(v))


def add_tag(batch: StepBatch, name: str, v: Any, n: int) -> None:
    sample = v if np.ndim(v) == 0 else next(iter(v), None)
    if isinstance(sample, str):
        batch.strs[tag_column(name)] = str_column(v, n, tag_key(name))
    else:
        batch.nums[tag_column(name)] = np.asarray(np.broadcast_to(np.asarray(v, np.float64), (n,)))


def steps_to_batch(steps: Sequence[Step], schema: Schema) -> StepBatch:
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
        next_obs = Ragged.of(nx_vals) if ragged else np.stack(nx_vals)  # type: ignore[arg-type]  # the values are arrays of one shape when not ragged
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
        info=[steps[i].info for i in info_rows],  # type: ignore[misc]  # info_rows are the steps whose info is set
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
