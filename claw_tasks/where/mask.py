"""Evaluate a ``where`` (either form) to a vectorized boolean mask over metadata columns.

The columns are numpy arrays with one entry per row, named as stored (``task_id``,
``flags``, ``t:<tag>``, … see :mod:`claw_tasks.store.layout`): dictionary columns and
string tags hold int32 codes (0 = missing), numeric tags and ``priority`` hold floats
(NaN = missing). String values compare by code through the ``encode`` callback; numbers
compare exactly on the stored values. A missing value (NaN, code 0) satisfies no
``eq``/``in``/ordering comparison, so ``ne`` and ``not`` do select it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from claw_tasks.format.schema import tag_name
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.where.errors import ExpressionError, FilterError
from claw_tasks.where.grammar import parse_tree
from claw_tasks.where.tree import (
    All,
    AnyOf,
    Cond,
    Node,
    Param,
    check_value,
    conditions,
    from_mapping,
    has_param,
    params_in,
    to_mapping,
)

Encoder = Callable[[str, Sequence[str]], np.ndarray]
"""``encode(column, strings)`` → integer codes of ``strings`` in ``column`` (-1 = unknown)."""

_SMALL_IN = 4
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}  # age op -> timestamp op


class Where:
    """A compiled ``where``: a string expression or a mapping (None or empty: every row).

    ``tags`` maps the namespace's free tags to ``'str'`` or ``'num'`` (without it tag keys
    are accepted but cannot be evaluated); ``encode`` looks up dictionary codes (needed
    only when a condition compares a string column)."""

    def __init__(
        self,
        where: str | Mapping[str, Any] | None,
        tags: Mapping[str, str] | None = None,
        encode: Encoder | None = None,
    ) -> None:
        self.text = where if isinstance(where, str) else None
        self.tree: Node = (
            parse_tree(where, tags) if isinstance(where, str) else from_mapping(where or {}, tags)
        )
        self.conds = tuple(conditions(self.tree))
        self.encode = encode

    @property
    def params(self) -> frozenset[str]:
        """Names of the params the conditions reference."""
        return frozenset(p.name for c in self.conds for p in params_in(c.value))

    @property
    def keys(self) -> frozenset[str]:
        """The keys the conditions name (``task_id``, ``tags.color``, ``age``, …)."""
        return frozenset(c.key.name for c in self.conds)

    @property
    def columns(self) -> frozenset[str]:
        """The stored metadata columns the mask reads."""
        return frozenset(c.key.column for c in self.conds)

    def mapping(self) -> dict[str, Any]:
        """The mapping form of this where."""
        return to_mapping(self.tree)

    def key(self, params: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """The conditions' values with ``$params`` substituted and checked, in condition
        order; hashable, and equal keys give equal masks on the same data (and ``now``)."""
        params = params or {}
        return tuple(self._resolve(c, params) for c in self.conds)

    def mask(
        self,
        columns: Mapping[str, np.ndarray],
        params: Mapping[str, Any] | None = None,
        rows: np.ndarray | None = None,
        now: float | None = None,
    ) -> np.ndarray:
        """Boolean mask over all rows, or over ``rows`` only when given. ``now`` (seconds,
        default the current time) is what ``age`` is measured from."""
        values = iter(self.key(params))
        if now is None and "age" in self.keys:
            now = time.time()
        n = len(rows) if rows is not None else len(next(iter(columns.values()), ()))

        def column(cond: Cond) -> np.ndarray:
            if cond.key.column not in columns:
                raise self._error(cond, f"{cond.label}: no column {cond.key.column!r} given")
            col = columns[cond.key.column]
            return col if rows is None else col[rows]

        def walk(node: Node) -> np.ndarray:
            if isinstance(node, Cond):
                return self._cond(node, column(node), next(values), now)
            if isinstance(node, All | AnyOf):
                out = np.full(n, isinstance(node, All))
                for part in node.parts:
                    out = out & walk(part) if isinstance(node, All) else out | walk(part)
                return out
            return ~walk(node.part)

        return walk(self.tree)

    def _cond(self, cond: Cond, col: np.ndarray, value: Any, now: float | None) -> np.ndarray:
        op, key = cond.op, cond.key
        if op == "ne":
            return ~self._cond(replace(cond, op="eq"), col, value, now)
        items = list(value) if op == "in" else [value]
        if key.kind == "flag":
            truth = ((col & key.bit) != 0) == key.when_set
            wanted = set(items)
            if len(wanted) == 2 or not wanted:
                return np.full(len(col), bool(wanted))
            return truth if True in wanted else ~truth
        if key.kind in ("code", "episode"):
            if key.kind == "episode":
                codes = np.array([episode_code(s) for s in items], np.int64)
            elif self.encode is None:
                raise self._error(cond, f"{cond.label}: comparing strings needs an encoder")
            else:
                codes = np.asarray(self.encode(key.column, items), np.int64)
            return _isin(col, codes[codes > 0].astype(col.dtype))
        if key.kind is None:
            raise self._error(cond, f"{cond.label}: the tag's kind is unknown (give the tags)")
        if key.kind == "age":  # now - timestamp <op> v  <=>  timestamp <flipped op> now - v
            assert now is not None
            if op == "between":
                return compare(col, "ge", now - value[1]) & compare(col, "le", now - value[0])
            if op == "in":
                return _any(col, [now - v for v in items])
            return compare(col, _FLIP[op], now - value)
        if op == "between":
            return compare(col, "ge", value[0]) & compare(col, "le", value[1])
        if op == "in":
            return _any(col, items)
        return compare(col, op, value)

    def _resolve(self, cond: Cond, params: Mapping[str, Any]) -> Any:
        if not has_param(cond.value):
            return cond.value

        def sub(v: Any) -> Any:
            if not isinstance(v, Param):
                return v
            if v.name not in params:
                raise self._error(cond, f"{cond.label}: param ${v.name} is not defined")
            return params[v.name]

        value = (
            tuple(sub(v) for v in cond.value) if isinstance(cond.value, tuple) else sub(cond.value)
        )
        try:
            return check_value(cond.key, cond.op, value, cond.label)
        except FilterError as e:
            raise self._error(cond, str(e)) from None

    def _error(self, cond: Cond, message: str) -> FilterError:
        """An error about ``cond``: located in the expression when there is one."""
        at = cond.vpos if cond.vpos is not None else cond.pos
        if self.text is None or at is None:
            return FilterError(message)
        return ExpressionError(message, self.text, at)


def compile_where(
    where: str | Mapping[str, Any] | None,
    tags: Mapping[str, str] | None = None,
    encode: Encoder | None = None,
) -> Where:
    """Parse and check a ``where`` of either form (raises FilterError naming the cause)."""
    return Where(where, tags, encode)


def mask(
    where: str | Mapping[str, Any] | Where | None,
    columns: Mapping[str, np.ndarray],
    *,
    params: Mapping[str, Any] | None = None,
    now: float | None = None,
    encode: Encoder | None = None,
    tags: Mapping[str, str] | None = None,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """Rows of ``columns`` that match ``where``: compile (unless given a :class:`Where`)
    and evaluate. Without ``tags`` the tags' kinds are read off the columns' dtypes."""
    if not isinstance(where, Where):
        if tags is None:
            tags = tag_kinds(columns)
        where = Where(where, tags, encode)
    return where.mask(columns, params, rows, now)


def tag_kinds(columns: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Free tags of a columns dict and their kinds (float columns are numeric tags)."""
    out = {}
    for col, arr in columns.items():
        tag = tag_name(col)
        if tag is not None:
            out[tag] = "num" if arr.dtype.kind == "f" else "str"
    return out


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


def _any(col: np.ndarray, values: Sequence[float]) -> np.ndarray:
    out = np.zeros(len(col), dtype=bool)
    for v in values:
        out |= compare(col, "eq", v)
    return out


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
