"""Compile a recipe's ``where`` into a vectorized boolean mask over metadata columns.

The columns dict is the sampling index's numpy mirror of the store's ``m:<col>`` strings:
every array has one entry per global row (``shard * cap + slot``):

===================  ===========  =============================================
column               dtype        meaning
===================  ===========  =============================================
``alive``            bool         the slot holds a live step
``id``               int64        step id (0 = empty slot)
``episode``          int64        episode code (blake2b of the episode id)
``step_index``       int32
``agent_id`` …       int32        dictionary codes (0 = missing): ``agent_id``,
                                  ``task_id``, ``skill_tag``, ``reward_source``,
                                  ``quality``
``policy_version``   int32
``timestamp``        float64      commit time, seconds
``reward``           float32
``priority``         float32      decoded: NaN = unset
``next``             int32        seq distance to the episode's next step (0 = unknown)
``flags``            uint8        :data:`FLAG_BITS`
``t:<tag>``          int32        string tag (dictionary codes) …
                     float64      … or numeric tag (NaN = missing)
===================  ===========  =============================================

A ``where`` is an AND of conditions, ``key: value`` (equality) or ``key: {op: value}``
with ops ``in``, ``gt``, ``ge``, ``lt``, ``le`` and ``between: [a, b]`` (inclusive).
Keys are the fixed metadata names of :data:`FIXED` or ``tags.<name>`` for a free tag
(the prefix keeps tags apart from fixed metadata). A value (or a list element) written
``$name`` is resolved from the recipe's live params at evaluation time; ``$$x`` is the
literal string ``$x``. String columns compare by dictionary code through the ``encode``
callback; numeric comparisons are exact on the stored values; NaN matches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from claw_tasks.schema import tag_column

Kind = Literal["code", "num", "flag"]
Encoder = Callable[[str, Sequence[str]], np.ndarray]
"""``encode(column, strings)`` → integer codes of ``strings`` in ``column`` (-1 = unknown)."""

FLAG_BITS = {"terminated": 1, "truncated": 2, "next_obs": 4, "not_trainable": 8}
FIXED: dict[str, tuple[str, Kind]] = {
    "episode_id": ("episode", "code"),
    "step_index": ("step_index", "num"),
    "agent_id": ("agent_id", "code"),
    "task_id": ("task_id", "code"),
    "skill_tag": ("skill_tag", "code"),
    "reward_source": ("reward_source", "code"),
    "policy_version": ("policy_version", "num"),
    "timestamp": ("timestamp", "num"),
    "priority": ("priority", "num"),
    "reward": ("reward", "num"),
    "quality": ("quality", "code"),
    "terminated": ("flags", "flag"),
    "truncated": ("flags", "flag"),
}
TAG_PREFIX = "tags."
_OPS = {"in", "gt", "ge", "lt", "le", "between"}
_OPS_BY_KIND = {"code": {"eq", "in"}, "flag": {"eq", "in"}, "num": {"eq"} | _OPS}
_SMALL_IN = 4


class FilterError(ValueError):
    """A ``where`` that cannot be compiled or evaluated; the message names the key."""


@dataclass(frozen=True)
class Param:
    """A ``$name`` reference to a recipe param."""

    name: str


@dataclass(frozen=True)
class Cond:
    """One parsed condition: ``key`` as written, the column it reads and how."""

    key: str
    column: str
    kind: Kind | None  # None: a tag whose kind is not known yet (no schema given)
    op: str  # eq in gt ge lt le between
    value: Any  # scalar, Param, or a list of them (in, between)


def eligible(columns: Mapping[str, np.ndarray], rows: np.ndarray | None = None) -> np.ndarray:
    """Rows that may be sampled at all: alive and not marked untrainable."""
    alive, flags = columns["alive"], columns["flags"]
    if rows is not None:
        alive, flags = alive[rows], flags[rows]
    return alive & ((flags & FLAG_BITS["not_trainable"]) == 0)


def parse_where(
    where: Mapping[str, Any], tags: Mapping[str, str] | None = None
) -> tuple[Cond, ...]:
    """Check the structure of ``where`` and resolve its keys to columns.

    ``tags`` maps free tag names to ``'str'`` or ``'num'``; without it (no schema yet) tag
    keys are accepted with an unknown kind.
    """
    if not isinstance(where, Mapping):
        raise FilterError(f"where must be a mapping, got {type(where).__name__}")
    conds = []
    for key, spec in where.items():
        column, kind = _column(key, tags)
        items = spec.items() if isinstance(spec, Mapping) else [("eq", spec)]
        if not items:
            raise FilterError(f"{key}: empty condition")
        for op, raw in items:
            if op != "eq" and op not in _OPS:
                raise FilterError(f"{key}: unknown operator {op!r} (use one of {sorted(_OPS)})")
            if kind is not None and op not in _OPS_BY_KIND[kind]:
                raise FilterError(f"{key}: operator {op!r} does not apply to a {kind} column")
            cond = Cond(str(key), column, kind, op, _parse_value(key, op, raw))
            if not _has_param(cond.value):
                _check(cond, cond.value)
            conds.append(cond)
    return tuple(conds)


def resolve(conds: Sequence[Cond], params: Mapping[str, Any]) -> tuple[Any, ...]:
    """Substitute ``$params`` and type-check the values; the result is hashable."""
    out = []
    for cond in conds:
        value = _substitute(cond, cond.value, params)
        if isinstance(value, list):
            value = tuple(value)
        if _has_param(cond.value):
            _check(cond, value)
        out.append(value)
    return tuple(out)


class Where:
    """A compiled ``where``: call :meth:`mask` with the columns and the live params."""

    def __init__(self, where: Mapping[str, Any], encode: Encoder, tags: Mapping[str, str]):
        self.conds = parse_where(where, tags)
        self.encode = encode

    @property
    def params(self) -> frozenset[str]:
        """Names of the params the conditions reference."""
        return frozenset(p.name for c in self.conds for p in _params_in(c.value))

    def key(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """Hashable resolved values: equal keys give equal masks on the same data."""
        return resolve(self.conds, params)

    def mask(
        self,
        columns: Mapping[str, np.ndarray],
        params: Mapping[str, Any],
        rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Boolean mask over all rows, or over ``rows`` only when given."""
        n = len(columns["alive"]) if rows is None else len(rows)
        out = np.ones(n, dtype=bool)
        for cond, value in zip(self.conds, resolve(self.conds, params), strict=True):
            col = columns[cond.column]
            out &= self._eval(cond, col if rows is None else col[rows], value)
        return out

    def _eval(self, cond: Cond, col: np.ndarray, value: Any) -> np.ndarray:
        if cond.kind == "flag":
            bits = (col & FLAG_BITS[cond.key]) != 0
            wanted = {value} if cond.op == "eq" else set(value)
            if len(wanted) == 2:
                return np.ones(len(col), dtype=bool)
            if not wanted:
                return np.zeros(len(col), dtype=bool)
            return bits if True in wanted else ~bits
        if cond.kind == "code":
            strings = [value] if cond.op == "eq" else list(value)
            codes = np.asarray(self.encode(cond.column, strings), dtype=np.int64)
            return _isin(col, codes[codes > 0].astype(col.dtype))
        if cond.op == "between":
            return compare(col, "ge", value[0]) & compare(col, "le", value[1])
        if cond.op == "in":
            out = np.zeros(len(col), dtype=bool)
            for v in value:
                out |= compare(col, "eq", v)
            return out
        return compare(col, cond.op, value)


