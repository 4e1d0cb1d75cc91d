"""n-step returns and sequence windows on hand-built, interleaved episodes in shard rings."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.sampling.sequences import follow, has_next_obs, n_step, windows

TERM, TRUNC, EXPLICIT = 1, 2, 4
CAP = 8


class Ring:
    """Shard rings written the way the store's commit writes them (ids, seqs, links)."""

    def __init__(self, cap: int = CAP, n_shards: int = 2):
        self.cap, self.n_shards = cap, n_shards
        n = cap * n_shards
        self.seq = [0] * n_shards
        self.at: dict[tuple[int, int], tuple[int, int]] = {}  # (episode, step) -> (row, seq)
        self.c = {
            "alive": np.zeros(n, bool),
            "id": np.zeros(n, np.int64),
            "episode": np.zeros(n, np.int64),
            "reward": np.zeros(n, np.float32),
            "flags": np.zeros(n, np.uint8),
            "next": np.zeros(n, np.int32),
        }

    def add(self, ep: int, step: int, reward: float = 0.0, flags: int = 0) -> int:
        shard = ep % self.n_shards
        self.seq[shard] += 1
        seq = self.seq[shard]
        row = shard * self.cap + (seq - 1) % self.cap
        c = self.c
        c["alive"][row], c["id"][row], c["episode"][row] = True, seq * self.n_shards + shard, ep
        c["reward"][row], c["flags"][row], c["next"][row] = reward, flags, 0
        self.at[(ep, step)] = (row, seq)
        prev = self.at.get((ep, step - 1))
        if prev and self.holds(*prev) and not c["flags"][prev[0]] & (TERM | TRUNC):
            c["next"][prev[0]] = seq - prev[1]
        succ = self.at.get((ep, step + 1))
        if succ and not flags & (TERM | TRUNC):
            c["next"][row] = succ[1] - seq  # successor committed first: negative distance
        return row

    def holds(self, row: int, seq: int) -> bool:
        return (
            bool(self.c["alive"][row])
            and self.c["id"][row] == seq * self.n_shards + row // self.cap
        )

    def stored(self, ep: int, step: int) -> int | None:
        """Row of the step while it is still stored."""
        got = self.at.get((ep, step))
        return got[0] if got and self.holds(*got) else None


# Shard 0 (even episodes): A terminates, B is truncated (explicit next_obs), C runs on, all
# interleaved. Shard 1 (odd episodes): G fills the ring, D wraps around its end, E's second
# step was committed before its first, then overwritten.
A, B, C, D, E, G, H = 2, 4, 6, 1, 3, 5, 7


def layout() -> Ring:
    ring = Ring()
    for ep, step, reward, flags in [
        (A, 0, 1.0, 0),  # row 0
        (B, 0, 10.0, 0),  # row 1
        (A, 1, 2.0, 0),  # row 2
        (B, 1, 20.0, TRUNC | EXPLICIT),  # row 3
        (A, 2, 3.0, TERM),  # row 4
        (C, 0, 100.0, 0),  # row 5
        (C, 1, 200.0, 0),  # row 6
    ]:
        ring.add(ep, step, reward, flags)
    for step in range(5):
        ring.add(G, step)  # rows 8..12
    ring.add(E, 1, 9.0)  # row 13
    ring.add(D, 0, 1.0)  # row 14
    ring.add(D, 1, 1.0)  # row 15
    ring.add(D, 2, 1.0, TERM)  # row 8 (wraps, overwrites G0)
    ring.add(E, 0, 5.0)  # row 9, links forward to row 13
    for step in range(3):
        ring.add(H, step)  # rows 10, 11, 12
    ring.add(H, 3)  # row 13: overwrites E1
    return ring


@pytest.fixture
def cols():
    return layout().c


def test_follow(cols):
    rows = np.array([0, 2, 4, 1, 3, 5, 6, 14, 15, 8, 9, 10, -1])
    want = [2, 4, -1, 3, -1, 6, -1, 15, 8, -1, -1, 11, -1]
    assert follow(cols, rows, CAP).tolist() == want
    nr = follow(cols, np.arange(16), CAP)
    assert nr[15] == 8  # across the ring's end
    assert cols["next"][9] < 0 and nr[9] == -1  # E1 came first, and its slot was reused


def test_follow_ignores_dead_targets(cols):
    cols["alive"][2] = False
    assert follow(cols, np.array([0]), CAP).tolist() == [-1]


def test_n_step_three(cols):
    rows = np.array([0, 2, 4, 1, 3, 5, 6, 14, 9])
    ns = n_step(cols, rows, 3, 0.5, CAP)
    np.testing.assert_allclose(ns.returns, [2.75, 3.5, 3.0, 20.0, 20.0, 200.0, 200.0, 1.75, 5.0])
    assert ns.bootstrap.tolist() == [4, 4, 4, 3, 3, 6, 6, 8, 9]
    np.testing.assert_allclose(ns.discount, [0.125, 0.25, 0.5, 0.25, 0.5, 0.25, 0.5, 0.125, 0.5])
    assert ns.done.tolist() == [True, True, True, False, False, False, False, True, False]
    # B is truncated with an explicit next_obs; C's newest step has no next_obs yet;
    # E's link is stale (its next slot was reused), so its data ends without a next_obs.
    assert ns.ready.tolist() == [True, True, True, True, True, False, False, True, False]
    # the windows ending on B's truncated step, not C's newest step nor E's stale link
    assert ns.end_truncated.tolist() == [False, False, False, True, True] + [False] * 4


