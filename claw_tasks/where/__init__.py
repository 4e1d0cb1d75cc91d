"""The where language: one filter over step metadata, in two spellings.

A ``where`` is either a mapping (recipes in YAML/JSON) or a string
(``task_id == 'grasp' and (reward > 0.5 or tags.difficulty >= 3) and not terminated``).
Both become the same tree (:mod:`.tree`), evaluated by one vectorized evaluator
(:mod:`.mask`) over numpy metadata columns. The string grammar is in :mod:`.grammar`, the
keys in :mod:`.keys`; docs/reference/where.md is the reference.

Entry points: :func:`parse` (string → mapping form), :func:`compile_where` (either form →
:class:`Where`, checked), :func:`mask` (either form + columns → boolean mask).
"""

from claw_tasks.durations import duration
from claw_tasks.where.errors import ExpressionError, FilterError
from claw_tasks.where.grammar import parse
from claw_tasks.where.keys import AGE, FIXED, Key, lookup
from claw_tasks.where.mask import Encoder, Where, compare, compile_where, mask, tag_kinds

__all__ = [
    "AGE",
    "FIXED",
    "Encoder",
    "ExpressionError",
    "FilterError",
    "Key",
    "Where",
    "compare",
    "compile_where",
    "duration",
    "lookup",
    "mask",
    "parse",
    "tag_kinds",
]
