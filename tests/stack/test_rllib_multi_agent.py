"""ClawMultiAgentEpisodeReplayBuffer against RLlib's own MultiAgentEpisodeReplayBuffer on the
same MultiAgentEpisode chunks: per module, the same n-step transitions (values, ids, n_step,
weights) and the same train batch keys and shapes out of multi-agent DQN's learner
connector; the joint-step records a joint recipe reads back aligned with the episodes; a
turn-based env's 1-step rows; recipe overrides per module; RLlib's multi-agent buffer
tests that apply, ported; what is not served raising. Over real Redis and Celery
workers; no Ray start. The lineage of RLlib samples: tests/stack/test_rllib_lineage.py."""

from __future__ import annotations

from collections import Counter, defaultdict

import gymnasium as gym
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
from ray.rllib.env.multi_agent_env import MultiAgentEnv
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import (
    MultiAgentEpisodeReplayBuffer,
)

from orchestrator import sample
from orchestrator.adapters.rllib import ClawMultiAgentEpisodeReplayBuffer

RECENT = {"sources": [{"name": "all", "sampler": {"kind": "recent"}}]}  # every stored row


def module_of(agent, episode=None, **kw) -> str:
    return f"p{agent}"


def ma_samples(env: MultiAgentEnv, seed: int, steps: int, chunk: int) -> list[list]:
    """What a one-env ``MultiAgentEnvRunner.sample()`` returns, call after call: the
    episodes that ended and the running one cut every ``chunk`` env steps; random actions."""
    rng = np.random.default_rng(seed)
    calls, out = [], []

    def reset() -> MultiAgentEpisode:
        eps = MultiAgentEpisode(
            observation_space=env.observation_spaces,
            action_space=env.action_spaces,
            agent_to_module_mapping_fn=module_of,
        )
        obs, infos = env.reset(seed=int(rng.integers(1 << 30)))
        eps.add_env_reset(observations=obs, infos=infos)
        return eps

    eps = reset()
    for t in range(1, steps + 1):
        actions = {a: int(rng.integers(2)) for a in eps.get_agents_to_act()}
        obs, rewards, terms, truncs, infos = env.step(actions)
        eps.add_env_step(obs, actions, rewards, infos, terminateds=terms, truncateds=truncs)
        if eps.is_done:
            out.append(eps.to_numpy())
            eps = reset()
        if t % chunk == 0 or t == steps:
            if eps.env_steps():
                running = eps
                eps = running.cut(len_lookback_buffer=1)  # as the EnvRunner cuts
                out.append(running.to_numpy())
            calls.append(out)
            out = []
    return calls


def _claw(redis_url: str, namespace: str, **kw) -> ClawMultiAgentEpisodeReplayBuffer:
    kw.setdefault("deterministic", True)
    kw.setdefault("timeout", 60)
    return ClawMultiAgentEpisodeReplayBuffer(
        kw.pop("capacity", 5000), namespace=namespace, redis_url=redis_url, **kw
    )


def _key(e) -> tuple[str, object, int]:
    return (e.multi_agent_episode_id, e.agent_id, e.t_started)


def _agent_steps(calls: list[list]) -> dict[tuple[str, object], list]:
    """Per (episode, agent): the agent's (obs, action, reward) by agent step, the obs after
    the last, and its flags; chunks joined."""
    got: dict[tuple[str, object], dict] = {}
    for call in calls:
        for ma in call:
            for aid, sa in ma.agent_episodes.items():
                n = len(sa)
                if not n:
                    continue
                rec = got.setdefault((ma.id_, aid), {"obs": [], "act": [], "rew": []})
                obs = np.asarray(sa.get_observations(slice(0, n + 1)))
                rec["obs"][sa.t_started :] = list(obs)
                rec["act"][sa.t_started :] = list(np.asarray(sa.get_actions(slice(0, n))))
                rec["rew"][sa.t_started :] = list(np.asarray(sa.get_rewards(slice(0, n))))
                rec["terminated"], rec["truncated"] = sa.is_terminated, sa.is_truncated
    return got


def _train_batch(episodes: list) -> dict:
    """Multi-agent DQN's learner connector over ``episodes`` (with the NEXT_OBS piece DQN's
    learner inserts): the tensors its loss reads, per module."""
    env = MultiAgentCartPole({"num_agents": 2})
    config = (
        DQNConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": 2})
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=module_of)
    )
    space = (env.observation_spaces[0], env.action_spaces[0])
    module = config.get_multi_rl_module_spec(spaces={"p0": space, "p1": space}).build()
    pipeline = config.build_learner_connector(input_observation_space=None, input_action_space=None)
    pipeline.insert_after(
        AddObservationsFromEpisodesToBatch, AddNextObservationsFromEpisodesToTrainBatch()
    )
    return pipeline(
        rl_module=module, batch={}, episodes=episodes, explore=False, shared_data={}, metrics=None
    )


