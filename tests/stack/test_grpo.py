"""GRPO groups on a real store: group readiness over interleaved, out-of-order rollouts,
once-per-pass claims, token budgets, and pop through the prefetch workers (the collation
itself: tests/unit/orchestrator/delivery/test_tokens.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua
from orchestrator import BatchClient
from orchestrator.recipe.options import Tokens
from orchestrator.sampling import InsufficientData, sample
from orchestrator.sampling.groups import Claim, claims_key, release
from orchestrator.sampling.index import SamplingIndex
from tests.support.llmturns import TOKEN_FIELDS, group_recipe, rollouts, turns_batch
from tests.support.processes import run_example


def check_whole_groups(batch, ended: dict[str, int], n: int = 4, turns: int = 2) -> list[float]:
    """Every group of the batch is n ended trajectories of one key, each with all its turns
    in order; returns the batch's keys."""
    g, keys = batch.groups, batch["tags.prompt_uid"]
    assert len(set(g.ids)) == len(g.ids)
    out = []
    for gi in range(len(g.ids)):
        rows = np.flatnonzero(g.group == gi)
        assert len(set(keys[rows].tolist())) == 1
        trajs = np.unique(g.trajectory[rows])
        assert len(trajs) == n
        for t in trajs:
            tr = rows[g.trajectory[rows] == t]
            assert len(tr) == turns
        out.append(float(keys[rows[0]]))
    for key in out:
        assert ended[key] == n, f"group {key} drawn with {ended[key]} of {n} ended"
    return out


def test_only_complete_groups_from_interleaved_out_of_order_rollouts(store):
    """8 prompts x 4 rollouts of 2 turns arrive interleaved, trajectories finishing in a
    random order, in commits of 5 turns: after every commit each batch holds only complete
    groups (all 4 trajectories ended, every turn present), or the source waits."""
    events = rollouts(8, 4, 2, seed=3)
    ended: dict[float, int] = {}
    r, rng = group_recipe(), np.random.default_rng(0)
    waited = drawn = 0
    for i in range(0, len(events), 5):
        chunk = events[i : i + 5]
        store.commit(turns_batch(chunk))
        for e in chunk:
            if e["last"]:
                ended[float(e["key"])] = ended.get(float(e["key"]), 0) + 1
        complete = sum(v == 4 for v in ended.values())
        if complete < 2:
            with pytest.raises(InsufficientData, match="complete groups"):
                sample(store, r, rng=rng)
            waited += 1
            continue
        for _ in range(3):
            check_whole_groups(sample(store, r, rng=rng), ended)
            drawn += 1
    assert waited and drawn and sum(v == 4 for v in ended.values()) == 8


def test_once_each_group_exactly_once_per_pass_across_workers(store):
    """once: two prefetch workers (two sampling indexes) alternating: 4 batches of 2 groups
    are the 8 groups exactly once, the next 4 again exactly once (pass 2)."""
    store.commit(turns_batch(rollouts(8, 4, 2, seed=5)))
    r = group_recipe(once=True)
    workers = [SamplingIndex(Store(store.r, store.namespace)) for _ in range(2)]
    ended = dict.fromkeys(range(1000, 1008), 4)
    for p in range(2):
        keys, passes = [], set()
        for b in range(4):
            batch = sample(store, r, index=workers[b % 2], rng=np.random.default_rng(10 * p + b))
            keys += check_whole_groups(batch, ended)
            passes.add(batch.groups.pass_no)
        assert sorted(keys) == list(range(1000, 1008)) and passes == {p}


def test_passes_1_delivers_each_group_once_then_waits(store):
    """once + passes: 1 (on-policy): 8 groups in 4 batches, then the source waits instead of
    starting a second pass; a new complete group is drawn; claims of groups gone from the
    candidates are pruned once they outnumber the groups present."""
    store.commit(turns_batch(rollouts(8, 4, 2, seed=5)))
    r = group_recipe(once=True, passes=1)
    ended = dict.fromkeys(range(1000, 1010), 4)
    keys = []
    for b in range(4):
        keys += check_whole_groups(sample(store, r, rng=np.random.default_rng(b)), ended)
    assert sorted(keys) == list(range(1000, 1008))
    with pytest.raises(InsufficientData, match=r"not delivered yet \(passes: 1\)"):
        sample(store, r, rng=np.random.default_rng(9))
    more = [e for e in rollouts(10, 4, 2, seed=6) if e["key"] >= 1008]
    store.commit(turns_batch(more))
    got = check_whole_groups(sample(store, r, rng=np.random.default_rng(11)), ended)
    assert sorted(got) == [1008.0, 1009.0]
    key = claims_key(store.layout_keys.base, "grpo")
    store.r.hset(key, mapping={f"s|{k}.0|0": 0 for k in range(5000, 7100)})  # gone groups
    with pytest.raises(InsufficientData):
        sample(store, r, rng=np.random.default_rng(12))  # no claim made: nothing pruned yet
    more = [e for e in rollouts(12, 4, 2, seed=7) if e["key"] >= 1010]
    store.commit(turns_batch(more))
    check_whole_groups(sample(store, r, rng=np.random.default_rng(13)), {1010: 4, 1011: 4})
    left = {k.decode() for k in store.r.hkeys(key)} - {"~pass"}
    assert len(left) == 12 and all(k.startswith("s|10") for k in left), sorted(left)[:5]


