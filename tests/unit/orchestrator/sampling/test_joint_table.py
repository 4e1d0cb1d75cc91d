"""The joint table against hostile joint tags, with Hypothesis: records of arbitrary joint
episodes, step indices, agents (repeated, missing) and anchors whose ``joint_agents`` is
any float (negative, fractional, huge, inf, NaN), two anchors in one step. Whatever the
columns, a joint step is served only when its one anchor counted exactly its live records
and each names a different agent; every joint step is counted complete or partial.
CI runs a small number of examples; ``pytest -m slow`` many more."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from claw_tasks.format.stepmeta import UNTRAINABLE
from orchestrator.sampling.joint import AGENTS_COLUMN, EPISODE_COLUMN, JointTable

AGENT_CODES = [1, 2, 3, 4]


def _encode(column: str, names: list[str]) -> np.ndarray:
    return np.array([AGENT_CODES[int(n[1:])] for n in names], np.int64)


COUNT = st.one_of(
    st.integers(0, 5).map(float),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-1.0, 1.5, 1e300, 2.0**63]),
)
STEP = st.tuples(
    st.integers(0, 2),  # joint episode
    st.integers(0, 3),  # step index
    st.lists(st.sampled_from([0, *AGENT_CODES]), min_size=1, max_size=5),  # agents (0: none)
    st.one_of(st.just("exact"), st.just("exact"), COUNT),  # the anchor's joint_agents
    st.lists(st.booleans(), min_size=5, max_size=5).map(lambda b: [True, *b[1:]]),  # alive
    st.booleans() | st.just(True),  # trainable
    st.booleans(),  # a second anchor
)


def _records(steps: list[tuple]) -> list[tuple]:
    """The records of the drawn joint steps, interleaved as an ingest would store them:
    ``(episode, t, agent, joint_agents or None, alive, trainable)``."""
    out = []
    for ep, t, agents, count, alive, trainable, twice in steps:
        n = len(agents) if count == "exact" else count
        for j, agent in enumerate(agents):
            anchor = n if j == 0 or (twice and j == 1) else None
            out.append((ep, t, agent, anchor, alive[j], trainable))
    return out


def _columns(records: list[tuple]) -> dict[str, np.ndarray]:
    n = len(records)
    ep, t, agent, count, alive, trainable = (list(c) for c in zip(*records, strict=True))
    return {
        "id": np.arange(1, n + 1, dtype=np.int64),
        "alive": np.array(alive, bool),
        EPISODE_COLUMN: np.array(ep, np.float64) * 7919.0 + 1.0,
        "step_index": np.array(t, np.int32),
        AGENTS_COLUMN: np.array([np.nan if c is None else c for c in count], np.float64),
        "agent_id": np.array(agent, np.int64),
        "flags": np.where(np.array(trainable, bool), 0, UNTRAINABLE).astype(np.uint8),
    }


def _check(records: list[tuple]) -> None:
    cols = _columns(records)
    table = JointTable(["a0", "a1", "a2", "a3"], _encode, cap=len(records), trainable=True)
    t = table.table(cols)
    counts = table.counts
    steps = {(r[0], r[1]) for r, a in zip(records, cols["alive"], strict=True) if a}
    assert counts["complete"] + counts["partial"] == len(steps)
    for row in np.flatnonzero(t.of_anchor >= 0).tolist():
        key = (records[row][0], records[row][1])
        live = [i for i, r in enumerate(records) if (r[0], r[1]) == key and cols["alive"][i]]
        anchors = [i for i in live if records[i][3] is not None]
        assert anchors == [row]  # the one anchor of its step
        assert float(records[row][3]) == len(live)  # it counted exactly the live records
        named = [records[i][2] for i in live if records[i][2]]
        assert len(named) == len(set(named)), (key, named)  # no agent twice
        assert all(records[i][5] for i in live)  # every record trainable
        assert any(records[i][2] for i in live)  # one of the recipe's agents is there


SETTINGS = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=200, **SETTINGS)
@given(st.lists(STEP, min_size=1, max_size=8))
def test_joint_table_serves_only_whole_steps_of_distinct_agents(steps: list[tuple]) -> None:
    _check(_records(steps))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=5_000, **SETTINGS)
@given(st.lists(STEP, min_size=1, max_size=24))
def test_joint_table_serves_only_whole_steps_of_distinct_agents_long(steps: list[tuple]) -> None:
    _check(_records(steps))
