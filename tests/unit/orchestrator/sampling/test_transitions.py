"""The ``transition`` source against a numpy reference: episodes with several skill
changes, windows cut by the episode's edges, late-arriving steps, evictions and ring
overwrites, kept current incrementally; exact mixtures of pure A / pure B / A→B; n-step
and sequence rows drawn only inside the windows."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.recipe.model import Recipe
from orchestrator.sampling.samplers import RecipeSampler
from orchestrator.sampling.transitions import Transitions

SKILLS = ["", "reach", "grasp", "lift", "place"]  # code i: SKILLS[i] (0: unset)
A, B = 1, 2


def encode(column: str, strings):
    return np.array([SKILLS.index(s) if s in SKILLS else -1 for s in strings])


class World:
    """One shard of ``cap`` slots holding episodes at scattered slots, linked by ``next``
    as the store's commit links them. Steps arrive over time; a step not stored yet is
    not alive, and its predecessor's link is unknown (0) until it arrives."""

    def __init__(self, seed: int, n_eps: int = 60, cap: int = 4000) -> None:
        rng = self.rng = np.random.default_rng(seed)
        self.cap = cap
        self.free = list(rng.permutation(cap))
        self.cols = {
            "id": np.arange(1, cap + 1, dtype=np.int64),
            "alive": np.zeros(cap, bool),
            "next": np.zeros(cap, np.int32),
            "skill_tag": np.zeros(cap, np.int32),
            "episode": np.zeros(cap, np.int64),
            "step_index": np.zeros(cap, np.int32),
            "policy_version": np.zeros(cap, np.int32),
            "agent_id": np.zeros(cap, np.int32),
            "task_id": np.zeros(cap, np.int32),
            "reward_source": np.zeros(cap, np.int32),
            "quality": np.zeros(cap, np.int32),
            "timestamp": np.arange(cap, dtype=np.float64),
            "reward": np.ones(cap, np.float32),
            "priority": np.full(cap, np.nan, np.float32),
            "flags": np.zeros(cap, np.uint8),
        }
        self.episodes: list[list[int]] = []  # per episode: its slots, in step order
        self.skills: list[list[int]] = []
        for e in range(n_eps):
            self.skills.append(self._skills(e))
            self.episodes.append([self.free.pop() for _ in self.skills[-1]])
        self.stored = [0] * n_eps  # steps of each episode committed so far

    def _skills(self, e: int) -> list[int]:
        """Runs of skills; a few fixed shapes put changes at the episode's edges."""
        fixed = {
            0: [A, B, B, B, B, B, B],
            1: [A, A, A, A, A, A, B],
            2: [A, B],
            3: [A, B, A, B, A, B],
        }
        if e in fixed:
            return fixed[e]
        out: list[int] = []
        while len(out) < 4 or self.rng.random() < 0.7:
            out += [int(self.rng.integers(1, 5))] * int(self.rng.integers(1, 6))
        return out

    def commit(self, e: int, upto: int) -> np.ndarray:
        """Store episode ``e``'s steps up to ``upto``; returns the changed rows (the new
        steps, and the older step whose link the commit sets)."""
        c, slots = self.cols, self.episodes[e]
        lo = self.stored[e]
        changed = []
        for i in range(lo, upto):
            s = slots[i]
            c["alive"][s] = True
            c["skill_tag"][s] = self.skills[e][i]
            c["episode"][s] = e + 1
            c["step_index"][s] = i
            c["flags"][s] = 1 if i == len(slots) - 1 else 0  # terminated on the last step
            c["next"][s] = 0
            changed.append(s)
            if i > 0:
                p = slots[i - 1]
                d = (s - p) % self.cap
                c["next"][p] = d
                c["id"][s] = c["id"][p] + d  # the id the link names (one shard)
                changed.append(p)
        self.stored[e] = max(lo, upto)
        return np.unique(np.array(changed, np.int64))

    def evict(self, rows: np.ndarray) -> np.ndarray:
        self.cols["alive"][rows] = False
        return np.unique(rows)

    def overwrite(self, rows: np.ndarray) -> np.ndarray:
        """A ring overwrite: each slot gets a new one-step episode (a new id; the old
        step's neighbours' links no longer hold)."""
        c = self.cols
        for s in rows.tolist():
            c["id"][s] += 10 * self.cap
            c["alive"][s], c["next"][s] = True, 0
            c["skill_tag"][s] = B
            c["episode"][s] = 10_000 + s
        return np.unique(rows)

    def reference(self, a: int, b: int, k: int) -> np.ndarray:
        """Members by definition: per episode, its runs of stored, alive, linked steps;
        in a run, the k steps up to each a→b pair and the k from it."""
        c, out = self.cols, np.zeros(self.cap, bool)
        for e, slots in enumerate(self.episodes):
            run: list[int] = []
            for s in [*slots[: self.stored[e]], -1]:
                linked = (
                    s >= 0
                    and c["alive"][s]
                    and c["episode"][s] == e + 1
                    and (not run or (c["id"][s] == c["id"][run[-1]] + c["next"][run[-1]]))
                )
                if linked:
                    run.append(s)
                    continue
                sk = c["skill_tag"][run] if run else []
                for j in range(len(run) - 1):
                    if sk[j] == a and sk[j + 1] == b:
                        for r in run[max(0, j - k + 1) : j + k + 1]:
                            out[r] = True
                ok = s >= 0 and c["alive"][s] and c["episode"][s] == e + 1
                run = [s] if ok else []
        return out


