"""Samplers: exact distributions (chi-square), IS weights, exact mixtures, windows, refresh."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from orchestrator.recipe.base import allocate
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.samplers import RecipeSampler

TASKS = [None, "grasp", "reach", "lift"]
COLORS = [None, "red", "blue"]
TAGS = {"color": "str", "difficulty": "num"}
P_MIN = 1e-3  # chi-square tests need every expected count well above 0


def encode(column: str, strings):
    words = {"task_id": TASKS, "skill_tag": TASKS, "t:color": COLORS}[column]
    return np.array([words.index(s) if s in words else -1 for s in strings])


def make_rows(n: int, seed: int, episode_len: int = 1) -> list[dict]:
    """Random logical metadata, one dict per row (strings, floats, NaN for unset)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        last = (i + 1) % episode_len == 0
        rows.append(
            {
                "alive": bool(rng.random() < 0.9),
                "trainable": bool(rng.random() < 0.9),
                "task_id": TASKS[rng.integers(4)],
                "skill_tag": TASKS[rng.integers(4)],
                "step_index": int(rng.integers(0, 50)),
                "policy_version": int(rng.integers(0, 4)),
                "reward": float(np.float32(rng.choice([-1.0, 0.0, 0.1, 0.5, 0.75, 1.0]))),
                "priority": math.nan if rng.random() < 0.2 else float(np.float32(rng.random())),
                "terminated": bool(last and rng.random() < 0.5),
                "truncated": False,
                "color": COLORS[rng.integers(3)],
                "difficulty": math.nan if rng.random() < 0.3 else float(rng.integers(0, 5)),
                "timestamp": 1000.0 + i,
            }
        )
    return rows


