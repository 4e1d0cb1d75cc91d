"""The names a ``where`` may use, the stored metadata column each one reads, and how.

Fixed keys are the step metadata every namespace has; ``tags.<name>`` names a free tag
(its kind comes from the namespace schema); ``age`` is derived: ``now - timestamp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from claw_tasks.format.schema import TAG_KEY_PREFIX, key_tag, tag_column
from claw_tasks.format.stepmeta import DICT_COLUMNS, TERMINATED, TRUNCATED, UNTRAINABLE
from claw_tasks.where.errors import FilterError

Kind = Literal["code", "episode", "num", "flag", "age"]
"""How a key compares: ``code`` a string through the column's dictionary, ``episode`` a
string through the episode hash, ``num`` a number, ``flag`` a bool (a bit of ``flags``),
``age`` a duration against ``now - timestamp``."""


@dataclass(frozen=True)
class Key:
    """One key of the language: as written, the column it reads, and how it compares."""

    name: str
    column: str
    kind: Kind | None  # None: a tag whose kind is not known yet (no schema given)
    bit: int = 0  # flag: its bit in ``flags``
    when_set: bool = True  # flag: the value a set bit stands for


FIXED: dict[str, Key] = {
    k.name: k
    for k in (
        Key("id", "id", "num"),
        Key("episode_id", "episode", "episode"),
        Key("step_index", "step_index", "num"),
        *(Key(c, c, "code") for c in DICT_COLUMNS),
        Key("policy_version", "policy_version", "num"),
        Key("timestamp", "timestamp", "num"),
        Key("reward", "reward", "num"),
        Key("priority", "priority", "num"),
        Key("terminated", "flags", "flag", TERMINATED),
        Key("truncated", "flags", "flag", TRUNCATED),
        Key("trainable", "flags", "flag", UNTRAINABLE, when_set=False),
    )
}
"""Stored step metadata, by the name users write."""

AGE = Key("age", "timestamp", "age")

OPS = ("eq", "ne", "in", "gt", "ge", "lt", "le", "between")
OPS_BY_KIND: dict[Kind, frozenset[str]] = {
    "code": frozenset({"eq", "ne", "in"}),
    "episode": frozenset({"eq", "ne", "in"}),
    "flag": frozenset({"eq", "ne", "in"}),
    "num": frozenset(OPS),
    "age": frozenset(OPS),
}


def lookup(name: object, tags: Mapping[str, str] | None = None) -> Key:
    """The key ``name`` names. ``tags`` maps the namespace's free tags to ``'str'`` or
    ``'num'``; without it (no schema yet) any ``tags.<name>`` is accepted, kind unknown."""
    if not isinstance(name, str):
        raise FilterError(f"{name!r}: keys must be strings")
    if name in FIXED:
        return FIXED[name]
    if name == AGE.name:
        return AGE
    tag = key_tag(name)
    if tag is None:
        raise FilterError(
            f"{name}: unknown metadata key (fixed: {', '.join([*FIXED, AGE.name])}; "
            f"free tags: {TAG_KEY_PREFIX}<name>)"
        )
    if tags is None:
        return Key(name, tag_column(tag), None)
    if tag not in tags:
        known = ", ".join(sorted(tags)) or "none"
        raise FilterError(f"{name}: no tag {tag!r} in the namespace schema (tags: {known})")
    return Key(name, tag_column(tag), "code" if tags[tag] == "str" else "num")