@pytest.mark.parametrize(("seed", "k"), [(0, 1), (1, 2), (2, 3), (3, 5)])
def test_members_follow_the_reference_as_steps_arrive_and_go(seed, k):
    w = World(seed)
    t = Transitions("reach", "grasp", k, encode, w.cap)
    for e, slots in enumerate(w.episodes):  # about half of each episode first
        w.commit(e, len(slots) // 2)
    np.testing.assert_array_equal(t.mask(w.cols), w.reference(A, B, k))
    assert t.mask(w.cols)[[w.episodes[0][0], w.episodes[0][1]]].all()  # a change at the start

    order = w.rng.permutation(len(w.episodes))
    for e in order:  # the rest arrives late, in two parts, episodes in random order
        n = len(w.episodes[e])
        for upto in ((n + w.stored[e] + 1) // 2, n):
            changed = w.commit(int(e), upto)
            near = t.update(w.cols, changed)
            assert set(changed.tolist()) <= set(near.tolist())
            np.testing.assert_array_equal(t.members, w.reference(A, B, k))
    assert t.members[w.episodes[1][-1]] and t.members[w.episodes[1][-2]]  # at the end
    assert t.members[w.episodes[3]].all()  # three changes, overlapping windows

    live = np.flatnonzero(w.cols["alive"])
    for _ in range(5):  # evictions, then ring overwrites of evicted slots
        gone = w.rng.choice(live, size=25, replace=False)
        t.update(w.cols, w.evict(gone))
        np.testing.assert_array_equal(t.members, w.reference(A, B, k))
        t.update(w.cols, w.overwrite(gone[:10]))
        np.testing.assert_array_equal(t.members, w.reference(A, B, k))
        live = np.flatnonzero(w.cols["alive"])
    fresh = Transitions("reach", "grasp", k, encode, w.cap)
    np.testing.assert_array_equal(fresh.mask(w.cols), t.members)


def test_an_unknown_skill_has_no_members_until_it_appears():
    w = World(4)
    for e, slots in enumerate(w.episodes):
        w.commit(e, len(slots))
    t = Transitions("reach", "stack", 2, encode, w.cap)
    assert not t.mask(w.cols).any()
    assert t.current_codes() == (A, -1)


def recipe(sources, batch_size=10, **kw) -> Recipe:
    return Recipe.model_validate(
        {"name": "compose", "batch_size": batch_size, "fields": ["obs"], "sources": sources, **kw}
    )


THREE = [
    {"name": "reach", "weight": 2, "where": {"skill_tag": "reach"}},
    {"name": "grasp", "weight": 2, "where": {"skill_tag": "grasp"}},
    {
        "name": "reach-grasp",
        "weight": 1,
        "transition": {"from": "reach", "to": "grasp", "window": 2},
    },
]


def test_a_mixture_of_pure_a_pure_b_and_a_to_b_is_exact_and_current():
    w = World(5)
    for e, slots in enumerate(w.episodes):
        w.commit(e, len(slots) // 2)
    r = recipe(THREE)
    assert r.counts == [4, 4, 2]
    s = RecipeSampler(r, encode, {}, w.cap)
    rng = np.random.default_rng(0)
    late = [e for e in range(len(w.episodes)) if w.stored[e] < len(w.episodes[e])]
    for e in late:
        seen: set[int] = set()
        for _ in range(30):
            d = s.sample(w.cols, rng)
            np.testing.assert_array_equal(np.bincount(d.source, minlength=3), [4, 4, 2])
            skill = w.cols["skill_tag"][d.rows]
            assert (skill[d.source == 0] == A).all() and (skill[d.source == 1] == B).all()
            ref = w.reference(A, B, 2)
            assert ref[d.rows[d.source == 2]].all()
            seen |= set(d.rows[d.source == 2].tolist())
        s.refresh(w.cols, w.commit(e, len(w.episodes[e])))  # the episode's rest arrives
    ref = w.reference(A, B, 2)
    assert s.sources[2].n == int(ref.sum())  # the candidates are exactly the members
    assert np.array_equal(s.sources[2].cand, ref)


@pytest.mark.parametrize("extra", [{"n_step": 3}, {"sequence_length": 3}])
def test_n_step_and_sequence_rows_start_inside_the_windows(extra):
    w = World(6)
    for e, slots in enumerate(w.episodes):
        w.commit(e, len(slots))
    r = recipe([THREE[2]], batch_size=64, **extra)
    s = RecipeSampler(r, encode, {}, w.cap)
    ref = w.reference(A, B, 2)
    for seed in range(10):
        d = s.sample(w.cols, np.random.default_rng(seed))
        assert ref[d.rows].all()


def test_the_recipe_checks_a_transition():
    with pytest.raises(ValueError, match="from and to are both 'reach'"):
        recipe([{"name": "t", "transition": {"from": "reach", "to": "reach"}}])
    with pytest.raises(ValueError, match="at most 64"):
        recipe([{"name": "t", "transition": {"from": "a", "to": "b", "window": 65}}])
    with pytest.raises(ValueError, match="not with group sources"):
        recipe(
            [
                {
                    "name": "t",
                    "transition": {"from": "a", "to": "b"},
                    "sampler": {"kind": "group", "group_size": 2},
                }
            ]
        )
    r = recipe([THREE[2]])
    assert r.model_dump(mode="json")["sources"][0]["transition"] == {
        "from": "reach",
        "to": "grasp",
        "window": 2,
    }
