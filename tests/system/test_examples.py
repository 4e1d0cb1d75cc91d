"""Examples stay valid: the recipes parse and validate, the scripts run at a small size
against a real stack."""

from __future__ import annotations

import json
import re

import pytest

from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.store import Store
from orchestrator import Recipe
from orchestrator.transforms.augment import build_pipelines
from tests.support.paths import ROOT
from tests.support.processes import run_example

EXAMPLES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipe_is_valid(path):
    recipe = Recipe.from_yaml(path)
    schema = Schema(fields={"obs": FieldSpec("|u1", (84, 84, 3)), "action": FieldSpec("<f4", (4,))})
    recipe.validate_against(schema)
    build_pipelines(recipe.augment)
    assert sum(recipe.counts) == recipe.batch_size


def test_dqn_per_learns_from_popped_batches(redis_url, workers, namespace):
    out = run_example(
        "dqn_per.py", redis_url, "--namespace", namespace, "--updates", "30", "--warmup", "200"
    )
    assert re.search(r"done: 30 updates in \d+ s, \d+ env steps", out), out
    assert Store(redis_url, namespace).count() >= 200


def test_drq_pixels_pops_shifted_images(redis_url, workers, namespace):
    out = run_example(
        "drq_pixels.py", redis_url, "--namespace", namespace, "--steps", "300", "--updates", "5"
    )
    assert "recorded 300 steps of 84x84x3 images" in out and "done: 5 updates" in out


def test_multi_agent_batches_mix_70_30(redis_url, workers, namespace):
    out = run_example(
        "multi_agent.py", redis_url, "--namespace", namespace, "--steps", "300", "--batches", "3"
    )
    lines = [ln for ln in out.splitlines() if ln.startswith("batch of 100")]
    assert len(lines) == 3
    for ln in lines:  # each source's rows are that agent's steps
        assert "agents {'cautious': 70, 'random': 30}" in ln, ln
        assert "sources {'cautious': 70, 'random': 30}" in ln, ln


def test_offline_online_mixes_restored_and_fresh_steps(redis_url, workers, namespace, tmp_path):
    out = run_example(
        "offline_online.py",
        redis_url,
        "--namespace",
        namespace,
        "--archive",
        str(tmp_path / "archive"),
        "--steps",
        "300",
        "--batches",
        "2",
    )
    assert "archived 300 steps" in out and "restored 300 steps" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("batch of 64")]
    assert len(lines) == 2
    for ln in lines:  # the restored half is yesterday's agent, the fresh half today's
        assert "sources {'offline': 32, 'online': 32}" in ln, ln
        assert "agents {'today': 32, 'yesterday': 32}, 32 rows with an orig_id" in ln, ln


def test_dataloader_workers_share_one_queue(redis_url, workers, namespace):
    out = run_example(
        "dataloader_workers.py",
        redis_url,
        "--namespace",
        namespace,
        "--batches",
        "3",
        "--num-workers",
        "2",
    )
    assert "done: 6 batches from 2 DataLoader workers" in out


def test_torchrl_dqn_trains_through_claw(redis_url, workers, namespace):
    out = run_example(
        "torchrl_dqn.py",
        redis_url,
        "--namespace",
        namespace,
        "--frames",
        "1024",
        "--init",
        "512",
        "--gradient-steps",
        "8",
        "--eval-episodes",
        "1",
    )
    assert re.search(r"done: 1024 frames, 24 updates in \d+ s; 1024 rows", out), out
    assert Store(redis_url, namespace).count() == 1024


def _run_mappo(redis_url: str, *args: str) -> str:
    return run_example("mappo_gather.py", redis_url, *args, timeout=1800)


def test_the_mappo_example_trains_from_joint_batches(redis_url, workers, namespace):
    """Short mode: every iteration's joint batch holds each joint step recorded once, each
    agent's slice with the action it took there."""
    args = ["--namespace", namespace, "--seeds", "1", "--iterations", "2", "--episodes", "4"]
    out = _run_mappo(redis_url, *args, "--check")
    assert len(re.findall(r"bookkeeping ok: \d+ joint steps, \d+ agent steps, 0 partial", out)) == 2


@pytest.mark.slow
def test_the_mappo_example_beats_a_random_policy(redis_url, workers, namespace, tmp_path):
    png = tmp_path / "curve.png"
    args = ["--namespace", namespace, "--seeds", "3", "--iterations", "25", "--png", str(png)]
    out = _run_mappo(redis_url, *args)
    numbers = r"(\S+) ± (\S+) \(random policy (\S+) ± (\S+)\)"
    m = re.search(r"team return after 25 iterations: " + numbers, out)
    assert m, out
    trained, spread, random_mean, random_std = map(float, m.groups())
    assert trained - 2 * spread > random_mean + 2 * random_std + 2.0, out
    assert png.stat().st_size > 10_000


