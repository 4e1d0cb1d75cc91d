"""ClawRolloutBuffer against SB3's own RolloutBuffer, over real Redis and Celery workers:
GAE and returns of the workers equal SB3's on segments mixing terminated, truncated (SB3's
timeout bootstrap) and running episodes of several envs; every epoch holds each step
once; SB3's own rollout-buffer tests (tests/test_buffers.py: devices, dtypes, the
rollout_buffer_class checks; tests/test_gae.py: the GAE callback, the infinite horizon)
with the Claw buffer substituted; A2C and PPO train as with SB3's buffer; PPO on
CartPole-v1 with the rl-zoo hyperparameters (slow)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.utils import get_device

from claw_tasks.store import Store
from claw_tasks.worker import context
from orchestrator.adapters.sb3 import ClawDictRolloutBuffer, ClawRolloutBuffer
from orchestrator.delivery.lineage import LineageLog

TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny networks: more threads only spin against the workers (10x slower here)."""
    before = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(before)


def _kw(redis_url: str, namespace: str, **kw) -> dict:
    return {"namespace": namespace, "redis_url": redis_url, "timeout": 60, **kw}


# ---- GAE and returns: the workers' numbers are SB3's ----------------------------------
class Collect:
    """SB3's collect loop, by hand: random rewards, values and log-probs; episodes end
    terminated or truncated at random (a truncated step's reward gets SB3's bootstrap
    ``gamma * V(final obs)``, as ``collect_rollouts`` adds it); obs = (t, env, rollout)."""

    def __init__(self, n_envs: int, gamma: float, seed: int = 0) -> None:
        self.n, self.gamma = n_envs, gamma
        self.rng = np.random.default_rng(seed)
        self.starts = np.ones(n_envs, bool)
        self.ends = {"terminated": 0, "truncated": 0}

    def rollout(self, buffers: list, n_steps: int, k: int) -> None:
        rng, n = self.rng, self.n
        for b in buffers:
            b.reset()
        for t in range(n_steps):
            obs = np.stack([np.full(n, t), np.arange(n), np.full(n, k), rng.normal(size=n)], 1)
            action = rng.integers(0, 2, n)
            value = th.tensor(rng.normal(size=(n, 1)), dtype=th.float32)
            log_prob = th.tensor(-rng.random(n), dtype=th.float32)
            u = rng.random(n)
            term, trunc = u < 0.07, (u >= 0.07) & (u < 0.13)
            reward = rng.normal(size=n).astype(np.float32)
            reward[trunc] += self.gamma * rng.normal(size=int(trunc.sum())).astype(np.float32)
            for b in buffers:
                b.add(obs.astype(np.float32), action, reward, self.starts, value, log_prob)
            self.starts = term | trunc
            self.ends["terminated"] += int(term.sum())
            self.ends["truncated"] += int(trunc.sum())
        last = th.tensor(rng.normal(size=(n, 1)), dtype=th.float32)
        for b in buffers:
            b.compute_returns_and_advantage(last_values=last, dones=self.starts)


def _served(buf: ClawRolloutBuffer, batch_size: int) -> dict[str, np.ndarray]:
    """One epoch's minibatches, concatenated, with each row's (t, env) from its obs."""
    parts = list(buf.get(batch_size))
    assert all(len(p.observations) == batch_size for p in parts)
    out = {
        name: np.concatenate([getattr(p, name).numpy() for p in parts])
        for name in (
            "observations",
            "actions",
            "old_values",
            "old_log_prob",
            "advantages",
            "returns",
        )
    }
    out["t"] = out["observations"][:, 0].astype(int)
    out["env"] = out["observations"][:, 1].astype(int)
    return out


def _pair(n_steps: int, n_envs: int, gamma: float, **kw):
    """SB3's RolloutBuffer and a ClawRolloutBuffer (``kw``) of the same shape, 4-d Box
    observations and 2 discrete actions, GAE lambda 0.9."""
    space, act = spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2)
    ref = RolloutBuffer(n_steps, space, act, "cpu", gae_lambda=0.9, gamma=gamma, n_envs=n_envs)
    return ref, ClawRolloutBuffer(n_steps, space, act, "cpu", 0.9, gamma, n_envs, **kw)


