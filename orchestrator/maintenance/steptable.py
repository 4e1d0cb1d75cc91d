"""Steps as Arrow tables: the column layout of the archive, both ways.

Every value is kept exactly. Payload fields keep dtype and shape in their column metadata:
a fixed-shape row is a fixed-size list of its flat items when small (queryable element by
element) and one fixed-size binary value when large (an image: Parquet writes a list
value by value, ~50 MB/s, a binary row at GB/s); a ragged row is a large list of rows.
Strings are their values (dictionary-encoded on disk), ``info`` its JSON text, and the explicit
final ``next_obs`` a nullable list of the observation's flat items. Dtypes Arrow has no
numeric type for (complex, big-endian) are raw bytes with the same metadata.

A compressed field keeps the store's frames as they are: one binary value per row, its
codec in the column metadata (``codec``), read back as :class:`Encoded` and committed
without a decode/encode round trip; the explicit ``next_obs`` of a compressed ``obs`` is
frames too. ``delta`` is the exception (:func:`keeps_frames`): its frames name other
steps' ids, so its rows are archived decoded (the codec still recorded) and encoded again
when restored. :func:`plain` turns a table into one without frames, for other tools.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from claw_tasks.codecs import CodecError, CodecFrames, decode
from claw_tasks.format.batch import STR_META, StepBatch
from claw_tasks.format.columns import Ragged, StrColumn
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import FieldSpec, Schema, SchemaError, tag_column

FORMAT = 1
META_KEY = b"claw"
LIST_MAX_ITEMS = 256  # fixed rows up to this many items are lists; larger ones binary
TAG_PREFIX = "tags."
LABELS = ("quality",)
STRING_COLUMNS = (*STR_META, *LABELS)


@dataclass
class StepRows:
    """Steps column by column (as archived): what one table holds."""

    id: np.ndarray  # int64, the step id in the namespace it was archived from
    episode_id: StrColumn
    step_index: np.ndarray  # int32
    policy_version: np.ndarray  # int32, 0 = unset
    timestamp: np.ndarray  # float64, commit time
    reward: np.ndarray  # float32
    priority: np.ndarray  # float32, NaN = unset
    terminated: np.ndarray  # bool
    truncated: np.ndarray  # bool
    trainable: np.ndarray  # bool
    strs: dict[str, StrColumn]  # STRING_COLUMNS and "tags.<name>" string tags
    nums: dict[str, np.ndarray]  # "tags.<name>" numeric tags (float64, NaN = missing)
    fields: dict[str, np.ndarray | Ragged | Encoded]
    next_obs: dict[int, Any] = field(default_factory=dict)  # row -> explicit (array or frame)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.id)

    def take(self, rows: np.ndarray) -> StepRows:
        """The sub-table of ``rows`` (sorted positions)."""
        remap = {int(r): i for i, r in enumerate(rows.tolist())}
        return StepRows(
            id=self.id[rows],
            episode_id=self.episode_id.take(rows),
            step_index=self.step_index[rows],
            policy_version=self.policy_version[rows],
            timestamp=self.timestamp[rows],
            reward=self.reward[rows],
            priority=self.priority[rows],
            terminated=self.terminated[rows],
            truncated=self.truncated[rows],
            trainable=self.trainable[rows],
            strs={k: v.take(rows) for k, v in self.strs.items()},
            nums={k: v[rows] for k, v in self.nums.items()},
            fields={
                k: v.take(rows) if isinstance(v, Ragged | Encoded) else v[rows]
                for k, v in self.fields.items()
            },
            next_obs={remap[r]: v for r, v in self.next_obs.items() if r in remap},
            info={remap[r]: v for r, v in self.info.items() if r in remap},
        )


# ---- payload columns ------------------------------------------------------------------
def keeps_frames(spec: FieldSpec) -> bool:
    """Whether the archive keeps the field's stored frames (every codec but ``delta``)."""
    return spec.codec is not None and spec.codec.name != "delta"


def _frames_array(frames: Sequence[bytes | memoryview | None]) -> pa.Array:
    """One binary value per frame (None: null)."""
    return pa.array([None if f is None else bytes(f) for f in frames], pa.large_binary())


def _frames(arr: pa.Array) -> list[bytes | None]:
    return arr.to_pylist()


def _numeric(dtype: np.dtype) -> pa.DataType | None:
    """Arrow's type for a dtype, or None (complex, big-endian): then raw bytes."""
    if dtype.kind not in "biuf" or dtype.byteorder == ">":
        return None
    return pa.from_numpy_dtype(dtype)


