"""The where language: both forms compile to the same mask, checked against a row-by-row
Python reference; errors name the key (mapping) or point at the column (string)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from claw_tasks.format.stepmeta import TERMINATED, TRUNCATED, UNTRAINABLE, episode_code
from claw_tasks.where import ExpressionError, FilterError, Where, compare, mask, parse

TASKS = ["grasp", "reach", "lift"]
COLORS = ["red", "blue"]
EPISODES = ["ep0", "ep1", "ep2"]
TAGS = {"color": "str", "difficulty": "num"}
VOCAB = {"task_id": TASKS, "skill_tag": ["a", "b"], "t:color": COLORS}
NOW = 1_700_000_000


def encode(column: str, strings):
    """encode(column, strings) over per-column vocabularies (code = position + 1)."""
    words = VOCAB.get(column, [])
    return np.array([words.index(s) + 1 if s in words else -1 for s in strings])


def compiled(where, tags=TAGS) -> Where:
    return Where(where, tags, encode)


def columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    difficulty = rng.integers(0, 5, n).astype(np.float64)
    difficulty[rng.random(n) < 0.3] = np.nan
    return {
        "alive": rng.random(n) < 0.9,
        "id": np.arange(1, n + 1, dtype=np.int64),
        "episode": np.array([episode_code(e) for e in [*EPISODES, "other"]])[rng.integers(0, 4, n)],
        "step_index": rng.integers(0, 20, n).astype(np.int32),
        "task_id": rng.integers(0, 4, n).astype(np.int32),  # 0 = missing
        "skill_tag": rng.integers(0, 3, n).astype(np.int32),
        "agent_id": np.zeros(n, np.int32),
        "reward_source": np.zeros(n, np.int32),
        "quality": np.zeros(n, np.int32),
        "policy_version": rng.integers(0, 3, n).astype(np.int32),
        "timestamp": (NOW - rng.integers(0, 3 * 86400, n)).astype(np.float64),
        "reward": rng.choice(np.float32([-1, 0, 0.1, 0.5, 1]), n),
        "priority": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)).astype(np.float32),
        "next": np.zeros(n, np.int32),
        "flags": rng.integers(0, 16, n).astype(np.uint8),
        "t:color": rng.integers(0, 3, n).astype(np.int32),
        "t:difficulty": difficulty,
    }


# ---- the mapping form ------------------------------------------------------------------
def test_equality_in_and_comparisons():
    c = columns(500)
    w = compiled(
        {
            "task_id": "grasp",
            "skill_tag": {"in": ["a", "zzz"]},
            "reward": {"gt": 0.05},
            "step_index": {"between": [3, 7]},
        }
    )
    want = (
        (c["task_id"] == 1)
        & (c["skill_tag"] == 1)
        & (c["reward"] > np.float32(0.05))
        & (c["step_index"] >= 3)
        & (c["step_index"] <= 7)
    )
    np.testing.assert_array_equal(w.mask(c), want)
    assert want.any()
    assert w.columns == {"task_id", "skill_tag", "reward", "step_index"}


def test_unknown_strings_and_missing_codes_match_nothing():
    c = columns(300)
    assert not compiled({"task_id": "nope"}).mask(c).any()
    assert not compiled({"task_id": {"in": ["x", "y"]}}).mask(c).any()
    np.testing.assert_array_equal(compiled({"task_id": {"in": TASKS}}).mask(c), c["task_id"] > 0)
    np.testing.assert_array_equal(compiled({"task_id": {"ne": "nope"}}).mask(c), np.ones(300, bool))


def test_flags_trainable_and_tags():
    c = columns(400)
    term = compiled({"terminated": True, "truncated": False}).mask(c)
    np.testing.assert_array_equal(term, (c["flags"] & (TERMINATED | TRUNCATED)) == TERMINATED)
    assert compiled({"terminated": {"in": [True, False]}}).mask(c).all()
    trainable = compiled({"trainable": False}).mask(c)
    np.testing.assert_array_equal(trainable, (c["flags"] & UNTRAINABLE) != 0)
    red = compiled({"tags.color": "red", "tags.difficulty": {"ge": 2}}).mask(c)
    np.testing.assert_array_equal(red, (c["t:color"] == 1) & (c["t:difficulty"] >= 2))


def test_episode_ids_compare_by_their_hash():
    c = columns(300)
    got = compiled({"episode_id": {"in": ["ep1", "nope"]}}).mask(c)
    np.testing.assert_array_equal(got, c["episode"] == episode_code("ep1"))
    assert got.any()


def test_nan_matches_no_comparison_but_ne_and_not_select_it():
    c = columns(400)
    nan = np.isnan(c["t:difficulty"])
    for spec in ({"lt": 1e300}, {"gt": -math.inf}, {"le": math.inf}, {"between": [-9, 9]}):
        got = compiled({"tags.difficulty": spec}).mask(c)
        assert not got[nan].any()
        assert got[~nan].all()
    ne = compiled({"tags.difficulty": {"ne": 2}}).mask(c)
    np.testing.assert_array_equal(ne, ~(c["t:difficulty"] == 2))
    assert ne[nan].all()
    unset = compiled({"priority": {"ge": 0}}).mask(c)
    np.testing.assert_array_equal(unset, ~np.isnan(c["priority"]))


def test_and_or_not_nest():
    c = columns(500)
    w = compiled({"or": [{"task_id": "grasp"}, {"not": {"reward": {"le": 0}}}], "truncated": False})
    want = ((c["task_id"] == 1) | ~(c["reward"] <= 0)) & ((c["flags"] & TRUNCATED) == 0)
    np.testing.assert_array_equal(w.mask(c), want)
    assert not compiled({"or": []}).mask(c).any()
    assert compiled({"and": []}).mask(c).all()


def test_age_and_durations():
    c = columns(500)
    age = NOW - c["timestamp"]
    np.testing.assert_array_equal(compiled({"age": {"lt": "1h"}}).mask(c, now=NOW), age < 3600)
    np.testing.assert_array_equal(compiled("age < 1h").mask(c, now=NOW), age < 3600)
    got = compiled("age between 30m and 1.5d").mask(c, now=NOW)
    np.testing.assert_array_equal(got, (age >= 1800) & (age <= 1.5 * 86400))
    assert got.any() and not got.all()
    got = compiled({"timestamp": {"gt": NOW - 7200}}).mask(c)
    np.testing.assert_array_equal(got, compiled("age < 2h").mask(c, now=NOW))


def test_params_resolved_live():
    c = columns(300)
    w = compiled({"step_index": {"lt": "$cut"}, "task_id": {"in": "$tasks"}})
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


def test_dollar_escape_both_ways():
    assert Where({"task_id": "$$grasp"}).conds[0].value == "$grasp"
    assert parse("task_id == '$grasp'") == {"task_id": "$$grasp"}
    assert parse("task_id == $grasp") == {"task_id": "$grasp"}


def test_rows_subset_equals_full_mask():
    c = columns(1000)
    w = compiled("reward >= 0 and skill_tag == 'b' and not terminated")
    rows = np.random.default_rng(1).integers(0, 1000, 200)
    np.testing.assert_array_equal(w.mask(c, rows=rows), w.mask(c)[rows])
    np.testing.assert_array_equal(compiled({}).mask(c, rows=rows), np.ones(200, bool))


def test_mask_reads_tag_kinds_off_the_columns():
    c = columns(300)
    got = mask("tags.difficulty >= 2 or tags.color == 'blue'", c, encode=encode)
    np.testing.assert_array_equal(got, (c["t:difficulty"] >= 2) | (c["t:color"] == 2))


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
        ({"reward": [1, 2]}, "reward: a list needs an operator"),
        ({"or": [{"reward": 1}, {"task": 1}]}, r"or\[1\]\.task: unknown metadata key"),
        ({"not": {"reward": "x"}}, r"not\.reward: eq: expected a number"),
        ({"or": {"reward": 1}}, "or: takes a list of conditions"),
    ],
)
def test_mapping_errors_name_the_key(where, message):
    with pytest.raises(FilterError, match=message):
        Where(where, TAGS)


# ---- the string form -------------------------------------------------------------------
def test_the_string_parses_into_the_mapping_form():
    text = "task_id == 'grasp' and (reward > 0.5 or tags.difficulty >= 3) and not terminated"
    assert parse(text) == {
        "task_id": "grasp",
        "or": [{"reward": {"gt": 0.5}}, {"tags.difficulty": {"ge": 3}}],
        "not": {"terminated": True},
    }
    assert parse("agent_id in ['a', \"b\"] and reward != -1 and age <= 7d") == {
        "agent_id": {"in": ["a", "b"]},
        "reward": {"ne": -1},
        "age": {"le": 7 * 86400},
    }
    assert parse("step_index between 2 and $hi and quality not in $bad") == {
        "step_index": {"between": [2, "$hi"]},
        "not": {"quality": {"in": "$bad"}},
    }
    assert parse("  ") == {}
    assert parse("x == 1 or x == 2".replace("x", "reward")) == {
        "or": [{"reward": 1}, {"reward": 2}]
    }


def test_precedence_not_and_or():
    c = columns(600)
    t, r = (c["flags"] & TERMINATED) != 0, c["reward"] > 0
    s = c["skill_tag"] == 1
    np.testing.assert_array_equal(compiled("not terminated and reward > 0").mask(c), ~t & r)
    got = compiled("terminated or reward > 0 and skill_tag == 'a'").mask(c)
    np.testing.assert_array_equal(got, t | (r & s))
    np.testing.assert_array_equal(compiled("not (terminated or reward > 0)").mask(c), ~(t | r))


def test_string_values_escapes_and_durations():
    assert parse(r"task_id == 'it\'s' or task_id == 'a\\b'") == {
        "or": [{"task_id": "it's"}, {"task_id": "a\\b"}]
    }
    tree = parse("age > 90s and age < 1.5h and reward >= -.5e1")  # keys repeat: an and list
    assert tree == {"and": [{"age": {"gt": 90}}, {"age": {"lt": 5400}}, {"reward": {"ge": -5.0}}]}


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("reward >", 9, "expected a value"),
        ("reward > and x", 10, "expected a value"),
        ("task_id = 'a'", 9, "use == to compare"),
        ("task_id == 'grasp' and (reward > 1", 35, "expected 'and', 'or' or ')'"),
        ("task_id == 'grasp' reward > 1", 20, "expected 'and', 'or' or the end"),
        ("task == 'a'", 1, "task: unknown metadata key"),
        ("reward > 0 and tags.shape == 'x'", 16, "tags.shape: no tag 'shape'"),
        ("reward > 'high'", 10, "reward: gt: expected a number"),
        ("task_id > 'a'", 9, "task_id: operator 'gt' does not apply to a code column"),
        ("task_id in ['a', 3]", 18, "task_id: in: expected a string"),
        ("reward between 0 and 'x'", 22, "reward: between: expected a number"),
        ("reward", 7, "reward is not a flag"),
        ("reward 5", 8, "expected an operator"),
        ("task_id == 'grasp", 12, "unterminated string"),
        ("age < 5y", 8, "unknown duration unit 'y'"),
        ("age < 2w and age > 1x", 21, "unknown duration unit 'x'"),
        ("reward > 1 & x", 12, "unexpected character '&'"),
        ("terminated == 1", 15, "terminated: eq: expected true or false"),
        ("task_id in 'a'", 12, "expected a list"),
        ("()", 2, "expected a condition"),
        ("not", 4, "expected a condition"),
        ("reward > $", 10, "a $ must start a param name"),
    ],
)
def test_string_errors_point_at_the_column(text, column, message):
    with pytest.raises(ExpressionError) as info:
        Where(text, TAGS)
    e = info.value
    assert isinstance(e, FilterError)
    assert message in str(e)
    assert e.column == column, str(e)
    lines = str(e).splitlines()
    assert lines[1] == f"  {text}" and lines[2] == "  " + " " * (column - 1) + "^"


def test_param_errors_in_the_string_point_at_the_param():
    w = compiled("task_id == 'a' and reward > $cut")
    with pytest.raises(ExpressionError) as info:
        w.mask(columns(10), {"cut": "high"})
    assert info.value.column == 29 and "reward: gt: expected a number" in str(info.value)
    with pytest.raises(ExpressionError, match=r"param \$cut is not defined"):
        w.key({})


# ---- the two forms select the same rows ------------------------------------------------
def decoded(c: dict[str, np.ndarray], i: int, key: str):
    """Row ``i``'s value of ``key`` as a Python value (None = missing)."""
    if key in ("task_id", "skill_tag", "tags.color"):
        col = "t:color" if key == "tags.color" else key
        code = int(c[col][i])
        return VOCAB[col][code - 1] if code else None
    if key == "episode_id":
        names = {episode_code(e): e for e in EPISODES}
        return names.get(int(c["episode"][i]))
    if key in ("terminated", "truncated", "trainable"):
        bit = {"terminated": TERMINATED, "truncated": TRUNCATED, "trainable": UNTRAINABLE}[key]
        return bool(c["flags"][i] & bit) != (key == "trainable")
    if key == "age":
        return NOW - float(c["timestamp"][i])
    col = "t:difficulty" if key == "tags.difficulty" else key
    return c[col][i].item()