@pytest.mark.parametrize("write_every", [None, 5])  # one message a rollout, or four
@pytest.mark.parametrize("form_here", [True, False], ids=["formed-here", "by-workers"])
def test_gae_and_returns_equal_sb3_with_terminated_truncated_and_running_episodes(
    redis_url, namespace, workers, write_every, form_here
):
    n_steps, n_envs, gamma = 16, 4, 0.97
    ref, claw = _pair(n_steps, n_envs, gamma, write_every=write_every, form_here=form_here,
                      **_kw(redis_url, namespace))  # fmt: skip
    collect = Collect(n_envs, gamma)
    running = 0
    for k in range(3):  # episodes run across rollouts: segments cut inside them
        collect.rollout([ref, claw], n_steps, k)
        running += int((~collect.starts).sum())
        np.testing.assert_array_equal(claw.advantages, ref.advantages)  # SB3's code, here
        np.testing.assert_array_equal(claw.returns, ref.returns)
        orders = []
        for _ in range(3):  # PPO's epochs: each step once per epoch, in a new order
            got = _served(claw, batch_size=16)
            pos = got["t"] * n_envs + got["env"]
            assert sorted(pos) == list(range(n_steps * n_envs))
            orders.append(pos)
            t, e = got["t"], got["env"]
            assert (got["observations"][:, 2] == k).all()  # this rollout's steps only
            np.testing.assert_allclose(got["advantages"], ref.advantages[t, e], **TOL)
            np.testing.assert_allclose(got["returns"], ref.returns[t, e], **TOL)
            np.testing.assert_array_equal(got["old_values"], ref.values[t, e])
            np.testing.assert_array_equal(got["old_log_prob"], ref.log_probs[t, e])
            np.testing.assert_array_equal(got["actions"][:, 0], ref.actions[t, e, 0])
        assert len({tuple(o) for o in orders}) == 3
    assert collect.ends["terminated"] > 3 and collect.ends["truncated"] > 3 and running > 0
    st = claw.client.stats(claw.recipe_name)[claw.recipe_name]["rollout"]
    assert (st["rollouts"], st["dropped_stale"], st["lost"]) == (3, 0, 0)
    claw.close()


def test_a_rollout_of_one_message_is_formed_in_the_learners_process(redis_url, namespace):
    """With ``form_here=True`` (an opt-in) the rollout's last message is committed and the
    rollout formed and served in the learner's process with the workers' own code: no
    worker runs here, yet each rollout is served with SB3's advantages, recorded in the
    lineage log once, counted as a worker's fill counts it."""
    n_steps, n_envs, gamma = 16, 4, 0.97
    ref, claw = _pair(n_steps, n_envs, gamma, **_kw(redis_url, namespace, timeout=5),
                      form_here=True)  # fmt: skip
    collect = Collect(n_envs, gamma)
    for k in range(2):
        collect.rollout([ref, claw], n_steps, k)
        got = _served(claw, batch_size=32)
        t, e = got["t"], got["env"]
        assert sorted(t * n_envs + e) == list(range(n_steps * n_envs))
        assert (got["observations"][:, 2] == k).all()
        np.testing.assert_allclose(got["advantages"], ref.advantages[t, e], **TOL)
        np.testing.assert_allclose(got["returns"], ref.returns[t, e], **TOL)
    claw.writer.wait(10)  # the fill's state is recorded by the writer thread
    st = claw.client.stats(claw.recipe_name)[claw.recipe_name]
    assert (st["rollout"]["rollouts"], st["rollout"]["lost"]) == (2, 0)
    assert st["state"].startswith("rollout 2 of policy_version 1")
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {"1": 1, "2": 1} and {e.rows for e in log.entries()} == {64}
    held = lambda: {key[-2] for key in context.contexts}  # noqa: E731
    assert namespace in held()  # forming here attached the namespace's index in this process
    claw.close()
    assert namespace not in held()  # and close() lets it go


