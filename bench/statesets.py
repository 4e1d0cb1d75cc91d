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
