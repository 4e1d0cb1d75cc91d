"""An episode's name (and its episode index) lives while any of its steps lives, on a real
Redis, against a pure-Python model of the ring: batches of interleaved episodes with their
rows in any order, parts of an episode committed late (allocated first, committed after
newer batches), steps skipped as past capacity, manual evictions, several wraps."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.stepmeta import episode_code
from claw_tasks.store import Store
from claw_tasks.store.config import LOG_MAXLEN
from claw_tasks.store.evict import _FIXED_KEYS, _SCRIPT, PLAN_COLUMNS, _Plan
from claw_tasks.store.layout import EPISODE_INDEX_ENTRY, row_episode_codes
from claw_tasks.worker.context import forget
from orchestrator.maintenance.lifecycle import drop_namespace
from tests.support.stepdata import batch, episode


@dataclass
class Ring:
    """The model: per shard, a seq counter; committed steps by id (until the ring passes
    them or they are evicted)."""

    cap: int
    n_shards: int
    seq: list[int] = field(default_factory=list)
    steps: dict[int, tuple[int, str, int]] = field(default_factory=dict)  # id -> shard, name, step

    def __post_init__(self) -> None:
        self.seq = [0] * self.n_shards

    def allocate(self, shards: np.ndarray) -> np.ndarray:
        """The id each row will have: its shard's rows take the next seqs, in row order."""
        ids = np.zeros(len(shards), np.int64)
        for sh in np.unique(shards).tolist():
            rows = np.flatnonzero(shards == sh)
            seqs = self.seq[sh] + 1 + np.arange(len(rows))
            self.seq[sh] += len(rows)
            ids[rows] = seqs * self.n_shards + sh
        return ids

    def commit(self, ids: np.ndarray, names: list[str], steps: list[int]) -> np.ndarray:
        """Rows whose slots newer seqs took already are skipped (id -1)."""
        out = ids.copy()
        for j, i in enumerate(ids.tolist()):
            sh = i % self.n_shards
            if i // self.n_shards > self.seq[sh] - self.cap:
                self.steps[i] = (sh, names[j], steps[j])
            else:
                out[j] = -1
        return out

    def live(self) -> dict[int, tuple[int, str, int]]:
        n = self.n_shards
        return {i: v for i, v in self.steps.items() if i // n > self.seq[v[0]] - self.cap}


@dataclass
class Pending:
    batch: StepBatch
    ids: np.ndarray
    names: list[str]
    steps: list[int]


def check(store: Store, ring: Ring, seen: set[str], episode_index: bool) -> None:
    live = ring.live()
    ids = sorted(live)
    if ids:
        got = store.get(ids, fields=[])
        assert got["episode_id"] == [live[i][1] for i in ids]
    if episode_index:
        for name in sorted(seen):
            mine = sorted((v[2], i) for i, v in live.items() if v[1] == name)
            assert store.trajectory_ids(name).tolist() == [i for _, i in mine], name


batches = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=4),
        st.randoms(use_true_random=False),  # the rows' order
        st.sampled_from(["now", "now", "late"]),  # late: allocated now, committed next op
        st.integers(0, 3),  # live steps to evict manually after it
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    cap=st.integers(6, 20),
    n_shards=st.integers(1, 2),
    episode_index=st.booleans(),
    ops=batches,
)
def test_a_name_lives_while_any_step_lives(redis_url, cap, n_shards, episode_index, ops):
    store = Store(redis_url, f"t-{uuid.uuid4().hex[:10]}")
    store.create(capacity=cap * n_shards, n_shards=n_shards)
    store.set_episode_index(episode_index)
    ring = Ring(store.config().cap, n_shards)
    next_step: dict[int, int] = {}
    seen: set[str] = set()
    late: list[Pending] = []
    try:
        for parts, rnd, when, n_evict in ops:
            steps = []
            for ep, count in parts:
                for _ in range(count):
                    steps.append({"ep": ep, "step": next_step.get(ep, 0)})
                    next_step[ep] = next_step.get(ep, 0) + 1
            rnd.shuffle(steps)
            b = batch(steps)
            names = [f"ep{s['ep']}" for s in steps]
            seen.update(names)
            codes = row_episode_codes(b.episode.values, b.episode.index)
            shards = codes % n_shards
            if any(np.bincount(shards, minlength=n_shards) > ring.cap):
                continue  # more rows for a shard than it holds: refused (tested elsewhere)
            ids = ring.allocate(shards)
            p = Pending(b, ids, names, [s["step"] for s in steps])
            if when == "late":
                for sh in np.unique(shards).tolist():
                    store.allocate(sh, b.batch_id, int((shards == sh).sum()))
            committing, late = (late, [p]) if when == "late" else ([p, *late], [])
            for q in committing:
                res = store.commit(q.batch)
                want = ring.commit(q.ids, q.names, q.steps)
                assert res.ids.tolist() == want.tolist()
            live = sorted(ring.live())
            for i in live[:: max(1, len(live) // max(1, n_evict))][:n_evict]:
                assert store.evict([i]) == 1
                del ring.steps[i]
            check(store, ring, seen, episode_index)
        for q in late:
            store.commit(q.batch)
            ring.commit(q.ids, q.names, q.steps)
        check(store, ring, seen, episode_index)
    finally:
        drop_namespace(store.r, store.namespace)
        forget(store.namespace, dropped=True)


def test_an_eviction_planned_before_a_late_commit_keeps_the_name(redis_url, namespace):
    """Plan: evict every live step of an episode; before the plan runs, an older part of
    it (allocated first) lands. Its newest seq is unchanged, yet the name must stay."""
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    store.set_episode_index(True)
    older, newer = batch(episode(0, 2)), batch(episode(0, 4, first=2))
    store.allocate(0, older.batch_id, older.n)  # seqs 1, 2
    assert store.commit(newer).ids.tolist() == [3, 4]
    cols = store.meta_columns(0, PLAN_COLUMNS)
    plan = _Plan(store, 0, cols, np.array([2, 3]))
    fixed = [store.layout_keys.shard_key(0, k) for k in _FIXED_KEYS]
    keys, victims = plan.chunk(np.array([2, 3]), fixed)
    assert _SCRIPT(store.r, keys, ["manual", LOG_MAXLEN, victims])[0] == 2
    assert store.commit(older).ids.tolist() == [1, 2]  # lands between the plan's two calls
    gone = msgpack.packb({"episodes": plan.gone}, use_bin_type=False)
    _SCRIPT(store.r, fixed, ["manual", LOG_MAXLEN, gone])
    assert store.get([1, 2], fields=[])["episode_id"] == ["ep0", "ep0"]
    assert store.trajectory_ids("ep0").tolist() == [1, 2]


def test_the_index_of_an_endless_episode_stays_bounded(redis_url, namespace):
    """An episode that never ends keeps committing past the ring: its index drops the
    entries of steps the ring passed (else it grows by every step ever committed)."""
    store = Store(redis_url, namespace)
    store.create(capacity=20)
    store.set_episode_index(True)
    ids = []
    for k in range(30):
        ids += store.commit(batch(episode(0, 5 * k + 5, first=5 * k))).ids.tolist()
    raw = store.r.hget(store.layout_keys.shard_key(0, "eptraj"), str(episode_code("ep0")))
    assert len(raw) // EPISODE_INDEX_ENTRY.itemsize <= 20
    assert store.trajectory_ids("ep0").tolist() == ids[-20:]