def test_a_reused_namespace_serves_each_buffer_its_own_steps(redis_url, namespace, workers):
    """A later run on the same namespace (or two at once) writes the same policy versions:
    each buffer's recipe takes only the steps it wrote; a namespace too small is refused."""
    space, act = spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2)
    bufs = [
        ClawRolloutBuffer(8, space, act, "cpu", 0.9, 0.99, 2, **_kw(redis_url, namespace))
        for _ in range(2)
    ]
    for k, buf in enumerate(bufs):
        Collect(2, 0.99, seed=k).rollout([buf], 8, k)
    for k, buf in enumerate(bufs):
        got = _served(buf, batch_size=4)
        assert (got["observations"][:, 2] == k).all() and len(got["t"]) == 16
        buf.close()
    with pytest.raises(ValueError, match=r"holds 32 steps; a rollout is 64"):
        ClawRolloutBuffer(16, space, act, "cpu", n_envs=4, **_kw(redis_url, namespace))


# ---- SB3's tests/test_buffers.py, rollout cases -----------------------------------------
class DummyEnv(gym.Env):
    """SB3's test_buffers.DummyEnv: Box(1, 5, (1,)) observations and actions."""

    def __init__(self):
        self.action_space = spaces.Box(1, 5, (1,))
        self.observation_space = spaces.Box(1, 5, (1,))
        self._observations = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]], dtype=np.float32)
        self._t = 0

    def reset(self, *, seed=None, options=None):
        self._t = 0
        return self._observations[0], {}

    def step(self, action):
        self._t += 1
        index = self._t % len(self._observations)
        return self._observations[index], index + 1, False, self._t >= 100, {}


class DummyDictEnv(DummyEnv):
    """SB3's test_buffers.DummyDictEnv: three Box keys and a (10, 7) action."""

    def __init__(self):
        super().__init__()
        self.action_space = spaces.Box(1, 5, shape=(10, 7))
        keys = ("observation", "achieved_goal", "desired_goal")
        self.observation_space = spaces.Dict({k: spaces.Box(1, 5, (1,)) for k in keys})

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset()
        return {k: obs for k in self.observation_space.spaces}, info

    def step(self, action):
        obs, *rest = super().step(action)
        return {k: obs for k in self.observation_space.spaces}, *rest


@pytest.mark.parametrize("buffer_cls", [ClawRolloutBuffer, ClawDictRolloutBuffer])
@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_device_buffer(redis_url, namespace, workers, buffer_cls, device):
    if device == "cuda" and not th.cuda.is_available():
        pytest.skip("CUDA not available")
    env = make_vec_env(DummyDictEnv if buffer_cls is ClawDictRolloutBuffer else DummyEnv)
    buf = buffer_cls(
        100, env.observation_space, env.action_space, device, **_kw(redis_url, namespace)
    )
    obs = env.reset()
    for _ in range(100):
        action = env.action_space.sample()
        next_obs, reward, _, _ = env.step(action)
        buf.add(obs, action, reward, np.zeros(1), th.zeros(1), th.ones(1))
        obs = next_obs
    data = list(buf.get(50))  # without compute_returns_and_advantage, as SB3's test
    assert len(data) == 2
    desired = get_device(device).type
    for minibatch in data:
        for value in minibatch:
            tensors = value.values() if isinstance(value, dict) else [value]
            assert all(v.device.type == desired for v in tensors)
    if buffer_cls is ClawDictRolloutBuffer:  # every key's rows came back
        rows = th.cat([m.observations["observation"] for m in data]).flatten()
        assert sorted(rows.tolist()) == sorted(np.tile([1.0, 2, 3, 4, 5], 20).tolist())
    buf.close()


OBS_DTYPES = [
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]


