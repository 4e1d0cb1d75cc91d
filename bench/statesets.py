"""Synthetic RL state sets for the retrieval benchmarks (bench/retrieval.py, bench/ann.py).

``states``: episodes of a smooth random walk on a 6-d latent space (momentum, clipped to
a box), mapped through a fixed random one-layer tanh network to ``dim`` features plus a
little noise: states lie near a low-dimensional manifold, consecutive steps of an episode
are close, and held-out episodes of the same process (a learner's states) fall between
the stored ones, as real environments' states do. ``gaussian``: i.i.d. N(0, I), the
structureless worst case for any approximate index.
"""

from __future__ import annotations

import numpy as np


def states(n: int, dim: int = 32, latent: int = 6, ep_len: int = 500, seed: int = 0) -> np.ndarray:
    """``n`` states (float32 ``(n, dim)``) of the process above; seeds give other episodes
    of the same system."""
    rng = np.random.default_rng(seed)
    system = np.random.default_rng(1234)
    w1 = system.standard_normal((latent, 64)).astype(np.float32) / np.sqrt(latent)
    w2 = system.standard_normal((64, dim)).astype(np.float32) / 8
    n_ep = -(-n // ep_len)
    z = rng.standard_normal((n_ep, latent)).astype(np.float32)
    v = np.zeros_like(z)
    walk = np.empty((n_ep, ep_len, latent), np.float32)
    for t in range(ep_len):
        v = 0.9 * v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
        z = np.clip(z + 0.1 * v, -3, 3)
        walk[:, t] = z
    x = np.tanh(walk.reshape(-1, latent)[:n] @ w1) @ w2
    x += 0.01 * rng.standard_normal(x.shape).astype(np.float32)
    return np.ascontiguousarray(x, np.float32)


def gaussian(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)


def mixture(n: int, dim: int = 32, components: int = 64, seed: int = 0) -> np.ndarray:
    """A Gaussian mixture: ``components`` clusters (weights from a Dirichlet, centres
    N(0, 4 I), each isotropic with its own scale in 0.3..1): states of several tasks or
    modes, dense clusters beside sparse ones. Seeds draw other points of the same mixture."""
    system = np.random.default_rng(4321)
    weights = system.dirichlet(np.ones(components))
    centres = 2 * system.standard_normal((components, dim)).astype(np.float32)
    scales = system.uniform(0.3, 1.0, components).astype(np.float32)
    rng = np.random.default_rng(seed)
    which = rng.choice(components, n, p=weights)
    x = centres[which] + scales[which, None] * rng.standard_normal((n, dim), dtype=np.float32)
    return np.ascontiguousarray(x, np.float32)


def halfcheetah(n: int, ep_len: int = 1000, seed: int = 0) -> np.ndarray:
    """``n`` observations (float32 ``(n, 17)``: ``qpos[1:]`` and ``qvel``, as Gymnasium's
    ``HalfCheetah-v5``) of episodes of its MuJoCo model (the XML Gymnasium ships; frame
    skip 5; reset noise 0.1 as the env's) driven by a smooth random policy (per episode an
    Ornstein-Uhlenbeck process around a random bias, clipped to the action box), rolled
    out by ``mujoco.rollout`` on every core. Needs ``mujoco`` (the ``bench`` extra)."""
    import os

    import gymnasium
    import mujoco
    from mujoco import rollout

    xml = os.path.join(os.path.dirname(gymnasium.__file__), "envs/mujoco/assets/half_cheetah.xml")
    model = mujoco.MjModel.from_xml_path(xml)
    skip, kind = 5, mujoco.mjtState.mjSTATE_FULLPHYSICS
    rng = np.random.default_rng(seed)
    n_ep = -(-n // ep_len)
    data = mujoco.MjData(model)
    init = np.empty((n_ep, mujoco.mj_stateSize(model, kind)))
    for e in range(n_ep):
        mujoco.mj_resetData(model, data)
        data.qpos[:] = model.qpos0 + rng.uniform(-0.1, 0.1, model.nq)
        data.qvel[:] = 0.1 * rng.standard_normal(model.nv)
        mujoco.mj_getState(model, data, init[e], kind)
    bias = rng.uniform(-0.5, 0.5, (n_ep, 1, model.nu))
    act = np.empty((n_ep, ep_len, model.nu))
    a = np.zeros((n_ep, model.nu))
    for t in range(ep_len):
        a = 0.8 * a + 0.45 * rng.standard_normal(a.shape)
        act[:, t] = a
    control = np.repeat(np.clip(act + bias, -1, 1), skip, axis=1)
    threads = [mujoco.MjData(model) for _ in range(os.cpu_count() or 1)]
    state, _ = rollout.rollout(model, threads, init, control)
    # FULLPHYSICS: time, qpos (9), qvel (9), ...; each env step is the last of its skip
    obs = state[:, skip - 1 :: skip, 2 : 1 + model.nq + model.nv]
    return np.ascontiguousarray(obs.reshape(-1, model.nq - 1 + model.nv)[:n], np.float32)


SETS = {"states": states, "gaussian": gaussian, "mixture": mixture, "halfcheetah": halfcheetah}
"""Every data set by name (the benchmarks' ``--data``)."""
EP_LEN = {"states": 500, "halfcheetah": 1000}
"""Steps per episode of the sets made of episodes (the others are i.i.d.)."""
