"""What a session key names: its trajectory ``S`` and choices ``S~i`` written as a split
writes them (``str(i)``), whatever the spelling sent; anything else is not its."""

from __future__ import annotations

import pytest

from orchestrator.gateway.gate import Principal

KEY = Principal("S", "h")


@pytest.mark.parametrize(("uid", "choice"), [("S~0", 0), ("S~7", 7), ("S~9999", 9999)])
def test_a_choice_is_read_in_its_canonical_spelling(uid: str, choice: int) -> None:
    assert KEY.choice(uid) == choice and KEY.allows(uid)


@pytest.mark.parametrize(
    "uid",
    [
        "S~07",
        "S~",
        "S~-1",
        "S~ 1",
        "S~1\n",
        "S~\u00b2",
        "S~\u0663",
        "S~\uff11",
        "T~1",
        "S~1~0",
        "~1",
    ],
)
def test_another_spelling_is_not_a_choice(uid: str) -> None:
    assert KEY.choice(uid) is None and not KEY.allows(uid)


def test_choices_needed_is_the_highest_choice_plus_one() -> None:
    assert KEY.choices_needed(("S",)) == 0
    assert KEY.choices_needed(("S~0", "S~1", "S~2")) == 3
    assert KEY.choices_needed(("S~4", "T~9")) == 5
    assert Principal().allows("anything") and Principal().choices_needed(("S~3",)) == 0