def test_a_claim_is_all_or_nothing(store):
    key = claims_key(store.layout_keys.base, "r")
    claim = Lua("claim", "orchestrator")
    assert claim(store.r, [key], [0, "t1", "a", "b"]) == 1
    assert claim(store.r, [key], [0, "t2", "c", "b"]) == 0  # b is taken: c is not either
    assert claim(store.r, [key], [0, "t3", "c", "d"]) == 1
    assert claim(store.r, [key], [2, "t4", "e"]) == 0  # not the current pass nor the next
    # a dropped batch gives back exactly its own claims, once
    t3 = Claim(0, "t3", ("c", "d"))
    assert release(store.r, store.layout_keys.base, "r", [t3, Claim(0, "t1", ("c",))]) == 2
    assert release(store.r, store.layout_keys.base, "r", [t3]) == 0
    assert claim(store.r, [key], [0, "t5", "c"]) == 1  # drawn again in the pass
    assert release(store.r, store.layout_keys.base, "r", [t3]) == 0  # t5's claim of c stays
    assert claim(store.r, [key], [1, "t6", "a", "b"]) == 1  # the next pass clears the last's
    assert claim(store.r, [key], [0, "t7", "e"]) == 0  # the old pass is over
    assert store.r.hgetall(key) == {b"~pass": b"1", b"a": b"1:t6", b"b": b"1:t6"}
    assert release(store.r, store.layout_keys.base, "r", [Claim(0, "t1", ("a", "b"))]) == 0


def test_partial_groups_after_max_wait(store):
    """max_wait_s 60: a group with 3 of 4 ended after 120 s is dropped (partial: drop) or
    used with its 3 (partial: use); a group that completed 100 s after it started is
    dropped; complete groups in time are drawn either way."""
    now = time.time()
    events = rollouts(4, 4, 1, seed=1)
    late_start = [e for e in events if e["key"] == 1002]
    stuck = [e for e in events if e["key"] == 1003 and e["traj"] != "p3r3"]
    fine = [e for e in events if e["key"] in (1000, 1001)]
    store.commit(turns_batch(fine), now=now - 10)
    store.commit(turns_batch(stuck), now=now - 120)
    store.commit(turns_batch(late_start[:1]), now=now - 150)
    store.commit(turns_batch(late_start[1:]), now=now - 50)
    rng = np.random.default_rng(0)
    drop = group_recipe(k=1, max_wait_s=60)
    seen = {float(sample(store, drop, rng=rng)["tags.prompt_uid"][0]) for _ in range(30)}
    assert seen == {1000.0, 1001.0}
    use = group_recipe(k=1, max_wait_s=60, partial="use")
    sizes = {}
    for _ in range(60):
        b = sample(store, use, rng=rng)
        sizes[float(b["tags.prompt_uid"][0])] = len(np.unique(b.groups.trajectory))
    assert sizes == {1000.0: 4, 1001.0: 4, 1002.0: 4, 1003.0: 3}


def test_token_budget_keeps_whole_groups(store):
    """max_tokens: a batch takes its leading groups while their sequences fit (4 groups of
    4 one-turn trajectories of 4 tokens: 16 tokens a group, budget 40 -> 2 groups)."""
    store.commit(turns_batch(rollouts(6, 4, 1, seed=2)))
    r = group_recipe(k=4).model_copy(update={"tokens": Tokens(max_tokens=40, advantage="grpo")})
    b = sample(store, r, rng=np.random.default_rng(0))
    assert len(b.groups.ids) == 2 and len(b.ids) == 8


def test_pop_returns_token_batches_within_the_staleness_bound(redis_url, workers, namespace):
    """Through the prefetch workers: BatchClient.pop returns token batches of whole groups;
    policy_version >= $min_version (a live param) keeps stale rollouts out."""
    st = Store(redis_url, namespace)
    st.create(capacity=1000, n_shards=2)
    events = rollouts(6, 4, 2, seed=4)
    for e in events:
        e["version"] = 0 if e["key"] < 1003 else 1
    st.commit(turns_batch(events))
    spec = {
        "name": "llm",
        "batch_size": 2,
        "fields": TOKEN_FIELDS,
        "params": {"min_version": 0},
        "sources": [
            {
                "name": "s",
                "where": "policy_version >= $min_version",
                "sampler": {"kind": "group", "group_size": 4},
            }
        ],
        "tokens": {"mode": "trajectory", "pad_multiple": 8},
        "prefetch": {"depth": 2},
    }
    with BatchClient(namespace, redis_url=redis_url) as client:
        client.register(spec)
        b = client.pop("llm", timeout=60)
        assert b["input_ids"].shape[0] == 8 and b["input_ids"].shape[1] % 8 == 0
        assert set(np.bincount(b["group_index"]).tolist()) == {4}
        client.set_params("llm", min_version=1)
        keys = set()
        for _ in range(4):
            b = client.pop("llm", timeout=60)
            keys |= set(b["tags.prompt_uid"].tolist())
            g = b["group_index"]
            for gi in np.unique(g):
                adv = b["advantages"][g == gi][b["loss_mask"][g == gi]]
                assert abs(np.unique(adv).mean()) < 1e-4 or len(np.unique(adv)) > 1
        assert keys <= {1003.0, 1004.0, 1005.0}