@pytest.mark.parametrize("use_dict", [False, True])
@pytest.mark.parametrize(
    "action_space",
    [
        spaces.Discrete(10),
        spaces.Box(low=-1.0, high=1.0, dtype=np.float32),
        spaces.Box(low=-1.0, high=1.0, dtype=np.float64),
    ],
    ids=["discrete", "box32", "box64"],
)
def test_buffer_dtypes(redis_url, namespace, workers, use_dict, action_space):
    """SB3's test_buffer_dtypes over every observation dtype (one buffer each, their
    rollouts served together): observations keep their dtype, actions come as float32.
    SB3's test reads a never-filled buffer; here one step is added first."""
    bufs = []
    for k, dtype in enumerate(OBS_DTYPES):
        obs_space = spaces.Box(0, 100, dtype=dtype)
        if use_dict:
            obs_space = spaces.Dict({"obs": obs_space, "obs_2": spaces.Box(0, 100, dtype=np.uint8)})
        cls = ClawDictRolloutBuffer if use_dict else ClawRolloutBuffer
        buf = cls(1, obs_space, action_space, "cpu", **_kw(redis_url, f"{namespace}-{k}"))
        obs = obs_space.sample()
        obs = {key: v[None] for key, v in obs.items()} if use_dict else obs[None]
        buf.add(
            obs, np.array([action_space.sample()]), np.ones(1), np.ones(1), th.ones(1), th.ones(1)
        )
        buf.compute_returns_and_advantage(th.zeros(1), np.zeros(1))
        bufs.append((dtype, obs, buf))
    for dtype, obs, buf in bufs:
        data = next(buf.get(batch_size=64))
        assert data.actions.numpy().dtype == np.float32
        if use_dict:
            assert data.observations["obs"].numpy().dtype == dtype
            assert data.observations["obs_2"].numpy().dtype == np.uint8
            np.testing.assert_array_equal(data.observations["obs"].numpy(), obs["obs"])
        else:
            assert data.observations.numpy().dtype == dtype
            np.testing.assert_array_equal(data.observations.numpy(), obs)
        buf.close()


def test_custom_rollout_buffer(redis_url, namespace, workers):
    kw = _kw(redis_url, namespace)
    A2C(
        "MlpPolicy", "Pendulum-v1", rollout_buffer_class=ClawRolloutBuffer, rollout_buffer_kwargs=kw
    )
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'wrong_keyword'"):
        A2C(
            "MlpPolicy",
            "Pendulum-v1",
            rollout_buffer_class=ClawRolloutBuffer,
            rollout_buffer_kwargs={**kw, "wrong_keyword": 1},
        )
    with pytest.raises(TypeError, match=r"got multiple values for keyword argument 'gamma'"):
        A2C(
            "MlpPolicy",
            "Pendulum-v1",
            rollout_buffer_class=ClawRolloutBuffer,
            rollout_buffer_kwargs={**kw, "gamma": 1},
        )
    with pytest.raises(TypeError, match=r"ClawDictRolloutBuffer is for Dict observations"):
        A2C("MlpPolicy", "Pendulum-v1", rollout_buffer_class=ClawDictRolloutBuffer)
    with pytest.raises(TypeError, match=r"for Dict ones use ClawDictRolloutBuffer"):
        ClawRolloutBuffer(4, DummyDictEnv().observation_space, spaces.Discrete(2))


