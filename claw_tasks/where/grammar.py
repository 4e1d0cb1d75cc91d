"""The string form of a ``where``: a hand-written tokenizer and recursive-descent parser
(never ``eval``) that builds the same tree as the mapping form.

Grammar (keywords are lowercase)::

    expr       := or_expr END
    or_expr    := and_expr ("or" and_expr)*
    and_expr   := unary ("and" unary)*
    unary      := "not" unary | "(" or_expr ")" | condition
    condition  := KEY                                  a flag is true: terminated
                | KEY ("==" | "!=" | "<" | "<=" | ">" | ">=") value
                | KEY ["not"] "in" (list | PARAM)
                | KEY "between" value "and" value     inclusive
    list       := "[" [value ("," value)* [","]] "]"
    value      := STRING | ["-"] NUMBER | ["-"] DURATION | "true" | "false" | PARAM
    KEY        := fixed key (task_id, reward, age, …) | "tags." tag name
    STRING     := '…' | "…"                            \\ escapes \\, ' and "
    DURATION   := NUMBER ("s" | "m" | "h" | "d" | "w")    seconds: 90s, 1.5h, 7d, 2w
    PARAM      := "$" name                              a recipe param

An empty expression matches every row. Nesting (parentheses and ``not``) is bounded by
``CLAW_WHERE_MAX_DEPTH`` (:func:`max_depth`): the parser recurses once per level, so an
expression nested thousands deep would otherwise end in a ``RecursionError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from claw_tasks.durations import UNITS as DURATION_UNITS
from claw_tasks.where.errors import ExpressionError, FilterError
from claw_tasks.where.keys import Key, lookup
from claw_tasks.where.tree import (
    All,
    AnyOf,
    Node,
    Not,
    Param,
    check_item,
    check_op,
    make_cond,
    max_depth,
    to_mapping,
    too_deep,
)

KEYWORDS = frozenset({"and", "or", "not", "in", "between", "true", "false"})
COMPARISONS = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_OPERATOR_HINT = "an operator (==, !=, <, <=, >, >=, in, not in, between)"
_VALUE_HINT = "a value ('string', number, duration like 5m, true, false or $param)"
_SINGLE = "()[],-=<>!"


@dataclass(frozen=True)
class Token:
    kind: str  # name, num, str, param, op, end
    text: str
    pos: int
    value: Any = None


def parse(text: str) -> dict[str, Any]:
    """The mapping form of a string ``where`` (keys checked, tags not: no schema here)."""
    return to_mapping(parse_tree(text))


def parse_tree(text: str, tags: Mapping[str, str] | None = None) -> Node:
    """The tree of a string ``where``; errors are :class:`ExpressionError`."""
    return _Parser(text, tags).parse()


def tokenize(text: str) -> list[Token]:
    """The tokens of ``text``, ending with an ``end`` token."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            tok, i = _number(text, i)
            out.append(tok)
        elif c.isalpha() or c == "_":
            j = _word_end(text, i)
            out.append(Token("name", text[i:j], i))
            i = j
        elif c == "$":
            j = _word_end(text, i + 1, dotted=False)
            if j == i + 1:
                raise ExpressionError("a $ must start a param name", text, i, "a param name")
            out.append(Token("param", text[i:j], i, Param(text[i + 1 : j])))
            i = j
        elif c in "'\"":
            tok, i = _string(text, i)
            out.append(tok)
        elif text[i : i + 2] in ("==", "!=", "<=", ">="):
            out.append(Token("op", text[i : i + 2], i))
            i += 2
        elif c in _SINGLE:
            out.append(Token("op", c, i))
            i += 1
        else:
            raise ExpressionError(f"unexpected character {c!r}", text, i, "a condition")
    out.append(Token("end", "", n))
    return out


