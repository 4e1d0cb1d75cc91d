"""A batch of steps in columnar form: what one ingest task carries and commits."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from claw_tasks.codecs import CodecError
from claw_tasks.format.arrays import (
    MAX_NDIM,
    Budget,
    check_dtype,
    lz4_sizes,
    pack_array,
    packb,
    unpack_array,
    unpackb,
)
from claw_tasks.format.columns import FieldValue, Placed, Ragged, StrColumn
from claw_tasks.format.encoded import Encoded
from claw_tasks.format.schema import (
    MAX_STEP_BYTES,
    ROLLOUT_TAGS,
    FieldSpec,
    Schema,
    SchemaError,
    tag_name,
)

STR_META = ("agent_id", "task_id", "skill_tag", "reward_source")
FORMAT_VERSION = 1


def _pack_field(v: FieldValue) -> Any:
    if isinstance(v, Ragged):
        return {"values": pack_array(v.values), "lengths": pack_array(v.lengths, compress=False)}
    if isinstance(v, Encoded):
        return v.to_msg()
    return pack_array(v)


def _check_rows(name: str, rows: np.ndarray, n: int) -> None:
    if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= n)):
        raise SchemaError(f"{name}: row numbers must lie in [0, {n})")
    if len(rows) > 1 and len(np.unique(rows)) != len(rows):
        raise SchemaError(f"{name}: a row appears twice")


def _take(v: FieldValue, rows: np.ndarray | slice, pos: np.ndarray) -> FieldValue:
    """``rows`` of a field (``pos``: the same rows as positions)."""
    if isinstance(v, Placed):
        return Placed(v.dtype, (len(pos), *v.shape[1:]))
    return v.take(pos) if isinstance(v, Ragged | Encoded) else v[rows]


@dataclass
class StepBatch:
    """Columns of ``n`` steps. String metadata travels as vocabulary + index."""

    episode: StrColumn
    step_index: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    fields: dict[str, FieldValue]
    priority: np.ndarray | None = None  # NaN = unset
    policy_version: np.ndarray | None = None
    strs: dict[str, StrColumn] = field(default_factory=dict)  # STR_META and string tags
    nums: dict[str, np.ndarray] = field(default_factory=dict)  # numeric tags, NaN = missing
    next_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    next_obs: FieldValue | None = None  # explicit next_obs for ``next_rows``
    info_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    info: list[dict[str, Any]] = field(default_factory=list)
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def n(self) -> int:
        return len(self.step_index)

    def tag_kinds(self) -> dict[str, str]:
        kinds = {tag: "str" for k in self.strs if (tag := tag_name(k)) is not None}
        kinds.update({tag_name(k) or k: "num" for k in self.nums})
        return kinds

    def schema(self) -> Schema:
        """The schema this batch implies (fields from dtypes and shapes, tags by kind)."""
        fields = {}
        for name, v in self.fields.items():
            if isinstance(v, Ragged):
                fields[name] = FieldSpec(v.values.dtype.str, (None, *v.values.shape[1:]))
            elif isinstance(v, Placed):
                fields[name] = FieldSpec(v.dtype.str, tuple(v.shape[1:]))
            elif isinstance(v, Encoded):
                fields[name] = v.spec
            else:
                fields[name] = FieldSpec(v.dtype.str, tuple(v.shape[1:]))
        schema = Schema(fields=fields, tags=self.tag_kinds())  # type: ignore[arg-type]  # tag_kinds' str values are the Literal kinds
        schema.check_self()
        return schema

    def row_nbytes(self) -> np.ndarray:
        total = np.zeros(self.n, np.int64)
        for v in self.fields.values():
            if isinstance(v, Ragged):
                total += v.row_nbytes()
            elif isinstance(v, Encoded):
                total += np.maximum(v.declared(), 0)  # an unreadable header: its own error
            elif self.n:
                total += v.row_bytes if isinstance(v, Placed) else v[0].nbytes
        return total

    def describe_row(self, i: int) -> str:
        ep = self.episode.index[i]
        if ep < 0:
            return f"step {i}"
        return f"step {i} (episode {self.episode.values[ep]!r}, step_index {self.step_index[i]})"

    def row_errors(
        self, max_step_bytes: int = MAX_STEP_BYTES, verify_frames: bool = False
    ) -> dict[int, str]:
        """Per-step problems, of values as stored (float32 reward and priority, float64
        numeric tags: a float64 1e300 reward is inf once stored): non-finite reward, a
        priority that is not finite and >= 0, a numeric tag neither NaN nor finite,
        step_index or policy_version outside int32's non-negative range, oversize step,
        missing episode, a malformed info dict, a compressed frame whose header does not
        declare the field's row size (``verify_frames``: or that does not decode to it).
        The client and the worker share these."""
        errors: dict[int, str] = {}
        for name, v in self.fields.items():
            if isinstance(v, Encoded):
                for i, problem in v.problems(max_step_bytes, verify_frames).items():
                    errors.setdefault(i, f"{self.describe_row(i)}: field '{name}': {problem}")
        if isinstance(self.next_obs, Encoded):
            for j, problem in self.next_obs.problems(max_step_bytes, verify_frames).items():
                i = int(self.next_rows[j])
                errors.setdefault(i, f"{self.describe_row(i)}: next_obs: {problem}")

        def add(rows: np.ndarray, what: Any) -> None:
            for i in np.flatnonzero(rows).tolist():
                errors.setdefault(i, f"{self.describe_row(i)}: {what(i)}")

        add(self.episode.index < 0, lambda i: "episode_id is missing")
        reward, sent = as_stored(self.reward, np.float32), self.reward
        add(~np.isfinite(reward), lambda i: f"reward is {sent[i]} (must be finite as float32)")
        if self.priority is not None:
            p, sent_p = as_stored(self.priority, np.float32), self.priority
            bad = ~np.isnan(p) & ~(np.isfinite(p) & (p >= 0))
            add(bad, lambda i: f"priority is {sent_p[i]} (must be finite and >= 0 as float32)")
        for col, v in self.nums.items():
            tag = tag_name(col) or col
            dtype = tag_dtype(tag)
            bad = ~np.isnan(v) & ~np.isfinite(as_stored(v, dtype))
            kind = np.dtype(dtype).name
            add(bad, lambda i, v=v, t=tag, k=kind: f"tag '{t}' is {v[i]} (NaN or finite as {k})")
        for name, col in (("step_index", self.step_index), ("policy_version", self.policy_version)):
            if col is not None:
                bad = (col < 0) | (col >= STEP_INDEX_LIMIT)
                add(bad, lambda i, c=col, k=name: f"{k} {int(c[i])} is outside [0, 2**31)")
        sizes = self.row_nbytes()
        add(sizes > max_step_bytes, lambda i: f"{sizes[i]} payload bytes > limit {max_step_bytes}")
        for row, info in zip(self.info_rows.tolist(), self.info, strict=True):
            problem = info_problem(info)
            if problem is not None:
                errors.setdefault(row, f"{self.describe_row(row)}: {problem}")
        return errors

    def check_columns(self) -> None:
        """Column-level consistency: every column has ``n`` rows of a numeric type."""
        n = self.n
        cols: dict[str, Any] = {
            "episode_id": self.episode.index,
            "reward": self.reward,
            "terminated": self.terminated,
            "truncated": self.truncated,
        }
        for k, v in self.strs.items():
            cols[f"tag '{tag_name(k)}'" if tag_name(k) is not None else k] = v.index
        cols.update({f"tag '{tag_name(k)}'": v for k, v in self.nums.items()})
        if self.priority is not None:
            cols["priority"] = self.priority
        if self.policy_version is not None:
            cols["policy_version"] = self.policy_version
        for name, v in self.fields.items():
            cols[f"field '{name}'"] = v.lengths if isinstance(v, Ragged) else v
            if isinstance(v, Encoded) and v.shape[0] != len(v):
                raise SchemaError(f"field '{name}': {len(v)} frames for {v.shape[0]} rows")
        for name, v in cols.items():
            rows = (
                len(v)
                if (hasattr(v, "__len__") and np.ndim(v) != 0) or isinstance(v, Placed)
                else None
            )
            if isinstance(v, Encoded):
                rows = len(v)
            if rows != n:
                raise SchemaError(f"{name} has {rows} rows, batch has {n}")
        for name, v in self.fields.items():
            if isinstance(v, Ragged) and int(v.lengths.sum()) != len(v.values):
                raise SchemaError(f"field '{name}': ragged lengths do not add up to the values")
        for name, col in (("episode_id", self.episode), *self.strs.items()):
            if len(col.index) and not (col.index.min() >= -1 and col.index.max() < len(col.values)):
                raise SchemaError(f"{name}: vocabulary index out of range")
        _check_rows("next_rows", self.next_rows, n)
        _check_rows("info_rows", self.info_rows, n)
        explicit = 0 if self.next_obs is None else len(self.next_obs)
        if explicit != len(self.next_rows):
            raise SchemaError(f"{len(self.next_rows)} next_rows but {explicit} explicit next_obs")
        if len(self.info) != len(self.info_rows):
            raise SchemaError(f"{len(self.info_rows)} info_rows but {len(self.info)} info dicts")

    def take(self, rows: np.ndarray | slice) -> StepBatch:
        """The sub-batch of ``rows`` (sorted positions, or a slice: then fixed-shape
        columns are views, not copies); explicit next_obs/info follow their rows."""
        if isinstance(rows, slice):  # the part's positions only: O(part), not O(batch)
            pos = np.arange(*rows.indices(self.n), dtype=np.int64)
        else:
            pos = np.asarray(rows, np.int64)
        nx_keep = info_keep = np.zeros(0, np.int64)
        remap = nx_keep
        if len(self.next_rows) or len(self.info_rows):  # else no remap to build
            remap = np.full(self.n, -1, np.int64)
            remap[pos] = np.arange(len(pos))
            nx_keep = np.flatnonzero(remap[self.next_rows] >= 0)
            info_keep = np.flatnonzero(remap[self.info_rows] >= 0)

        def sel(v: np.ndarray | None) -> np.ndarray | None:
            return None if v is None else v[rows]

        return StepBatch(
            episode=self.episode.take(rows),
            step_index=self.step_index[rows],
            reward=self.reward[rows],
            terminated=self.terminated[rows],
            truncated=self.truncated[rows],
            fields={k: _take(v, rows, pos) for k, v in self.fields.items()},
            priority=sel(self.priority),
            policy_version=sel(self.policy_version),
            strs={k: v.take(rows) for k, v in self.strs.items()},
            nums={k: v[rows] for k, v in self.nums.items()},
            next_rows=remap[self.next_rows[nx_keep]].astype(np.int32),
            next_obs=_take(self.next_obs, nx_keep, nx_keep)
            if len(nx_keep) and self.next_obs is not None
            else None,
            info_rows=remap[self.info_rows[info_keep]].astype(np.int32),
            info=[self.info[i] for i in info_keep.tolist()],
            batch_id=self.batch_id,
        )

    def encode(self) -> bytes:
        """msgpack bytes; ``Placed`` fields travel as dtype and shape only."""
        opt = {
            "priority": None if self.priority is None else pack_array(self.priority),
            "policy_version": None
            if self.policy_version is None
            else pack_array(self.policy_version),
        }
        return packb(
            {
                "v": FORMAT_VERSION,
                "id": self.batch_id,
                "episode": [self.episode.values, pack_array(self.episode.index)],
                "step_index": pack_array(self.step_index),
                "reward": pack_array(self.reward),
                "terminated": pack_array(self.terminated),
                "truncated": pack_array(self.truncated),
                **opt,
                "strs": {k: [v.values, pack_array(v.index)] for k, v in self.strs.items()},
                "nums": {k: pack_array(v) for k, v in self.nums.items()},
                "fields": {
                    k: _pack_field(v) for k, v in self.fields.items() if not isinstance(v, Placed)
                },
                "next_rows": pack_array(self.next_rows),
                "next_obs": None if self.next_obs is None else _pack_field(self.next_obs),
                "info_rows": pack_array(self.info_rows),
                "info": self.info,
                "placed": {
                    k: [v.dtype.str, list(v.shape)]
                    for k, v in self.fields.items()
                    if isinstance(v, Placed)
                },
            }
        )

    @classmethod
    def decode(cls, data: bytes | memoryview, max_decompressed: int | None = None) -> StepBatch:
        """A batch from untrusted bytes: every type, shape and length is checked, and the
        declared sizes of all its frames together against ``max_decompressed`` before any
        is inflated (:class:`~claw_tasks.format.arrays.Budget`); CodecError or SchemaError
        names what is wrong."""
        try:
            d = unpackb(data)
        except Exception as e:  # msgpack raises several types for malformed input
            raise CodecError(f"not msgpack: {type(e).__name__}: {e}") from None
        batch = _Decoder(Budget(max_decompressed or 2**63)).batch(d)
        batch.check_columns()
        return batch


STEP_INDEX_LIMIT = 2**31  # step_index and policy_version are stored as int32
_BATCH_KEYS = frozenset(
    {
        "v",
        "id",
        "episode",
        "step_index",
        "reward",
        "terminated",
        "truncated",
        "priority",
        "policy_version",
        "strs",
        "nums",
        "fields",
        "next_rows",
        "next_obs",
        "info_rows",
        "info",
        "placed",
    }
)
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def as_stored(col: np.ndarray, dtype: type[np.floating]) -> np.ndarray:
    """A float column cast to the type it is stored as (overflow becomes inf, checked after)."""
    with np.errstate(over="ignore"):
        return col.astype(dtype)


def tag_dtype(tag: str) -> type[np.floating]:
    """The type a numeric tag's values are used in, so the type they are checked in:
    float32 for the rollout tags (GAE and V-trace run in float32), float64 (as stored) for
    the others."""
    return np.float32 if tag in ROLLOUT_TAGS else np.float64


def tag_value_problem(tag: str, value: Any) -> str | None:
    """Why a numeric tag's value cannot be stored and used (NaN or finite in
    :func:`tag_dtype`), or None."""
    dtype = tag_dtype(tag)
    try:
        x = float(value)
    except (OverflowError, TypeError, ValueError):
        x = float("inf")
    if np.isnan(x) or np.isfinite(as_stored(np.array([x]), dtype))[0]:
        return None
    return f"tag '{tag}' is {str(value)[:40]} (NaN or finite as {np.dtype(dtype).name})"


def check_batch_id(batch_id: Any) -> str:
    """A batch id names keys: letters, digits, '.', '_' and '-' only."""
    if not isinstance(batch_id, str) or not _NAME.fullmatch(batch_id):
        raise CodecError(f"batch id {batch_id!r:.80}: use 1-128 letters, digits, '.', '_', '-'")
    return batch_id


def info_problem(info: Any) -> str | None:
    """What is wrong with one step's ``info`` dict (None: nothing)."""
    if not isinstance(info, dict):
        return f"info is {type(info).__name__}, not a dict"
    for k, v in info.items():
        if not isinstance(k, str):
            return f"info key {k!r:.40} is {type(k).__name__}; info keys must be strings"
        if not isinstance(v, str | int | float | bool | None):
            return f"info[{k!r}] is {type(v).__name__}; info holds str/int/float/bool only"
    return None


