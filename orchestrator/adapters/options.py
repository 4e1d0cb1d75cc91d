"""The keyword arguments Claw's adapters share: one name, one default and one meaning for
each, whichever host library the adapter serves (docs/adapters.md's reference table lists
every adapter's arguments; ``tests/system/test_adapter_table.py`` checks it against the
signatures and the defaults below).

A host library's own argument names (SB3's ``buffer_size``, TorchRL's ``max_size``,
RLlib's ``capacity`` and ``batch_size_B``) stay where the host passes them. An old
spelling of a shared argument raises ``TypeError`` naming the new one: Claw is 0.x and
keeps no silent aliases."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = [
    "DEFAULTS_DIFFER",
    "POLICY_VERSIONS",
    "RENAMED",
    "RENAMED_VERSIONS",
    "SHARED",
    "check_policy_version",
    "refuse_renamed",
    "refuse_renamed_state",
]

SHARED: dict[str, tuple[Any, str]] = {
    "namespace": (None, "the Claw namespace the rows live in (None: a new unique one, logged)"),
    "redis_url": (None, "the data store (None: CLAW_REDIS_URL)"),
    "broker_url": (None, "the Celery broker (None: CLAW_BROKER_URL, else the data store)"),
    "capacity": (
        None,
        "the namespace's ring in rows (None: the host's own size when the namespace is new)",
    ),
    "episode": (None, "keyword arguments of Ingestor.episode (task_id, tags)"),
    "ingest": (None, "keyword arguments of the Ingestor"),
    "seed": (None, "the draws' seed (None: from numpy's global state, which the host seeds)"),
    "deterministic": (False, "each draw made at the call, from the seed: samples repeat"),
    "gradient_steps": (None, "the trainer's burst of samples between adds (None: learned)"),
    "readahead": (None, "batches decoded ahead in this process (None: follows the bursts)"),
    "readahead_bytes": (64 << 20, "at most this many bytes read ahead"),
    "batches_per_pop": (None, "samples served by one popped batch (None: follows the bursts)"),
    "drop_on_reset": (
        False,
        "a reset (SB3's reset, TorchRL's empty) drops the old namespace instead of keeping it",
    ),
    "timeout": (30.0, "seconds a sample waits for its batch (then TimeoutError)"),
}
"""name -> (default, meaning) of the arguments every adapter taking them spells alike."""

POLICY_VERSIONS: dict[str, str] = {
    "updates": "the number of samples (batches) served so far, this one included: one per "
    "gradient step, so version v trained the policy after v updates (off-policy default)",
    "timesteps": "the transitions added so far (the host's timestep or frame count)",
    "rollouts": "the rollouts served so far (the on-policy buffers' default)",
}
"""The counters ``policy_version`` may name, one meaning each across adapters."""

DEFAULTS_DIFFER: dict[tuple[str, str], str] = {
    ("ClawRolloutBuffer", "timeout"): "60.0: a pop waits for the whole rollout just written "
    "(n_steps x n_envs steps) to be formed, not for a prefetched batch",
    ("ClawDictRolloutBuffer", "timeout"): "as ClawRolloutBuffer",
    ("ClawRollouts", "timeout"): "300.0: a pop waits for LLM agents to finish whole groups",
    **{
        (cls, "capacity"): "10000: RLlib's own argument and default (its config passes it)"
        for cls in (
            "ClawEpisodeReplayBuffer",
            "ClawPrioritizedEpisodeReplayBuffer",
            "ClawMultiAgentEpisodeReplayBuffer",
        )
    },
}
"""(adapter, argument) -> why its default differs from :data:`SHARED`'s."""

RENAMED: dict[str, str] = {"drop_on_empty": "drop_on_reset"}
"""Old argument spellings -> the shared name."""

RENAMED_VERSIONS: dict[str, str] = {
    "samples": "updates",
    "frames": "timesteps",
    "batches": "updates",
}
"""Old ``policy_version`` counter names -> the shared name."""

F = TypeVar("F", bound=Callable[..., Any])


def refuse_renamed(init: F) -> F:
    """Wrap a constructor so that an old spelling of a shared argument raises a
    ``TypeError`` naming the new one (the signature stays the constructor's)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        for old, new in RENAMED.items():
            if old in kwargs:
                raise TypeError(f"{type(self).__name__}: {old}= is now {new}=")
        return init(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]  # same signature: functools.wraps


def refuse_renamed_state(saved: Mapping[str, Any], what: str) -> None:
    """Raise a ``ValueError`` naming the new spelling for saved constructor arguments (a
    ``state_dict``'s) that use an old one: loading them would fail later, on first use."""
    for old, new in RENAMED.items():
        if old in saved:
            raise ValueError(f"{what}: the saved state has {old}=, which is now {new}=")


def check_policy_version(declare: Any, counters: Any) -> None:
    """Raise for a ``policy_version`` counter name this adapter does not count, naming
    the shared name when it is an old one."""
    if isinstance(declare, str) and declare not in counters:
        new = RENAMED_VERSIONS.get(declare)
        if new is not None and new in counters:
            raise ValueError(f"policy_version={declare!r} is now {new!r}")
        raise ValueError(
            f"policy_version={declare!r}: one of {', '.join(map(repr, counters))}, a "
            "callable of the sample's number, or None"
        )
