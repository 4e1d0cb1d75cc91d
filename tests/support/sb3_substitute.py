"""pytest plugin (``-p tests.support.sb3_substitute``) for running Stable-Baselines3's own
``tests/test_buffers.py`` against Claw, in a process of its own
(tests/stack/test_sb3_own_tests.py): SB3's buffer classes, as that file imports them, are
Claw's (``stable_baselines3.common.buffers.ReplayBuffer`` is ``ClawReplayBuffer`` and so
on), set before the file is imported. Each buffer opens a new namespace of the store
``CLAW_REDIS_URL`` names (the test's workers serve it). Not a ``conftest.py``: pytest
would load that in every test process of the suite."""

from __future__ import annotations

from stable_baselines3.common import buffers

from orchestrator.adapters.sb3 import (
    ClawDictReplayBuffer,
    ClawDictRolloutBuffer,
    ClawReplayBuffer,
    ClawRolloutBuffer,
)

buffers.ReplayBuffer = ClawReplayBuffer  # type: ignore[misc]  # the substitution itself
buffers.DictReplayBuffer = ClawDictReplayBuffer  # type: ignore[misc]  # likewise
buffers.RolloutBuffer = ClawRolloutBuffer  # type: ignore[misc]  # likewise
buffers.DictRolloutBuffer = ClawDictRolloutBuffer  # type: ignore[misc]  # likewise