def _is_encoded(v: Any) -> bool:
    return isinstance(v, dict) and "codec" in v


class _Decoder:
    """Builds a StepBatch from a decoded msgpack map, checking each part's type."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def col(self, f: Any, name: str, kinds: str) -> np.ndarray:
        arr = unpack_array(f, self.budget)
        if arr.ndim != 1 or arr.dtype.kind not in kinds:
            raise CodecError(f"{name}: a 1-D column of kind {kinds!r}, not {arr.dtype}{arr.shape}")
        return arr

    def strings(self, v: Any, name: str) -> StrColumn:
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], list)):
            raise CodecError(f"{name}: expected [vocabulary, index]")
        if not all(isinstance(x, str) for x in v[0]):
            raise CodecError(f"{name}: the vocabulary holds strings only")
        return StrColumn(v[0], self.col(v[1], name, "iu"))

    def mapping(self, v: Any, name: str) -> dict[str, Any]:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise CodecError(f"{name}: expected a map with string keys")
        return v

    def encoded(self, v: dict[str, Any], name: str) -> Encoded:
        """A compressed field's frames (offsets uncompressed: nothing is inflated here)."""
        off = v.get("offsets")
        if isinstance(off, list) and len(off) == 4 and off[3] is True:
            raise CodecError(f"field '{name}': frame offsets travel uncompressed")
        return Encoded.from_msg(v, self.col(off, f"field '{name}' offsets", "iu"), name)

    def field(self, v: Any, name: str) -> FieldValue:
        if isinstance(v, dict):
            if set(v) != {"values", "lengths"}:
                raise CodecError(f"field '{name}': a ragged field has values and lengths only")
            lengths = self.col(v["lengths"], f"field '{name}' lengths", "iu")
            if len(lengths) and lengths.min() < 0:
                raise CodecError(f"field '{name}': negative ragged length")
            values = unpack_array(v["values"], self.budget)
            if values.ndim == 0:
                raise CodecError(f"field '{name}': ragged values need a leading dimension")
            return Ragged(values, lengths)
        arr = unpack_array(v, self.budget)
        if arr.ndim == 0:
            raise CodecError(f"field '{name}': needs a leading (row) dimension")
        return arr

    def placed(self, v: Any, name: str) -> Placed:
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)):
            raise CodecError(f"placed field '{name}': expected [dtype, shape]")
        try:
            dt = np.dtype(v[0])
        except (TypeError, ValueError) as e:
            raise CodecError(f"placed field '{name}': {e}") from None
        check_dtype(dt, f"field '{name}'")
        shape = v[1]
        if not (
            isinstance(shape, list)
            and 1 <= len(shape) <= MAX_NDIM
            and all(type(x) is int and 0 <= x < 2**31 for x in shape)
        ):
            raise CodecError(f"placed field '{name}': shape {shape!r:.80}")
        return Placed(dt, tuple(shape))

    def batch(self, d: Any) -> StepBatch:
        if not isinstance(d, dict):
            raise CodecError(f"a batch is a msgpack map, not {type(d).__name__}")
        version = d.get("v")
        if type(version) is not int or version != FORMAT_VERSION:  # not True, not 1.0
            raise CodecError(
                f"batch format version {version!r:.20} is not one this worker reads "
                f"({FORMAT_VERSION}): upgrade the worker or the client"
            )
        unknown = set(d) - _BATCH_KEYS
        missing = _BATCH_KEYS - {"priority", "policy_version", "placed"} - set(d)
        if unknown or missing:
            raise CodecError(
                f"batch keys: unknown {sorted(map(str, unknown))}, missing {sorted(missing)}"
            )
        # The whole message's frames are reserved before any is inflated: lz4 array frames,
        # then a compressed field's frames (from their headers; row checks inflate them).
        self.budget.reserve(lz4_sizes(d), lz4=True)
        sent = self.mapping(d["fields"], "fields")
        encoded = {k: self.encoded(v, k) for k, v in sent.items() if _is_encoded(v)}
        nx = d["next_obs"]
        nx_encoded = self.encoded(nx, "next_obs") if _is_encoded(nx) else None
        frames = [*encoded.values(), *([nx_encoded] if nx_encoded is not None else [])]
        self.budget.reserve([int(n) for v in frames for n in v.declared()], lz4=False)
        fields = {k: encoded[k] if k in encoded else self.field(v, k) for k, v in sent.items()}
        for k, v in self.mapping(d.get("placed") or {}, "placed").items():
            if k in fields:
                raise CodecError(f"field '{k}' is both sent and placed")
            fields[k] = self.placed(v, k)
        for k in fields:
            if not _NAME.fullmatch(k):
                raise CodecError(f"field name {k!r:.80}: use letters, digits, '.', '_', '-'")
        strs = self.mapping(d["strs"], "strs")
        for k in strs:
            if k not in STR_META and not _NAME.fullmatch(tag_name(k) or ""):
                raise CodecError(f"strs: {k!r:.80} is neither string metadata nor a tag column")
        nums = self.mapping(d["nums"], "nums")
        for k in nums:
            if not _NAME.fullmatch(tag_name(k) or ""):
                raise CodecError(f"nums: {k!r:.80} is not a tag column ('t:<name>')")
        info = d["info"]
        if not isinstance(info, list):
            raise CodecError("info: expected a list of dicts")
        return StepBatch(
            episode=self.strings(d["episode"], "episode_id"),
            step_index=self.col(d["step_index"], "step_index", "iu"),
            reward=self.col(d["reward"], "reward", "f"),
            terminated=self.col(d["terminated"], "terminated", "b"),
            truncated=self.col(d["truncated"], "truncated", "b"),
            priority=None
            if d.get("priority") is None
            else self.col(d["priority"], "priority", "f"),
            policy_version=None
            if d.get("policy_version") is None
            else self.col(d["policy_version"], "policy_version", "iu"),
            strs={k: self.strings(v, k) for k, v in strs.items()},
            nums={k: self.col(v, f"tag '{tag_name(k)}'", "f") for k, v in nums.items()},
            fields=fields,
            next_rows=self.col(d["next_rows"], "next_rows", "iu"),
            next_obs=nx_encoded
            if nx_encoded is not None
            else (None if nx is None else self.field(nx, "next_obs")),
            info_rows=self.col(d["info_rows"], "info_rows", "iu"),
            info=info,
            batch_id=check_batch_id(d["id"]),
        )