def _updates(out: str) -> tuple[list[dict], dict]:
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    return lines[:-1], lines[-1]


# slow: three processes importing torch cost 30-130 s; tests/stack/test_rollouts.py checks the
# same bookkeeping with 4 actor threads in CI.
@pytest.mark.slow
def test_ppo_actors_consume_each_rollout_once(redis_url, workers, namespace):
    """Short mode: 2 actors, 3 updates of 2 epochs; every update is the next rollout, of
    the version just published, each step of it once per epoch, nothing dropped."""
    args = ["--actors", "2", "--updates", "3", "--epochs", "2", "--n-steps", "16"]
    out = run_example(
        "ppo_actors.py", redis_url, "--namespace", namespace, *args, "--batch-size", "64"
    )
    updates, summary = _updates(out)
    assert [u["update"] for u in updates] == [1, 2, 3]
    for u in updates:
        assert u["rollouts"] == [u["update"]] and u["versions"] == [u["update"] - 1], u
        assert u["steps"] == 128 and u["each_step_once_per_epoch"], u
    assert summary["env_steps"] == 384 and summary["stats"]["rollouts"] == 3
    assert summary["stats"]["dropped_stale"] == 0 and summary["stats"]["lost"] == 0


@pytest.mark.slow
def test_ppo_actors_learn_cartpole(redis_url, workers, namespace):
    """In full: 4 actors, rl-zoo's hyperparameters, to a mean evaluation return >= 475."""
    args = ["--namespace", namespace, "--actors", "4"]
    out = run_example("ppo_actors.py", redis_url, *args, timeout=3600)
    _, summary = _updates(out)
    assert summary["eval_return"] >= 475, out[-3000:]


def _imitation(out: str) -> dict:
    """The imitation example's bookkeeping (its last line), checked for either mode."""
    s = json.loads(out.strip().splitlines()[-1])
    recorded, counts = s["recorded"], s["counts"]
    assert counts["noisy:steps"] == recorded["steps"], s  # every step of the source came in
    assert counts["noisy:finite"] == recorded["nan"] and counts["noisy:range"] == recorded["range"]
    assert s["quarantined"] >= recorded["nan"] + recorded["range"], s  # outliers may add some
    assert s["bad_rows"] == 0 and s["other_version"] == 0, s  # none served, one statistics
    assert s["nearest_shapes"] == [[128, 5]], s
    return s


def test_imitation_cartpole_short_run_keeps_its_bookkeeping(redis_url, workers, namespace):
    """Short mode (CI): 4 expert and 2 noisy episodes, 20 BC updates, one DAgger round of
    10: the cleaning counted every broken step by rule, no served row was bad, every batch
    was normalised by the same statistics, nearest labels came for each row."""
    out = run_example("imitation_cartpole.py", redis_url, "--namespace", namespace, "--short")
    s = _imitation(out)
    assert s["mode"] == "short" and s["expert_steps"] == 2000, s  # 4 episodes of 500 steps
    assert s["bc_batches"] == 20 + 10 and s["dagger_batches"] == 10, s
    assert s["final_return"] > 50, s  # a random policy gets ~22; learning is the slow test's


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_imitation_cartpole_full_run_balances(redis_url, workers, namespace):
    """In full: 20 expert and 10 noisy episodes, 400 BC updates, 4 DAgger rounds of 200
    (~5 minutes under load): BC balances, DAgger keeps it."""
    out = run_example("imitation_cartpole.py", redis_url, "--namespace", namespace, timeout=1700)
    s = _imitation(out)
    assert s["bc_return"] >= 450 and s["final_return"] >= 475, out


# slow: Ray's start and three processes importing ray cost 30-90 s under load;
# tests/stack/test_rllib.py covers the RLlib buffer in CI.
@pytest.mark.slow
def test_rllib_actors_record_into_claw_and_the_learner_trains(redis_url, workers, namespace):
    pytest.importorskip("ray", reason="the rllib extra (ray[rllib]) is not installed")
    out = run_example(
        "rllib_actors.py", redis_url, "--namespace", namespace, "--short", timeout=900
    )
    rounds = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["env_steps"] for r in rounds] == [200, 400, 600]
    assert rounds[0]["batch_policy_versions"] == [0]  # the first round's steps only
    assert re.search(r"done: 2 Ray actors recorded 600 steps .*, 60 updates from Claw", out), out
    assert Store(redis_url, namespace).count() == 600