def holds(value, op: str, target) -> bool:
    """Python reference: a missing value (None, NaN) satisfies no comparison."""
    if op == "ne":
        return not holds(value, "eq", target)
    if op == "in":
        return any(holds(value, "eq", t) for t in target)
    if op == "between":
        return holds(value, "ge", target[0]) and holds(value, "le", target[1])
    if value is None or value != value:
        return False
    return {
        "eq": lambda: value == target,
        "lt": lambda: value < target,
        "le": lambda: value <= target,
        "gt": lambda: value > target,
        "ge": lambda: value >= target,
    }[op]()


STRINGS = {
    "task_id": [*TASKS, "zzz", "it's"],
    "skill_tag": ["a", "b", "c"],
    "tags.color": [*COLORS, "green"],
    "episode_id": [*EPISODES, "nope"],
}
NUMBERS = {
    "reward": [-1, 0, 0.1, 0.5, 1, 0.3],
    "step_index": [0, 3, 7, 19, 25],
    "policy_version": [0, 1, 2],
    "priority": [0.0, 0.25, 0.5, 1.0],
    "tags.difficulty": [0, 1.5, 2, 4],
}
DURATIONS = [("30s", 30), ("45m", 2700), ("1h", 3600), ("1.5h", 5400), ("1d", 86400)]
PARAM_NAMES = itertools.count()
SYMBOL = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


