"""A ``transition`` source on a real store: its rows are exactly the steps around the A→B
changes committed so far, an episode whose B steps are committed later (interleaved with
other episodes' steps) becomes eligible as they arrive, and an evicted step cuts its
window; the three-source mixture is exact in every batch."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator import sample
from tests.support.stepdata import batch, interleave

K = 2
RECIPE = {
    "name": "compose",
    "batch_size": 10,
    "fields": ["obs"],
    "sources": [
        {"name": "reach", "weight": 2, "where": {"skill_tag": "reach"}},
        {"name": "grasp", "weight": 2, "where": {"skill_tag": "grasp"}},
        {
            "name": "reach-grasp",
            "weight": 1,
            "transition": {"from": "reach", "to": "grasp", "window": K},
        },
    ],
}


def steps(ep: int, skills: list[str], first: int = 0) -> list[dict]:
    return [
        {"ep": ep, "step": first + t, "skill_tag": s, "terminated": False}
        for t, s in enumerate(skills)
    ]


def drawn(store, rounds: int, seed: int) -> set[tuple[int, int]]:
    """(episode, step) of the transition source's rows over ``rounds`` batches, each batch
    checked for exact counts."""
    got: set[tuple[int, int]] = set()
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        b = sample(store, RECIPE, rng=rng)
        assert np.bincount(b.source_index, minlength=3).tolist() == [4, 4, 2]
        obs = np.asarray(b["obs"])[b.source_index == 2]
        got |= {(int(o[0]), int(o[1])) for o in obs}
    return got


@pytest.mark.both_stores
def test_transition_rows_follow_the_store(store):
    r, g = "reach", "grasp"
    store.commit(
        batch(
            interleave(
                steps(0, [r] * 4 + [g] * 4),  # one change at 3 -> 4: window steps 2..5
                steps(1, [r] * 5),  # its grasp steps come later
                steps(2, [g, r, g, r, g]),  # changes at 1 -> 2 and 3 -> 4: steps 0..4
                steps(3, [g] * 3 + [r] * 3),  # grasp -> reach only: none
            )
        )
    )
    want = {(0, t) for t in range(2, 6)} | {(2, t) for t in range(5)}
    assert drawn(store, 60, seed=0) == want
    store.commit(batch(interleave(steps(1, [g] * 3, first=5), steps(4, [r, r]))))
    want |= {(1, t) for t in range(3, 7)}
    assert drawn(store, 80, seed=1) == want
    # evicting episode 0's first grasp step takes its change, and its window, away
    one = {"name": "one", "where": {"episode_id": "ep0", "step_index": 4}}
    got = sample(store, {**RECIPE, "name": "one", "batch_size": 1, "sources": [one]})
    assert store.evict([int(got.ids[0])]) == 1
    assert drawn(store, 80, seed=2) == want - {(0, t) for t in range(2, 6)}