def run_toy(redis_url: str, namespace: str, *args: str, timeout: float = 300) -> str:
    return run_example("grpo_toy.py", redis_url, "--namespace", namespace, *args, timeout=timeout)


def test_grpo_toy_loop_runs_and_groups_arrive_complete(redis_url, workers, namespace):
    """The example's agents call its policy server through `claw gateway`, which records
    every turn and takes every reward; the trainer pops complete groups from Claw."""
    import re

    out = run_toy(
        redis_url,
        namespace,
        "--updates",
        "4",
        "--groups",
        "4",
        "--group-size",
        "4",
        "--agents",
        "8",
    )
    lines = [ln for ln in out.splitlines() if ln.startswith("update ")]
    assert len(lines) == 4, out
    assert all(" 4 groups of [4] trajectories" in ln for ln in lines), out
    assert "done: 4 updates" in out
    turns, rewarded = map(
        int, re.search(r"gateway: (\d+) turns recorded, (\d+) traj", out).groups()
    )
    assert turns == rewarded >= 64, out  # 4 batches of 16 trajectories, one turn each
    store = Store(redis_url, namespace)
    cols = store.meta_columns(0, ["episode", "flags", "policy_version", "t:final_reward"])
    alive = cols["alive"]
    assert alive.sum() == turns
    assert (cols["flags"][alive] & 1).all()  # every trajectory ended by its reward post
    assert np.isin(cols["t:final_reward"][alive], [0.0, 1.0]).all()
    assert len(np.unique(cols["episode"][alive])) == turns
    assert cols["policy_version"][alive].max() >= 1  # from the server's header, via the gateway


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_toy_learns(redis_url, workers, namespace):
    """With seed 0 the success rate rises by at least 30 points within the 5-minute budget."""
    import re

    out = run_toy(redis_url, namespace, "--updates", "400", "--budget-s", "300", timeout=420)
    gain = float(re.search(r"\(([+-][\d.]+) points\)", out).group(1))
    assert gain >= 30, out


@pytest.mark.parametrize("readahead", [0, 2])
def test_once_groups_survive_a_recipe_change(redis_url, workers, namespace, readahead):
    """once + passes: 1 through a real prefetch worker: batches queued (and read ahead, with
    ``readahead``) when the recipe changes are dropped and give their groups back, so every
    one of 12 groups is served exactly once across the change, none lost, none twice."""
    from orchestrator.delivery.registry import Registry

    st = Store(redis_url, namespace)
    st.create(capacity=1000, n_shards=2)
    st.commit(turns_batch(rollouts(12, 4, 2, seed=8)))
    spec = group_recipe(once=True, passes=1).model_dump()
    spec.update(params={"min_version": 0}, prefetch={"depth": 3})
    spec["sources"][0]["where"] = "policy_version >= $min_version"
    queue = Registry(st).queue("grpo")
    served: list[float] = []

    def pop(client: BatchClient, timeout: float = 60) -> None:
        b = client.pop("grpo", timeout=timeout)
        keys = b["tags.prompt_uid"]
        served.extend(float(keys[b["group_index"] == g][0]) for g in np.unique(b["group_index"]))

    with BatchClient(namespace, redis_url=redis_url, readahead=readahead) as client:
        client.register(spec)
        pop(client)
        deadline = time.monotonic() + 60
        key = claims_key(st.layout_keys.base, "grpo")
        # 2 served; the batches queued (depth 3: a refill waits for the low water) and
        # read ahead by this client hold at least 4 claimed groups more
        while st.r.llen(queue) + client.held("grpo") < 2:
            assert time.monotonic() < deadline, (st.r.llen(queue), client.held("grpo"))
            time.sleep(0.05)
        assert len(set(st.r.hkeys(key)) - {b"~pass"}) >= 6
        client.set_params("grpo", min_version=0)  # a new version: the queue is dropped
        for _ in range(5):
            pop(client)
        with pytest.raises(TimeoutError):
            pop(client, timeout=3)  # passes: 1: nothing left to serve
    assert sorted(served) == [float(k) for k in range(1000, 1012)], served
