"""The soak's verdicts can fail: each check of tests/soak/roles.py flags the fault it is
for, from logs and batches made here (no hosts, no services)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tests.soak.roles import check_grpo, check_joint, check_nearest, joint_rows
from tests.soak.soak import llm_verdicts


def write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps({"t": 0.0, **r}) + "\n" for r in records))
    return path


class Batch(SimpleNamespace):
    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]


def batch(rows: list[tuple[str, int, list[int]]]) -> Batch:
    """A joint batch as the recipe serves it: per row and agent slot, Crowd's observation
    [episode, t, agent, noise], the step index, the mask and the agent's episode id."""
    n = len(rows)
    obs, steps = np.zeros((n, 4, 4), np.float32), np.zeros((n, 4), np.int64)
    mask, names = np.zeros((n, 4), bool), []
    for i, (episode, t, agents) in enumerate(rows):
        row: list[str | None] = [None] * 4
        for j in agents:
            obs[i, j], steps[i, j], mask[i, j] = [1, t, j, 0.5], t, True
            row[j] = f"{episode}/a{j}"
        names.append(row)
    fields = {"obs": obs, "step_index": steps, "mask": mask}
    return Batch(meta={"episode_id": names}, fields=fields)


def test_joint_rows_name_their_step_and_flag_a_misaligned_slot():
    b = batch([("ep1", 0, [0, 1, 2]), ("ep1", 3, [1, 3])])
    assert joint_rows(b) == ([["ep1", 0, 0b0111], ["ep1", 3, 0b1010]], 0)
    b.fields["obs"][1, 3, 1] = 4  # agent a3's slot holds another joint step's observation
    assert joint_rows(b)[1] == 1
    b = batch([("ep1", 0, [0, 1])])
    b.meta["episode_id"][0][1] = "ep2/a1"  # another episode's agent in the row
    assert joint_rows(b)[1] == 1


def test_check_joint_flags_a_partial_row_and_one_never_recorded(tmp_path):
    actor = write(
        tmp_path / "actor.jsonl",
        {"event": "recorded", "episode": "ep1", "masks": [0b0111, 0b0011]},
        {"event": "confirmed", "episode": "ep1", "steps": 2},
    )
    good = {"event": "batch", "rows": [["ep1", 0, 0b0111]], "misaligned": 0, "partial": 0}
    trainer = write(tmp_path / "trainer.jsonl", good)
    got = check_joint([actor], trainer)
    assert (got["n_problems"], got["batches"], got["confirmed_episodes"]) == (0, 1, 1)
    bad = {"event": "batch", "rows": [["ep1", 1, 0b0001], ["ep9", 0, 1]], "misaligned": 1}
    got = check_joint([actor], write(tmp_path / "trainer.jsonl", good, bad))
    assert got["n_problems"] == 3
    assert any("partial joint row ep1/1" in p for p in got["problems"])
    assert any("never recorded" in p for p in got["problems"])


def test_check_grpo_flags_a_row_older_than_the_bound(tmp_path):
    fresh = {"event": "batch", "v": 5, "oldest": 4, "trajectories": 4}
    log = write(tmp_path / "grpo.jsonl", fresh, {"event": "declared", "v": 6})
    assert check_grpo(log) == {"batches": 1, "version": 6, "problems": [], "n_problems": 0}
    stale = {"event": "batch", "v": 6, "oldest": 4, "trajectories": 4}
    assert check_grpo(write(tmp_path / "grpo.jsonl", fresh, stale))["n_problems"] == 1


def test_check_nearest_counts_answers_and_their_problems(tmp_path):
    log = write(
        tmp_path / "nearest.jsonl",
        {"event": "error", "error": "no index yet"},
        {"event": "answer", "ids": 20, "problems": []},
        {"event": "answer", "ids": 20, "problems": ["step ids not in the store: [7]"]},
    )
    got = check_nearest(log)
    assert (got["answers"], got["n_problems"]) == (2, 1)


def llm_result(**changes) -> dict:
    """The LLM check's result (tests/soak/roles.py ``check_llm``) with nothing wrong."""
    adm = {"admitted": 8, "budget": 8, "open": 0, "waiting": 0, "total": 8, "released": 0}
    result = {
        "problems": [],
        "refused_rewards": {},
        "missing": [],
        "missing_at": {},
        "admission": adm,
        "trained_slots": 8,
    }
    return {**result, **changes}


def test_llm_verdicts_excuse_only_what_a_fault_explains():
    assert llm_verdicts(llm_result(), []) == []
    lost_turn = {"answered_at": [98.0, 100.0], "error": "1 of its 2 turns are stored"}
    taken = {"answered_at": [100.0], "error": "trajectory 't' already has its reward"}
    got = llm_result(refused_rewards={"t1": lost_turn, "t2": taken})
    assert llm_verdicts(got, []) == [  # the gateway spools what it answered: no excuse
        "llm: the reward of t1 refused: " + lost_turn["error"],
        "llm: the reward of t2 refused: " + taken["error"],
    ]
    got = llm_result(missing=["t3", "t4"], missing_at={"t3": 100.0, "t4": 50.0})
    assert llm_verdicts(got, [104.0]) == ["llm: rewarded turns not stored: ['t4']"]
    assert got["lost_to_failover"] == ["t3"]
    leaked = llm_result(admission={"admitted": 10, "open": 1, "waiting": 0})
    assert len(llm_verdicts(leaked, [])) == 2  # one still open, two slots leaked
    wrong = llm_result(problems=["t5: a turn with another reward [0.0]"])
    assert llm_verdicts(wrong, []) == ["llm: t5: a turn with another reward [0.0]"]
