"""The PyTorch and Stable-Baselines3 adapters against real Redis, ingest and prefetch workers."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import DQN, SAC
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize
from torch.utils.data import DataLoader

from claw_tasks.client import Ingestor
from claw_tasks.store import Store
from orchestrator.adapters.cadence import plan_for
from orchestrator.adapters.sb3 import ClawReplayBuffer
from orchestrator.adapters.torch import ClawIterableDataset
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import LineageLog


def _ingest_vectors(url: str, ns: str, episodes: int = 4, steps: int = 40) -> None:
    rng = np.random.default_rng(0)
    ing = Ingestor(ns, url, flush_interval=None)
    for e in range(episodes):
        with ing.episode(episode_id=f"e{e}") as ep:
            for t in range(steps):
                last = t == steps - 1
                obs = rng.normal(size=8).astype(np.float32)
                ep.add(
                    obs, np.int64(t % 3), float(t), terminated=last, next_obs=obs if last else None
                )
    assert ing.close().committed == episodes * steps


def test_torch_dataset_yields_tensor_batches(redis_url, namespace, workers):
    _ingest_vectors(redis_url, namespace)
    recipe = {
        "name": "vec",
        "batch_size": 16,
        "fields": ["obs", "action", "reward", "next_obs", "terminated"],
        "sources": [{"name": "all", "sampler": {"kind": "priority"}}],
        "prefetch": {"depth": 2},
    }
    ds = ClawIterableDataset(recipe, namespace, redis_url, timeout=60, num_batches=3)
    store = Store(redis_url, namespace)
    items = list(DataLoader(ds, batch_size=None))
    assert len(items) == 3
    for item in items:
        assert set(item) == {*recipe["fields"], "ids", "weights"}
        assert item["obs"].dtype == torch.float32 and item["obs"].shape == (16, 8)
        assert item["next_obs"].shape == (16, 8)
        assert item["action"].dtype == torch.int64 and item["action"].shape == (16,)
        assert item["reward"].dtype == torch.float32 and item["terminated"].dtype == torch.bool
        assert item["ids"].dtype == torch.int64 and item["weights"].dtype == torch.float32
        stored = store.get(item["ids"].numpy())
        np.testing.assert_array_equal(item["obs"].numpy(), stored["obs"])
        np.testing.assert_array_equal(item["reward"].numpy(), stored["reward"])
    assert ds.update_priorities(items[0]["ids"], torch.full((16,), 5.0), wait=True) > 0
    ds.close()


def test_torch_dataset_in_dataloader_workers(redis_url, namespace, workers):
    _ingest_vectors(redis_url, namespace, episodes=2)
    with BatchClient(namespace, redis_url) as client:
        client.register(
            {
                "name": "v",
                "batch_size": 8,
                "fields": ["obs", "reward"],
                "sources": [{"name": "all"}],
            }
        )
    ds = ClawIterableDataset("v", namespace, redis_url, timeout=60, num_batches=2)
    items = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(items) == 4  # num_batches per worker
    assert all(i["obs"].shape == (8, 8) and i["ids"].shape == (8,) for i in items)
    # lineage: the k-th batch the loader gave trains version k, whichever worker made it
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {"1": 1, "2": 1, "3": 1, "4": 1}
    for k, item in enumerate(items, 1):
        (entry,) = log.trained(k)
        assert np.array_equal(entry.ids, np.sort(item["ids"].numpy())), k


# ---- Stable-Baselines3 ---------------------------------------------------------------
def _rollout(buffers: list[ReplayBuffer], steps: int, n_envs: int = 2) -> None:
    """SB3's own store loop (``_store_transition``) over random CartPole actions, adding the
    same transitions to every buffer; a few next_obs are replaced by unrelated arrays."""
    venv = DummyVecEnv([lambda: gym.make("CartPole-v1", max_episode_steps=16)] * n_envs)
    venv.seed(3)
    rng = np.random.default_rng(3)
    last = venv.reset()
    for t in range(steps):
        action = rng.integers(0, 2, n_envs)
        new_obs, reward, dones, infos = venv.step(action)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done:
                next_obs[i] = infos[i]["terminal_observation"]
        if t % 7 == 3:
            next_obs[0] = rng.normal(size=4)  # a next_obs that is not the next step's obs
        for b in buffers:
            b.add(last, next_obs, action.reshape(n_envs, 1), reward, dones, infos)
        last = new_obs


def _rows(samples) -> np.ndarray:
    """Samples as rows of (obs, action, next_obs, done, reward[, discount]), sorted."""
    parts = [
        samples.observations,
        samples.actions,
        samples.next_observations,
        samples.dones,
        samples.rewards,
    ]
    if samples.discounts is not None:
        parts.append(samples.discounts)
    rows = np.concatenate([p.numpy().astype(np.float64).reshape(len(p), -1) for p in parts], 1)
    return rows[np.lexsort(rows.T[::-1])]


def _all_sb3_rows(rb: ReplayBuffer, env: VecNormalize | None) -> np.ndarray:
    """Every stored transition through SB3's own ``_get_samples`` (it draws env indices at
    random: 30 draws per position cover both envs)."""
    np.random.seed(0)
    rows = _rows(rb._get_samples(np.repeat(np.arange(rb.size()), 30), env=env))
    return np.unique(rows, axis=0)


def test_sb3_sample_matches_sb3_replay_buffer(redis_url, namespace, workers):
    env = gym.make("CartPole-v1")
    spaces_ = (env.observation_space, env.action_space)
    steps, n_envs = 60, 2
    ref = ReplayBuffer(1000, *spaces_, device="cpu", n_envs=n_envs)
    claw = ClawReplayBuffer(
        1000,
        *spaces_,
        device="cpu",
        n_envs=n_envs,
        namespace=namespace,
        redis_url=redis_url,
        recipe={"sources": [{"name": "all", "sampler": {"kind": "recent"}}]},
        timeout=60,
    )
    _rollout([ref, claw], steps, n_envs)
    assert claw.size() == ref.size() == steps and claw.pos == ref.pos
    assert ref.timeouts.sum() > 0 and (ref.dones * (1 - ref.timeouts)).sum() > 0

    stats_env = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]))
    stats_env.reset()
    for _ in range(200):
        stats_env.step(np.array([stats_env.action_space.sample()]))
    for vec_env in (None, stats_env):
        got = claw.sample(steps * n_envs, env=vec_env)  # recent: every stored transition
        assert got.observations.shape == (steps * n_envs, 4)
        assert got.actions.shape == (steps * n_envs, 1) and got.actions.dtype == torch.int64
        assert got.rewards.shape == got.dones.shape == (steps * n_envs, 1)
        assert got.observations.dtype == got.dones.dtype == got.rewards.dtype == torch.float32
        assert got.discounts is None and got.observations.device.type == "cpu"
        np.testing.assert_array_equal(_rows(got), _all_sb3_rows(ref, vec_env))
    claw.close()


def test_sb3_n_step_matches_sb3_n_step_buffer(redis_url, namespace, workers):
    env = gym.make("CartPole-v1")
    spaces_ = (env.observation_space, env.action_space)
    steps, n, gamma = 50, 3, 0.9
    ref = NStepReplayBuffer(1000, *spaces_, device="cpu", n_steps=n, gamma=gamma)
    claw = ClawReplayBuffer(
        1000,
        *spaces_,
        device="cpu",
        namespace=namespace,
        redis_url=redis_url,
        timeout=60,
        recipe={
            "n_step": n,
            "gamma": gamma,
            "sources": [{"name": "all", "sampler": {"kind": "recent"}}],
        },
    )
    _rollout([ref, claw], steps, n_envs=1)
    # Both cut the windows of the newest rows short (SB3 treats the newest row as truncated;
    # the buffer's flush stores it with its next_obs).
    rows = np.arange(steps)
    got = claw.sample(steps)
    assert got.discounts.shape == (steps, 1)
    np.testing.assert_allclose(_rows(got), _rows(ref._get_samples(rows)), rtol=1e-6)
    claw.close()


def test_dqn_trains_on_cartpole(redis_url, namespace, workers):
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        learning_starts=200,
        buffer_size=10_000,
        batch_size=32,
        train_freq=4,
        target_update_interval=100,
        device="cpu",
        seed=0,
        replay_buffer_class=ClawReplayBuffer,
        replay_buffer_kwargs={"namespace": namespace, "redis_url": redis_url, "timeout": 60},
    )
    model.learn(total_timesteps=800)
    rb = model.replay_buffer
    assert isinstance(rb, ClawReplayBuffer) and rb.size() == 800
    name = rb.recipe_name(32)
    assert rb.client.stats(name)[name]["popped"] >= (800 - 200) // 4
    rb.close()
    store = Store(redis_url, namespace)
    assert store.count({}) == 800
    # lineage without a line of the user's: sample k trained the model of _n_updates k
    assert model._n_updates >= (800 - 200) // 4 and rb.updates == model._n_updates
    log = LineageLog(store)
    assert log.counts() == {str(v): 1 for v in range(1, model._n_updates + 1)}
    assert {e.rows for e in log.entries()} == {32}


def test_sac_trains_on_pendulum(redis_url, namespace, workers):
    model = SAC(
        "MlpPolicy",
        "Pendulum-v1",
        learning_starts=100,
        buffer_size=5_000,
        batch_size=32,
        device="cpu",
        seed=0,
        replay_buffer_class=ClawReplayBuffer,
        replay_buffer_kwargs={"namespace": namespace, "redis_url": redis_url, "timeout": 60},
    )
    model.learn(total_timesteps=250)
    rb = model.replay_buffer
    got = rb.sample(32)
    assert got.actions.shape == (32, 1) and got.actions.dtype == torch.float32
    rb.close()


def test_sb3_one_prefetched_batch_serves_several_samples(redis_url, namespace, workers):
    """``gradient_steps=64``: each popped batch of 4 x 8 rows serves four ``sample(8)``
    calls (converted in the read-ahead thread), each of stored transitions only."""
    env = gym.make("CartPole-v1")
    spaces_ = (env.observation_space, env.action_space)
    ref = ReplayBuffer(1000, *spaces_, device="cpu", n_envs=2)
    sources = [
        {"name": "first", "weight": 0.5, "where": "step_index < 8"},
        {"name": "later", "weight": 0.5, "where": "step_index >= 8"},
    ]
    claw = ClawReplayBuffer(
        1000,
        *spaces_,
        device="cpu",
        n_envs=2,
        namespace=namespace,
        redis_url=redis_url,
        recipe={"sources": sources},
        timeout=60,
        gradient_steps=64,
    )
    assert claw.batches_per_pop == 4
    _rollout([ref, claw], 60)
    stored = _all_sb3_rows(ref, None)
    name = claw.recipe_name(8)
    assert claw.client.registry.get(name).recipe.batch_size == 32
    served = []
    for _ in range(12):
        got = claw.sample(8)
        assert got.observations.shape == (8, 4) and got.rewards.shape == (8, 1)
        rows = _rows(got)
        assert all((stored == row).all(1).any() for row in rows)
        served.append(got.observations.numpy())
    claw.close()
    # lineage: each sample (a quarter of a popped batch) is its own update, with its rows
    store = Store(redis_url, namespace)
    log = LineageLog(store)
    assert log.counts() == {str(v): 1 for v in range(1, 13)}
    for v, obs in enumerate(served, 1):
        (entry,) = log.trained(v)
        recorded = store.get(entry.ids, fields=["obs"])["obs"]
        assert np.array_equal(np.sort(recorded, axis=0), np.sort(obs, axis=0)), v


def test_sb3_defaults_size_themselves_from_the_bursts_of_samples(redis_url, namespace, workers):
    """No kwargs: a burst of 64 ``sample()`` calls between adds re-sizes the buffer as
    ``gradient_steps=64`` would (4 calls per prefetched batch of 4 x 8 rows, under a new
    recipe; the old one is unregistered); every sample is of stored transitions."""
    env = gym.make("CartPole-v1")
    spaces_ = (env.observation_space, env.action_space)
    ref = ReplayBuffer(1000, *spaces_, device="cpu", n_envs=2)
    claw = ClawReplayBuffer(
        1000, *spaces_, device="cpu", n_envs=2, namespace=namespace, redis_url=redis_url
    )
    tuned = plan_for(64)
    assert claw.batches_per_pop == 1 and tuned.parts == 4
    _rollout([ref, claw], 60)
    stored = _all_sb3_rows(ref, None)
    first = claw.recipe_name(8)
    for _ in range(64):  # one burst: grows while it lasts
        rows = _rows(claw.sample(8))
        assert all((stored == row).all(1).any() for row in rows)
    assert (claw.batches_per_pop, claw.readahead) == (tuned.parts, tuned.readahead)
    name = claw.recipe_name(8)
    assert name != first and claw.client.registry.get(first) is None
    assert claw.client.registry.get(name).recipe.batch_size == 8 * tuned.parts
    assert claw.client.registry.get(name).recipe.prefetch.depth == tuned.depth
    _rollout([ref, claw], 1)  # the burst ended: its size is kept
    assert claw.batches_per_pop == tuned.parts and claw.recipe_name(8) == name
    claw.close()