def _flat(values: np.ndarray, dtype: np.dtype, items: int) -> pa.Array:
    """Rows of ``items`` values each: a plain column (1), a fixed-size list, or binary."""
    t = _numeric(dtype)
    # (np.concatenate hands back native byte order: back to the field's own)
    values = np.ascontiguousarray(values).astype(dtype, copy=False).reshape(-1)
    n = len(values) // max(1, items)
    if t is not None and items == 1:
        return pa.array(values, t)
    if t is not None and items <= LIST_MAX_ITEMS:
        return pa.FixedSizeListArray.from_arrays(pa.array(values, t), items)
    width = items * dtype.itemsize
    return pa.Array.from_buffers(pa.binary(width), n, [None, pa.py_buffer(values)])


def _unflat(arr: pa.Array, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``_flat``: ``len(arr)`` rows of ``shape``."""
    n = len(arr)
    if pa.types.is_fixed_size_binary(arr.type):
        width = arr.type.byte_width
        raw = arr.buffers()[1]
        start = arr.offset * width
        out = np.frombuffer(raw, dtype, count=n * width // dtype.itemsize, offset=start)
    elif pa.types.is_fixed_size_list(arr.type):
        out = arr.flatten().to_numpy(zero_copy_only=False)
    else:
        out = arr.to_numpy(zero_copy_only=False)
    return out.astype(dtype, copy=False).reshape(n, *shape)


def field_array(spec: FieldSpec, value: np.ndarray | Ragged | Encoded) -> pa.Array:
    dtype = np.dtype(spec.dtype)
    if isinstance(value, Encoded):
        return _frames_array(list(value.frames))
    if spec.ragged:
        assert isinstance(value, Ragged)
        tail = spec.shape[1:]
        child = _flat(value.values, dtype, int(np.prod(tail, dtype=np.int64)))
        return pa.LargeListArray.from_arrays(pa.array(value.offsets, pa.int64()), child)
    assert isinstance(value, np.ndarray)
    return _flat(value, dtype, spec.row_items)


def field_values(spec: FieldSpec, arr: pa.Array) -> np.ndarray | Ragged | Encoded:
    dtype = np.dtype(spec.dtype)
    if keeps_frames(spec):
        assert spec.codec is not None
        frames = CodecFrames.of([f or b"" for f in _frames(arr)])
        return Encoded(spec.codec, dtype, (len(arr), *spec.shape), frames)
    if spec.ragged:
        off = np.asarray(arr.offsets, np.int64)
        child = arr.values.slice(int(off[0]), int(off[-1] - off[0]))
        values = _unflat(child, dtype, tuple(spec.shape[1:]))  # type: ignore[arg-type]  # the ragged dimension is dropped: no None left
        return Ragged(values, np.diff(off).astype(np.int32))
    return _unflat(arr, dtype, tuple(spec.shape))  # type: ignore[arg-type]  # not ragged: a fixed shape (no None)


def next_obs_array(obs: FieldSpec, n: int, rows: dict[int, Any]) -> pa.Array:
    """Explicit next_obs: a nullable large list per row (the observation's flat items, or
    its rows when ragged); a nullable frame per row for a compressed obs."""
    if keeps_frames(obs):
        return _frames_array([rows.get(r) for r in range(n)])
    dtype = np.dtype(obs.dtype)
    present = sorted(rows)
    per_item = obs.shape[1:] if obs.ragged else ()
    items = int(np.prod(per_item, dtype=np.int64))
    vals = [np.asarray(rows[r], dtype).reshape(-1, *per_item) for r in present]
    lengths = np.zeros(n, np.int64)
    lengths[present] = [len(v) for v in vals]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate(vals) if vals else np.zeros((0, *per_item), dtype)
    mask = np.ones(n, bool)
    mask[present] = False
    child = _flat(flat, dtype, items)
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, pa.int64()), child, mask=pa.array(mask) if n else None
    )


def next_obs_rows(obs: FieldSpec, arr: pa.Array) -> dict[int, Any]:
    if keeps_frames(obs):
        return {r: f for r, f in enumerate(_frames(arr)) if f is not None}
    dtype = np.dtype(obs.dtype)
    per_item = tuple(obs.shape[1:]) if obs.ragged else ()
    valid = np.flatnonzero(~np.asarray(arr.is_null(), bool))
    off = np.asarray(arr.offsets, np.int64)
    out = {}
    for r in valid.tolist():
        child = arr.values.slice(int(off[r]), int(off[r + 1] - off[r]))
        row = _unflat(child, dtype, per_item)  # type: ignore[arg-type]  # per-item shape of a ragged field: no None
        out[r] = row if obs.ragged else row.reshape(obs.shape)
    return out


# ---- strings --------------------------------------------------------------------------
def str_array(col: StrColumn) -> pa.Array:
    """Plain strings (Parquet dictionary-encodes them on disk): files whose dictionaries
    differ still filter and group together as one dataset."""
    index = pa.array(col.index, pa.int32(), mask=col.index < 0)
    return pa.DictionaryArray.from_arrays(index, pa.array(col.values, pa.string())).cast(
        pa.string()
    )


def str_column(arr: pa.Array) -> StrColumn:
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    index = arr.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)
    return StrColumn(arr.dictionary.to_pylist(), index)


# ---- tables ---------------------------------------------------------------------------
def _meta(spec: Any) -> dict[bytes, bytes]:
    return {META_KEY: json.dumps(spec).encode()}


def to_table(rows: StepRows, schema: Schema, extra: dict[str, Any]) -> pa.Table:
    """One table of steps; ``extra`` (namespace, shard, seq range) goes in its metadata."""
    cols: list[tuple[pa.Field, pa.Array]] = []

    def add(name: str, arr: pa.Array, meta: Any = None) -> None:
        field_meta = None if meta is None else _meta(meta)
        cols.append((pa.field(name, arr.type, metadata=field_meta), arr))

    add("id", pa.array(rows.id, pa.int64()))
    add("episode_id", str_array(rows.episode_id))
    add("step_index", pa.array(rows.step_index, pa.int32()))
    for name in STR_META:
        add(name, str_array(rows.strs[name]))
    add("policy_version", pa.array(rows.policy_version, pa.int32()))
    add("timestamp", pa.array(rows.timestamp, pa.float64()))
    add("reward", pa.array(rows.reward, pa.float32()))
    add("priority", pa.array(rows.priority, pa.float32()))
    add("terminated", pa.array(rows.terminated, pa.bool_()))
    add("truncated", pa.array(rows.truncated, pa.bool_()))
    add("trainable", pa.array(rows.trainable, pa.bool_()))
    add("quality", str_array(rows.strs["quality"]))
    for name, kind in schema.tags.items():
        col = TAG_PREFIX + name
        arr = str_array(rows.strs[col]) if kind == "str" else pa.array(rows.nums[col])
        add(col, arr)
    for name, spec in schema.fields.items():
        add(name, field_array(spec, rows.fields[name]), _spec(spec))
    if "obs" in schema.fields:
        obs = schema.fields["obs"]
        add("next_obs", next_obs_array(obs, rows.n, rows.next_obs), _spec(obs))
    info = [None] * rows.n
    for r, d in rows.info.items():
        info[r] = json.dumps(d)
    add("info", pa.array(info, pa.string()))
    meta = {"format": FORMAT, "schema": schema.to_dict(), **extra}
    return pa.Table.from_arrays(
        [a for _, a in cols], schema=pa.schema([f for f, _ in cols], metadata=_meta(meta))
    )


def _spec(spec: FieldSpec) -> dict[str, Any]:
    return spec.to_dict()  # dtype, shape, and the codec of a compressed field


def table_meta(schema: pa.Schema) -> dict[str, Any]:
    """The Claw metadata of an archive file (format, schema, namespace, seq range)."""
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError("not a Claw archive file (no 'claw' schema metadata)")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise ValueError(f"archive format {meta.get('format')!r}; this Claw reads {FORMAT}")
    return meta


def from_table(table: pa.Table) -> StepRows:
    """The steps of an archive table, exactly as archived."""
    schema = Schema.from_dict(table_meta(table.schema)["schema"])

    def col(name: str) -> pa.Array:
        chunks = table.column(name).chunks
        return chunks[0] if len(chunks) == 1 else table.column(name).combine_chunks()

    def num(name: str, dtype: Any) -> np.ndarray:
        return col(name).to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    strs = {name: str_column(col(name)) for name in STRING_COLUMNS}
    nums = {}
    for name, kind in schema.tags.items():
        if kind == "str":
            strs[TAG_PREFIX + name] = str_column(col(TAG_PREFIX + name))
        else:
            nums[TAG_PREFIX + name] = num(TAG_PREFIX + name, np.float64)
    info_col = col("info")
    info = {i: json.loads(v) for i, v in enumerate(info_col.to_pylist()) if v is not None}
    obs = schema.fields.get("obs")
    return StepRows(
        id=num("id", np.int64),
        episode_id=str_column(col("episode_id")),
        step_index=num("step_index", np.int32),
        policy_version=num("policy_version", np.int32),
        timestamp=num("timestamp", np.float64),
        reward=num("reward", np.float32),
        priority=num("priority", np.float32),
        terminated=num("terminated", bool),
        truncated=num("truncated", bool),
        trainable=num("trainable", bool),
        strs=strs,
        nums=nums,
        fields={name: field_values(spec, col(name)) for name, spec in schema.fields.items()},
        next_obs={} if obs is None else next_obs_rows(obs, col("next_obs")),
        info=info,
    )


def to_batch(rows: StepRows, schema: Schema, batch_id: str) -> StepBatch:
    """A committable batch of the rows (timestamps, labels and ids travel beside it)."""
    nx = sorted(rows.next_obs)
    next_obs: np.ndarray | Ragged | Encoded | None = None
    if nx:
        obs = schema.fields["obs"]
        vals = [rows.next_obs[r] for r in nx]
        if keeps_frames(obs):
            assert obs.codec is not None
            shape = (len(vals), *obs.shape)
            next_obs = Encoded(obs.codec, np.dtype(obs.dtype), shape, CodecFrames.of(vals))
        else:
            next_obs = Ragged.of(vals) if obs.ragged else np.stack(vals)
    info_rows = sorted(rows.info)
    tags = {
        tag_column(k[len(TAG_PREFIX) :]): v
        for k, v in rows.strs.items()
        if k.startswith(TAG_PREFIX)
    }
    return StepBatch(
        episode=rows.episode_id,
        step_index=rows.step_index,
        reward=rows.reward,
        terminated=rows.terminated,
        truncated=rows.truncated,
        fields=dict(rows.fields),
        priority=rows.priority,
        policy_version=rows.policy_version,
        strs={**{k: rows.strs[k] for k in STR_META}, **tags},
        nums={tag_column(k[len(TAG_PREFIX) :]): v for k, v in rows.nums.items()},
        next_rows=np.array(nx, np.int32),
        next_obs=next_obs,
        info_rows=np.array(info_rows, np.int32),
        info=[rows.info[r] for r in info_rows],
        batch_id=batch_id,
    )


def batch_problem(batch: StepBatch) -> str | None:
    """What is wrong with a batch built from outside input (an archive file, an offline
    dataset), by the checks ingest makes before anything is stored; None if nothing."""
    try:
        batch.check_columns()
        batch.schema()
    except (SchemaError, CodecError) as e:
        return str(e)
    errors = batch.row_errors(verify_frames=True)  # frames must decode, as at ingest
    if errors:
        first = "; ".join(errors[i] for i in sorted(errors)[:3])
        return f"{len(errors)} bad step(s), e.g. {first}"
    return None


# ---- plain tables ---------------------------------------------------------------------
def plain_schema(schema: Schema) -> Schema:
    """The schema with every field's codec dropped (the same dtypes and shapes)."""
    fields = {k: FieldSpec(v.dtype, v.shape) for k, v in schema.fields.items()}
    return Schema(fields=fields, tags=schema.tags)


def _decoded(spec: FieldSpec, codec: Any, frames: list[Any]) -> np.ndarray | list[np.ndarray]:
    return decode(codec, frames, np.dtype(spec.dtype), tuple(spec.shape))


def decoded(rows: StepRows, schema: Schema) -> StepRows:
    """The rows with every kept frame decoded (fields and explicit next_obs)."""
    fields: dict[str, np.ndarray | Ragged | Encoded] = {}
    for name, v in rows.fields.items():
        if isinstance(v, Encoded):
            out = _decoded(schema.fields[name], v.codec, list(v.frames))
            fields[name] = Ragged.of(out, v.dtype) if isinstance(out, list) else out
        else:
            fields[name] = v
    next_obs = rows.next_obs
    obs = schema.fields.get("obs")
    if obs is not None and keeps_frames(obs) and next_obs:
        at = sorted(next_obs)
        out = _decoded(obs, obs.codec, [next_obs[r] for r in at])
        next_obs = {r: out[i] for i, r in enumerate(at)}
    return StepRows(**{**rows.__dict__, "fields": fields, "next_obs": next_obs})


def plain(table: pa.Table) -> pa.Table:
    """An archive table as one without frames: compressed fields decoded into the columns
    raw fields have, so DuckDB, Polars or pandas read the values themselves."""
    meta = table_meta(table.schema)
    schema = Schema.from_dict(meta["schema"])
    extra = {k: v for k, v in meta.items() if k not in ("format", "schema")}
    return to_table(decoded(from_table(table), schema), plain_schema(schema), extra)
