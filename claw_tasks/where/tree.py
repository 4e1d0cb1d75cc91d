"""The parsed form both spellings of a ``where`` become, and the mapping spelling.

Mapping form (JSON/YAML)::

    where   := {entry, ...}            all entries hold (an empty mapping: every row)
    entry   := key: value              equality
             | key: {op: value, ...}   every op holds (op: eq ne in gt ge lt le between)
             | and: [where, ...]       every one holds
             | or: [where, ...]        at least one holds
             | not: where

A value (or a list element) written ``$name`` is a recipe param, resolved when the mask is
computed; ``$$x`` is the literal string ``$x``. A number may be written as a duration
string (``30s``, ``5m``, ``1h``, ``7d``): it means that many seconds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from claw_tasks.durations import duration
from claw_tasks.settings import get_settings
from claw_tasks.where.errors import FilterError
from claw_tasks.where.keys import OPS, OPS_BY_KIND, Key, lookup

_SCALAR_TYPES = "a string, number, duration or bool"


@dataclass(frozen=True)
class Param:
    """A ``$name`` reference to a recipe param."""

    name: str


@dataclass(frozen=True)
class Cond:
    """One condition: ``key op value``. ``pos``/``vpos`` locate the key and the value in
    the string form (None for the mapping form)."""

    key: Key
    op: str
    value: Any  # scalar, Param, or a tuple of them (in, between)
    label: str  # where the condition is, for messages: the key, with its mapping path
    pos: int | None = None
    vpos: int | None = None


@dataclass(frozen=True)
class All:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    part: Node


Node = Cond | All | AnyOf | Not


def conditions(node: Node) -> Iterator[Cond]:
    """The conditions of a tree, depth first (the order of resolved values)."""
    if isinstance(node, Cond):
        yield node
    elif isinstance(node, Not):
        yield from conditions(node.part)
    else:
        for part in node.parts:
            yield from conditions(part)


def check_op(key: Key, op: object, label: str) -> str:
    """``op`` if it is an operator that applies to ``key``."""
    if op not in OPS:
        raise FilterError(f"{label}: unknown operator {op!r} (use one of {', '.join(OPS)})")
    if key.kind is not None and op not in OPS_BY_KIND[key.kind]:
        allowed = ", ".join(o for o in OPS if o in OPS_BY_KIND[key.kind])
        raise FilterError(
            f"{label}: operator {op!r} does not apply to a {key.kind} column (use {allowed})"
        )
    return str(op)


def check_value(key: Key, op: str, value: Any, label: str) -> Any:
    """A (resolved) value checked against the operator's shape and the key's kind, with
    durations converted to seconds; lists become tuples (hashable)."""
    where = f"{label}: {op}"
    if op in ("in", "between"):
        if not isinstance(value, list | tuple):
            raise FilterError(f"{where} takes a list, got {value!r}")
        if op == "between" and len(value) != 2:
            raise FilterError(f"{where} takes [low, high], got {list(value)!r}")
        return tuple(check_item(key, v, where) for v in value)
    return check_item(key, value, where)


def check_item(key: Key, v: Any, where: str) -> Any:
    """One scalar checked against the key's kind (a duration becomes seconds)."""
    if key.kind in ("code", "episode") and not isinstance(v, str):
        raise FilterError(f"{where}: expected a string, got {v!r}")
    if key.kind == "flag" and not isinstance(v, bool):
        raise FilterError(f"{where}: expected true or false, got {v!r}")
    if key.kind in ("num", "age"):
        if isinstance(v, str) and (seconds := duration(v)) is not None:
            return seconds
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
            hint = " (a duration is written 30s, 5m, 1h, 7d or 2w)" if isinstance(v, str) else ""
            raise FilterError(f"{where}: expected a number, got {v!r}{hint}")
    return v


def has_param(value: Any) -> bool:
    return bool(params_in(value))


def params_in(value: Any) -> list[Param]:
    if isinstance(value, Param):
        return [value]
    if isinstance(value, tuple):
        return [v for v in value if isinstance(v, Param)]
    return []


