"""ClawEpisodeReplayBuffer against RLlib's own EpisodeReplayBuffer (new API stack): the same
episodes give the same n-step transitions, keys and train batch; RLlib's buffer tests that
apply, ported (docs/adapters.md lists which and why not the others); get_state/set_state
through a checkpoint file; over real Redis and Celery workers. No test here starts Ray:
the buffers never need it, and a Ray start costs more than these tests together. The
DQN learning run is `-m slow`."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import gymnasium as gym
import msgpack
import numpy as np
import pytest

pytest.importorskip("ray.rllib", reason="ray[rllib] is not installed (pip install -e '.[rllib]')")

from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.connectors.common.add_observations_from_episodes_to_batch import (
    AddObservationsFromEpisodesToBatch,
)
from ray.rllib.connectors.learner.add_next_observations_from_episodes_to_train_batch import (
    AddNextObservationsFromEpisodesToTrainBatch,
)
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import (
    EpisodeReplayBuffer,
)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import (
    PrioritizedEpisodeReplayBuffer,
)

from claw_tasks.settings import use_settings
from claw_tasks.store import Store
from orchestrator.adapters.rllib import (
    ClawEpisodeReplayBuffer,
    ClawPrioritizedEpisodeReplayBuffer,
)
from orchestrator.delivery.lineage import LineageLog

RECENT = {"sources": [{"name": "all", "sampler": {"kind": "recent"}}]}  # every stored row


def cartpole_samples(seed: int, steps: int, chunk: int, limit: int) -> list[list]:
    """What a one-env ``SingleAgentEnvRunner.sample()`` returns, call after call: the
    episodes that ended, and the running one cut every ``chunk`` steps (its next chunk
    has the same ``id_``); random actions, episodes truncated at ``limit`` steps."""
    env = gym.make("CartPole-v1", max_episode_steps=limit)
    env.action_space.seed(seed)
    calls, out = [], []

    def reset() -> SingleAgentEpisode:
        eps = SingleAgentEpisode(
            observation_space=env.observation_space, action_space=env.action_space
        )
        obs, info = env.reset(seed=seed + len(calls) + len(out))
        eps.add_env_reset(obs, info)
        return eps

    eps = reset()
    for t in range(1, steps + 1):
        a = env.action_space.sample()
        obs, r, term, trunc, info = env.step(a)
        eps.add_env_step(obs, a, r, info, terminated=term, truncated=trunc)
        if term or trunc:
            out.append(eps.to_numpy())
            eps = reset()
        if t % chunk == 0 or t == steps:
            if len(eps):
                running = eps
                eps = running.cut()
                out.append(running.to_numpy())
            calls.append(out)
            out = []
    return calls


def _claw(redis_url: str, namespace: str, cls=ClawEpisodeReplayBuffer, **kw):
    kw.setdefault("deterministic", True)
    kw.setdefault("timeout", 60)
    return cls(kw.pop("capacity", 1000), namespace=namespace, redis_url=redis_url, **kw)


def _by_key(episodes: list[SingleAgentEpisode]) -> dict[tuple[str, int], SingleAgentEpisode]:
    return {(e.id_, e.t_started): e for e in episodes}


def _lengths(calls: list[list]) -> dict[str, int]:
    """Steps stored per episode id after all the calls."""
    n: dict[str, int] = {}
    for call in calls:
        for eps in call:
            n[eps.id_] = n.get(eps.id_, 0) + len(eps)
    return n


def _train_batch(config: DQNConfig, episodes: list[SingleAgentEpisode]) -> dict:
    """DQN's learner connector over ``episodes`` (with the NEXT_OBS piece DQN's learner
    inserts): the tensors its loss reads."""
    env = gym.make("CartPole-v1")
    module = config.get_multi_rl_module_spec(env=env).build()
    pipeline = config.build_learner_connector(
        input_observation_space=env.observation_space, input_action_space=env.action_space
    )
    pipeline.insert_after(
        AddObservationsFromEpisodesToBatch, AddNextObservationsFromEpisodesToTrainBatch()
    )
    batch = pipeline(
        rl_module=module, batch={}, episodes=episodes, explore=False, shared_data={}, metrics=None
    )
    return batch["default_policy"]


@pytest.mark.parametrize("n_step", [1, 3])
def test_transitions_keys_and_shapes_match_rllibs_buffer(redis_url, namespace, workers, n_step):
    """Every n-step transition of the same episodes (chunks of running episodes joined by
    id, episodes ending terminated and truncated), as both buffers return them."""
    gamma = 0.9
    calls = cartpole_samples(seed=1, steps=90, chunk=7, limit=20)
    ref = EpisodeReplayBuffer(capacity=1000)
    ref.rng = np.random.default_rng(0)
    claw = _claw(redis_url, namespace, recipe=RECENT)
    for call in calls:
        ref.add(call)
        claw.add(call)
    total = sum(_lengths(calls).values())
    assert len(claw) == len(ref) == total
    got = claw.sample(num_items=total, n_step=n_step, gamma=gamma, sample_episodes=True)
    drawn = ref.sample(num_items=4000, n_step=n_step, gamma=gamma, sample_episodes=True)
    want = _by_key(drawn)
    assert len(got) == total and set(_by_key(got)) == set(want)  # every step, once
    ended = {e.id_ for call in calls for e in call if e.is_done}
    terminated = {e.id_ for call in calls for e in call if e.is_terminated}
    truncated = {e.id_ for call in calls for e in call if e.is_truncated}
    assert any(e.is_terminated for call in calls for e in call)
    assert any(e.is_truncated for call in calls for e in call)
    lengths = _lengths(calls)
    for g in got:
        w = want[(g.id_, g.t_started)]
        assert len(g) == len(w) == 1
        np.testing.assert_array_equal(g.get_observations(0), w.get_observations(0))
        np.testing.assert_array_equal(g.get_observations(-1), w.get_observations(-1))
        assert g.get_actions(0) == w.get_actions(0)
        np.testing.assert_allclose(g.get_rewards(0), w.get_rewards(0), rtol=1e-6)
        m = min(n_step, lengths[g.id_] - g.t_started)  # the window, cut at the stored end
        if g.t_started + n_step > lengths[g.id_]:  # cut at the end: RLlib's slice drops
            assert g.is_terminated == (g.id_ in terminated)  # the flags (ts + n > len)
            assert g.is_truncated == (g.id_ in truncated)
        else:  # a window ending exactly on a truncated end keeps the flag, as RLlib's;
            assert g.is_terminated == w.is_terminated  # a running episode's last stored
            assert g.is_truncated == w.is_truncated  # steps are not truncated
        assert g.get_extra_model_outputs("n_step", 0) == m
        assert w.get_extra_model_outputs("n_step", 0) == n_step  # RLlib's: n even when cut
        assert g.get_extra_model_outputs("weights", 0) == w.get_extra_model_outputs("weights", 0)
        assert set(g.extra_model_outputs) == set(w.extra_model_outputs) == {"n_step", "weights"}
        if m < n_step and g.id_ in ended:
            assert g.is_terminated or g.is_truncated
    config = DQNConfig().environment("CartPole-v1")
    pairs = [want[(g.id_, g.t_started)] for g in got[:8]]  # before: the connector renames
    mine = _train_batch(config, got[:8])
    theirs = _train_batch(config, pairs)
    assert (
        set(mine)
        == set(theirs)
        >= {
            "obs",
            "new_obs",
            "actions",
            "rewards",
            "terminateds",
            "truncateds",
            "n_step",
            "weights",
        }
    )
    for k in theirs:
        assert (mine[k].shape, mine[k].dtype) == (theirs[k].shape, theirs[k].dtype), k
    np.testing.assert_allclose(mine["new_obs"].numpy(), theirs["new_obs"].numpy())
    claw.close()


# ---- RLlib's buffer tests, ported (rllib/utils/replay_buffers/tests/) ------------------
def counting_episode(length: int, id_: str, rng: np.random.Generator) -> SingleAgentEpisode:
    """RLlib's test episode: observation t, action t, reward 0.1 t after obs t; ending
    terminated, truncated or neither (a running episode's chunk) at random."""
    eps = SingleAgentEpisode(id_=id_, observations=[0.0], infos=[{}])
    for t in range(length):
        eps.add_env_step(observation=float(t + 1), action=int(t), reward=0.1 * (t + 1), infos={})
    eps.is_terminated = bool(rng.random() > 0.5)
    eps.is_truncated = False if eps.is_terminated else bool(rng.random() > 0.8)
    return eps


@pytest.mark.parametrize("cls", [ClawEpisodeReplayBuffer, ClawPrioritizedEpisodeReplayBuffer])
def test_ported_buffer_sample_logic_1_and_3_step(redis_url, namespace, workers, cls):
    """test_prioritized_episode_buffer.py's test_buffer_sample_logic(_with_3_step), on the
    prefetched path: 30 episodes of up to 40 steps and 20 samples (RLlib's: 200 x 200 and
    1000). A 3-step window cut at an episode's end reports its m steps, so the relations
    hold with m: next_obs = obs + m, the reward the discounted sum of m rewards."""
    rng = np.random.default_rng(0)
    buf = _claw(redis_url, namespace, cls, capacity=10_000, deterministic=False)
    buf.add([counting_episode(int(rng.integers(1, 40)), f"e{i}", rng) for i in range(30)])
    for n_step in (1, 3):
        for _ in range(20):
            before = buf.get_sampled_timesteps()
            sample = buf.sample(batch_size_B=16, n_step=n_step, gamma=0.99, beta=0.0)
            assert len(sample) == 16 and buf.get_sampled_timesteps() == before + 16
            for eps in sample:
                obs, nxt = eps.get_observations(0), eps.get_observations(-1)
                m = eps.get_extra_model_outputs("n_step", -1)
                assert not (eps.is_terminated and eps.is_truncated)
                assert eps.get_actions(-1) == pytest.approx(obs)
                assert 1 <= m <= n_step and nxt == pytest.approx(obs + m)
                want = sum(0.99**k * 0.1 * (obs + 1 + k) for k in range(m))
                assert eps.get_rewards(-1) == pytest.approx(want, rel=1e-6)
                assert eps.get_extra_model_outputs("weights", -1) == pytest.approx(1.0)
    buf.close()


def test_ported_random_n_step(redis_url, namespace, workers):
    """test_buffer_sample_logic_with_random_n_step: n_step=(1, 5) gives each row an n in
    1..4, varying within the batch (here the rows are split evenly over the four n's), and
    each row's next_obs and reward are those of its own window."""
    rng = np.random.default_rng(4)
    buf = _claw(redis_url, namespace, ClawPrioritizedEpisodeReplayBuffer, capacity=10_000)
    buf.add([counting_episode(int(rng.integers(10, 40)), f"r{i}", rng) for i in range(20)])
    for _ in range(5):
        sample = buf.sample(batch_size_B=16, n_step=(1, 5), gamma=0.99)
        assert len(sample) == 16
        n_steps = [eps.get_extra_model_outputs("n_step", -1) for eps in sample]
        assert set(n_steps) <= {1, 2, 3, 4} and np.var(n_steps) > 0
        for eps, m in zip(sample, n_steps, strict=True):
            obs = eps.get_observations(0)
            assert eps.get_observations(-1) == pytest.approx(obs + m)
            want = sum(0.99**k * 0.1 * (obs + 1 + k) for k in range(m))
            assert eps.get_rewards(-1) == pytest.approx(want, rel=1e-6)
    buf.update_priorities(np.full(16, 0.3))  # one update for the rows of all four n's
    buf.close()


def test_ported_what_is_not_served_raises(redis_url, namespace, workers):
    """test_buffer_sample_logic_with_infos_and_extra_model_output and
    test_episode_replay_buffer_sample_logic (B x T sequences) do not apply: each of those
    requests raises, saying so, instead of returning something else."""
    rng = np.random.default_rng(1)
    buf = _claw(redis_url, namespace)
    buf.add([counting_episode(20, "a", rng)])
    asks = [
        {"n_step": 1, "include_infos": True},
        {"n_step": 1, "include_extra_model_outputs": True},
        {"batch_length_T": 64, "n_step": 1},
        {"sample_episodes": False},
    ]
    for ask in asks:
        with pytest.raises(NotImplementedError):
            buf.sample(batch_size_B=4, **ask)
    buf.close()


def test_ported_update_priorities(redis_url, namespace, workers):
    """test_update_priorities: one 10-step episode; one step's priority made far above the
    others' draws it in > 80 % of the rows (alpha 1). RLlib's test picks segment-tree
    slots; here the rows of a sample are updated by their step (t_started). A mismatched
    update raises."""
    rng = np.random.default_rng(2)
    buf = _claw(redis_url, namespace, ClawPrioritizedEpisodeReplayBuffer, capacity=10)
    buf.add(counting_episode(10, "p", rng))
    sample = buf.sample(200, n_step=1, beta=0.0)
    assert {e.t_started for e in sample} == set(range(10))
    high = float(rng.random()) + 0.2
    buf.update_priorities(np.array([high if e.t_started == 1 else 0.01 for e in sample]))
    for _ in range(3):
        sample = buf.sample(1000, n_step=1, beta=0.0)
        assert np.mean([e.t_started == 1 for e in sample]) > 0.8
    buf.update_priorities(np.full(1000, 0.5))
    buf.sample(16, n_step=1)
    with pytest.raises(ValueError, match="16 rows"):
        buf.update_priorities(np.ones(15))
    buf.close()


def test_ported_add_and_eviction_keeps_the_newest_steps(redis_url, namespace, workers):
    """test_add_and_eviction_logic, adapted: RLlib evicts whole episodes (A's 50 steps go
    when D's one comes: 51 left); Claw's ring evicts the oldest steps, so ``capacity``
    steps stay (A's first step goes)."""
    rng = np.random.default_rng(3)
    buf = _claw(redis_url, namespace, capacity=100, recipe=RECENT)
    for id_, length, steps in (("A", 50, 50), ("B", 25, 75), ("C", 25, 100)):
        buf.add(counting_episode(length, id_, rng))
        assert buf.get_num_timesteps() == steps
        assert buf.get_num_episodes() == "ABC".index(id_) + 1
    buf.add(counting_episode(1, "D", rng))
    assert buf.get_num_timesteps() == 100 and buf.get_added_timesteps() == 101
    rows = buf.sample(99, n_step=1)  # the newest 99 steps: all but A's second
    kept = {(e.id_, e.t_started) for e in rows}
    assert ("D", 0) in kept and ("A", 0) not in kept and ("A", 1) not in kept
    assert {(i, t) for i, t in kept if i == "A"} == {("A", t) for t in range(2, 50)}
    buf.close()


def test_state_round_trip_through_a_checkpoint_restores_the_buffer(
    redis_url, namespace, workers, r, monkeypatch, tmp_path
):
    """get_state -> a checkpoint file -> set_state on a new buffer: the same namespace,
    counters and settings; no data and no password in the file; the restored buffer
    samples what was added before and joins the next chunk of a running episode to it."""
    parts = urlsplit(redis_url)
    r.execute_command("ACL", "SETUSER", "rllib", "on", ">s3cret-pw", "~*", "&*", "+@all")
    url = f"redis://rllib:s3cret-pw@{parts.hostname}:{parts.port}/0"
    monkeypatch.setenv("CLAW_REDIS_URL", url)
    use_settings()
    first = SingleAgentEpisode(id_="run", observations=[0.0])  # a running episode
    for t in range(50):
        first.add_env_step(observation=float(t + 1), action=t, reward=1.0)
    second = first.cut()  # its next chunk: same id_, t_started 50
    for t in range(50, 60):
        second.add_env_step(observation=float(t + 1), action=t, reward=1.0)
    buf = _claw(redis_url=url, namespace=namespace, seed=7, recipe=RECENT)
    buf.add(first)
    assert len(buf.sample(8, n_step=3)) == 8
    state = buf.get_state()
    blob = msgpack.packb(state)  # as a Checkpointable writes it (or pickles it)
    assert b"s3cret-pw" not in blob and "s3cret-pw" not in json.dumps(state)
    assert len(blob) < 2048  # settings, not 50 steps of data
    (tmp_path / "replay_buffer.msgpack").write_bytes(blob)
    buf.close()

    fresh = ClawEpisodeReplayBuffer(50)  # another namespace until set_state
    assert fresh.namespace != namespace
    fresh.set_state(msgpack.unpackb((tmp_path / "replay_buffer.msgpack").read_bytes()))
    assert (fresh.namespace, fresh.seed, fresh.capacity) == (namespace, 7, 1000)
    assert fresh.get_num_timesteps() == buf.get_num_timesteps() == 50
    assert fresh.get_added_timesteps() == 50 and fresh.get_sampled_timesteps() == 8
    assert fresh.client.store.r.connection_pool.connection_kwargs["password"] == "s3cret-pw"
    fresh.add(second)  # from the restored buffer
    rows = _by_key(fresh.sample(60, n_step=3))
    assert set(rows) == {("run", t) for t in range(60)}  # before and after the restore
    across = rows[("run", 49)]  # its window runs into the chunk added after the restore
    assert across.get_extra_model_outputs("n_step", 0) == 3
    assert across.get_observations(-1) == 52.0 and not across.is_truncated
    with pytest.raises(ValueError, match="not a Claw buffer's state"):
        fresh.set_state(PrioritizedEpisodeReplayBuffer(capacity=10).get_state())
    fresh.close()


def test_the_algorithms_seed_makes_deterministic_samples_repeat(redis_url, namespace, workers):
    """RLlib seeds numpy's global state before it builds the buffer: that seed is the
    buffer's, and two deterministic buffers of one seed draw the same rows."""
    rng = np.random.default_rng(5)
    seeds, rows = [], []
    for _ in range(2):
        np.random.seed(11)  # what debugging(seed=11) does first
        buf = _claw(redis_url, namespace)
        if not rows:
            buf.add([counting_episode(30, f"s{i}", rng) for i in range(3)])
        seeds.append(buf.seed)
        rows.append([(e.id_, e.t_started) for e in buf.sample(64, n_step=3)])
        buf.close()
    np.random.seed(12)
    other = _claw(redis_url, namespace)
    assert seeds[0] == seeds[1] != other.seed
    assert rows[0] == rows[1] and len(set(rows[0])) > 20
    other.close()


@pytest.mark.slow
def test_dqn_learns_cartpole_with_the_claw_buffer(redis_url, namespace, workers):
    """RLlib's DQN (new API stack, seed 0) on CartPole-v1 with ClawEpisodeReplayBuffer, the
    config of bench/rllib_dqn.py, 10,000 env steps: the mean return of the last 20
    episodes passes 150 (a random policy's is ~22; RLlib's own buffer passed 200 by then in
    the bench's run). It stops once it passes: 154 s at load 13 on 2 cores (Ray starts here)."""
    import ray
    import torch
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    torch.set_num_threads(1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        config = (
            DQNConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=16)
            .learners(num_learners=0)
            .training(
                lr=1e-3,
                gamma=0.99,
                train_batch_size_per_learner=64,
                n_step=3,
                target_network_update_freq=500,
                num_steps_sampled_before_learning_starts=1000,
                training_intensity=16,
                epsilon=[(0, 1.0), (10_000, 0.02)],
                replay_buffer_config={
                    "type": "orchestrator.adapters.rllib.ClawEpisodeReplayBuffer",
                    "capacity": 50_000,
                    "namespace": namespace,
                    "redis_url": redis_url,
                    "timeout": 120,
                },
            )
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64], head_fcnet_hiddens=[64]))
            .reporting(
                min_sample_timesteps_per_iteration=1000, metrics_num_episodes_for_smoothing=20
            )
            .debugging(seed=0)
        )
        algo = config.build_algo()
        assert isinstance(algo.local_replay_buffer, ClawEpisodeReplayBuffer)
        steps, best = 0, 0.0
        while steps < 10_000 and best < 150:
            res = algo.train()["env_runners"]
            steps = int(res["num_env_steps_sampled_lifetime"])
            best = max(best, float(res.get("episode_return_mean", 0.0)))
        buffer = algo.local_replay_buffer
        assert buffer.namespace == namespace and buffer.sampled_timesteps > 0
        updates = buffer.updates
        buffer.close()
        algo.stop()
    finally:
        ray.shutdown()
    assert best >= 150, (steps, best)
    # lineage without a line of the user's: one entry of 64 rows per learner update
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {str(v): 1 for v in range(1, updates + 1)}
    assert {e.rows for e in log.entries()} == {64}
