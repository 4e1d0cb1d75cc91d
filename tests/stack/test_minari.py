"""Minari interchange: a recorded namespace exports as a dataset Minari loads, and imports
back equal, tagged offline beside the online steps."""

from __future__ import annotations

import gymnasium as gym
import minari
import numpy as np
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.store import Store
from orchestrator.cli.main import app


def claw(redis_url: str, *args: str) -> str:
    result = CliRunner().invoke(
        app, list(args), env={"CLAW_REDIS_URL": redis_url, "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_minari_round_trip(redis_url, namespace, tmp_path, ingest_worker, monkeypatch):
    ing = Ingestor(namespace, redis_url, n_shards=2, flush_interval=None)
    env = RecordSteps(gym.make("CartPole-v1"), ing, task_id="balance")
    episodes = []
    for seed in range(4):
        obs, _ = env.reset(seed=seed)
        traj, done = [obs], False
        while not done:
            obs, _, term, trunc, _ = env.step(env.action_space.sample())
            traj.append(obs)
            done = term or trunc
        episodes.append(np.stack(traj))
    # An episode still running has no final observation: it is left out of the export.
    env.reset(seed=99)
    env.step(0)
    env.close()
    ing.close()
    src = Store(redis_url, namespace)
    assert src.config().spaces is not None  # recorded by RecordSteps

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    out = claw(redis_url, "export", namespace, "--format", "minari", "--to", "claw/cartpole-v0")
    assert "4 episode(s)" in out and "1 incomplete" in out

    dataset = minari.load_dataset("claw/cartpole-v0")
    assert dataset.total_episodes == 4
    assert dataset.observation_space == env.observation_space
    assert dataset.action_space == env.action_space
    loaded = sorted((ep.observations for ep in dataset), key=lambda o: o[0].tobytes())
    for got, want in zip(loaded, sorted(episodes, key=lambda o: o[0].tobytes()), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)  # N+1 observations

    back_ns = namespace + "-offline"
    claw(redis_url, "import", "claw/cartpole-v0", "--format", "minari", "--namespace", back_ns)
    back = Store(redis_url, back_ns)
    for ep in dataset:
        name = dataset.storage.get_episode_metadata([ep.id]).__next__()["claw_episode_id"]
        a, b = src.episode(name), back.episode(name)
        for key in (
            "obs",
            "action",
            "reward",
            "terminated",
            "truncated",
            "next_obs",
            "step_index",
            "has_next_obs",
        ):
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
        assert set(a["tags.origin"]) == {"online"} and set(b["tags.origin"]) == {"offline"}
    # Imported again: nothing stored twice.
    claw(redis_url, "import", "claw/cartpole-v0", "--namespace", back_ns)
    assert back.count() == dataset.total_steps
    # Offline steps beside online ones in one namespace, told apart by the origin tag.
    claw(redis_url, "import", "claw/cartpole-v0", "--namespace", namespace)
    assert src.count({"tags.origin": "offline"}) == dataset.total_steps
    assert src.count({"tags.origin": "online"}) == dataset.total_steps + 1
