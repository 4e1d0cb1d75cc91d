"""Stored LLM turns: a trajectory's turn ids, its rewards applied by the rule of
:func:`claw_tasks.format.turns.spread_rewards`, and the turns' ``info`` read back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from claw_tasks.format.arrays import unpackb
from claw_tasks.format.turns import discount_turns, spread_rewards
from claw_tasks.store import Store
from claw_tasks.store.layout import SPARSE_CHUNK_SLOTS


def trajectory_step_ids(
    store: Store, trajectory_uid: str, expect_turns: int | None = None
) -> np.ndarray:
    """A trajectory's stored turn ids by turn: from the episode index when the namespace
    keeps one and it holds every turn (``expect_turns`` when given; O(turns)), else from
    the shard's episode column (a full-column read). Raises KeyError when none is stored."""
    ids = store.trajectory_ids(trajectory_uid)
    if ids is not None and len(ids) and (expect_turns is None or len(ids) == expect_turns):
        return ids
    return np.asarray(store.episode(trajectory_uid, fields=[])["id"], np.int64)


def attach_rewards(
    store: Store,
    trajectory_uid: str,
    final_reward: float,
    turn_rewards: Sequence[float] | None = None,
    *,
    reward_source: str | None = None,
    expect_turns: int | None = None,
    discount: float | None = None,
    tags: Mapping[str, float] | None = None,
) -> int:
    """Apply :func:`spread_rewards` to a trajectory's committed turns and mark its last
    turn terminated (``is_last``). ``expect_turns`` guards against rewarding a trajectory
    whose turns are not all committed yet. ``discount`` (gamma) then credits each turn
    with the discounted rewards after it (:func:`discount_turns`); ``tags`` are more
    numeric tags set on every turn (the gateway's ``min_version``/``max_version``),
    written with the rewards, before the terminated flag. Returns how many turns were
    updated."""
    ids = trajectory_step_ids(store, trajectory_uid, expect_turns)
    if expect_turns is not None and len(ids) != expect_turns:
        raise ValueError(
            f"trajectory {trajectory_uid!r} has {len(ids)} stored turns, expected {expect_turns}"
        )
    rewards = spread_rewards(len(ids), final_reward, turn_rewards)
    if discount is not None:
        rewards = discount_turns(rewards, discount).astype(np.float32)
    return store.update_rewards(
        ids,
        rewards,
        tags={**(tags or {}), "final_reward": float(final_reward)},
        reward_source=reward_source,
        terminated=ids[-1:],
    )


def turn_infos(store: Store, ids: Sequence[int] | np.ndarray) -> list[dict[str, Any] | None]:
    """The ``info`` dicts of steps by id (None where a step has none), messages and tool
    calls still JSON text. Ids must be live (``Store.get`` checks that)."""
    shards, slots = store.locate(ids)
    with store.r.pipeline(transaction=False) as pipe:
        for shard, slot in zip(shards.tolist(), slots.tolist(), strict=True):
            pipe.hget(store.layout_keys.sparse(shard, "info", slot // SPARSE_CHUNK_SLOTS), slot)
        return [None if raw is None else unpackb(raw) for raw in pipe.execute()]
