"""The adapters' shared arguments: an old spelling is refused with the new one named, in a
call and in a saved state (``ClawStorage.load_state_dict`` reads one)."""

from __future__ import annotations

import pytest

from orchestrator.adapters.options import (
    check_policy_version,
    refuse_renamed,
    refuse_renamed_state,
)


class _Adapter:
    @refuse_renamed
    def __init__(self, drop_on_reset: bool = False) -> None:
        self.drop_on_reset = drop_on_reset


def test_an_old_argument_names_the_new_one() -> None:
    assert _Adapter(drop_on_reset=True).drop_on_reset
    with pytest.raises(TypeError, match="_Adapter: drop_on_empty= is now drop_on_reset="):
        _Adapter(drop_on_empty=True)


def test_a_saved_state_with_an_old_argument_names_the_new_one() -> None:
    refuse_renamed_state({"drop_on_reset": True}, "load")
    with pytest.raises(ValueError, match="load: the saved state has drop_on_empty=, which is now"):
        refuse_renamed_state({"drop_on_empty": True}, "load")


def test_an_old_counter_names_the_new_one() -> None:
    check_policy_version("updates", {"updates": int})
    with pytest.raises(ValueError, match="policy_version='batches' is now 'updates'"):
        check_policy_version("batches", {"updates": int})
    with pytest.raises(ValueError, match="one of 'updates'"):
        check_policy_version("rollouts", {"updates": int})