@st.composite
def leaf(draw):
    """(text, mapping, params, reference(c, i) -> bool) of one random condition."""
    kind = draw(st.sampled_from(["str", "num", "age", "flag"]))
    params: dict = {}
    name = f"p{next(PARAM_NAMES)}"  # a param name no other leaf uses
    if kind == "flag":
        key = draw(st.sampled_from(["terminated", "truncated", "trainable"]))
        v = draw(st.booleans())
        bare = draw(st.booleans())
        text = (key if v else f"not {key}") if bare else f"{key} == {'true' if v else 'false'}"
        mapping = {key: v} if not bare or v else {"not": {key: True}}
        return text, mapping, params, lambda c, i: decoded(c, i, key) == v
    if kind == "str":
        key = draw(st.sampled_from(sorted(STRINGS)))
        op = draw(st.sampled_from(["eq", "ne", "in", "not in"]))
        pool = STRINGS[key]
        if op in ("in", "not in"):
            vals = draw(st.lists(st.sampled_from(pool), max_size=3))
            text_v, map_v = "[" + ", ".join(quote(s) for s in vals) + "]", vals
            if draw(st.booleans()):
                params[name] = vals
                text_v = map_v = f"${name}"
            inner = {key: {"in": map_v}}
            text = f"{key} {op} {text_v}"
            mapping = {"not": inner} if op == "not in" else inner
            neg = op == "not in"
            return text, mapping, params, lambda c, i: holds(decoded(c, i, key), "in", vals) != neg
        v = draw(st.sampled_from(pool))
        text, mapping = f"{key} {SYMBOL[op]} {quote(v)}", {key: v if op == "eq" else {op: v}}
        return text, mapping, params, lambda c, i: holds(decoded(c, i, key), op, v)
    if kind == "num":
        key = draw(st.sampled_from(sorted(NUMBERS)))
        pool = NUMBERS[key]
        op = draw(st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "in", "between"]))
        if op == "in":
            target = draw(st.lists(st.sampled_from(pool), max_size=3))
            text = f"{key} in [{', '.join(repr(v) for v in target)}]"
        elif op == "between":
            target = sorted(draw(st.lists(st.sampled_from(pool), min_size=2, max_size=2)))
            text = f"{key} between {target[0]!r} and {target[1]!r}"
        else:
            target = draw(st.sampled_from(pool))
            if draw(st.booleans()):
                params[name] = target
                text = f"{key} {SYMBOL[op]} ${name}"
            else:
                text = f"{key} {SYMBOL[op]} {target!r}"
        value = f"${name}" if params else target
        mapping = {key: value if op == "eq" else {op: value}}
        return text, mapping, params, lambda c, i: holds(decoded(c, i, key), op, target)
    op = draw(st.sampled_from(["lt", "le", "gt", "ge", "between"]))
    if op == "between":
        pair = draw(st.lists(st.sampled_from(DURATIONS), min_size=2, max_size=2))
        (ta, a), (tb, b) = sorted(pair, key=lambda d: d[1])
        text, mapping, target = f"age between {ta} and {tb}", {"age": {"between": [ta, b]}}, (a, b)
    else:
        td, target = draw(st.sampled_from(DURATIONS))
        text, mapping = f"age {SYMBOL[op]} {td}", {"age": {op: td}}
    return text, mapping, params, lambda c, i: holds(decoded(c, i, "age"), op, target)