@pytest.mark.parametrize("n_step", [1, 3])
def test_per_module_transitions_match_rllibs_buffer(redis_url, namespace, workers, n_step):
    """Two agents mapped to two modules, agents dying at different env steps, running
    episodes cut every 7 env steps: per module, every agent step once, each the n-step
    transition RLlib's buffer returns for it (a window cut at an agent's end: its m steps,
    which RLlib draws again instead), and the same train batch per module."""
    gamma = 0.9
    calls = ma_samples(MultiAgentCartPole({"num_agents": 2}), seed=1, steps=120, chunk=7)
    ref = MultiAgentEpisodeReplayBuffer(capacity=10_000)
    ref.rng = np.random.default_rng(0)
    claw = _claw(redis_url, namespace, recipe=RECENT)
    for call in calls:
        ref.add(call)
        claw.add(call)
    steps = _agent_steps(calls)
    assert any(len(v["act"]) for v in steps.values())
    per_module = defaultdict(int)
    for (_, aid), rec in steps.items():
        per_module[module_of(aid)] += len(rec["act"])
    assert set(claw.get_module_ids()) == set(ref.get_module_ids()) == {"p0", "p1"}
    assert claw.get_added_agent_timesteps() == ref.get_added_agent_timesteps()
    assert claw.get_added_timesteps() == ref.get_added_timesteps()
    ended_apart = {
        ma.id_
        for call in calls
        for ma in call
        if ma.is_done and len({len(sa) for sa in ma.agent_episodes.values()}) > 1
    }
    assert ended_apart, "some episode where one agent died before the other"
    for module, total in per_module.items():
        assert claw.get_num_timesteps(module) == total
        assert claw.get_added_timesteps(module) == ref.get_added_timesteps(module)
        got = claw.sample(total, n_step=n_step, gamma=gamma, modules_to_sample=[module])
        drawn = ref.sample(4000, n_step=n_step, gamma=gamma, modules_to_sample=[module])
        want = {_key(e): e for e in drawn}
        assert len(got) == total and len({_key(g) for g in got}) == total  # every step once
        assert {_key(g) for g in got} >= set(want)
        for g in got:
            assert g.module_id == module and type(g.agent_id) is int  # RLlib's ids, as given
            assert len(g) == 1 and set(g.extra_model_outputs) == {"n_step", "weights"}
            rec = steps[g.multi_agent_episode_id, g.agent_id]
            t, length = g.t_started, len(rec["act"])
            m = min(n_step, length - t)
            assert g.get_extra_model_outputs("n_step", 0) == m
            assert g.get_extra_model_outputs("weights", 0) == 1.0
            np.testing.assert_array_equal(g.get_observations(0), rec["obs"][t])
            np.testing.assert_array_equal(g.get_observations(-1), rec["obs"][t + m])
            assert g.get_actions(0) == rec["act"][t]
            reward = sum(gamma**k * rec["rew"][t + k] for k in range(m))
            np.testing.assert_allclose(g.get_rewards(0), reward, rtol=1e-6)
            assert g.is_terminated == (t + m == length and rec["terminated"])
            w = want.get(_key(g))
            if w is None:  # RLlib draws only windows that fit
                assert m < n_step
                continue
            np.testing.assert_array_equal(g.get_observations(0), w.get_observations(0))
            np.testing.assert_array_equal(g.get_observations(-1), w.get_observations(-1))
            assert g.get_actions(0) == w.get_actions(0)
            np.testing.assert_allclose(g.get_rewards(0), w.get_rewards(0), rtol=1e-6)
            assert g.is_terminated == w.is_terminated
            assert g.get_extra_model_outputs("n_step", 0) == w.get_extra_model_outputs("n_step", 0)
            assert (g.agent_id, g.module_id) == (w.agent_id, w.module_id)
    # Both modules in one sample, through multi-agent DQN's learner connector.
    got = claw.sample(16, n_step=n_step, gamma=gamma)
    theirs_eps = ref.sample(16, n_step=n_step, gamma=gamma)
    counts = {m: 16 for m in ("p0", "p1")}  # module after module (RLlib's order is a set's)
    assert dict(Counter(e.module_id for e in got)) == counts
    assert dict(Counter(e.module_id for e in theirs_eps)) == counts
    mine, theirs = _train_batch(got), _train_batch(theirs_eps)
    assert set(mine) == set(theirs) == {"p0", "p1"}
    for module in ("p0", "p1"):
        keys = {"obs", "new_obs", "actions", "rewards", "terminateds", "n_step", "weights"}
        assert set(mine[module]) == set(theirs[module]) >= keys
        for k, v in theirs[module].items():
            assert (mine[module][k].shape, mine[module][k].dtype) == (v.shape, v.dtype), k
    assert claw.get_sampled_timesteps("p0") == per_module["p0"] + 16
    claw.close()


