"""Errors of the where language."""

from __future__ import annotations


class FilterError(ValueError):
    """A ``where`` that cannot be compiled or evaluated; the message names the key."""


class ExpressionError(FilterError):
    """An error located in the string form: the message quotes the expression with a caret
    under the offending column and says what was expected there.

    ``position`` is 0-based (``column`` is 1-based), ``expected`` describes what the parser
    wanted at that point (None for errors about a well-formed but wrong condition)."""

    def __init__(
        self, message: str, expression: str, position: int, expected: str | None = None
    ) -> None:
        self.reason, self.expression, self.position, self.expected = (
            message,
            expression,
            position,
            expected,
        )
        shown = expression.replace("\n", " ").replace("\t", " ")
        super().__init__(f"{message} (column {position + 1})\n  {shown}\n  {' ' * position}^")

    @property
    def column(self) -> int:
        return self.position + 1