def _join(op: str, parts: list):
    fs = [p[3] for p in parts]
    combined = all if op == "and" else any
    return (
        f" {op} ".join(f"({p[0]})" for p in parts),
        {op: [p[1] for p in parts]},
        {k: v for p in parts for k, v in p[2].items()},
        lambda c, i: combined(f(c, i) for f in fs),
    )


def _negate(part):
    f = part[3]
    return f"not ({part[0]})", {"not": part[1]}, part[2], lambda c, i: not f(c, i)


def combine(children):
    """An and/or/not over generated conditions, in both spellings."""
    return st.one_of(
        st.builds(
            _join, st.sampled_from(["and", "or"]), st.lists(children, min_size=2, max_size=3)
        ),
        children.map(_negate),
    )


EXPRESSIONS = st.recursive(leaf(), combine, max_leaves=6)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(expr=EXPRESSIONS, seed=st.integers(0, 2**16))
def test_string_and_mapping_forms_select_the_same_rows(expr, seed):
    text, mapping, params, reference = expr
    c = columns(120, seed)
    from_string = compiled(text).mask(c, params, now=NOW)
    from_mapping = compiled(mapping).mask(c, params, now=NOW)
    from_parsed = compiled(parse(text)).mask(c, params, now=NOW)
    want = np.array([reference(c, i) for i in range(120)])
    np.testing.assert_array_equal(from_string, want, err_msg=text)
    np.testing.assert_array_equal(from_mapping, want, err_msg=str(mapping))
    np.testing.assert_array_equal(from_parsed, want, err_msg=text)