# ---- SB3's tests/test_gae.py -------------------------------------------------------------
class CustomEnv(gym.Env):
    """SB3's test_gae.CustomEnv: a reward of 1 at the last of ``max_steps`` steps."""

    def __init__(self, max_steps=8):
        super().__init__()
        self.observation_space = spaces.Box(low=-1, high=1, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Box(low=-1, high=1, shape=(2,), dtype=np.float32)
        self.max_steps = max_steps
        self.n_steps = 0

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.observation_space.seed(seed)
        self.n_steps = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.n_steps += 1
        done = self.n_steps >= self.max_steps
        return self.observation_space.sample(), float(done), done, False, {}


class InfiniteHorizonEnv(gym.Env):
    def __init__(self, n_states=4):
        super().__init__()
        self.n_states = n_states
        self.observation_space = spaces.Discrete(n_states)
        self.action_space = spaces.Box(low=-1, high=1, shape=(2,), dtype=np.float32)
        self.current_state = 0

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            super().reset(seed=seed)
        self.current_state = 0
        return self.current_state, {}

    def step(self, action):
        self.current_state = (self.current_state + 1) % self.n_states
        return self.current_state, 1.0, False, False, {}


class CheckGAECallback(BaseCallback):
    """SB3's check of the buffer's numbers, and the same of what Claw serves (rows are
    not identifiable here: the served advantages and returns as multisets)."""

    def _on_rollout_end(self):
        buffer = self.model.rollout_buffer
        size = buffer.size()
        max_steps = self.training_env.envs[0].get_wrapper_attr("max_steps")
        gamma, lam = self.model.gamma, self.model.gae_lambda
        value = self.model.policy.constant_value
        rewards = np.zeros(size)
        rewards[max_steps - 1 :: max_steps] = 1.0
        starts = np.zeros(size)
        starts[::max_steps] = 1.0
        deltas, advantages = np.zeros(size), np.zeros(size)
        deltas[-1] = rewards[-1] - value
        advantages[-1] = deltas[-1]
        for n in reversed(range(size - 1)):
            mask = 1.0 - starts[n + 1]
            deltas[n] = rewards[n] + gamma * value * mask - value
            advantages[n] = deltas[n] + gamma * lam * advantages[n + 1] * mask
        returns = advantages + value
        assert np.allclose(buffer.advantages.flatten(), advantages)
        assert np.allclose(buffer.returns.flatten(), returns)
        served = list(buffer.get(None))  # an extra epoch: the training still gets its own
        assert len(served) == 1
        np.testing.assert_allclose(
            np.sort(served[0].advantages.numpy()), np.sort(advantages), **TOL
        )
        np.testing.assert_allclose(np.sort(served[0].returns.numpy()), np.sort(returns), **TOL)

    def _on_step(self):
        return True


class CustomPolicy(ActorCriticPolicy):
    """A constant value function."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.constant_value = 0.0

    def forward(self, obs, deterministic=False):
        actions, values, log_prob = super().forward(obs, deterministic)
        return actions, th.ones_like(values) * self.constant_value, log_prob


@pytest.mark.parametrize("model_class", [A2C, PPO])
@pytest.mark.parametrize("gae_lambda", [1.0, 0.9])
@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_gae_computation(redis_url, namespace, workers, model_class, gae_lambda, gamma):
    """SB3's test_gae_computation (its num_episodes=3: a rollout of three episodes)."""
    rollout_size = 64 * 3
    kwargs = {} if model_class == A2C else {"n_epochs": 1}
    model = model_class(
        CustomPolicy,
        CustomEnv(max_steps=64),
        seed=1,
        gamma=gamma,
        n_steps=rollout_size,
        gae_lambda=gae_lambda,
        policy_kwargs={"net_arch": []},
        rollout_buffer_class=ClawRolloutBuffer,
        rollout_buffer_kwargs=_kw(redis_url, namespace),
        **kwargs,
    )
    model.learn(rollout_size, callback=CheckGAECallback())
    model.policy.constant_value = 1.0  # advantages != returns
    model.learn(rollout_size, callback=CheckGAECallback())
    model.rollout_buffer.close()


@pytest.mark.slow
def test_infinite_horizon(redis_url, namespace, workers):
    """SB3's test_infinite_horizon for A2C (100 rollouts; in CI, the timeouts' handling is
    test_trains_as_with_sb3s_buffer's "timeouts" case): with timeouts bootstrapped (SB3's
    collect loop adds gamma * V(final obs) to the truncated step's reward; Claw stores and
    serves it), the value of the initial state is the infinite-horizon one, 1 / (1 - gamma)."""
    gamma = 0.98
    env = gym.wrappers.TimeLimit(InfiniteHorizonEnv(n_states=4), 8)
    model = A2C(
        "MlpPolicy",
        env,
        gamma=gamma,
        seed=1,
        learning_rate=0.01,
        policy_kwargs={"net_arch": [32]},
        rollout_buffer_class=ClawRolloutBuffer,
        rollout_buffer_kwargs=_kw(redis_url, namespace),
    )
    model.learn(500)
    value = model.policy.predict_values(model.policy.obs_to_tensor(0)[0]).item()
    assert abs(1 / (1 - gamma) - value) < 1.0
    model.rollout_buffer.close()


# ---- training as with SB3's buffer -------------------------------------------------------
def _timeouts():
    return gym.wrappers.TimeLimit(InfiniteHorizonEnv(n_states=4), 8)


@pytest.mark.parametrize(
    ("model_class", "env"),
    [(A2C, "CartPole-v1"), (PPO, "CartPole-v1"), (A2C, _timeouts)],
    ids=["a2c", "ppo", "timeouts"],
)
def test_trains_as_with_sb3s_buffer(redis_url, namespace, workers, model_class, env):
    """One minibatch per epoch makes the order of a rollout's rows irrelevant (up to float
    rounding): A2C, and PPO with ``batch_size = n_steps * n_envs``, learn what they learn
    with SB3's own buffer, seed for seed; also where every episode is truncated (SB3's
    timeout bootstrap, test_infinite_horizon's env)."""
    kw = {"n_steps": 16, "seed": 3, "device": "cpu"}
    if model_class is PPO:
        kw.update(batch_size=64, n_epochs=3)

    def params(buffer_cls, steps=16 * 4 * 4, **buffer_kw):
        model = model_class(
            "MlpPolicy",
            make_vec_env(env, n_envs=4, seed=3),
            rollout_buffer_class=buffer_cls,
            rollout_buffer_kwargs=buffer_kw,
            **kw,
        )
        model.learn(steps)
        if isinstance(model.rollout_buffer, ClawRolloutBuffer):
            model.rollout_buffer.close()
        return th.cat([p.detach().flatten() for p in model.policy.parameters()])

    ref, got = params(RolloutBuffer), params(ClawRolloutBuffer, **_kw(redis_url, namespace))
    assert (ref - params(RolloutBuffer, steps=0)).abs().max() > 1e-3  # it trained
    assert th.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # lineage: rollout k (all its 64 steps, once) trained the weights of version k
    log = LineageLog(Store(redis_url, namespace))
    assert log.counts() == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert {e.rows for e in log.entries()} == {64}


@pytest.mark.slow
def test_ppo_cartpole_rl_zoo_reaches_sb3s_evaluation(redis_url, namespace, workers):
    """PPO on CartPole-v1, rl-zoo hyperparameters, seed 0, 1e5 steps: the final
    deterministic evaluation with ClawRolloutBuffer is SB3's own buffer's (>= 475)."""

    def linear(start):
        return lambda remaining: remaining * start

    def evaluate(buffer_cls, **buffer_kw):
        model = PPO(
            "MlpPolicy",
            make_vec_env("CartPole-v1", n_envs=8, seed=0),
            seed=0,
            device="cpu",
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=linear(1e-3),
            clip_range=linear(0.2),
            rollout_buffer_class=buffer_cls,
            rollout_buffer_kwargs=buffer_kw,
        )
        model.learn(100_000)
        if isinstance(model.rollout_buffer, ClawRolloutBuffer):
            model.rollout_buffer.close()
        env = make_vec_env("CartPole-v1", n_envs=1, seed=1000)
        return evaluate_policy(model, env, n_eval_episodes=20, deterministic=True)[0]

    ref = evaluate(RolloutBuffer)
    got = evaluate(ClawRolloutBuffer, **_kw(redis_url, namespace))
    assert ref >= 475 and got >= 475, (ref, got)