def test_joint_recipes_read_the_episodes_joint_steps(redis_url, namespace, workers):
    """What the buffer wrote is Claw's joint-step layout: a joint recipe over the
    namespace returns one row per env timestep, each agent's slice its step at that
    timestep (absent agents masked), every joint step complete."""
    calls = ma_samples(MultiAgentCartPole({"num_agents": 2}), seed=2, steps=80, chunk=9)
    claw = _claw(redis_url, namespace)
    for call in calls:
        claw.add(call)
    claw.flush()
    by_t: dict[tuple[str, int], dict[str, tuple]] = defaultdict(dict)
    for call in calls:
        for ma in call:
            for aid, sa in ma.agent_episodes.items():
                for k in range(len(sa)):  # MultiAgentCartPole: every live agent acts each step
                    env_t = sa.t_started + k
                    by_t[ma.id_, env_t][str(aid)] = (sa.get_observations(k), sa.get_actions(k))
    recipe = {
        "name": "joint",
        "batch_size": len(by_t),
        "fields": ["obs", "action", "reward", "step_index", "episode_id"],
        "sources": [{"name": "all", "sampler": {"kind": "recent"}}],
        "joint": {"agents": ["0", "1"]},
    }
    batch = sample(namespace, recipe, redis_url=redis_url)
    assert batch.meta["joint"] == {"complete": len(by_t), "partial": 0}
    seen = set()
    for i in range(len(batch)):
        j = int(np.flatnonzero(batch["mask"][i])[0])
        key = (batch.meta["episode_id"][i][j].rsplit("/", 1)[0], int(batch["step_index"][i, j]))
        seen.add(key)
        for j, agent in enumerate(["0", "1"]):
            assert bool(batch["mask"][i, j]) == (agent in by_t[key])
            if agent in by_t[key]:
                obs, act = by_t[key][agent]
                np.testing.assert_array_equal(batch["obs"][i, j], obs)
                assert batch["action"][i, j] == act
    assert seen == set(by_t)
    claw.close()