# ---- exact numeric comparison ----------------------------------------------------------
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


@settings(max_examples=300, deadline=None, derandomize=True)
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


def test_nesting_is_bounded_by_a_named_limit():
    """Thousands of levels (parentheses, ``not``, ``and``/``or`` lists) are refused with
    an error naming CLAW_WHERE_MAX_DEPTH, not a RecursionError; 32 levels still compile
    and select the same rows as the flat condition."""
    c = columns(200)
    for deep, column in (("(" * 3000 + "reward > 0" + ")" * 3000, 33), ("not " * 3000 + "x", 129)):
        with pytest.raises(ExpressionError, match="CLAW_WHERE_MAX_DEPTH=32") as e:
            Where(deep)
        assert e.value.column == column  # the caret under the first level too many
    nested: dict = {"reward": {"gt": 0}}
    for k in range(3000):
        nested = {"not": nested} if k % 2 else {"or": [nested, {"reward": {"gt": 9}}]}
    with pytest.raises(FilterError, match="CLAW_WHERE_MAX_DEPTH=32"):
        Where(nested)
    ok = compiled("(" * 32 + "reward > 0" + ")" * 32)
    np.testing.assert_array_equal(ok.mask(c), compiled("reward > 0").mask(c))
    with pytest.raises(ExpressionError, match="CLAW_WHERE_MAX_DEPTH"):
        Where("(" * 33 + "reward > 0" + ")" * 33)
