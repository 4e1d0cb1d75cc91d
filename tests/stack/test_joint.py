"""Multi-agent joint steps: recording through RecordParallelSteps (agents dying and
joining), joint batches aligned bit for bit with what was recorded (sampled directly and
popped through the prefetch workers), the global state stored once per joint step, joint
filters against a numpy reference, partial joint steps under eviction, mixtures and
priorities on joint rows, per-agent views and ``claw query`` over joint conditions. The
example that learns from joint batches: tests/system/test_examples.py."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.client.pettingzoo import RecordParallelSteps
from claw_tasks.format.joint import AGENTS_TAG, EPISODE_TAG, STATE_FIELD, agent_episode, joint_code
from claw_tasks.store import Store
from orchestrator import BatchClient, sample, update_priorities
from orchestrator.cli.main import app
from orchestrator.inspect.query import JointFilter, Query, parse_aggs
from orchestrator.sampling import InsufficientData
from tests.support.marlenv import Crowd

AGENTS = ["a0", "a1", "a2", "a3"]
PER_AGENT = ["obs", "action", "reward", "terminated", "truncated", "step_index", "episode_id"]


@dataclass
class Log:
    """What was recorded, by joint key (env episode, t)."""

    order: list[tuple[str, int]] = field(default_factory=list)  # joint steps, as stepped
    agents: dict[tuple[str, int], dict[str, dict[str, Any]]] = field(default_factory=dict)
    state: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    next_state: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    spread: dict[tuple[str, int], float] = field(default_factory=dict)


def spread(state: np.ndarray) -> dict[str, float]:
    return {"spread": float(state[3])}


def record(ns: str, url: str, episodes: int, seed: int = 0, broker: str | None = None, **kw) -> Log:
    """Record ``episodes`` Crowd episodes with random actions, in one message (so ids
    follow the order stepped); log every record."""
    env = Crowd(seed=seed)
    log = Log()
    with Ingestor(ns, url, broker_url=broker, flush_interval=None, flush_steps=1 << 20) as ing:
        rec = RecordParallelSteps(env, ing, task_id="crowd", state_tags=spread, **kw)
        rng = np.random.default_rng(seed)
        for _ in range(episodes):
            obs, _ = rec.reset()
            t = 0
            state = env.state() if rec.state else None
            while rec.agents:
                actions = {a: int(rng.integers(3)) for a in rec.agents}
                key = (rec.episode_id, rec.step_index)
                prev = dict(obs)
                obs, rewards, terms, truncs, _ = rec.step(actions)
                log.order.append(key)
                log.agents[key] = {
                    a: {
                        "obs": prev[a],
                        "action": np.int64(actions[a]),
                        "reward": np.float32(rewards[a]),
                        "terminated": terms[a],
                        "truncated": truncs[a],
                    }
                    for a in actions
                }
                if state is not None:
                    log.state[key] = state
                    log.spread[key] = float(state[3])
                    state = env.state()
                    log.next_state[key] = state
                t += 1
    return log


def joint_recipe(batch_size: int, *sources: dict, fields: list[str] | None = None, **kw) -> dict:
    return {
        "name": kw.pop("name", "joint"),
        "batch_size": batch_size,
        "fields": fields or [*PER_AGENT, "state", "next_state", "team_reward", "step_ids"],
        "sources": list(sources) or [{"name": "all", "sampler": {"kind": "recent"}}],
        "joint": {"agents": AGENTS},
        **kw,
    }


def joint_keys(batch) -> list[tuple[str, int]]:
    """Each row's joint key, from its agents' episode ids and step indices."""
    keys = []
    for i, eps in enumerate(batch.meta["episode_id"]):
        j = int(np.flatnonzero(batch["mask"][i])[0])
        keys.append((eps[j].rsplit("/", 1)[0], int(batch["step_index"][i, j])))
    return keys


def check_aligned(batch, log: Log) -> None:
    """Every row's agent slices are that agent's recorded step, bit for bit; absent agents
    are masked with zeros; the state is the recorded one."""
    for i, key in enumerate(joint_keys(batch)):
        rec = log.agents[key]
        for j, a in enumerate(AGENTS):
            assert bool(batch["mask"][i, j]) == (a in rec), (key, a)
            if a not in rec:
                assert not batch["obs"][i, j].any() and batch["step_ids"][i, j] == -1
                assert batch.meta["episode_id"][i][j] is None
                continue
            mine = rec[a]
            assert batch["obs"][i, j].tobytes() == mine["obs"].tobytes(), (key, a)
            assert batch["action"][i, j].tobytes() == mine["action"].tobytes()
            assert batch["reward"][i, j].tobytes() == mine["reward"].tobytes()
            assert bool(batch["terminated"][i, j]) == mine["terminated"]
            assert bool(batch["truncated"][i, j]) == mine["truncated"]
            assert batch.meta["episode_id"][i][j] == agent_episode(key[0], a)
            assert batch["step_index"][i, j] == key[1]
        assert batch["state"][i].tobytes() == log.state[key].tobytes(), key
        assert batch["next_state"][i].tobytes() == log.next_state[key].tobytes(), key
        present = [rec[a]["reward"] for a in AGENTS if a in rec]
        assert batch["team_reward"][i] == np.float32(sum(present, np.float32(0)))


def test_joint_rows_are_the_recorded_steps(redis_url, workers, namespace):
    log = record(namespace, redis_url, episodes=12)
    n = len(log.order)
    counts = [len(v) for v in log.agents.values()]
    assert min(counts) < 3 and max(counts) == 4, "some agents died, a3 joined"
    batch = sample(namespace, joint_recipe(n), redis_url=redis_url)
    assert len(batch) == n and batch["obs"].shape == (n, 4, 4) and batch["mask"].shape == (n, 4)
    assert sorted(joint_keys(batch)) == sorted(log.order)  # every joint step once
    assert batch["state"].shape == (n, 6) and batch["team_reward"].shape == (n,)
    check_aligned(batch, log)
    assert batch.meta["joint"] == {"complete": n, "partial": 0}
    # Stored once: one state entry per joint step, none on the other agents' records.
    store = Store(redis_url, namespace)
    keys = store.r.keys(f"{store.layout_keys.shard(0)}r:{STATE_FIELD}:*")
    assert sum(store.r.hlen(k) for k in keys) == n
    assert store.count() == sum(counts)

    client = BatchClient(namespace, redis_url)
    client.register(joint_recipe(64, {"name": "u"}, name="popped", seed=3))
    popped = client.pop("popped", timeout=60)
    client.close()
    assert len(popped) == 64 and popped["obs"].shape == (64, 4, 4)
    check_aligned(popped, log)
    assert popped.meta["joint"]["partial"] == 0


@pytest.fixture(scope="module")
def crowd(store_url, broker_url, workers) -> tuple[str, str, Log]:
    """200 episodes (~2,200 joint steps), recorded once for the read-only tests."""
    ns = f"t-crowd-{uuid.uuid4().hex[:8]}"
    return ns, store_url, record(ns, store_url, episodes=200, seed=1, broker=broker_url)


def test_last_joint_steps_where_the_state_matches_a_numpy_reference(crowd):
    ns, url, log = crowd
    spread = np.array([log.spread[k] for k in log.order], np.float32)
    hit = np.flatnonzero(spread > np.float32(0.4))  # stored as float64 of the float32 state
    assert len(hit) > 1000
    ref = [log.order[i] for i in hit[-1000:]]
    where = {"name": "x", "where": "tags.spread > $cut", "sampler": {"kind": "recent"}}
    batch = sample(
        ns, joint_recipe(1000, where, params={"cut": float(np.float32(0.4))}), redis_url=url
    )
    assert joint_keys(batch) == ref[::-1]  # newest first
    check_aligned(batch, log)
    # The same window drawn uniformly: every row among those 1,000.
    windowed = {**where, "sampler": {"kind": "uniform"}, "window": {"last_steps": 1000}}
    batch = sample(
        ns,
        joint_recipe(256, windowed, params={"cut": float(np.float32(0.4))}, seed=1),
        redis_url=url,
    )
    assert set(joint_keys(batch)) <= set(ref)


def test_any_and_all_agent_predicates_match_a_numpy_reference(crowd):
    ns, url, log = crowd
    ref = [
        k
        for k in log.order
        if log.spread[k] < np.float32(0.5)
        and any(r["reward"] > 2 for r in log.agents[k].values())
        and all(not r["terminated"] for r in log.agents[k].values())
    ]
    src = {
        "name": "c",
        "where": {"tags.spread": {"lt": float(np.float32(0.5))}},
        "any_agent": "reward > 2",
        "all_agents": {"terminated": False},
        "sampler": {"kind": "recent"},
    }
    assert 50 < len(ref) < len(log.order) // 4
    batch = sample(ns, joint_recipe(len(ref), src), redis_url=url)
    assert sorted(joint_keys(batch)) == sorted(ref)
    with pytest.raises(InsufficientData):
        sample(ns, joint_recipe(len(ref) + 1, src, name="more"), redis_url=url)


def test_per_agent_views_stay_as_they_are(crowd):
    ns, url, log = crowd
    mine = [(k, r) for k in log.order for a, r in log.agents[k].items() if a == "a3"]
    plain = {
        "name": "a3",
        "batch_size": len(mine),
        "fields": ["obs", "next_obs", "agent_id", "episode_id", "step_index"],
        "sources": [{"name": "a3", "where": "agent_id == 'a3'", "sampler": {"kind": "recent"}}],
    }
    batch = sample(ns, plain, redis_url=url)
    assert set(batch.meta["agent_id"]) == {"a3"}
    by_key = {
        (e.rsplit("/", 1)[0], int(t)): i
        for i, (e, t) in enumerate(zip(batch.meta["episode_id"], batch["step_index"], strict=True))
    }
    assert sorted(by_key) == sorted(k for k, _ in mine)
    for (ep, t), rec in mine:  # its own episode: next_obs is its next step's obs
        i = by_key[ep, t]
        assert batch["obs"][i].tobytes() == rec["obs"].tobytes()
        nxt = log.agents.get((ep, t + 1), {}).get("a3")
        if nxt is not None:
            assert batch["next_obs"][i].tobytes() == nxt["obs"].tobytes()


def test_query_groups_joint_conditions_by_agent(crowd):
    ns, url, log = crowd
    result = Query(Store(url, ns)).run(
        "tags.spread > 0.6",
        group_by=["agent_id"],
        aggs=parse_aggs("count,mean(reward)"),
        joint=JointFilter(any_agent="reward > 2"),
    )
    picked = [
        k
        for k in log.order
        if log.spread[k] > 0.6 and any(r["reward"] > 2 for r in log.agents[k].values())
    ]
    by_agent = defaultdict(list)
    for k in picked:
        for a, r in log.agents[k].items():
            by_agent[a].append(r["reward"])
    assert result.joint == {"complete": len(log.order), "partial": 0, "matched": len(picked)}
    got = {g["agent_id"]: g for g in result.groups}
    assert sorted(got) == sorted(by_agent)
    for a, rewards in by_agent.items():
        assert got[a]["count"] == len(rewards)
        assert got[a]["mean(reward)"] == pytest.approx(np.mean(np.float64(rewards)))
    args = [ns, "tags.spread > 0.6", "--any-agent", "reward > 2", "--group-by", "agent_id"]
    cli = CliRunner().invoke(app, ["query", *args, "--json"], env={"CLAW_REDIS_URL": url})
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["groups"] == [
        {"agent_id": a, "count": len(by_agent[a])} for a in sorted(by_agent)
    ]


def test_mixtures_and_priorities_on_joint_rows(redis_url, workers, namespace):
    log = record(namespace, redis_url, episodes=20, seed=2)
    every = sample(namespace, joint_recipe(len(log.order), name="every"), redis_url=redis_url)
    keys = joint_keys(every)
    # Priority 0 but on five joint steps (the anchors' priorities are the joint rows').
    update_priorities(namespace, every.ids, np.zeros(len(every.ids)), redis_url=redis_url)
    update_priorities(namespace, every.ids[:5], np.ones(5), redis_url=redis_url)
    sources = (
        {"name": "rich", "weight": 3, "any_agent": "reward > 1.5"},
        {"name": "hot", "weight": 1, "sampler": {"kind": "priority", "alpha": 1.0, "beta": 0.5}},
    )
    batch = sample(namespace, joint_recipe(64, *sources, name="mix", seed=4), redis_url=redis_url)
    assert np.bincount(batch.source_index).tolist() == [48, 16]
    rows = joint_keys(batch)
    for i in np.flatnonzero(batch.source_index == 0).tolist():
        assert any(r["reward"] > 1.5 for r in log.agents[rows[i]].values())
    hot = set(keys[:5])
    assert {rows[i] for i in np.flatnonzero(batch.source_index == 1).tolist()} <= hot
    assert set(batch.ids[batch.source_index == 1].tolist()) <= set(every.ids[:5].tolist())
    check_aligned(batch, log)


def test_a_joint_step_missing_a_record_is_not_served_and_is_counted(redis_url, workers, namespace):
    log = record(namespace, redis_url, episodes=10, seed=3)
    n = len(log.order)
    every = sample(namespace, joint_recipe(n, name="every"), redis_url=redis_url)
    keys = joint_keys(every)
    crowded = [i for i in range(n) if every["mask"][i].sum() >= 2][:3]
    ids = every["step_ids"]
    victims = [  # the second agent of two joint steps, the anchor of a third
        ids[crowded[0]][every["mask"][crowded[0]]][1],
        ids[crowded[1]][every["mask"][crowded[1]]][1],
        every.ids[crowded[2]],
    ]
    assert Store(redis_url, namespace).evict(victims) == 3
    gone = {keys[i] for i in crowded}
    fields = [*PER_AGENT, "state", "team_reward", "step_ids"]
    with pytest.raises(InsufficientData):
        sample(namespace, joint_recipe(n - 2, name="too-many", fields=fields), redis_url=redis_url)
    batch = sample(namespace, joint_recipe(n - 3, name="left", fields=fields), redis_url=redis_url)
    assert set(joint_keys(batch)) == set(log.order) - gone
    assert batch.meta["joint"] == {"complete": n - 3, "partial": 3}
    for i, key in enumerate(joint_keys(batch)):
        assert batch["state"][i].tobytes() == log.state[key].tobytes()
        assert batch["mask"][i].sum() == len(log.agents[key])
    # With next_state, the joint step before the one whose anchor (and state) went is not
    # complete either: its next state is gone.
    ep, t = keys[crowded[2]]
    before = {(ep, t - 1)} if t > 0 else set()
    full = sample(namespace, joint_recipe(n - 3 - len(before), name="next"), redis_url=redis_url)
    assert set(joint_keys(full)) == set(log.order) - gone - before
    check_aligned(full, log)
    result = Query(Store(redis_url, namespace)).run("", joint=JointFilter())
    assert result.joint == {"complete": n - 3, "partial": 3, "matched": n - 3}


def test_a_joint_step_with_a_repeated_agent_is_partial_and_counted(redis_url, workers, namespace):
    """The attack: an anchor for a0 says 2 agents were present; a second record also says
    ``agent_id="a0"``. Counted by records the step looks complete, and its row (one
    record per agent) would be served masked ``[True, False, ...]`` with one of the two
    records dropped. Counted by distinct agents it is partial: never served, counted."""
    log = record(namespace, redis_url, episodes=4, seed=5)
    n = len(log.order)
    code = {EPISODE_TAG: joint_code("forged")}
    obs, state = np.zeros(4, np.float32), np.zeros((1, 6), np.float32)
    with Ingestor(namespace, redis_url, flush_interval=None) as ing:
        anchor = ing.episode(agent_episode("forged", "a0"), agent_id="a0", **code)
        anchor.add(obs, np.int64(0), 1.0, state=state, terminated=True, **{AGENTS_TAG: 2.0})
        twin = ing.episode(agent_episode("forged", "twin"), agent_id="a0", **code)
        twin.add(obs + 1, np.int64(1), 2.0, state=state[:0], terminated=True)
        assert ing.flush().committed == 2
    fields = [*PER_AGENT, "state", "team_reward", "step_ids"]
    batch = sample(namespace, joint_recipe(n, name="all", fields=fields), redis_url=redis_url)
    assert sorted(joint_keys(batch)) == sorted(log.order)  # the forged step is not a row
    assert batch.meta["joint"] == {"complete": n, "partial": 1}
    with pytest.raises(InsufficientData):
        sample(namespace, joint_recipe(n + 1, name="more", fields=fields), redis_url=redis_url)
