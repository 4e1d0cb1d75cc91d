"""ClawReplayBuffer against SB3's own ReplayBuffer: what SB3's buffer tests check (every
space's dtypes, device, a full buffer) and one test per difference between the two (reset,
default namespace, pickling, seed and the deterministic mode, optimize_memory_usage,
close on GC/exit), over real Redis and Celery workers."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces
from stable_baselines3 import SAC
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer
from stable_baselines3.common.logger import Logger

from claw_tasks.settings import use_settings
from claw_tasks.store import Store
from orchestrator.adapters.sb3 import ClawDictReplayBuffer, ClawReplayBuffer
from tests.support.paths import ROOT

OBS_SPACES = {
    "box": spaces.Box(-1, 1, (3,), np.float32),
    "image": spaces.Box(0, 255, (2, 3, 3), np.uint8),
    "discrete": spaces.Discrete(5),
    "multidiscrete": spaces.MultiDiscrete([3, 4]),
    "multibinary": spaces.MultiBinary(4),
}
ACTION_SPACES = {
    "box": spaces.Box(-2, 2, (2,), np.float32),
    "box64": spaces.Box(-2, 2, (1,), np.float64),
    "discrete": spaces.Discrete(3),
    "multidiscrete": spaces.MultiDiscrete([2, 5]),
    "multibinary": spaces.MultiBinary(3),
}


def _buffer(redis_url: str, namespace: str | None, size: int = 100, **kw) -> ClawReplayBuffer:
    obs = kw.pop("obs", OBS_SPACES["box"])
    act = kw.pop("act", ACTION_SPACES["discrete"])
    kw.setdefault("deterministic", True)
    kw.setdefault("recipe", {"sources": [{"name": "all", "sampler": {"kind": "recent"}}]})
    return ClawReplayBuffer(
        size, obs, act, device="cpu", namespace=namespace, redis_url=redis_url, timeout=60, **kw
    )


def _add(buffers: list[ReplayBuffer], steps: int, seed: int = 0, episode: int = 7) -> None:
    """``steps`` transitions of random spaces' samples into every buffer (a timeout and a
    termination among them, next_obs the next step's obs as in SB3's loop)."""
    b0 = buffers[0]
    b0.observation_space.seed(seed)
    b0.action_space.seed(seed)
    obs = b0.observation_space.sample()
    for t in range(steps):
        nxt = b0.observation_space.sample()
        act = np.array([b0.action_space.sample()])
        done = np.array([t % episode == episode - 1])
        infos = [{"TimeLimit.truncated": bool(done[0] and t % (2 * episode) == episode - 1)}]
        for b in buffers:
            b.add(_one(obs), _one(nxt), act, np.array([float(t)]), done, infos)
        obs = nxt


def _one(obs):
    """One env's observation as SB3 passes it (a leading env axis; per key for Dict)."""
    return {k: np.array([v]) for k, v in obs.items()} if isinstance(obs, dict) else np.array([obs])


def _rows(samples) -> np.ndarray:
    parts = [
        samples.observations,
        samples.actions,
        samples.next_observations,
        samples.dones,
        samples.rewards,
    ]
    rows = np.concatenate([p.numpy().astype(np.float64).reshape(len(p), -1) for p in parts], 1)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize("obs", OBS_SPACES)
@pytest.mark.parametrize("act", ["box", "discrete"])
def test_dtypes_and_rows_match_sb3_per_observation_space(redis_url, namespace, workers, obs, act):
    _check_space(redis_url, namespace, OBS_SPACES[obs], ACTION_SPACES[act])


@pytest.mark.parametrize("act", ["box64", "multidiscrete", "multibinary"])
def test_dtypes_and_rows_match_sb3_per_action_space(redis_url, namespace, workers, act):
    _check_space(redis_url, namespace, OBS_SPACES["box"], ACTION_SPACES[act])