def test_n_step_one_is_the_plain_transition(cols):
    rows = np.array([0, 4, 5, 6, 3])
    ns = n_step(cols, rows, 1, 0.9, CAP)
    np.testing.assert_allclose(ns.returns, cols["reward"][rows])
    assert ns.bootstrap.tolist() == rows.tolist()
    np.testing.assert_allclose(ns.discount, 0.9)
    assert ns.done.tolist() == [False, True, False, False, False]
    assert ns.ready.tolist() == [True, True, True, False, True]
    assert has_next_obs(cols, rows, CAP).tolist() == [True, False, True, False, True]


def test_windows(cols):
    starts = np.array([0, 2, 4, 1, 5, 14, 15, 9])
    w = windows(cols, starts, 3, CAP)
    assert w.tolist() == [
        [0, 2, 4],  # ends on A's terminal step: complete
        [2, 4, -1],
        [4, -1, -1],
        [1, 3, -1],  # B's data ends at its truncation
        [5, 6, -1],
        [14, 15, 8],  # D wraps around the ring
        [15, 8, -1],
        [9, -1, -1],
    ]
    assert (w[:, -1] >= 0).tolist() == [  # the whole window is stored
        True,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert (windows(cols, starts, 1, CAP)[:, -1] >= 0).all()


def test_windows_stop_at_terminal_even_if_linked(cols):
    """A link out of a terminated step (a reused episode id) never extends a window."""
    cols["next"][4] = 1  # row 4 (seq 5) -> row 5 (seq 6)
    assert windows(cols, np.array([2]), 3, CAP).tolist() == [[2, 4, -1]]
    assert n_step(cols, np.array([4]), 3, 0.5, CAP).bootstrap.tolist() == [4]


def random_ring(seed: int, cap: int = 16) -> Ring:
    """Random interleaved episodes in two shard rings: wrapping, out-of-order commits
    (negative distances), stale links, a few evictions."""
    rng = np.random.default_rng(seed)
    ring = Ring(cap, 2)
    length = {ep: int(rng.integers(1, 9)) for ep in range(1, 30)}
    ending = {ep: int(rng.integers(0, 3)) for ep in length}  # running, terminated, truncated
    upcoming = dict.fromkeys(length, 0)
    while upcoming:
        ep = int(rng.choice(list(upcoming)))
        first = upcoming[ep]
        steps = [first]
        if first + 1 < length[ep] and rng.random() < 0.2:
            steps = [first + 1, first]
        for step in steps:
            last = step == length[ep] - 1
            flags = (TERM if last and ending[ep] == 1 else 0) | (
                TRUNC | EXPLICIT if last and ending[ep] == 2 else 0
            )
            flags |= EXPLICIT if rng.random() < 0.1 else 0
            ring.add(ep, step, float(rng.integers(-3, 4)), flags)
        upcoming[ep] = first + len(steps)
        if upcoming[ep] == length[ep]:
            del upcoming[ep]
    ring.c["alive"][rng.choice(2 * cap, 3, replace=False)] = False
    return ring


@pytest.mark.parametrize("seed", range(10))
def test_against_reference(seed):
    """Vectorized n-step and windows equal a step-by-step walk of the logical episodes."""
    ring = random_ring(seed)
    cols, cap = ring.c, ring.cap
    where = {r: k for k in ring.at if (r := ring.stored(*k)) is not None}
    rows = np.array(sorted(where))
    nxt = {r: ring.stored(where[r][0], where[r][1] + 1) for r in rows.tolist()}
    assert follow(cols, rows, cap).tolist() == [-1 if nxt[r] is None else nxt[r] for r in rows]
    n, gamma = 3, 0.9
    ns = n_step(cols, rows, n, gamma, cap)
    win = windows(cols, rows, 4, cap)
    for i, row in enumerate(rows.tolist()):
        ret, disc, cur, done = 0.0, 1.0, row, False
        for k in range(n):
            ret += disc * float(cols["reward"][cur])
            disc *= gamma
            boot = cur
            if cols["flags"][cur] & TERM:
                done = True
                break
            if cols["flags"][cur] & TRUNC or k + 1 == n or nxt[cur] is None:
                break
            cur = nxt[cur]
        ready = done or bool(cols["flags"][boot] & EXPLICIT) or nxt[boot] is not None
        assert (ns.returns[i], ns.discount[i]) == pytest.approx((ret, disc))
        assert (ns.bootstrap[i], ns.done[i], ns.ready[i]) == (boot, done, ready)
        want, cur = [row], row
        for _ in range(3):
            cur = None if cur is None or cols["flags"][cur] & (TERM | TRUNC) else nxt[cur]
            want.append(-1 if cur is None else cur)
        assert win[i].tolist() == want
