"""What posting a reward reads of the store besides the turn script: the turn rewards
given by the calls' interaction ids, and the turns other gateways may still be sending."""

from __future__ import annotations

import time
from collections.abc import Mapping

from claw_tasks.store import Store
from orchestrator.gateway.calls import TrajectoryError


def turn_rewards_by_call(
    store: Store, trajectory_uid: str, key: str, turns: int, call_rewards: Mapping[str, float]
) -> list[float]:
    """Turn rewards from rewards by interaction id (the ``X-Claw-Call-Id`` of a call)."""
    ids = list(call_rewards)
    found = store.r.hmget(key, [f"c:{c}" for c in ids])
    missing = [c for c, i in zip(ids, found, strict=True) if i is None]
    if missing:
        raise TrajectoryError(
            f"trajectory {trajectory_uid!r}: call ids {missing[:3]} are not recorded turns of it"
        )
    out = [0.0] * turns
    for c, i in zip(ids, found, strict=True):
        out[int(i)] += call_rewards[c]
    return out


def wait_committed(store: Store, trajectory_uid: str, turns: int, deadline: float) -> None:
    """Wait until the store holds ``turns`` turns of the trajectory (another gateway's
    Ingestor may still be sending some); a TrajectoryError after the deadline."""
    delay = 0.002
    while True:
        found = store.trajectory_ids(trajectory_uid)
        if found is None or len(found) >= turns:
            return  # no index: attach_rewards counts (and refuses) on the column
        if time.monotonic() > deadline:
            raise TrajectoryError(
                f"trajectory {trajectory_uid!r}: {len(found)} of its {turns} turns are "
                "stored; the rest were not committed in time (are the ingest workers "
                "running?); post the reward again"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