def _word_end(text: str, i: int, dotted: bool = True) -> int:
    """End of an identifier at ``i``; ``dotted`` also takes ``.part`` suffixes (tag keys,
    whose names may hold letters, digits, ``_``, ``-`` and ``.``)."""
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] == "_"):
        j += 1
    while dotted and j < len(text) and text[j] == "." and j > i:
        k = j + 1
        while k < len(text) and (text[k].isalnum() or text[k] in "_-."):
            k += 1
        if k == j + 1:
            break
        j = k
    return j


def _number(text: str, i: int) -> tuple[Token, int]:
    j, n = i, len(text)
    while j < n and text[j].isdigit():
        j += 1
    is_float = j < n and text[j] == "."
    if is_float:
        j += 1
        while j < n and text[j].isdigit():
            j += 1
    if j < n and text[j] in "eE":
        k = j + 1 + (j + 1 < n and text[j + 1] in "+-")
        if k < n and text[k].isdigit():
            is_float, j = True, k
            while j < n and text[j].isdigit():
                j += 1
    number = float(text[i:j]) if is_float else int(text[i:j])
    u = _word_end(text, j, dotted=False)
    if u == j:
        return Token("num", text[i:j], i, number), j
    unit = text[j:u]
    if unit not in DURATION_UNITS:
        raise ExpressionError(
            f"unknown duration unit {unit!r}", text, j, "a duration unit (s, m, h, d or w)"
        )
    seconds = number * DURATION_UNITS[unit]
    if isinstance(seconds, float) and seconds.is_integer():
        seconds = int(seconds)
    return Token("num", text[i:u], i, seconds), u


def _string(text: str, i: int) -> tuple[Token, int]:
    quote, j, chars = text[i], i + 1, []
    while j < len(text) and text[j] != quote:
        if text[j] == "\\":
            if j + 1 >= len(text) or text[j + 1] not in "\\'\"":
                raise ExpressionError(
                    "unknown escape in a string", text, j, "one of \\\\, \\' or \\\""
                )
            j += 1
        chars.append(text[j])
        j += 1
    if j >= len(text):
        raise ExpressionError("unterminated string", text, i, f"a closing {quote}")
    return Token("str", text[i : j + 1], i, "".join(chars)), j + 1