def _check_space(redis_url: str, ns: str, obs: spaces.Space, act: spaces.Space) -> None:
    steps = 20
    ref = ReplayBuffer(100, obs, act, device="cpu", handle_timeout_termination=True)
    claw = _buffer(redis_url, ns, obs=obs, act=act)
    _add([ref, claw], steps)
    got = claw.sample(steps)  # recent: every stored transition
    want = ref._get_samples(np.arange(steps))
    for name in ("observations", "actions", "next_observations", "dones", "rewards"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device, name
    np.testing.assert_array_equal(_rows(got), _rows(want))
    claw.close()


def test_device_and_full_buffer_like_sb3(redis_url, namespace, workers):
    size, steps = 16, 40
    ref = ReplayBuffer(size, OBS_SPACES["box"], ACTION_SPACES["discrete"], device="cpu")
    claw = _buffer(redis_url, namespace, size=size)
    assert claw.device == ref.device == torch.device("cpu")
    _add([ref, claw], steps)
    assert (claw.size(), claw.pos, claw.full) == (ref.size(), ref.pos, ref.full) == (16, 8, True)
    got = claw.sample(size)  # the newest `size` transitions: SB3's ring holds those
    np.testing.assert_array_equal(_rows(got), _rows(ref._get_samples(np.arange(size))))
    assert got.observations.device.type == "cpu"
    claw.close()


def _sb3_rows(ref: ReplayBuffer) -> np.ndarray:
    """Every transition SB3's ``ref`` can sample (all positions x envs once full), as
    ``_rows`` lays them out."""
    upper = ref.buffer_size if ref.full else ref.pos
    parts = [
        ref.observations[:upper],
        ref.actions[:upper],
        ref.next_observations[:upper],
        ref.dones[:upper] * (1 - ref.timeouts[:upper]),
        ref.rewards[:upper],
    ]
    n = upper * ref.n_envs
    flat = [p.astype(np.float32).astype(np.float64).reshape(n, -1) for p in parts]
    rows = np.concatenate(flat, 1)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize("n_envs", [1, 2, 4])
@pytest.mark.parametrize("size", [64, 67])
def test_the_ring_holds_what_sb3_holds_with_several_envs(
    redis_url, namespace, workers, n_envs, size
):
    """SB3's loop over a vectorized env (terminal observations, timeouts), well past full:
    what the Claw buffer can sample is exactly what SB3's can, ``buffer_size // n_envs``
    positions of every env (67 with 4 envs: 64 transitions)."""
    import gymnasium as gym
    from stable_baselines3.common.vec_env import DummyVecEnv

    env = DummyVecEnv([lambda: gym.make("CartPole-v1", max_episode_steps=9)] * n_envs)
    env.seed(3)
    ref = ReplayBuffer(size, env.observation_space, env.action_space, "cpu", n_envs=n_envs)
    claw = _buffer(
        redis_url, namespace, size, obs=env.observation_space, act=env.action_space, n_envs=n_envs
    )
    claw.recipe["sources"] = [{"name": "all", "sampler": {"kind": "uniform"}}]
    rng = np.random.default_rng(0)
    obs = env.reset()
    for t in range(3 * size // n_envs + 5):
        actions = rng.integers(0, 2, n_envs)
        new_obs, rewards, dones, infos = env.step(actions)
        rewards = rewards + t  # tell the rows apart
        next_obs = new_obs.copy()  # as OffPolicyAlgorithm._store_transition
        for i in np.flatnonzero(dones):
            next_obs[i] = infos[i]["terminal_observation"]
        for b in (ref, claw):
            b.add(obs, next_obs, actions, rewards, dones, infos)
        obs = new_obs
        if t in (size // n_envs + 1, 2 * size // n_envs + 2, 3 * size // n_envs + 4):
            want = _sb3_rows(ref)
            assert len(want) == size // n_envs * n_envs or not ref.full
            got = np.unique(_rows(claw.sample(4096)), axis=0)  # uniform: every row, w.h.p.
            assert (claw.size(), claw.pos, claw.full) == (ref.size(), ref.pos, ref.full)
            assert len(got) == len(want), f"step {t}: {len(got)} rows, SB3 has {len(want)}"
            np.testing.assert_array_equal(got, want)
    claw.close()


# ---- the numbered differences ------------------------------------------------------------
def test_1_reset_starts_empty_and_keeps_the_old_data(redis_url, namespace, workers):
    claw = _buffer(redis_url, namespace, recipe={})
    _add([claw], 10, seed=1)
    old = set(map(tuple, claw.sample(32).observations.numpy().tolist()))
    claw.reset()
    assert claw.size() == 0 and claw.namespace == f"{namespace}.r1"
    _add([claw], 10, seed=2)
    new = set(map(tuple, claw.sample(64).observations.numpy().tolist()))
    assert new and not new & old
    assert Store(redis_url, namespace).count({}) == 10  # not dropped unless asked
    claw.close()

    dropping = _buffer(redis_url, namespace, recipe={}, drop_on_reset=True)
    dropping.reset()
    assert not Store(redis_url, namespace).exists()
    dropping.close()


def test_2_each_buffer_gets_its_own_namespace_and_logs_it(redis_url, workers, caplog):
    with caplog.at_level(logging.INFO, logger="orchestrator.adapters.sb3"):
        a, b = _buffer(redis_url, None), _buffer(redis_url, None)
    assert a.namespace != b.namespace
    assert a.namespace in caplog.text and b.namespace in caplog.text
    _add([a], 5)
    assert Store(redis_url, b.namespace).count({}) == 0
    a.close()
    b.close()


def test_3_pickle_and_deepcopy_keep_settings_not_data_nor_password(redis_url, namespace, workers):
    claw = _buffer(redis_url, namespace, recipe={}, deterministic=False, seed=5)
    _add([claw], 12)
    blob = pickle.dumps(claw)
    assert len(blob) < 4096  # settings, not 12 transitions' arrays
    back = pickle.loads(blob)
    twin = copy.deepcopy(claw)
    for other in (back, twin):
        assert (other.namespace, other.seed, other.size()) == (namespace, 5, 12)
        assert other.recipe["name"] != claw.recipe["name"]  # closing one never stops another
        got = other.sample(8)
        assert got.observations.shape == (8, 3)
    twin.close()
    assert claw.sample(8).observations.shape == (8, 3)  # still served after the twin closed
    back.close()
    claw.close()


def _env(redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CLAW_REDIS_URL": redis_url,
        "CLAW_BROKER_URL": redis_url,
    }


def test_3_save_then_load_in_a_new_process_continues_training(
    redis_url, namespace, workers, tmp_path
):
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from stable_baselines3 import DQN
        from orchestrator.adapters.sb3 import ClawReplayBuffer
        model = DQN("MlpPolicy", "CartPole-v1", learning_starts=50, buffer_size=1000,
                    batch_size=16, train_freq=8, policy_kwargs={{"net_arch": [16]}},
                    device="cpu", seed=0, replay_buffer_class=ClawReplayBuffer,
                    replay_buffer_kwargs={{"namespace": {namespace!r}, "timeout": 60}})
        path = {str(tmp_path / "rb.pkl")!r}
        if sys.argv[1] == "save":
            model.learn(total_timesteps=120)
            model.save_replay_buffer(path)
        else:
            model.load_replay_buffer(path)
            rb = model.replay_buffer
            assert rb.namespace == {namespace!r} and rb.size() == 120, rb.size()
            before = model._n_updates
            model.learn(total_timesteps=80)  # updates after learning_starts again
            assert model._n_updates > before and rb.size() == 200, rb.size()
            print("continued", model._n_updates - before)
        model.replay_buffer.close()
    """)
    for phase in ("save", "load"):
        out = subprocess.run(
            [sys.executable, "-c", script, phase],
            env=_env(redis_url),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    assert "continued" in out.stdout
    assert Store(redis_url, namespace).count({}) == 200  # the saved run's steps and the new


class _Losses(Logger):
    def __init__(self) -> None:
        super().__init__(None, [])
        self.losses: list[tuple[str, float]] = []

    def record(self, key, value, exclude=None) -> None:
        if key in ("train/critic_loss", "train/actor_loss"):  # one of each per update
            self.losses.append((key, float(value)))
        super().record(key, value, exclude)


def _sac_losses(redis_url: str, namespace: str, seed: int) -> list[tuple[str, float]]:
    model = SAC(
        "MlpPolicy",
        "Pendulum-v1",
        learning_starts=20,
        buffer_size=1000,
        batch_size=16,
        policy_kwargs={"net_arch": [16]},
        device="cpu",
        seed=seed,
        replay_buffer_class=ClawReplayBuffer,
        replay_buffer_kwargs={
            "namespace": namespace,
            "redis_url": redis_url,
            "deterministic": True,
            "timeout": 60,
        },
    )
    logger = _Losses()
    model.set_logger(logger)
    model.learn(total_timesteps=220)
    model.replay_buffer.close()
    return logger.losses


def test_4_seeded_sac_repeats_in_the_deterministic_mode(redis_url, workers):
    torch.set_num_threads(1)
    ns = f"det-{os.getpid()}"
    a = _sac_losses(redis_url, f"{ns}-a", seed=3)
    b = _sac_losses(redis_url, f"{ns}-b", seed=3)
    assert len(a) == 2 * 200 and a == b  # identical losses, update by update


def test_4_the_algorithms_seed_reaches_the_recipe(redis_url, workers):
    def seed_of(seed: int) -> int:
        model = SAC(
            "MlpPolicy",
            "Pendulum-v1",
            seed=seed,
            device="cpu",
            policy_kwargs={"net_arch": [8]},
            replay_buffer_class=ClawReplayBuffer,
            replay_buffer_kwargs={"redis_url": redis_url},
        )
        rb = model.replay_buffer
        rb.close()
        assert rb.recipe["seed"] == rb.seed
        return rb.seed

    assert seed_of(1) == seed_of(1) != seed_of(2)


def test_4_deterministic_batches_come_from_steps_added_before_the_call(
    redis_url, namespace, workers
):
    claw = _buffer(redis_url, namespace, recipe={}, seed=0)
    _add([claw], 5)
    first = claw.sample(64).rewards.numpy()
    _add([claw], 5)
    assert set(first.ravel()) <= {0.0, 1.0, 2.0, 3.0, 4.0}  # all 5 added, nothing later
    assert len(set(first.ravel())) == 5
    claw.close()


def test_5_optimize_memory_usage_is_accepted(redis_url, namespace, workers):
    claw = _buffer(redis_url, namespace, optimize_memory_usage=True)
    assert claw.optimize_memory_usage
    _add([claw], 6)
    assert claw.sample(6).next_observations.shape == (6, 3)
    claw.close()


def test_6_garbage_collection_and_exit_close_the_buffer(redis_url, namespace, workers):
    claw = _buffer(redis_url, namespace, deterministic=False)
    _add([claw], 9)  # the newest stays pending until the next add or a close
    del claw
    gc.collect()
    assert Store(redis_url, namespace).count({}) == 9

    script = textwrap.dedent(f"""
        from tests.stack.test_sb3_parity import _add, _buffer
        claw = _buffer({redis_url!r}, {namespace + "-exit"!r}, deterministic=False)
        _add([claw], 7)
        import builtins; builtins.kept = claw  # alive until the interpreter exits
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert Store(redis_url, namespace + "-exit").count({}) == 7


def test_5_dict_observations_match_sb3_dict_replay_buffer(redis_url, namespace, workers):
    obs = spaces.Dict({k: OBS_SPACES[k] for k in ("box", "image", "discrete", "multibinary")})
    act = ACTION_SPACES["box"]
    steps = 15
    ref = DictReplayBuffer(100, obs, act, device="cpu")
    claw = ClawDictReplayBuffer(
        100,
        obs,
        act,
        device="cpu",
        namespace=namespace,
        redis_url=redis_url,
        timeout=60,
        deterministic=True,
        recipe={"sources": [{"name": "all", "sampler": {"kind": "recent"}}]},
    )
    with pytest.raises(TypeError, match="ClawDictReplayBuffer"):
        ClawReplayBuffer(100, obs, act, redis_url=redis_url)
    _add([ref, claw], steps)
    got, want = claw.sample(steps), ref._get_samples(np.arange(steps))
    order = np.argsort(got.rewards.numpy().ravel())  # recent: newest first; SB3: oldest
    for name in ("observations", "next_observations"):
        g, w = getattr(got, name), getattr(want, name)
        assert set(g) == set(w) == set(obs.spaces)
        for key in g:
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape, key
            np.testing.assert_array_equal(g[key].numpy()[order], w[key].numpy())
    for name in ("actions", "dones", "rewards"):
        np.testing.assert_array_equal(
            getattr(got, name).numpy()[order], getattr(want, name).numpy()
        )
    assert pickle.loads(pickle.dumps(claw)).observation_space == obs
    claw.close()


def _readahead_children() -> list[int]:
    """Pids of this process's read-ahead children."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"orchestrator.delivery.readahead_child" in cmdline:
            pids.append(int(d.name))
    return pids


@pytest.mark.parametrize("process", ["1", "0"])
def test_samples_read_ahead_by_a_child_or_a_thread_are_rows_sb3_holds(
    redis_url, namespace, workers, monkeypatch, process
):
    monkeypatch.setenv("CLAW_READAHEAD_PROCESS", process)
    use_settings()
    try:
        ref = ReplayBuffer(100, OBS_SPACES["box"], ACTION_SPACES["discrete"], device="cpu")
        claw = _buffer(redis_url, namespace, deterministic=False, gradient_steps=32, recipe={})
        assert bool(_readahead_children()) == (process == "1")  # started with the buffer
        _add([ref, claw], 80)
        claw.flush()
        held = {tuple(r) for r in _sb3_rows(ref)}
        for _ in range(40):  # 20 popped batches of 2 parts
            assert {tuple(r) for r in _rows(claw.sample(16))} <= held
        claw.close()
        assert not _readahead_children()
    finally:
        monkeypatch.delenv("CLAW_READAHEAD_PROCESS")
        use_settings()


def _buffer_of(array: np.ndarray) -> np.ndarray:
    """The whole buffer a decoded array views (the popped item, or the segment's mapping),
    as bytes."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return np.frombuffer(base, np.uint8)


@pytest.mark.parametrize(("dim", "path"), [(8, "inline"), (2048, "shared memory")])
def test_samples_are_views_of_the_popped_batch_bit_equal_to_the_rows_drawn(
    redis_url, namespace, workers, monkeypatch, dim, path
):
    """The trainer only wraps bytes: every tensor of a sample lies in the buffer its batch
    was popped in (the read-ahead's item, or the shared-memory segment: no copy), holds
    the drawn rows bit for bit, and the done flags arrive as float32 (the recipe's
    layout)."""
    from orchestrator.delivery import shm
    from orchestrator.delivery.client import BatchClient

    accepted = []
    accept = BatchClient.accept

    def recording(self, name, item):
        batch = accept(self, name, item)
        accepted.append((bytes(item[:4]), batch))
        return batch

    monkeypatch.setattr(BatchClient, "accept", recording)
    steps = 64
    space = spaces.Box(-1, 1, (dim,), np.float32)
    obs = np.random.default_rng(dim).standard_normal((steps + 1, dim)).astype(np.float32)
    claw = ClawReplayBuffer(
        200, space, ACTION_SPACES["discrete"], device="cpu", namespace=namespace,
        redis_url=redis_url, timeout=60, gradient_steps=1,
    )  # fmt: skip
    assert claw.recipe["layout"] == {"dtypes": {"terminated": "float32", "truncated": "float32"}}
    for t in range(steps):
        done = np.array([t % 7 == 6])
        claw.add(obs[t : t + 1], obs[t + 1 : t + 2], np.array([t % 3]), np.array([t]), done, [{}])
    claw.flush()
    for _ in range(3):
        got = claw.sample(32)
        magic, batch = accepted[-1]  # the batch this sample was converted from
        assert (magic == shm.REF_MAGIC) == (path == "shared memory")
        assert batch["terminated"].dtype == np.float32
        whole = _buffer_of(batch["obs"])
        lo, hi = whole.ctypes.data, whole.ctypes.data + whole.nbytes
        tensors = [
            got.observations, got.actions, got.next_observations, got.dones, got.rewards
        ]  # fmt: skip
        for t in tensors:
            assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi  # a view: no copy
        step = got.rewards.numpy()[:, 0].astype(int)
        assert got.observations.numpy().tobytes() == obs[step].tobytes()
        assert got.next_observations.numpy().tobytes() == obs[step + 1].tobytes()
        assert got.actions.numpy()[:, 0].tolist() == (step % 3).tolist()
        assert got.dones.dtype == torch.float32
        assert got.dones.numpy()[:, 0].tolist() == (step % 7 == 6).astype(float).tolist()
    claw.close()