def compare(col: np.ndarray, op: str, t: float) -> np.ndarray:
    """``col <op> t`` exactly on the stored values (no rounding of ``t`` to the dtype)."""
    lo, hi = _floor(col.dtype, t), _ceil(col.dtype, t)
    if op == "eq":
        return col == lo if lo is not None and lo == hi else np.zeros(len(col), dtype=bool)
    if op in ("gt", "le"):
        if lo is None:  # t is below every value of the dtype
            return _not_nan(col) if op == "gt" else np.zeros(len(col), dtype=bool)
        return col > lo if op == "gt" else col <= lo
    if hi is None:  # t is above every value of the dtype
        return _not_nan(col) if op == "lt" else np.zeros(len(col), dtype=bool)
    return col >= hi if op == "ge" else col < hi


def _floor(dtype: np.dtype, t: float) -> np.generic | None:
    """Largest value of ``dtype`` that is <= t (None if there is none)."""
    if dtype.kind == "f":
        with np.errstate(over="ignore"):  # beyond the dtype's range: inf, corrected below
            v = dtype.type(t)
        return np.nextafter(v, dtype.type(-np.inf)) if float(v) > t else v
    info = np.iinfo(dtype)
    f = math.floor(t) if math.isfinite(t) else (info.max if t > 0 else info.min - 1)
    return None if f < info.min else dtype.type(min(f, info.max))


