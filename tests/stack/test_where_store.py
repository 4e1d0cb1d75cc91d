"""One where language for the store and the samplers: on one stored table, ``Store.count``
(string and mapping form) and a recipe's candidates select the rows a Python reference
selects; a namespace config in an unknown format is refused, not misread."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from claw_tasks.format.arrays import packb, unpackb
from claw_tasks.store import NamespaceError, Store
from claw_tasks.store.check import check_namespace
from claw_tasks.store.config import FORMAT, READS
from claw_tasks.where import FilterError, parse
from orchestrator import InsufficientData, Recipe, sample
from orchestrator.inspect.stats import Statistics, UnreadableNamespace
from tests.support.stepdata import batch

TASKS = ["grasp", "reach", None]


def steps(n: int = 72, seed: int = 7) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = {"ep": i // 6, "step": i % 6, "reward": float(rng.choice([-1.0, 0.0, 0.25, 0.75]))}
        if (task := TASKS[int(rng.integers(0, 3))]) is not None:
            s["task_id"] = task
        tags = {}
        if rng.random() < 0.7:
            tags["color"] = str(rng.choice(["red", "blue"]))
        if rng.random() < 0.7:
            tags["level"] = float(rng.integers(0, 4))
        s["tags"] = tags
        s["terminated"] = s["step"] == 5 and s["ep"] % 2 == 0
        out.append(s)
    out[0]["tags"] = {"color": "red", "level": 1.0}  # fixes the tags' kinds
    return out


@pytest.fixture
def table(redis_url: str, namespace: str) -> tuple[Store, list[dict]]:
    """A 2-shard namespace, its steps as the store reports them (decoded, with ids)."""
    store = Store(redis_url, namespace)
    store.create(capacity=500, n_shards=2)
    store.commit(batch(steps()))
    ids = np.concatenate([(c := store.meta_columns(s, ["id"]))["id"][c["alive"]] for s in range(2)])
    store.curate(ids[::5], trainable=False)
    store.curate(ids[1::7], quality="golden")
    meta = store.get(np.sort(ids), fields=[])
    keys = [
        "id",
        "episode_id",
        "step_index",
        "task_id",
        "quality",
        "reward",
        "terminated",
        "trainable",
        "tags.color",
        "tags.level",
    ]
    rows = [{k: meta[k][i] for k in keys} for i in range(len(ids))]
    return store, rows


def _level(row: dict) -> float:
    return float(row["tags.level"])


WHERES = [
    (
        "task_id == 'grasp' and (reward > 0.5 or tags.level >= 2) and not terminated",
        {},
        lambda r: (
            r["task_id"] == "grasp"
            and (r["reward"] > 0.5 or _level(r) >= 2)
            and not r["terminated"]
        ),
    ),
    (
        "task_id in ['grasp', 'nope'] or tags.color == 'blue'",
        {},
        lambda r: r["task_id"] == "grasp" or r["tags.color"] == "blue",
    ),
    ("tags.level != 2", {}, lambda r: _level(r) != 2),  # NaN != 2: missing included
    ("not trainable", {}, lambda r: not r["trainable"]),
    (
        "quality == 'golden' or step_index between 1 and 2",
        {},
        lambda r: r["quality"] == "golden" or 1 <= r["step_index"] <= 2,
    ),
    (
        "reward > $cut and episode_id not in $eps",
        {"cut": 0.1, "eps": ["ep3", "ep4"]},
        lambda r: r["reward"] > 0.1 and r["episode_id"] not in ("ep3", "ep4"),
    ),
    ("task_id != 'reach' and age < 1h", {}, lambda r: r["task_id"] != "reach"),
    ("", {}, lambda r: True),
]


@pytest.mark.parametrize(("text", "params", "holds"), WHERES, ids=[w[0] or "all" for w in WHERES])
def test_count_and_sampling_select_the_same_rows(table, text, params, holds):
    store, rows = table
    want = {r["id"] for r in rows if holds(r)}
    assert 0 < len(want) < len(rows) or text == ""
    assert store.count(text, params) == len(want)
    assert store.count(parse(text), params) == len(want)
    trainable = {r["id"] for r in rows if r["trainable"] and holds(r)}
    both = f"trainable and ({text})" if text else "trainable"
    assert store.count(both, params) == len(trainable)
    if "age" in text:  # a source filters by age with a window, not a where
        return
    recipe = Recipe.model_validate(
        {
            "name": f"w{abs(hash(text)) % 10**6}",
            "batch_size": max(1, len(trainable)),
            "fields": ["reward"],
            "params": params,
            "sources": [{"name": "s", "where": text, "sampler": {"kind": "recent"}}],
        }
    )
    if not trainable:  # sampling draws trainable steps only
        with pytest.raises(InsufficientData) as e:
            sample(store, recipe)
        assert e.value.candidates == 0
        return
    got = sample(store, recipe).ids.tolist()
    assert sorted(got) == sorted(trainable)  # recent, without replacement: every candidate


def test_age_counts_from_now(table):
    store, rows = table
    assert store.count("age < 1h") == len(rows)
    assert store.count("age > 1h") == 0
    assert store.count({"age": {"gt": "1h"}}, now=1e12) == len(rows)


def test_count_errors_name_the_cause(table):
    store, _ = table
    with pytest.raises(FilterError, match=r"tags\.shape: no tag 'shape'") as e:
        store.count("reward > 0 and tags.shape == 'x'")
    assert e.value.column == 16
    with pytest.raises(FilterError, match=r"param \$cut is not defined"):
        store.count({"reward": {"gt": "$cut"}})


# ---- the namespace config's format version ------------------------------------------------
def test_config_records_its_format(redis_url, namespace):
    store = Store(redis_url, namespace)
    store.create(capacity=10)
    r = redis.Redis.from_url(redis_url)
    assert unpackb(r.get(store.layout_keys.config))["format"] == FORMAT == 3


@pytest.mark.parametrize(
    ("found", "fix"),
    [
        (FORMAT + 1, "upgrade Claw"),
        (None, "recreate it"),
        ("1", "recreate it"),
        # Formats 1 and 2 kept a per-slot m:timestamp column: an archive of the namespace
        # (every step's own time) restores into this format.
        (1, "then restore the archive with this one (claw restore DIR -n NS)"),
        (2, "archive it with that Claw (claw archive NS --to DIR)"),
    ],
)
def test_an_unknown_format_is_refused_not_misread(redis_url, namespace, found, fix):
    Store(redis_url, namespace).create(capacity=10)
    r = redis.Redis.from_url(redis_url)
    key = Store(redis_url, namespace).layout_keys.config
    good = r.get(key)
    d = unpackb(good)
    d["format"] = found
    r.set(key, packb(d))
    try:
        _refused(redis_url, namespace, r, found, fix)
    finally:  # other tests list every namespace of this server
        r.set(key, good)


def _refused(redis_url: str, namespace: str, r: redis.Redis, found: object, fix: str) -> None:
    before = sorted(r.scan_iter(match=f"claw:{{{namespace}*"))
    store = Store(redis_url, namespace)
    with pytest.raises(NamespaceError) as e:
        store.config()
    msg = str(e.value)
    reads = " and ".join(map(str, READS))
    assert f"store format {found!r}" in msg and f"reads format {reads} only" in msg
    assert fix in msg and namespace in msg
    with pytest.raises(NamespaceError, match="store format"):
        store.commit(batch([{"ep": 0, "step": 0}]))
    with pytest.raises(NamespaceError, match="store format"):
        sample(
            store,
            Recipe.model_validate(
                {"name": "r", "batch_size": 1, "fields": ["reward"], "sources": [{"name": "s"}]}
            ),
        )
    assert sorted(r.scan_iter(match=f"claw:{{{namespace}*")) == before  # nothing written
    with pytest.raises(UnreadableNamespace, match="store format"):  # claw stats/metrics go on
        Statistics(store.r).namespace(namespace, 0)
    (problem,) = check_namespace(r, namespace).problems  # claw doctor names it too
    assert problem.check == "config" and f"store format {found!r}" in problem.detail
