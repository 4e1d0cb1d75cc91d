"""Multi-agent joint steps: recording through RecordParallelSteps (agents dying and
joining), joint batches aligned bit for bit with what was recorded (sampled directly and
popped through the prefetch workers), the global state stored once per joint step, joint
filters against a numpy reference, partial joint steps under eviction, mixtures and
priorities on joint rows, per-agent views and ``claw query`` over joint conditions."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from marlenv import Crowd

from claw_tasks.client import Ingestor
from claw_tasks.client.pettingzoo import RecordParallelSteps
from claw_tasks.format.joint import STATE_FIELD, agent_episode
from claw_tasks.store import Store
from orchestrator import BatchClient, sample, update_priorities
from orchestrator.inspect.query import Query
from orchestrator.sampling import InsufficientData

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


def record(ns: str, url: str, episodes: int, seed: int = 0, **kw: Any) -> Log:
    """Record ``episodes`` Crowd episodes with random actions; log every record."""
    env = Crowd(seed=seed)
    log = Log()
    with Ingestor(ns, url, flush_interval=None, **kw.pop("ingestor", {})) as ing:
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
    keys = store.r.keys(f"{store.keys.shard(0)}r:{STATE_FIELD}:*")
    assert sum(store.r.hlen(k) for k in keys) == n
    assert store.count() == sum(counts)

    client = BatchClient(namespace, redis_url)
    client.register(joint_recipe(64, {"name": "u"}, name="popped", seed=3))
    popped = client.pop("popped", timeout=60)
    client.close()
    assert len(popped) == 64 and popped["obs"].shape == (64, 4, 4)
    check_aligned(popped, log)
    assert popped.meta["joint"]["partial"] == 0
