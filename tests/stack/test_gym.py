"""The gymnasium wrapper records every step with no change to the user's loop."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from claw_tasks.client import Ingestor
from claw_tasks.client.gym import RecordSteps
from claw_tasks.store import Store


def test_record_steps_cartpole(redis_url, namespace, ingest_worker):
    ing = Ingestor(namespace, redis_url, flush_interval=None)
    env = RecordSteps(gym.make("CartPole-v1"), ing, task_id="cartpole", agent_id="random")
    seen: list[list[np.ndarray]] = []
    steps = 0
    for episode in range(3):
        obs, _ = env.reset(seed=episode)
        traj = [obs]
        done = False
        while not done:
            obs, _, term, trunc, _ = env.step(env.action_space.sample())
            traj.append(obs)
            steps += 1
            done = term or trunc
        seen.append(traj)
    env.close()
    assert ing.close().committed == steps
    store = Store(redis_url, namespace)
    assert store.count({"task_id": "cartpole"}) == steps
    assert store.count({"terminated": True}) == 3
    codes = Store(redis_url, namespace).meta_columns(0, ["episode"])["episode"]
    episodes = {c for c in codes.tolist() if c}
    assert len(episodes) == 3
    # Each recorded episode's obs/next_obs chain is exactly what the env produced.
    first_obs = {}
    for code in episodes:
        name = store.r.hget(store.layout_keys.shard_key(0, "epname"), code).decode()
        got = store.episode(name)
        first_obs[got["obs"][0].tobytes()] = got
    for traj in seen:
        got = first_obs[traj[0].tobytes()]
        np.testing.assert_array_equal(got["obs"], np.stack(traj[:-1]))
        np.testing.assert_array_equal(got["next_obs"], np.stack(traj[1:]))
