"""`claw query` against a real Redis: counts and aggregates checked against numpy on the
same data."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.store import Store
from orchestrator.cli.main import app
from orchestrator.inspect.query import Query

TASKS, AGENTS = ("grasp", "reach"), ("a1", "a2", "a3")
EPISODE_LEN = 50


@pytest.fixture(scope="module")
def data(redis_server) -> tuple[str, dict[str, np.ndarray]]:
    """24 episodes of 50 steps: task, agent, policy version and a numeric tag per episode,
    seeded random rewards; returns the namespace and the same columns as numpy arrays."""
    ns = f"query-{uuid.uuid4().hex[:8]}"
    store = Store(redis_server.url, ns)
    store.create(capacity=10_000, n_shards=2)
    rng = np.random.default_rng(7)
    cols: dict[str, list] = {k: [] for k in ("task", "agent", "version", "level", "reward", "step")}
    for e in range(24):
        task, agent, version = TASKS[e % 2], AGENTS[e % 3], e // 6
        n = EPISODE_LEN
        reward = rng.uniform(-1, 1, n).astype(np.float32)
        end = np.zeros(n, bool)
        end[-1] = True
        store.commit(
            StepBatch(
                episode=StrColumn.constant(f"ep{e}", n),
                step_index=np.arange(n),
                reward=reward,
                terminated=end,
                truncated=np.zeros(n, bool),
                fields={
                    "obs": rng.standard_normal((n, 3)).astype(np.float32),
                    "action": rng.integers(0, 2, n),
                },
                policy_version=np.full(n, version, np.int32),
                strs={
                    "task_id": StrColumn.constant(task, n),
                    "agent_id": StrColumn.constant(agent, n),
                },
                nums={"t:level": np.full(n, float(e % 4))},
                next_rows=np.array([n - 1], np.int32),
                next_obs=np.zeros((1, 3), np.float32),
            )
        )
        cols["task"] += [task] * n
        cols["agent"] += [agent] * n
        cols["version"] += [version] * n
        cols["level"] += [e % 4] * n
        cols["reward"] += reward.tolist()
        cols["step"] += list(range(n))
    return ns, {k: np.asarray(v) for k, v in cols.items()}


@pytest.fixture
def claw(redis_url):
    runner = CliRunner()

    def invoke(*args: str, code: int = 0):
        result = runner.invoke(app, list(args), env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "80"})
        assert result.exit_code == code, result.output
        return result

    return invoke


def test_grouped_aggregates_match_numpy(claw, data):
    ns, d = data
    out = claw(
        "query",
        ns,
        "task_id == 'grasp' and reward > 0.5",
        "--group-by",
        "task_id,agent_id",
        "--agg",
        "count,mean(reward),p95(reward),max(step_index)",
        "--json",
    )
    doc = json.loads(out.stdout)
    hit = (d["task"] == "grasp") & (d["reward"] > np.float32(0.5))
    assert doc["matched"] == int(hit.sum()) and doc["steps"] == len(d["reward"])
    expected = sorted({(t, a) for t, a in zip(d["task"][hit], d["agent"][hit], strict=True)})
    assert [(g["task_id"], g["agent_id"]) for g in doc["groups"]] == expected
    for g in doc["groups"]:
        sel = hit & (d["task"] == g["task_id"]) & (d["agent"] == g["agent_id"])
        r = d["reward"][sel].astype(np.float64)
        assert g["count"] == int(sel.sum())
        assert g["mean(reward)"] == pytest.approx(r.mean(), rel=1e-12)
        assert g["p95(reward)"] == pytest.approx(np.percentile(r, 95), rel=1e-12)
        assert g["max(step_index)"] == d["step"][sel].max()


def test_everything_by_a_numeric_key_and_a_tag(claw, data):
    ns, d = data
    doc = json.loads(
        claw(
            "query",
            ns,
            "--group-by",
            "policy_version,tags.level",
            "--agg",
            "count,sum(reward),std(reward)",
            "--json",
        ).stdout
    )
    assert doc["matched"] == len(d["reward"])
    assert sum(g["count"] for g in doc["groups"]) == len(d["reward"])
    for g in doc["groups"]:
        sel = (d["version"] == g["policy_version"]) & (d["level"] == g["tags.level"])
        r = d["reward"][sel].astype(np.float64)
        assert g["count"] == int(sel.sum()) > 0
        assert g["sum(reward)"] == pytest.approx(r.sum(), rel=1e-9)
        assert g["std(reward)"] == pytest.approx(r.std(), rel=1e-9)


def test_table_at_80_columns_and_the_histogram(claw, data, tmp_path):
    ns, d = data
    png = tmp_path / "h.png"
    args = [
        "policy_version >= 2 and not terminated",
        "--group-by",
        "task_id",
        "--agg",
        "count,mean(reward)",
        "--hist",
        "reward",
        "--png",
        str(png),
    ]
    out = claw("query", ns, *args).stdout
    assert png.stat().st_size > 5_000
    assert max(len(line) for line in out.splitlines()) <= 80
    hit = (d["version"] >= 2) & (d["step"] != EPISODE_LEN - 1)
    assert f"{int(hit.sum()):,} of {len(d['reward']):,} steps match" in out
    for task in TASKS:
        assert f"{int((hit & (d['task'] == task)).sum()):,}" in out


def test_since_counts_from_now(redis_url, data):
    ns, d = data
    q = Query(Store(redis_url, ns))
    assert q.run("", aggs=[], since="1h").matched == len(d["reward"])
    assert q.run("", aggs=[], since="1h", now=time.time() + 7200).matched == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reward >> 1"], "column"),  # the parser's caret message
        (["", "--agg", "median(reward)"], "write count, or mean/sum/min/max/std/pNN"),
        (["", "--agg", "mean(task_id)"], "'task_id' is not numeric"),
        (["", "--group-by", "episode_id"], "--group-by episode_id: group by a metadata key"),
        (["", "--since", "yesterday"], "--since 'yesterday': write a duration"),
        (["tags.nope > 1"], "nope"),
        (["(" * 3000 + "reward > 0" + ")" * 3000], "CLAW_WHERE_MAX_DEPTH=32"),
    ],
)
def test_bad_queries_exit_1_naming_the_fix(claw, data, args, message):
    ns, _ = data
    out = claw("query", ns, *args, code=1).output
    assert message in out


def test_unknown_namespace_exits_1(claw):
    assert "does not exist" in claw("query", "no-such-ns", code=1).output


def test_transition_windows_are_counted(claw, redis_server):
    """``--from-skill/--to-skill``: the A→B changes inside episodes and the steps within
    the window of one, against the same count by hand; the expression still applies."""
    ns = f"skills-{uuid.uuid4().hex[:8]}"
    store = Store(redis_server.url, ns)
    store.create(capacity=1_000, n_shards=2)
    episodes = {
        "e0": ["reach"] * 4 + ["grasp"] * 4,  # one change: 3 + 3 steps with window 3
        "e1": ["reach", "grasp", "reach", "grasp", "lift"],  # two changes, windows overlap
        "e2": ["grasp"] * 3 + ["reach"] * 3,  # grasp -> reach: not counted
        "e3": ["reach"] * 3,  # its grasp steps arrive later
    }
    for ep, skills in episodes.items():
        n = len(skills)
        store.commit(
            StepBatch(
                episode=StrColumn.constant(ep, n),
                step_index=np.arange(n),
                reward=np.arange(n, dtype=np.float32),
                terminated=np.zeros(n, bool),
                truncated=np.zeros(n, bool),
                fields={"obs": np.zeros((n, 3), np.float32), "action": np.zeros(n, np.int64)},
                strs={"skill_tag": StrColumn.of(skills)},
            )
        )

    def counted(*extra: str) -> dict:
        args = ["query", ns, *extra, "--from-skill", "reach", "--to-skill", "grasp"]
        return json.loads(claw(*args, "--transition-window", "3", "--json").output)

    got = counted()
    assert (got["transition"]["windows"], got["matched"]) == (3, 6 + 5)
    assert counted("reward >= 1")["matched"] == 6 + 5 - 1  # e1 starts inside a window
    later = ["grasp"] * 2
    store.commit(
        StepBatch(
            episode=StrColumn.constant("e3", 2),
            step_index=np.arange(3, 5),
            reward=np.zeros(2, np.float32),
            terminated=np.zeros(2, bool),
            truncated=np.zeros(2, bool),
            fields={"obs": np.zeros((2, 3), np.float32), "action": np.zeros(2, np.int64)},
            strs={"skill_tag": StrColumn.of(later)},
        )
    )
    got = counted()
    assert (got["transition"]["windows"], got["matched"]) == (4, 6 + 5 + 5)
    out = claw("query", ns, "--from-skill", "reach", "--to-skill", "grasp").output
    assert "4 reach -> grasp changes; 8 matching steps within 1 steps of one" in out
    assert "give both" in claw("query", ns, "--from-skill", "reach", code=1).output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-skill", "reach", "--to-skill", "grasp", "--transition-window", "0"], "1 to 64"),
        (["--from-skill", "reach", "--to-skill", "grasp", "--transition-window", "65"], "1 to 64"),
        (["--transition-window", "3"], "only with --from-skill and --to-skill"),
        (["--from-skill", "reach", "--to-skill", "reach"], "both are 'reach'"),
        (["--from-skill", "", "--to-skill", "grasp"], "--from-skill: a skill_tag of 1 to 1024"),
    ],
)
def test_bad_transition_options_exit_1_naming_the_argument(claw, args, message):
    out = claw("query", "no-such-ns", *args, code=1).output
    assert message in out and len(out.strip().splitlines()) == 1
