"""GRPO groups and token batches: group readiness over interleaved, out-of-order rollouts,
once-per-pass claims, advantages against a numpy reference, transition and trajectory
collation against hand-built references, and pop through the prefetch workers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua
from orchestrator import BatchClient
from orchestrator.delivery.tokens import advantages, collate_tokens
from orchestrator.recipe.model import Recipe, Tokens
from orchestrator.sampling import InsufficientData, sample
from orchestrator.sampling.groups import Groups, claims_key
from orchestrator.sampling.index import SamplingIndex
from tests.support.llmturns import rollouts, turns_batch

FIELDS = ["prompt_ids", "response_ids", "response_logprobs", "response_mask", "tags.prompt_uid"]


def recipe(k: int = 2, n: int = 4, **sampler) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "grpo",
            "batch_size": k,
            "fields": FIELDS,
            "sources": [{"name": "s", "sampler": {"kind": "group", "group_size": n, **sampler}}],
        }
    )


@pytest.fixture
def store(redis_url: str, namespace: str) -> Store:
    st = Store(redis_url, namespace)
    st.create(capacity=1000, n_shards=2)
    return st


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
    r, rng = recipe(), np.random.default_rng(0)
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
    r = recipe(once=True)
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
    r = recipe(once=True, passes=1)
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
    key = claims_key(store.keys.base, "grpo")
    store.r.hset(key, mapping={f"s|{k}.0|0": 0 for k in range(5000, 7100)})  # gone groups
    with pytest.raises(InsufficientData):
        sample(store, r, rng=np.random.default_rng(12))  # no claim made: nothing pruned yet
    more = [e for e in rollouts(12, 4, 2, seed=7) if e["key"] >= 1010]
    store.commit(turns_batch(more))
    check_whole_groups(sample(store, r, rng=np.random.default_rng(13)), {1010: 4, 1011: 4})
    left = {k.decode() for k in store.r.hkeys(key)} - {"~pass"}
    assert len(left) == 12 and all(k.startswith("s|10") for k in left), sorted(left)[:5]


def test_a_claim_is_all_or_nothing(store):
    key = claims_key(store.keys.base, "r")
    claim = Lua("claim", "orchestrator")
    assert claim(store.r, [key], [0, "a", "b"]) == 1
    assert claim(store.r, [key], [0, "c", "b"]) == 0  # b is taken: c is not claimed either
    assert claim(store.r, [key], [0, "c", "d"]) == 1
    assert claim(store.r, [key], [2, "e"]) == 0  # not the current pass nor the next
    assert claim(store.r, [key], [1, "a", "b"]) == 1  # the next pass clears the last's
    assert claim(store.r, [key], [0, "e"]) == 0  # the old pass is over
    assert store.r.hgetall(key) == {b"~pass": b"1", b"a": b"1", b"b": b"1"}


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
    drop = recipe(k=1, max_wait_s=60)
    seen = {float(sample(store, drop, rng=rng)["tags.prompt_uid"][0]) for _ in range(30)}
    assert seen == {1000.0, 1001.0}
    use = recipe(k=1, max_wait_s=60, partial="use")
    sizes = {}
    for _ in range(60):
        b = sample(store, use, rng=rng)
        sizes[float(b["tags.prompt_uid"][0])] = len(np.unique(b.groups.trajectory))
    assert sizes == {1000.0: 4, 1001.0: 4, 1002.0: 4, 1003.0: 3}


def test_advantages_equal_a_numpy_reference():
    rng = np.random.default_rng(7)
    group = np.repeat(np.arange(6), 5)
    returns = rng.normal(size=30).round(2)
    returns[:5] = 1.0  # a group whose rewards are all equal: advantage 0, not NaN
    ref_grpo, ref_dr = np.zeros(30), np.zeros(30)
    for g in range(6):
        r = returns[group == g]
        ref_dr[group == g] = r - r.mean()
        ref_grpo[group == g] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    perm = rng.permutation(30)  # trajectories in any order
    for kind, ref in (("grpo", ref_grpo), ("dr_grpo", ref_dr)):
        np.testing.assert_allclose(advantages(returns[perm], group[perm], kind), ref[perm], 1e-5)
    np.testing.assert_array_equal(advantages(returns, group, "none"), returns.astype(np.float32))
    assert np.all(advantages(returns, group, "grpo")[:5] == 0)


# ---- a 3-turn tool-use session -------------------------------------------------------
# turn 0: prompt [1 2 3]            response [10 11 12] (12 is a tool call)
# turn 1: prompt [1 2 3 10 11 12 | 20 21]  (the tool's answer)   response [13 30 31 14],
#         with a tool result spliced into the response: mask [1 0 0 1]
# turn 2: prompt [... turn 1 ... 13 30 31 14 | 22]                response [15]
P0, R0 = [1, 2, 3], [10, 11, 12]
P1, R1, M1 = [*P0, *R0, 20, 21], [13, 30, 31, 14], [1, 0, 0, 1]
P2, R2 = [*P1, *R1, 22], [15]
LP = {0: [-0.1, -0.2, -0.3], 1: [-0.4, -0.5, -0.6, -0.7], 2: [-0.8]}


def session(p2=P2) -> dict:
    prompts = [np.array(p, np.int32) for p in (P0, P1, p2)]
    return {
        "prompt_ids": prompts,
        "response_ids": [np.array(r, np.int32) for r in (R0, R1, R2)],
        "response_logprobs": [np.array(LP[t], np.float32) for t in range(3)],
        "response_mask": [np.array(m, np.uint8) for m in ([1, 1, 1], M1, [1])],
        "reward": np.array([0, 0, 2.0], np.float32),
    }


def one_group(returns=(2.0, 2.0, 2.0), group=(0, 0, 0)) -> Groups:
    return Groups(
        np.array(group, np.int32), np.zeros(3, np.int32), np.array(returns, np.float32), ("g",), 0
    )


def test_transition_collation_equals_the_hand_built_reference():
    spec = Tokens(mode="transition", pad_multiple=4, pad_token_id=99, advantage="none")
    out = collate_tokens(session(), np.array([7, 8, 9]), None, spec).arrays
    # lengths 6, 12, 14 -> width 16 (a multiple of 4), right padding
    ref_ids = np.full((3, 16), 99)
    ref_loss = np.zeros((3, 16), bool)
    ref_lp = np.zeros((3, 16), np.float32)
    for i, (p, r, m) in enumerate(((P0, R0, [1, 1, 1]), (P1, R1, M1), (P2, R2, [1]))):
        ref_ids[i, : len(p) + len(r)] = p + r
        ref_loss[i, len(p) : len(p) + len(r)] = m
        ref_lp[i, len(p) : len(p) + len(r)] = LP[i]
    np.testing.assert_array_equal(out["input_ids"], ref_ids)
    np.testing.assert_array_equal(out["attention_mask"], ref_ids != 99)
    np.testing.assert_array_equal(out["loss_mask"], ref_loss)
    np.testing.assert_array_equal(out["old_logprobs"], ref_lp)  # masked tokens keep theirs
    np.testing.assert_array_equal(out["position_ids"][1], [*range(12), *[0] * 4])
    np.testing.assert_array_equal(out["advantages"], np.where(ref_loss, [[0], [0], [2.0]], 0))
    np.testing.assert_array_equal(out["seq_lengths"], [6, 12, 14])
    np.testing.assert_array_equal(out["prompt_lengths"], [3, 8, 13])
    np.testing.assert_array_equal(out["step_ids"], [[7], [8], [9]])


def test_trajectory_collation_equals_the_hand_built_reference_left_padded():
    spec = Tokens(mode="trajectory", pad_multiple=8, padding_side="left")
    out = collate_tokens(session(), np.array([7, 8, 9]), one_group(), spec).arrays
    seq = [*P2, *R2]  # 14 tokens: the whole session is one sequence
    assert out["input_ids"].shape == (1, 16)
    np.testing.assert_array_equal(out["input_ids"][0], [0] * 2 + seq)
    np.testing.assert_array_equal(out["attention_mask"][0], [0] * 2 + [1] * 14)
    np.testing.assert_array_equal(out["position_ids"][0], [0] * 2 + list(range(14)))
    #                 pads     P0       R0       tool     R1 (masked)  tool  R2
    loss = np.array([0] * 2 + [0] * 3 + [1] * 3 + [0] * 2 + M1 + [0] + [1], bool)
    np.testing.assert_array_equal(out["loss_mask"][0], loss)
    lp = [0] * 2 + [0] * 3 + LP[0] + [0] * 2 + LP[1] + [0] + LP[2]
    np.testing.assert_allclose(out["old_logprobs"][0], lp)
    # one group of one trajectory: its GRPO advantage is 0
    np.testing.assert_array_equal(out["advantages"], np.zeros((1, 16)))
    np.testing.assert_array_equal(out["step_ids"], [[7, 8, 9]])
    np.testing.assert_array_equal(out["prompt_lengths"], [3])


def test_trajectory_mode_falls_back_where_a_prefix_breaks():
    """Turn 2's context was rewritten (turn 1's response dropped): turns 0-1 stay one
    sequence, turn 2 is a transition of its own; advantages still per trajectory."""
    p2 = [*P0, 50, 22]
    spec = Tokens(mode="trajectory", advantage="dr_grpo")
    groups = one_group(returns=(3.0, 3.0, 3.0))
    out = collate_tokens(session(p2), np.array([7, 8, 9]), groups, spec).arrays
    assert out["input_ids"].shape == (2, 12)
    np.testing.assert_array_equal(out["input_ids"][0], [*P1, *R1])
    np.testing.assert_array_equal(out["input_ids"][1, :6], [*p2, *R2])
    np.testing.assert_array_equal(out["loss_mask"][1], [0] * 5 + [1] + [0] * 6)
    np.testing.assert_array_equal(out["step_ids"], [[7, 8], [9, -1]])
    np.testing.assert_array_equal(out["trajectory_index"], [0, 0])
    assert out["old_logprobs"][1, 5] == np.float32(LP[2][0])
    np.testing.assert_array_equal(out["advantages"][out["loss_mask"]], 0.0)  # R - mean = 0


def test_token_budget_keeps_whole_groups(store):
    """max_tokens: a batch takes its leading groups while their sequences fit (4 groups of
    4 one-turn trajectories of 4 tokens: 16 tokens a group, budget 40 -> 2 groups)."""
    store.commit(turns_batch(rollouts(6, 4, 1, seed=2)))
    r = recipe(k=4).model_copy(update={"tokens": Tokens(max_tokens=40, advantage="grpo")})
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
        "fields": FIELDS,
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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sources": [{"name": "s", "sampler": {"kind": "group"}}]}, "group_size: required"),
        (
            {"sources": [{"name": "s", "sampler": {"kind": "uniform", "once": True}}]},
            "once: only for kind: group",
        ),
        (
            {
                "sources": [
                    {"name": "s", "sampler": {"kind": "group", "group_size": 2, "passes": 1}}
                ]
            },
            "passes: only with once",
        ),
        (
            {
                "sources": [
                    {"name": "s", "sampler": {"kind": "group", "group_size": 2}},
                    {"name": "u"},
                ]
            },
            "cannot be mixed",
        ),
        ({"fields": ["prompt_ids"], "tokens": {}}, "fields must include response_ids"),
        ({"sources": [{"name": "u"}], "tokens": {"mode": "trajectory"}}, "needs whole groups"),
    ],
)
def test_recipe_errors_name_the_cause(change, message):
    data = {**recipe().model_dump(exclude={"version"}), **change}
    with pytest.raises(ValueError, match=message):
        Recipe.model_validate(data)


def test_group_by_must_be_a_value_of_the_schema():
    from claw_tasks.format.schema import FieldSpec, Schema
    from orchestrator.recipe.model import RecipeError

    schema = Schema({"prompt_ids": FieldSpec("<i4", (None,))}, {"prompt_uid": "num"})
    r = recipe(group_by="terminated").model_copy(update={"fields": ["prompt_ids"]})
    with pytest.raises(RecipeError, match="group_by: terminated is a flag"):
        r.validate_against(schema)
    assert recipe().sources[0].sampler.group_by == "tags.prompt_uid"


@pytest.mark.parametrize("side", ["right", "left"])
def test_torch_adapter_and_the_verl_and_trl_layouts(side):
    """The trajectory batch of the 3-turn session: token tensors, and the prompt/response
    split verl and TRL use (prompt left-padded, response right-padded)."""
    from orchestrator.adapters.llm_trainers import token_tensors, trl_inputs, verl_fields

    spec = Tokens(mode="trajectory", pad_multiple=8, padding_side=side, pad_token_id=99)
    fields = session(p2=[*P0, 50, 22])
    out = collate_tokens(fields, np.array([7, 8, 9]), one_group((1.0, 1.0, 1.0)), spec).arrays
    t = token_tensors(out)
    assert t["input_ids"].dtype == t["attention_mask"].dtype == __import__("torch").int64
    assert t["loss_mask"].dtype == t["advantages"].dtype == __import__("torch").float32
    v, trl = verl_fields(out), trl_inputs(out)
    # sequence 0: turns 0-1 (prompt P0); sequence 1: turn 2 alone (prompt p2)
    np.testing.assert_array_equal(v["prompts"].numpy(), [[99, 99, *P0], [*P0, 50, 22]])
    resp0 = [*R0, 20, 21, *R1]
    np.testing.assert_array_equal(v["responses"].numpy(), [resp0, R2 + [99] * 8])
    np.testing.assert_array_equal(v["response_mask"].numpy()[0], [1, 1, 1, 0, 0, *M1])
    np.testing.assert_allclose(v["old_log_probs"].numpy()[0], [*LP[0], 0, 0, *LP[1]], 1e-6)
    np.testing.assert_array_equal(v["input_ids"].numpy()[1, :6], [*P0, 50, 22, *R2])
    np.testing.assert_array_equal(v["attention_mask"].numpy()[0], [0, 0] + [1] * 12)
    np.testing.assert_array_equal(v["position_ids"].numpy()[0], [0, 0, *range(12)])
    np.testing.assert_array_equal(trl["completion_mask"].numpy(), v["response_mask"].numpy())
    np.testing.assert_array_equal(trl["prompt_ids"].numpy(), v["prompts"].numpy())
    assert trl["advantages"].shape == (2,)


def run_toy(redis_url: str, namespace: str, *args: str, timeout: float = 300) -> str:
    import os
    import subprocess
    import sys

    from tests.support.paths import ROOT as root

    env = {**os.environ, "CLAW_REDIS_URL": redis_url, "PYTHONPATH": str(root)}
    env.pop("CLAW_BROKER_URL", None)
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "grpo_toy.py"), "--namespace", namespace, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


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