def columns(rows: list[dict], episode_len: int = 1) -> dict[str, np.ndarray]:
    """One shard (cap = n), ids in row order, episodes of ``episode_len`` consecutive rows."""
    n = len(rows)

    def col(key, dtype, f=lambda v: v):
        return np.array([f(r[key]) for r in rows], dtype=dtype)

    last = (np.arange(n) + 1) % episode_len == 0
    flags = col("terminated", np.uint8) | (col("trainable", np.uint8) ^ 1) << 3
    return {
        "alive": col("alive", bool),
        "id": np.arange(1, n + 1, dtype=np.int64),
        "episode": (np.arange(n) // episode_len + 1).astype(np.int64),
        "step_index": col("step_index", np.int32),
        "agent_id": np.zeros(n, np.int32),
        "task_id": col("task_id", np.int32, TASKS.index),
        "skill_tag": col("skill_tag", np.int32, TASKS.index),
        "reward_source": np.zeros(n, np.int32),
        "quality": np.zeros(n, np.int32),
        "policy_version": col("policy_version", np.int32),
        "timestamp": col("timestamp", np.float64),
        "reward": col("reward", np.float32),
        "priority": col("priority", np.float32),
        "next": np.where(last, 0, 1).astype(np.int32),
        "flags": flags.astype(np.uint8),
        "t:color": col("color", np.int32, COLORS.index),
        "t:difficulty": col("difficulty", np.float64),
    }


def holds(row: dict, where: dict, params: dict) -> bool:
    """Reference evaluation of a ``where`` on one row's logical values."""

    def val(v):
        return params[v[1:]] if isinstance(v, str) and v.startswith("$") else v

    for key, spec in where.items():
        x = row[key.removeprefix("tags.")]
        for op, v in spec.items() if isinstance(spec, dict) else [("eq", spec)]:
            v = [val(e) for e in val(v)] if op in ("in", "between") else val(v)
            if x != x:  # NaN
                return False
            ok = {
                "eq": lambda x, v: x == v,
                "in": lambda x, v: x in v,
                "gt": lambda x, v: x > v,
                "ge": lambda x, v: x >= v,
                "lt": lambda x, v: x < v,
                "le": lambda x, v: x <= v,
                "between": lambda x, v: v[0] <= x <= v[1],
            }[op](x, v)
            if not ok:
                return False
    return True


def recipe(sources, batch_size=256, **kw) -> Recipe:
    return Recipe.model_validate(
        {"name": "r", "batch_size": batch_size, "fields": ["obs"], "sources": sources, **kw}
    )


def sampler(r: Recipe, cap: int) -> RecipeSampler:
    return RecipeSampler(r, encode, TAGS, cap)


def effective_priority(rows: list[dict]) -> np.ndarray:
    p = np.array([r["priority"] for r in rows])
    live_max = max(r["priority"] for r in rows if r["alive"] and r["priority"] == r["priority"])
    return np.where(np.isnan(p), live_max, p)


def counts(draw_rows: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(draw_rows, minlength=n)


def priority_rows(n: int, seed: int) -> list[dict]:
    rows = make_rows(n, seed)
    for r in rows:  # keep expected counts of the chi-square test large
        if r["priority"] == r["priority"]:
            r["priority"] = float(np.float32(max(r["priority"], 0.05)))
    return rows


@pytest.mark.parametrize("window", [None, {"last_steps": 25}])
def test_priority_matches_exact_distribution(window):
    """51,200 draws against p^alpha / sum over the candidates (unset = namespace max)."""
    rows = priority_rows(120, seed=1)
    where = {"task_id": {"in": ["grasp", "reach"]}, "reward": {"ge": 0}}
    src = {"name": "p", "where": where, "sampler": {"kind": "priority", "alpha": 0.7}}
    if window:
        src["window"] = window
    s = sampler(recipe([src]), 120)
    c = columns(rows)
    rng = np.random.default_rng(7)
    drawn = np.concatenate([s.sample(c, rng).rows for _ in range(200)])
    cand = np.array([r["alive"] and r["trainable"] and holds(r, where, {}) for r in rows])
    if window:
        cand[np.flatnonzero(cand)[: -window["last_steps"]]] = False
    mass = np.where(cand, effective_priority(rows) ** 0.7, 0.0)
    observed = counts(drawn, 120)
    assert observed[~cand].sum() == 0
    expected = mass[cand] / mass.sum() * len(drawn)
    assert expected.min() > 5
    assert chisquare(observed[cand], expected).pvalue > 1e-3


def test_unset_priority_is_the_namespace_max():
    """The max is over every live step, also ones outside the filter; it follows updates."""
    rows = priority_rows(50, seed=2)
    for r in rows:
        r["alive"], r["trainable"], r["task_id"] = True, True, "grasp"
    rows[0].update(task_id="lift", priority=9.0)
    rows[1].update(priority=math.nan)
    src = {"name": "p", "where": {"task_id": "grasp"}, "sampler": {"kind": "priority"}}
    s = sampler(recipe([src], batch_size=1), 50)
    c = columns(rows)
    assert s.max_priority(c) == 9.0
    c["priority"][0] = 0.5
    s.refresh(c, np.array([0]))
    assert s.max_priority(c) == pytest.approx(max(np.nanmax(c["priority"][1:]), 0.5))
    c["priority"][:] = np.nan
    s.refresh(c, np.arange(50))
    assert s.max_priority(c) == 1.0


def test_importance_weights_match_formula():
    rows = priority_rows(200, seed=3)
    beta, alpha = 0.4, 0.6
    src = {"name": "p", "where": {"reward": {"gt": 0}}, "sampler": {"kind": "priority"}}
    s = sampler(recipe([src]), 200)
    c = columns(rows)
    d = s.sample(c, np.random.default_rng(0))
    cand = np.array([r["alive"] and r["trainable"] and r["reward"] > 0 for r in rows])
    mass = effective_priority(rows) ** alpha
    prob = mass[d.rows] / mass[cand].sum()
    w = (cand.sum() * prob) ** -beta
    np.testing.assert_allclose(d.weights, w / w.max(), rtol=1e-5)
    assert d.weights.dtype == np.float32 and d.weights.max() == 1.0


def test_uniform_matches_exact_distribution():
    rows = make_rows(80, seed=4)
    where = {"tags.color": "red"}
    s = sampler(recipe([{"name": "u", "where": where}]), 80)
    c = columns(rows)
    rng = np.random.default_rng(1)
    drawn = np.concatenate([s.sample(c, rng).rows for _ in range(100)])
    cand = np.array([r["alive"] and r["trainable"] and r["color"] == "red" for r in rows])
    observed = counts(drawn, 80)
    assert observed[~cand].sum() == 0
    assert chisquare(observed[cand]).pvalue > 1e-3


def test_rejection_keeps_the_exact_distribution():
    """With next_obs in the fields, rows without a next_obs are redrawn: the result is the
    priority distribution restricted to complete transitions."""
    rows = priority_rows(120, seed=5)
    for i, r in enumerate(rows):
        r.update(alive=True, trainable=True, terminated=False)
        r["priority"] = 0.1 + (i % 7) / 7
    c = columns(rows, episode_len=4)
    c["next"][np.arange(120) % 4 == 3] = 0  # each episode's last step: no next_obs yet
    src = {"name": "p", "sampler": {"kind": "priority", "alpha": 1.0}}
    r = recipe([src], fields=["obs", "next_obs"])
    s = sampler(r, 120)
    rng = np.random.default_rng(2)
    drawn = np.concatenate([s.sample(c, rng).rows for _ in range(100)])
    ok = np.arange(120) % 4 != 3
    observed = counts(drawn, 120)
    assert observed[~ok].sum() == 0
    p = c["priority"].astype(np.float64)
    assert chisquare(observed[ok], p[ok] / p[ok].sum() * len(drawn)).pvalue > 1e-3


def test_sequence_starts_are_complete_windows():
    rows = make_rows(120, seed=6, episode_len=6)
    for r in rows:
        r.update(alive=True, trainable=True)
    c = columns(rows, episode_len=6)
    s = sampler(recipe([{"name": "u"}], batch_size=64, sequence_length=3), 120)
    d = s.sample(c, np.random.default_rng(0))
    pos = d.rows % 6
    assert (pos <= 3).all() and set(pos.tolist()) == {0, 1, 2, 3}


def test_mixture_counts_exact_in_every_batch():
    rows = make_rows(300, seed=7)
    sources = [
        {"name": "a", "weight": 0.5, "where": {"task_id": "grasp"}},
        {
            "name": "b",
            "weight": 0.3,
            "where": {"reward": {"lt": 0}},
            "sampler": {"kind": "priority"},
        },
        {"name": "c", "weight": 0.2, "where": {"tags.difficulty": {"between": [1, 3]}}},
    ]
    r = recipe(sources, batch_size=37)
    assert r.counts == [19, 11, 7]
    s = sampler(r, 300)
    c = columns(rows)
    rng = np.random.default_rng(3)
    for _ in range(50):
        d = s.sample(c, rng)
        assert np.bincount(d.source, minlength=3).tolist() == r.counts
        assert d.source.tolist() == sorted(d.source.tolist())
        for row, i in zip(d.rows.tolist(), d.source.tolist(), strict=True):
            assert holds(rows[row], sources[i]["where"], {}) and rows[row]["alive"]


@given(
    weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=8),
    total=st.integers(1, 5000),
)
def test_allocate_is_largest_remainder(weights, total):
    got = allocate(weights, total)
    quotas = np.array(weights) / sum(weights) * total
    assert sum(got) == total
    assert (np.abs(np.array(got) - quotas) < 1 + 1e-9).all()
    assert allocate([1, 1, 1], 10) == [4, 3, 3]


def test_insufficient_data_names_the_source():
    rows = make_rows(100, seed=8)
    where = {"step_index": {"lt": 3}}
    n = sum(r["alive"] and r["trainable"] and r["step_index"] < 3 for r in rows)
    src = {"name": "early", "where": where, "sampler": {"kind": "recent"}}
    s = sampler(recipe([src], batch_size=n + 1), 100)
    with pytest.raises(InsufficientData, match=f"source 'early': {n} candidates, needs {n + 1}"):
        s.sample(columns(rows), np.random.default_rng(0))
    src = {"name": "none", "where": {"step_index": {"lt": 0}}}
    s = sampler(recipe([src], batch_size=8), 100)
    with pytest.raises(InsufficientData, match="source 'none': 0 candidates, needs 1") as e:
        s.sample(columns(rows), np.random.default_rng(0))
    assert (e.value.source, e.value.candidates, e.value.need) == ("none", 0, 1)
    zero = sampler(recipe([{"name": "z", "sampler": {"kind": "priority"}}], batch_size=2), 100)
    c = columns(rows)
    c["priority"][:] = 0
    with pytest.raises(InsufficientData, match="priority 0"):
        zero.sample(c, np.random.default_rng(0))


def test_recent_takes_the_newest_complete_rows():
    rows = make_rows(60, seed=9, episode_len=5)
    for r in rows:
        r["alive"] = True
    c = columns(rows, episode_len=5)
    s = sampler(recipe([{"name": "new", "sampler": {"kind": "recent"}}], batch_size=6), 60)
    cand = np.flatnonzero(c["alive"] & (c["flags"] & 8 == 0))
    d = s.sample(c, np.random.default_rng(0))
    assert d.rows.tolist() == cand[::-1][:6].tolist()
    assert (d.weights == 1).all()
    complete = recipe(
        [{"name": "new", "sampler": {"kind": "recent"}}], 6, fields=["obs", "next_obs"]
    )
    s = sampler(complete, 60)
    d = s.sample(c, np.random.default_rng(0))
    ready = cand[(cand % 5 != 4) | (c["flags"][cand] & 1 == 1)]
    assert d.rows.tolist() == ready[::-1][:6].tolist()


def test_max_age_window():
    rows = make_rows(100, seed=10)
    src = {"name": "fresh", "window": {"max_age_s": 30}, "sampler": {"kind": "priority"}}
    s = sampler(recipe([src], batch_size=8), 100)
    c = columns(rows)
    rng = np.random.default_rng(0)
    for now in (1080.0, 1100.0):
        d = s.sample(c, rng, now=now)
        assert (c["timestamp"][d.rows] >= now - 30).all()
    with pytest.raises(InsufficientData, match="'fresh'"):
        s.sample(c, rng, now=2000.0)


def test_live_params():
    rows = make_rows(200, seed=11)
    src = {"name": "cur", "where": {"step_index": {"lt": "$cut"}}}
    s = sampler(recipe([src], batch_size=16, params={"cut": 10}), 200)
    c = columns(rows)
    rng = np.random.default_rng(0)
    for cut in (10, 40, 10):
        d = s.sample(c, rng, params={"cut": cut})
        assert (c["step_index"][d.rows] < cut).all()
    assert (c["step_index"][s.sample(c, rng).rows] < 10).all()


def test_priority_updates_change_the_distribution():
    rows = priority_rows(100, seed=12)
    for r in rows:
        r.update(alive=True, trainable=True)
    s = sampler(recipe([{"name": "p", "sampler": {"kind": "priority", "alpha": 1.0}}]), 100)
    c = columns(rows)
    rng = np.random.default_rng(0)
    s.sample(c, rng)
    c["priority"][42] = 1000.0
    s.refresh(c, np.array([42]))
    share = np.mean(np.concatenate([s.sample(c, rng).rows for _ in range(20)]) == 42)
    p = c["priority"].astype(np.float64)
    assert share == pytest.approx(1000 / np.where(np.isnan(p), 1000, p).sum(), abs=0.03)


KINDS = [
    {"kind": "priority"},
    {"kind": "uniform"},
    {"kind": "recent"},
]


@pytest.mark.parametrize("spec", KINDS)
@pytest.mark.parametrize("window", [None, {"last_steps": 30}, {"max_age_s": 150}])
def test_refresh_equals_rebuild(spec, window):
    """After random inserts, evictions, curation and priority updates, an index kept current
    with refresh draws exactly what a freshly built one draws."""
    rows = make_rows(300, seed=13)
    where = {"task_id": {"in": ["grasp", "lift"]}, "priority": {"lt": 0.9}}
    src = {"name": "s", "where": where, "sampler": spec, "window": window}
    r = recipe([src], batch_size=4)
    c = columns(rows)
    live = sampler(r, 300)
    rng = np.random.default_rng(5)
    live.sample(c, rng, now=1300.0)
    for _ in range(5):
        changed = rng.choice(300, 40, replace=False)
        c["priority"][changed[:10]] = rng.random(10)
        c["priority"][changed[10:12]] = np.nan
        c["alive"][changed[12:20]] ^= True
        c["flags"][changed[20:25]] ^= 8
        c["task_id"][changed[25:]] = rng.integers(0, 4, 15)
        c["id"][changed[30:]] += 1000  # re-inserted (ring overwrite)
        live.refresh(c, changed)
        fresh = sampler(r, 300)
        a = live.sample(c, np.random.default_rng(9), now=1300.0)
        b = fresh.sample(c, np.random.default_rng(9), now=1300.0)
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_array_equal(a.weights, b.weights)


def test_refresh_none_rebuilds():
    rows = make_rows(100, seed=14)
    s = sampler(recipe([{"name": "s", "where": {"task_id": "reach"}}], batch_size=2), 100)
    c = columns(rows)
    s.sample(c, np.random.default_rng(0))
    c["task_id"][:] = TASKS.index("grasp")
    s.refresh(c, None)
    with pytest.raises(InsufficientData):
        s.sample(c, np.random.default_rng(0))


# ---- property: no sampled row ever violates its where ----------------------------------

NUM_KEYS = ["step_index", "policy_version", "reward", "priority", "timestamp", "tags.difficulty"]
STR_KEYS = {"task_id": [*TASKS[1:], "nope"], "skill_tag": TASKS[1:], "tags.color": COLORS[1:]}
NUMS = st.sampled_from([-1, 0, 0.1, 0.5, 1, 2.5, 10, 1010, 1100])


@st.composite
def conditions(draw):
    kind = draw(st.sampled_from(["num", "str", "flag"]))
    params = {}
    if kind == "flag":
        return draw(st.sampled_from(["terminated", "truncated"])), draw(st.booleans()), params
    if kind == "str":
        key = draw(st.sampled_from(sorted(STR_KEYS)))
        words = st.sampled_from(STR_KEYS[key])
        if draw(st.booleans()):
            return key, draw(words), params
        values = draw(st.lists(words, max_size=3))
        if draw(st.booleans()):
            params[f"p{key}"] = values
            return key, {"in": f"$p{key}"}, params
        return key, {"in": values}, params
    key = draw(st.sampled_from(NUM_KEYS))
    op = draw(st.sampled_from(["eq", "in", "gt", "ge", "lt", "le", "between"]))
    if op == "eq":
        return key, draw(NUMS), params
    if op == "in":
        return key, {"in": draw(st.lists(NUMS, max_size=3))}, params
    if op == "between":
        return key, {"between": sorted(draw(st.lists(NUMS, min_size=2, max_size=2)))}, params
    value = draw(NUMS)
    if draw(st.booleans()):
        params[f"p{key}"] = value
        value = f"$p{key}"
    return key, {op: value}, params


@st.composite
def recipes(draw):
    sources, params = [], {}
    for i in range(draw(st.integers(1, 3))):
        where = {}
        for key, spec, p in draw(st.lists(conditions(), max_size=3)):
            where[key], params = spec, {**params, **p}
        src = {"name": f"s{i}", "weight": draw(st.sampled_from([1, 2, 5])), "where": where}
        src["sampler"] = {"kind": draw(st.sampled_from(["uniform", "priority", "recent"]))}
        src["window"] = draw(
            st.sampled_from([None, {"last_steps": 20}, {"last_steps": 500}, {"max_age_s": 60}])
        )
        sources.append(src)
    batch = draw(st.integers(len(sources) * 5, 24))
    fields = draw(st.sampled_from([["obs"], ["obs", "next_obs"]]))
    return recipe(sources, batch_size=batch, params=params, fields=fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=recipes(), seed=st.integers(0, 3))
def test_sampled_rows_satisfy_their_where(r, seed):
    rows = make_rows(150, seed, episode_len=3)
    c = columns(rows, episode_len=3)
    s = sampler(r, 150)
    now = 1150.0
    rng = np.random.default_rng(seed)
    for _ in range(3):
        try:
            d = s.sample(c, rng, now=now)
        except InsufficientData as e:
            src = next(x for x in r.sources if x.name == e.source)
            ok = [x["alive"] and x["trainable"] and holds(x, src.where, r.params) for x in rows]
            if src.window and src.window.max_age_s:
                cut = now - src.window.max_age_s
                ok = [o and x["timestamp"] >= cut for o, x in zip(ok, rows, strict=True)]
            n = sum(ok)
            if src.window and src.window.last_steps:
                n = min(n, src.window.last_steps)
            k = r.counts[r.sources.index(src)]
            if "complete" in str(e):  # enough candidates, too few of them complete
                assert e.candidates == n and e.need == k
            else:
                assert (e.candidates, e.need) == (n, k if src.sampler.kind == "recent" else 1)
                assert n < e.need
            return
        assert np.bincount(d.source, minlength=len(r.sources)).tolist() == r.counts
        for row, i in zip(d.rows.tolist(), d.source.tolist(), strict=True):
            src = r.sources[i]
            assert rows[row]["alive"] and rows[row]["trainable"]
            assert holds(rows[row], src.where, r.params)
            if src.window and src.window.max_age_s:
                assert rows[row]["timestamp"] >= now - src.window.max_age_s
            if src.window and src.window.last_steps:
                newer = [
                    x
                    for j, x in enumerate(rows)
                    if j > row and x["alive"] and x["trainable"] and holds(x, src.where, r.params)
                ]
                assert len(newer) < src.window.last_steps


@pytest.mark.parametrize("tag", [False, True])
def test_an_admission_recipe_serves_within_its_bound_without_a_where(tag):
    """``admission`` alone bounds every source: ``policy_version >= $min_version``, or
    ``tags.min_version >= $min_version`` where the namespace has that tag (a multi-turn
    trajectory's oldest turn), and the bound follows the live version."""
    rows = make_rows(2000, seed=7)
    cols = columns(rows)
    tags = dict(TAGS)
    if tag:
        tags["min_version"] = "num"
        cols["t:min_version"] = np.maximum(cols["policy_version"] - 1, 0).astype(np.float64)
    r = recipe(
        [{"name": "a"}, {"name": "b", "where": {"task_id": "grasp"}}],
        params={"policy_version": 3},
        admission={"max_staleness": 1},
    )
    s = RecipeSampler(r, encode, tags, len(rows))
    rng = np.random.default_rng(0)
    oldest = cols["t:min_version"] if tag else cols["policy_version"]
    for v in (3, 2, 3):
        for _ in range(20):
            d = s.sample(cols, rng, params={"policy_version": v, "min_version": v - 1})
            assert (oldest[d.rows] >= v - 1).all()
            assert (v - cols["policy_version"][d.rows] <= 1).all()
        ok = np.flatnonzero(cols["alive"] & (cols["flags"] & 8 == 0) & (oldest >= v - 1))
        assert set(np.unique(d.rows)) <= set(ok.tolist())


def test_group_sources_draw_the_oldest_ready_groups_first():
    """``order: oldest`` (the default with ``once``) takes the ready groups with the
    earliest first commit; ``uniform`` (the default without) spreads over all of them."""
    rows = make_rows(400, seed=3, episode_len=4)
    for i, r in enumerate(rows):
        r["alive"], r["trainable"], r["terminated"] = True, True, i % 4 == 3
    cols = columns(rows, episode_len=4)
    cols["timestamp"] = cols["timestamp"][::-1].copy()  # the last episodes are the oldest
    spec = {"kind": "group", "group_by": "episode_id", "group_size": 1}
    assert recipe([{"name": "g", "sampler": {**spec, "once": True}}]).sources[0].sampler.order == (
        "oldest"
    )
    oldest = recipe([{"name": "g", "sampler": {**spec, "order": "oldest"}}], batch_size=3)
    uniform = recipe([{"name": "g", "sampler": spec}], batch_size=3)
    assert uniform.sources[0].sampler.order == "uniform"
    episodes = cols["episode"]
    for seed in range(3):
        d = sampler(oldest, len(rows)).sample(cols, np.random.default_rng(seed))
        assert set(episodes[d.rows].tolist()) == {100, 99, 98}
    seen = set()
    for seed in range(30):
        d = sampler(uniform, len(rows)).sample(cols, np.random.default_rng(seed))
        seen |= set(episodes[d.rows].tolist())
    assert len(seen) > 30