class Turns(MultiAgentEnv):
    """``a`` acts at even env steps, ``b`` at odd ones, ``c`` joins at step 3 and acts
    at every step; the episode ends after 8 steps."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__()
        self.possible_agents = self.agents = ["a", "b", "c"]
        box = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
        self.observation_spaces = dict.fromkeys(self.possible_agents, box)
        self.action_spaces = dict.fromkeys(self.possible_agents, gym.spaces.Discrete(3))

    def _obs(self, agent: str) -> np.ndarray:
        return np.array([self.t, ord(agent)], np.float32)

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return {"a": self._obs("a")}, {}

    def step(self, actions):
        self.t += 1
        acting = ["a"] if self.t % 2 == 0 else ["b"]
        acting += ["c"] if self.t >= 3 else []
        rewards = {k: float(self.t) + 0.5 * ord(k) for k in actions}
        done = {"__all__": self.t >= 8}
        return {k: self._obs(k) for k in acting}, rewards, done, {"__all__": False}, {}


def test_a_turn_based_env_gives_exact_one_step_rows(redis_url, namespace, workers):
    """Agents that skip env steps, one joining late, running episodes cut mid-turn: every
    agent step is a 1-step row equal to RLlib's (n_step 3 gives 1-step rows for ``a`` and
    ``b``, whose env steps are not consecutive, and 3-step windows for ``c``)."""
    calls = ma_samples(Turns(), seed=3, steps=40, chunk=5)
    ref = MultiAgentEpisodeReplayBuffer(capacity=10_000)
    claw = _claw(redis_url, namespace, recipe=RECENT)
    for call in calls:
        ref.add(call)
        claw.add(call)
    steps = _agent_steps(calls)
    for module in ("pa", "pb", "pc"):
        total = sum(len(v["act"]) for (_, a), v in steps.items() if module_of(a) == module)
        got = claw.sample(total, n_step=1, gamma=0.5, modules_to_sample=[module])
        want = {_key(e): e for e in ref.sample(2000, n_step=1, modules_to_sample=[module])}
        assert {_key(g) for g in got} == set(want) and len(got) == total
        for g in got:
            w = want[_key(g)]
            np.testing.assert_array_equal(g.get_observations(0), w.get_observations(0))
            np.testing.assert_array_equal(g.get_observations(-1), w.get_observations(-1))
            assert g.get_actions(0) == w.get_actions(0)
            assert g.get_rewards(0) == pytest.approx(w.get_rewards(0))
            assert g.is_terminated == w.is_terminated
        rows = claw.sample(total, n_step=3, modules_to_sample=[module])
        m = {g.get_extra_model_outputs("n_step", 0) for g in rows}
        assert m == ({1} if module != "pc" else {1, 2, 3})
    claw.close()


def test_what_is_not_served_raises(redis_url, namespace, workers):
    calls = ma_samples(MultiAgentCartPole({"num_agents": 2}), seed=4, steps=20, chunk=10)
    claw = _claw(redis_url, namespace)
    claw.add(calls[0])
    with pytest.raises(NotImplementedError, match="joint recipe"):
        claw.sample(4, replay_mode="synchronized")
    with pytest.raises(KeyError, match="p9"):
        claw.sample(4, modules_to_sample=["p9"])
    with pytest.raises(TypeError, match="MultiAgentEpisode"):
        claw.add(calls[0][0].agent_episodes[0])
    claw.close()


@pytest.mark.slow
def test_multi_agent_dqn_trains_with_the_claw_buffer(redis_url, namespace, workers):
    """RLlib's multi-agent DQN (new API stack, two modules) on two-agent CartPole with
    ClawMultiAgentEpisodeReplayBuffer, 3,000 env steps: it trains both modules from the
    buffer, and the lineage log holds one entry of every update (both modules' rows)."""
    import ray
    import torch
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from claw_tasks.store import Store
    from orchestrator.delivery.lineage import LineageLog

    torch.set_num_threads(1)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        config = (
            DQNConfig()
            .environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=module_of)
            .env_runners(num_env_runners=0, rollout_fragment_length=16)
            .learners(num_learners=0)
            .training(
                train_batch_size_per_learner=32,
                n_step=3,
                num_steps_sampled_before_learning_starts=500,
                training_intensity=4,
                replay_buffer_config={
                    "type": "orchestrator.adapters.rllib.ClawMultiAgentEpisodeReplayBuffer",
                    "capacity": 20_000,
                    "namespace": namespace,
                    "redis_url": redis_url,
                    "timeout": 120,
                },
            )
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32], head_fcnet_hiddens=[32]))
            .reporting(min_sample_timesteps_per_iteration=500)
            .debugging(seed=0)
        )
        algo = config.build_algo()
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, ClawMultiAgentEpisodeReplayBuffer)
        steps = 0
        while steps < 3000:
            res = algo.train()
            steps = int(res["env_runners"]["num_env_steps_sampled_lifetime"])
        trained = res["learners"]
        assert {"p0", "p1"} <= set(trained)
        assert set(buffer.get_module_ids()) == {"p0", "p1"} and buffer.updates > 0
        updates = buffer.updates
        buffer.close()
        algo.stop()
    finally:
        ray.shutdown()
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {str(v): 1 for v in range(1, updates + 1)}


# ---- RLlib's multi-agent buffer tests, ported (test_multi_agent_episode_buffer.py) -------
def counting_episode(length: int, id_: str, rng: np.random.Generator) -> MultiAgentEpisode:
    """RLlib's test episode: two agents on two modules, observation t, action t, reward
    0.1 (t + 1) after obs t; ending terminated, truncated or neither at random."""
    agents = ("agent_1", "agent_2")
    eps = MultiAgentEpisode(
        id_=id_,
        observations=[dict.fromkeys(agents, 0.0)],
        infos=[{a: {} for a in agents}],
        agent_module_ids={"agent_1": "module_1", "agent_2": "module_2"},
    )
    for t in range(length):
        eps.add_env_step(
            observations=dict.fromkeys(agents, float(t + 1)),
            actions=dict.fromkeys(agents, int(t)),
            rewards=dict.fromkeys(agents, 0.1 * (t + 1)),
            infos={a: {} for a in agents},
        )
    eps.is_terminated = bool(rng.random() > 0.5)
    eps.is_truncated = False if eps.is_terminated else bool(rng.random() > 0.8)
    return eps


