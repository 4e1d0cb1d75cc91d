"""Follow episodes through the ``next`` column: n-step returns and sequence windows.

``next`` (int32) is what the store's commit writes: the seq distance from a step to the
next step of its episode (0 = unknown; negative when the successor was committed first).
A row ``r = shard * cap + slot`` with distance ``d`` links to
``shard * cap + (slot + d) % cap``, and the link holds only while that row is alive and
still has the id ``id[r] + d * n_shards`` (a ring slot may have been reused since).
Every function takes and returns int64 global rows (-1 = no row) and loops over the n
steps (or the window length) only, never over rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from claw_tasks.format.stepmeta import EXPLICIT_NEXT, TERMINATED, TRUNCATED

_END = TERMINATED | TRUNCATED


class NStep(NamedTuple):
    """n-step transitions starting at the given rows.

    The target is ``returns + discount * (1 - done) * V(next_obs of bootstrap)``.
    """

    returns: np.ndarray  # float64: sum_{k<m} gamma^k r_{t+k}
    bootstrap: np.ndarray  # int64: row t+m-1, whose next_obs bootstraps the target
    discount: np.ndarray  # float64: gamma^m
    done: np.ndarray  # bool: terminated within the m steps
    ready: np.ndarray  # bool: done, or the bootstrap row's next_obs exists
    end_truncated: np.ndarray  # bool: the bootstrap row is a truncated step (not done)


def follow(columns: Mapping[str, np.ndarray], rows: np.ndarray, cap: int) -> np.ndarray:
    """Global row of the next step of each row's episode; -1 where unknown (or rows is -1)."""
    ids = columns["id"]
    n_shards = len(ids) // cap
    rows = np.asarray(rows, dtype=np.int64)
    has = rows >= 0
    src = np.where(has, rows, 0)
    delta = columns["next"][src].astype(np.int64)
    out = src - src % cap + (src + delta) % cap
    has &= delta != 0
    tgt = np.where(has, out, 0)
    has &= columns["alive"][tgt] & (ids[tgt] == ids[src] + delta * n_shards)
    return np.where(has, out, -1)


def has_next_obs(columns: Mapping[str, np.ndarray], rows: np.ndarray, cap: int) -> np.ndarray:
    """Whether each row's ``next_obs`` exists: given explicitly, or the next step's ``obs``."""
    explicit = (columns["flags"][rows] & EXPLICIT_NEXT) != 0
    return explicit | (follow(columns, rows, cap) >= 0)


def n_step(
    columns: Mapping[str, np.ndarray], rows: np.ndarray, n: int, gamma: float, cap: int
) -> NStep:
    """n-step returns from ``rows``, within each row's episode.

    Accumulation stops after a terminated step (``done``), after a truncated step (the
    episode's data ends; not ``done``) and where the next step is not stored (yet).
    """
    reward, flags = columns["reward"], columns["flags"]
    rows = np.asarray(rows, dtype=np.int64)
    returns = np.zeros(len(rows))
    discount = np.ones(len(rows))
    done = np.zeros(len(rows), dtype=bool)
    active = np.ones(len(rows), dtype=bool)
    cur = bootstrap = rows
    for k in range(n):
        returns += np.where(active, discount * reward[cur], 0.0)
        bootstrap = np.where(active, cur, bootstrap)
        discount = np.where(active, discount * gamma, discount)
        f = flags[cur]
        done |= active & ((f & TERMINATED) != 0)
        active &= (f & _END) == 0
        if k + 1 < n:
            nxt = follow(columns, cur, cap)
            active &= nxt >= 0
            cur = np.where(active, nxt, cur)
    ready = done | has_next_obs(columns, bootstrap, cap)
    end_truncated = ~done & ((flags[bootstrap] & TRUNCATED) != 0)
    return NStep(returns, bootstrap, discount, done, ready, end_truncated)


def windows(
    columns: Mapping[str, np.ndarray], starts: np.ndarray, length: int, cap: int
) -> np.ndarray:
    """``(len(starts), length)`` rows of consecutive steps; -1 past the episode's stored end.

    A window never continues past a terminated or truncated step, so it never crosses an
    episode boundary; one that ends on the episode's last step is complete.
    """
    starts = np.asarray(starts, dtype=np.int64)
    out = np.empty((len(starts), length), dtype=np.int64)
    out[:, 0] = cur = starts
    for j in range(1, length):
        ended = (columns["flags"][np.maximum(cur, 0)] & _END) != 0
        cur = np.where(ended, -1, follow(columns, cur, cap))
        out[:, j] = cur
    return out