def make_cond(
    key: Key, op: str, value: Any, label: str, pos: int | None = None, vpos: int | None = None
) -> Cond:
    """A condition, its value checked now unless it holds a param (checked when resolved)."""
    if isinstance(value, list):
        value = tuple(value)
    if not has_param(value):
        value = check_value(key, op, value, label)
    return Cond(key, op, value, label, pos, vpos)


def max_depth() -> int:
    """How deep a ``where`` may nest (``CLAW_WHERE_MAX_DEPTH``)."""
    return get_settings().where_max_depth


def too_deep(limit: int) -> str:
    """The refusal of a ``where`` nested past ``limit`` levels (both forms)."""
    return (
        f"nested more than {limit} levels deep (parentheses, 'not', 'and'/'or' lists; "
        f"the limit is CLAW_WHERE_MAX_DEPTH={limit})"
    )


def from_mapping(
    where: Any, tags: Mapping[str, str] | None = None, path: str = "", depth: int = 0
) -> Node:
    """The tree of a mapping-form ``where``; errors name the key with its path. ``and``,
    ``or`` and ``not`` nest at most :func:`max_depth` deep (as in the string form)."""
    if depth > max_depth():
        raise FilterError(f"{path[:80] or 'where'}…: {too_deep(max_depth())}")
    if not isinstance(where, Mapping):
        raise FilterError(f"{path or 'where'}: expected a mapping, got {type(where).__name__}")
    parts: list[Node] = []
    for name, spec in where.items():
        label = f"{path}{name}"
        if name in ("and", "or"):
            if not isinstance(spec, list | tuple):
                raise FilterError(f"{label}: takes a list of conditions, got {spec!r}")
            subs = tuple(
                from_mapping(s, tags, f"{label}[{i}].", depth + 1) for i, s in enumerate(spec)
            )
            parts.append(All(subs) if name == "and" else AnyOf(subs))
            continue
        if name == "not":
            parts.append(Not(from_mapping(spec, tags, f"{label}.", depth + 1)))
            continue
        try:
            key = lookup(name, tags)
        except FilterError as e:
            raise FilterError(f"{path}{e}") from None
        if isinstance(spec, list | tuple):
            raise FilterError(
                f"{label}: a list needs an operator ({{in: [...]}} or {{between: [low, high]}})"
            )
        items = spec.items() if isinstance(spec, Mapping) else [("eq", spec)]
        if not items:
            raise FilterError(f"{label}: empty condition")
        for op, raw in items:
            op = check_op(key, op, label)
            parts.append(make_cond(key, op, _value(raw, label), label))
    return parts[0] if len(parts) == 1 else All(tuple(parts))


def _value(raw: Any, label: str) -> Any:
    if isinstance(raw, list | tuple):
        return tuple(_scalar(v, label) for v in raw)
    return _scalar(raw, label)


def _scalar(raw: Any, label: str) -> Any:
    if isinstance(raw, str) and raw.startswith("$$"):
        return raw[1:]
    if isinstance(raw, str) and raw.startswith("$"):
        if len(raw) == 1:
            raise FilterError(f"{label}: empty $param reference")
        return Param(raw[1:])
    if isinstance(raw, list | tuple):
        raise FilterError(f"{label}: lists do not nest, got {list(raw)!r}")
    if not isinstance(raw, str | int | float | bool):
        raise FilterError(f"{label}: expected {_SCALAR_TYPES}, got {raw!r}")
    return raw


def to_mapping(node: Node) -> dict[str, Any]:
    """The mapping form of a tree (an ``and`` whose parts have distinct keys is written as
    one mapping)."""
    if isinstance(node, Cond):
        return {node.key.name: _raw(node.value) if node.op == "eq" else {node.op: _raw(node.value)}}
    if isinstance(node, Not):
        return {"not": to_mapping(node.part)}
    subs = [to_mapping(p) for p in node.parts]
    if isinstance(node, All):
        names = [n for s in subs for n in s]
        if len(set(names)) == len(names):
            return {n: v for s in subs for n, v in s.items()}
        return {"and": subs}
    return {"or": subs}


def _raw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_raw(v) for v in value]
    if isinstance(value, Param):
        return f"${value.name}"
    if isinstance(value, str) and value.startswith("$"):
        return "$" + value
    return value