class _Parser:
    def __init__(self, text: str, tags: Mapping[str, str] | None) -> None:
        self.text, self.tags = text, tags
        self.toks = tokenize(text)
        self.i = 0
        self.depth, self.max_depth = 0, max_depth()

    def parse(self) -> Node:
        if self.peek().kind == "end":
            return All(())
        node = self.or_expr()
        tok = self.peek()
        if tok.kind != "end":
            self.fail(tok, "'and', 'or' or the end")
        return node

    # ---- tokens --------------------------------------------------------------------
    def peek(self, ahead: int = 0) -> Token:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def take(self) -> Token:
        tok = self.peek()
        self.i += 1
        return tok

    def at(self, text: str, ahead: int = 0) -> bool:
        tok = self.peek(ahead)
        return tok.kind in ("name", "op") and tok.text == text

    def fail(self, tok: Token, expected: str) -> NoReturn:
        got = "the end" if tok.kind == "end" else repr(tok.text)
        hint = " (use == to compare)" if tok.text == "=" else ""
        raise ExpressionError(f"expected {expected}, got {got}{hint}", self.text, tok.pos, expected)

    def located(self, pos: int, e: FilterError) -> ExpressionError:
        return ExpressionError(str(e), self.text, pos)

    # ---- grammar -------------------------------------------------------------------
    def or_expr(self) -> Node:
        parts = [self.and_expr()]
        while self.at("or"):
            self.take()
            parts.append(self.and_expr())
        return parts[0] if len(parts) == 1 else AnyOf(tuple(parts))

    def and_expr(self) -> Node:
        parts = [self.unary()]
        while self.at("and"):
            self.take()
            parts.append(self.unary())
        return parts[0] if len(parts) == 1 else All(tuple(parts))

    def unary(self) -> Node:
        if not self.at("not") and not self.at("("):
            return self.condition()
        self.depth += 1
        if self.depth > self.max_depth:
            tok = self.peek()
            raise ExpressionError(too_deep(self.max_depth), self.text, tok.pos)
        try:
            if self.take().text == "not":
                return Not(self.unary())
            node = self.or_expr()
            if not self.at(")"):
                self.fail(self.peek(), "'and', 'or' or ')'")
            self.take()
            return node
        finally:
            self.depth -= 1

    def condition(self) -> Node:
        tok = self.take()
        if tok.kind != "name" or tok.text in KEYWORDS:
            self.fail(tok, "a condition (a key such as task_id or tags.<name>, 'not' or '(')")
        try:
            key = lookup(tok.text, self.tags)
        except FilterError as e:
            raise self.located(tok.pos, e) from None
        nxt = self.peek()
        if nxt.kind == "op" and nxt.text in COMPARISONS:
            self.take()
            value, vpos = self.value(nxt)
            return self.cond(key, tok, nxt, COMPARISONS[nxt.text], value, vpos)
        if self.at("in") or (self.at("not") and self.at("in", 1)):
            negate = self.at("not")
            if negate:
                self.take()
            op = self.take()
            value, vpos, items = self.list_or_param(op)
            self.check_items(key, "in", items)
            node = self.cond(key, tok, op, "in", value, vpos)
            return Not(node) if negate else node
        if self.at("between"):
            op = self.take()
            low, vpos = self.value(op)
            if not self.at("and"):
                self.fail(self.peek(), "'and' between the two bounds")
            high, hpos = self.value(self.take())
            self.check_items(key, "between", [(low, vpos), (high, hpos)])
            return self.cond(key, tok, op, "between", (low, high), vpos)
        if nxt.kind == "end" or nxt.text in ("and", "or", ")"):
            if key.kind == "flag":
                return make_cond(key, "eq", True, key.name, tok.pos, tok.pos)
            raise ExpressionError(
                f"{key.name} is not a flag (terminated, truncated, trainable): compare it",
                self.text,
                nxt.pos,
                _OPERATOR_HINT,
            )
        self.fail(nxt, f"{_OPERATOR_HINT} after {tok.text!r}")

    def cond(self, key: Key, ktok: Token, otok: Token, op: str, value: Any, vpos: int) -> Node:
        try:
            check_op(key, op, key.name)
        except FilterError as e:
            raise self.located(otok.pos, e) from None
        try:
            return make_cond(key, op, value, key.name, ktok.pos, vpos)
        except FilterError as e:
            raise self.located(vpos, e) from None

    def value(self, after: Token) -> tuple[Any, int]:
        tok = self.take()
        if tok.kind == "op" and tok.text == "-":
            num = self.take()
            if num.kind != "num":
                self.fail(num, "a number after '-'")
            return -num.value, tok.pos
        if tok.kind in ("num", "str", "param"):
            return tok.value, tok.pos
        if tok.kind == "name" and tok.text in ("true", "false"):
            return tok.text == "true", tok.pos
        self.fail(tok, f"{_VALUE_HINT} after {after.text!r}")

    def list_or_param(self, after: Token) -> tuple[Any, int, list[tuple[Any, int]]]:
        """The value after ``in``, its position, and the list's items with theirs."""
        tok = self.peek()
        if tok.kind == "param":
            self.take()
            return tok.value, tok.pos, []
        if not self.at("["):
            self.fail(tok, f"a list [...] or a $param after {after.text!r}")
        self.take()
        items: list[tuple[Any, int]] = []
        while not self.at("]"):
            items.append(self.value(self.peek(-1)))
            if self.at(","):
                self.take()
            elif not self.at("]"):
                self.fail(self.peek(), "',' or ']'")
        self.take()
        return tuple(v for v, _ in items), tok.pos, items

    def check_items(self, key: Key, op: str, items: list[tuple[Any, int]]) -> None:
        """Point at the first element of a list that does not fit ``key``."""
        for v, pos in items:
            if not isinstance(v, Param):
                try:
                    check_item(key, v, f"{key.name}: {op}")
                except FilterError as e:
                    raise self.located(pos, e) from None