def test_ported_independent_sample_logic(redis_url, namespace, workers):
    """test_buffer_independent_sample_logic on the prefetched path: 30 episodes of up to 60
    steps (RLlib's: 200 of up to 200) and 50 samples (1,000): both modules in every sample,
    16 rows each, the sampled-timestep counters per module, and RLlib's relations (action =
    obs, next_obs = obs + 1, reward = next_obs / 10, weights 1, n_step 1)."""
    rng = np.random.default_rng(0)
    buf = _claw(redis_url, namespace, capacity=10_000, deterministic=False)
    buf.add([counting_episode(int(rng.integers(1, 60)), f"e{i}", rng) for i in range(30)])
    for i in range(50):
        sample = buf.sample(batch_size_B=16, n_step=1)
        assert buf.get_sampled_timesteps() == 16 * (i + 1)
        assert Counter(e.module_id for e in sample) == {"module_1": 16, "module_2": 16}
        assert buf.get_sampled_timesteps("module_1") == 16 * (i + 1)
        assert buf.get_sampled_timesteps("module_2") == 16 * (i + 1)
        for eps in sample:
            obs, nxt = eps.get_observations(0), eps.get_observations(-1)
            assert not (eps.is_terminated and eps.is_truncated)
            assert eps.get_actions(-1) == pytest.approx(obs)
            assert nxt == pytest.approx(obs + 1)
            assert eps.get_rewards(-1) * 10 == pytest.approx(nxt)
            assert eps.get_extra_model_outputs("weights", -1) == 1.0
            assert eps.get_extra_model_outputs("n_step", -1) == 1
            assert eps.agent_id == {"module_1": "agent_1", "module_2": "agent_2"}[eps.module_id]
    buf.close()


def test_ported_counts_and_state_round_trip(redis_url, namespace, workers):
    """test_add_and_eviction_logic's counts while nothing is evicted (RLlib evicts whole
    episodes; Claw's ring evicts records: test_rllib.py covers it for one agent), and
    test_get_state_and_set_state: a restored buffer has the module counters and the agents'
    ids, and samples what was added before."""
    rng = np.random.default_rng(1)
    buf = _claw(redis_url, namespace, capacity=1000, recipe=RECENT)
    for id_, length, steps in (("A", 50, 50), ("B", 25, 75), ("C", 25, 100)):
        buf.add(counting_episode(length, id_, rng))
        assert buf.get_num_episodes() == "ABC".index(id_) + 1
        assert buf.get_num_agent_timesteps() == buf.get_added_agent_timesteps() == 2 * steps
        assert buf.get_added_timesteps() == steps
        for module in buf.get_module_ids():
            assert buf.get_num_episodes(module) == "ABC".index(id_) + 1
            assert buf.get_num_timesteps(module) == buf.get_added_timesteps(module) == steps
    buf.sample(8)
    state = buf.get_state()
    buf.close()
    fresh = ClawMultiAgentEpisodeReplayBuffer(10)
    fresh.set_state(state)
    assert fresh.namespace == namespace and fresh.get_module_ids() == ["module_1", "module_2"]
    assert fresh.get_sampled_timesteps("module_1") == 8 and fresh.updates == 1
    assert fresh.get_added_agent_timesteps() == 200
    rows = fresh.sample(100, modules_to_sample=["module_2"])
    assert {e.agent_id for e in rows} == {"agent_2"}
    assert {(e.multi_agent_episode_id, e.t_started) for e in rows} == {
        (i, t) for i, n in (("A", 50), ("B", 25), ("C", 25)) for t in range(n)
    }
    fresh.close()


def test_recipe_overrides_apply_to_every_module(redis_url, namespace, workers):
    """A ``recipe`` override's sources (a string where, a mapping where with a param) are
    repeated per module, each keeping its filter: every row matches, both modules get
    their rows, and the override's params are left as given."""
    rng = np.random.default_rng(6)
    params = {"late": 10}
    recipe = {
        "sources": [
            {"name": "late", "where": "tags.rllib_t >= $late", "weight": 3},
            {"name": "early", "where": {"tags.rllib_t": {"lt": 5}}, "weight": 1},
        ],
        "params": params,
    }
    buf = _claw(redis_url, namespace, recipe=recipe)
    buf.add([counting_episode(30, f"o{i}", rng) for i in range(4)])
    rows = buf.sample(16, n_step=1)
    assert Counter(e.module_id for e in rows) == {"module_1": 16, "module_2": 16}
    for module in ("module_1", "module_2"):
        mine = [e.t_started for e in rows if e.module_id == module]
        assert sum(t >= 10 for t in mine) == 12 and sum(t < 5 for t in mine) == 4
    assert params == {"late": 10}
    buf.close()