def _ceil(dtype: np.dtype, t: float) -> np.generic | None:
    """Smallest value of ``dtype`` that is >= t (None if there is none)."""
    if dtype.kind == "f":
        with np.errstate(over="ignore"):
            v = dtype.type(t)
        return np.nextafter(v, dtype.type(np.inf)) if float(v) < t else v
    info = np.iinfo(dtype)
    c = math.ceil(t) if math.isfinite(t) else (info.max + 1 if t > 0 else info.min)
    return None if c > info.max else dtype.type(max(c, info.min))


def _not_nan(col: np.ndarray) -> np.ndarray:
    return ~np.isnan(col) if col.dtype.kind == "f" else np.ones(len(col), dtype=bool)


def _isin(col: np.ndarray, codes: np.ndarray) -> np.ndarray:
    if len(codes) > _SMALL_IN:
        return np.isin(col, codes, kind="sort")
    out = np.zeros(len(col), dtype=bool)
    for c in codes:
        out |= col == c
    return out


def _column(key: Any, tags: Mapping[str, str] | None) -> tuple[str, Kind | None]:
    if not isinstance(key, str):
        raise FilterError(f"{key!r}: keys must be strings")
    if key in FIXED:
        return FIXED[key]
    if key.startswith(TAG_PREFIX) and len(key) > len(TAG_PREFIX):
        name = key[len(TAG_PREFIX) :]
        if tags is None:
            return tag_column(name), None
        if name not in tags:
            raise FilterError(f"{key}: no tag {name!r} in the namespace schema")
        return tag_column(name), "code" if tags[name] == "str" else "num"
    raise FilterError(
        f"{key}: unknown metadata key (fixed: {', '.join(FIXED)}; free tags: tags.<name>)"
    )


def _parse_value(key: str, op: str, raw: Any) -> Any:
    if op in ("in", "between"):
        if isinstance(raw, str) and raw.startswith("$") and not raw.startswith("$$"):
            return Param(raw[1:])
        if not isinstance(raw, list | tuple):
            raise FilterError(f"{key}: {op} takes a list or a $param, got {raw!r}")
        if op == "between" and len(raw) != 2:
            raise FilterError(f"{key}: between takes [low, high], got {raw!r}")
        return [_scalar(key, v) for v in raw]
    return _scalar(key, raw)


def _scalar(key: str, raw: Any) -> Any:
    if isinstance(raw, str) and raw.startswith("$$"):
        return raw[1:]
    if isinstance(raw, str) and raw.startswith("$"):
        if len(raw) == 1:
            raise FilterError(f"{key}: empty $param reference")
        return Param(raw[1:])
    if not isinstance(raw, str | int | float | bool):
        raise FilterError(f"{key}: expected a string, number or bool, got {raw!r}")
    return raw


def _has_param(value: Any) -> bool:
    return bool(_params_in(value))


def _params_in(value: Any) -> list[Param]:
    if isinstance(value, Param):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, Param)]
    return []


def _substitute(cond: Cond, value: Any, params: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_substitute(cond, v, params) for v in value]
    if not isinstance(value, Param):
        return value
    if value.name not in params:
        raise FilterError(f"{cond.key}: param ${value.name} is not defined")
    return params[value.name]


def _check(cond: Cond, value: Any) -> None:
    """Check a (resolved) value's shape and type against the operator and column kind."""
    where = f"{cond.key}: {cond.op}"
    if cond.op in ("in", "between"):
        if not isinstance(value, list | tuple):
            raise FilterError(f"{where} takes a list, got {value!r}")
        if cond.op == "between" and len(value) != 2:
            raise FilterError(f"{where} takes [low, high], got {value!r}")
        items = list(value)
    else:
        items = [value]
    for v in items:
        if cond.kind == "code" and not isinstance(v, str):
            raise FilterError(f"{where}: expected a string, got {v!r}")
        if cond.kind == "flag" and not isinstance(v, bool):
            raise FilterError(f"{where}: expected true or false, got {v!r}")
        if cond.kind == "num" and (isinstance(v, bool) or not isinstance(v, int | float) or v != v):
            raise FilterError(f"{where}: expected a number, got {v!r}")
