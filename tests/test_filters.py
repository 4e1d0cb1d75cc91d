"""Compiled ``where`` masks against a row-by-row Python reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.recipe.where import FilterError, Where, compare, eligible, parse_where

TASKS = ["grasp", "reach", "lift"]
TAGS = {"color": "str", "difficulty": "num"}


def encoder(vocab: dict[str, list[str]]):
    """encode(column, strings) over per-column vocabularies (code = position + 1)."""

    def encode(column: str, strings):
        words = vocab.get(column, [])
        return np.array([words.index(s) + 1 if s in words else -1 for s in strings])

    return encode


VOCAB = {"task_id": TASKS, "skill_tag": ["a", "b"], "t:color": ["red", "blue"]}
ENCODE = encoder(VOCAB)


def columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    difficulty = rng.integers(0, 5, n).astype(np.float64)
    difficulty[rng.random(n) < 0.3] = np.nan
    return {
        "alive": rng.random(n) < 0.9,
        "id": np.arange(1, n + 1, dtype=np.int64),
        "episode": rng.integers(1, 4, n).astype(np.int64),
        "step_index": rng.integers(0, 20, n).astype(np.int32),
        "task_id": rng.integers(0, 4, n).astype(np.int32),  # 0 = missing
        "skill_tag": rng.integers(0, 3, n).astype(np.int32),
        "agent_id": np.zeros(n, np.int32),
        "reward_source": np.zeros(n, np.int32),
        "quality": np.zeros(n, np.int32),
        "policy_version": rng.integers(0, 3, n).astype(np.int32),
        "timestamp": np.arange(n, dtype=np.float64),
        "reward": rng.choice(np.float32([-1, 0, 0.1, 0.5, 1]), n),
        "priority": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)).astype(np.float32),
        "next": np.zeros(n, np.int32),
        "flags": rng.integers(0, 16, n).astype(np.uint8),
        "t:color": rng.integers(0, 3, n).astype(np.int32),
        "t:difficulty": difficulty,
    }


def test_equality_in_and_comparisons():
    c = columns(500)
    w = Where(
        {
            "task_id": "grasp",
            "skill_tag": {"in": ["a", "zzz"]},
            "reward": {"gt": 0.05},
            "step_index": {"between": [3, 7]},
        },
        ENCODE,
        TAGS,
    )
    want = (
        (c["task_id"] == 1)
        & (c["skill_tag"] == 1)
        & (c["reward"] > np.float32(0.05))
        & (c["step_index"] >= 3)
        & (c["step_index"] <= 7)
    )
    np.testing.assert_array_equal(w.mask(c, {}), want)
    assert want.any()


def test_unknown_strings_and_missing_codes_match_nothing():
    c = columns(300)
    assert not Where({"task_id": "nope"}, ENCODE, TAGS).mask(c, {}).any()
    assert not Where({"task_id": {"in": ["x", "y"]}}, ENCODE, TAGS).mask(c, {}).any()
    got = Where({"task_id": {"in": TASKS}}, ENCODE, TAGS).mask(c, {})
    np.testing.assert_array_equal(got, c["task_id"] > 0)


def test_flags_and_tags():
    c = columns(400)
    term = Where({"terminated": True, "truncated": False}, ENCODE, TAGS).mask(c, {})
    np.testing.assert_array_equal(term, (c["flags"] & 3) == 1)
    both = Where({"terminated": {"in": [True, False]}}, ENCODE, TAGS).mask(c, {})
    assert both.all()
    red = Where({"tags.color": "red", "tags.difficulty": {"ge": 2}}, ENCODE, TAGS).mask(c, {})
    np.testing.assert_array_equal(red, (c["t:color"] == 1) & (c["t:difficulty"] >= 2))


def test_nan_matches_nothing():
    c = columns(400)
    nan = np.isnan(c["t:difficulty"])
    for spec in ({"lt": 1e300}, {"gt": -math.inf}, {"le": math.inf}, {"between": [-9, 9]}):
        got = Where({"tags.difficulty": spec}, ENCODE, TAGS).mask(c, {})
        assert not got[nan].any()
        assert got[~nan].all()
    unset = Where({"priority": {"ge": 0}}, ENCODE, TAGS).mask(c, {})
    np.testing.assert_array_equal(unset, ~np.isnan(c["priority"]))


def test_params_resolved_live():
    c = columns(300)
    w = Where({"step_index": {"lt": "$cut"}, "task_id": {"in": "$tasks"}}, ENCODE, TAGS)
    assert w.params == {"cut", "tasks"}
    for cut, tasks in [(5, ["grasp"]), (15, ["reach", "lift"])]:
        want = (c["step_index"] < cut) & np.isin(c["task_id"], [TASKS.index(t) + 1 for t in tasks])
        np.testing.assert_array_equal(w.mask(c, {"cut": cut, "tasks": tasks}), want)
    assert w.key({"cut": 5, "tasks": ["a"]}) != w.key({"cut": 6, "tasks": ["a"]})
    with pytest.raises(FilterError, match=r"step_index: param \$cut is not defined"):
        w.mask(c, {"tasks": []})
    with pytest.raises(FilterError, match="step_index: lt: expected a number"):
        w.mask(c, {"cut": "5", "tasks": []})
    with pytest.raises(FilterError, match="task_id: in takes a list"):
        w.mask(c, {"cut": 5, "tasks": "grasp"})


def test_dollar_escape():
    (cond,) = parse_where({"task_id": "$$grasp"})
    assert cond.value == "$grasp"


def test_rows_subset_equals_full_mask():
    c = columns(1000)
    w = Where({"reward": {"ge": 0}, "skill_tag": "b", "terminated": False}, ENCODE, TAGS)
    rows = np.random.default_rng(1).integers(0, 1000, 200)
    np.testing.assert_array_equal(w.mask(c, {}, rows), w.mask(c, {})[rows])
    np.testing.assert_array_equal(Where({}, ENCODE, TAGS).mask(c, {}, rows), np.ones(200, bool))


def test_eligible():
    c = columns(300)
    np.testing.assert_array_equal(eligible(c), c["alive"] & (c["flags"] & 8 == 0))


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ({"task": "x"}, "task: unknown metadata key"),
        ({"tags.shape": "x"}, "tags.shape: no tag 'shape'"),
        ({"reward": {"gtt": 1}}, "reward: unknown operator 'gtt'"),
        ({"task_id": {"gt": "a"}}, "task_id: operator 'gt' does not apply to a code column"),
        ({"terminated": {"lt": 1}}, "terminated: operator 'lt' does not apply"),
        ({"reward": {"between": [1]}}, r"reward: between takes \[low, high\]"),
        ({"reward": {"in": 3}}, "reward: in takes a list"),
        ({"reward": "high"}, "reward: eq: expected a number"),
        ({"reward": True}, "reward: eq: expected a number"),
        ({"task_id": 3}, "task_id: eq: expected a string"),
        ({"terminated": 1}, "terminated: eq: expected true or false"),
        ({"tags.color": {"ge": 1}}, "tags.color: operator 'ge'"),
        ({"reward": {}}, "reward: empty condition"),
        ({"reward": {"gt": "$"}}, "reward: empty"),
        ({"reward": [1, 2]}, "reward: expected a string, number or bool"),
    ],
)
def test_errors_name_the_key(where, message):
    with pytest.raises(FilterError, match=message):
        parse_where(where, TAGS)


def _reference(value: float, op: str, t: float) -> bool:
    """Exact real comparison of a stored value with t (Python compares int/float exactly)."""
    if value != value:
        return False
    return {"eq": value == t, "gt": value > t, "ge": value >= t, "lt": value < t, "le": value <= t}[
        op
    ]


THRESHOLDS = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, width=64),
    st.sampled_from([0.1, 0.5, 2**31 - 0.5, -(2**31) - 1, 2**31, 16777217, 1e39]),
)


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.int32]),
    op=st.sampled_from(["eq", "gt", "ge", "lt", "le"]),
    t=THRESHOLDS,
    offsets=st.lists(st.integers(-2, 2), min_size=1, max_size=6),
)
def test_compare_is_exact(dtype, op, t, offsets):
    """Values near t (and at the dtype's edges) compare as the exact reals they store."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        with np.errstate(over="ignore"):  # thresholds beyond the dtype's range
            base = dt.type(t)
            vals = [base]
            for o in offsets:
                v = base
                for _ in range(abs(o)):
                    v = np.nextafter(v, dt.type(np.inf if o > 0 else -np.inf))
                vals.append(v)
        vals += [dt.type(np.inf), dt.type(-np.inf), dt.type(np.nan), np.finfo(dt).max]
    else:
        info = np.iinfo(dt)
        base = min(max(math.floor(t) if math.isfinite(t) else 0, info.min), info.max)
        vals = [min(max(base + o, info.min), info.max) for o in offsets] + [info.min, info.max]
    col = np.array(vals, dtype=dt)
    got = compare(col, op, t)
    want = [_reference(v.item(), op, t) for v in col]
    assert got.tolist() == want
