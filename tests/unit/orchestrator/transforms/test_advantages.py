"""GAE and V-trace (orchestrator.transforms.advantages) against plain numpy references of
the papers' sums and against Stable-Baselines3's RolloutBuffer, on chains that mix
terminated, truncated and still-running episodes of several envs, with segment boundaries
inside episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer

from orchestrator.transforms.advantages import (
    chains_from_time_major,
    gae,
    normalize,
    vtrace,
)


def _scenario(seed: int, n_envs: int = 4, steps: int = 40) -> dict[str, np.ndarray]:
    """Per env ``steps`` steps: episodes that terminate, are truncated (with the value of
    their final observation) or keep running; each env's steps are cut into segments of
    random length (a cut inside an episode bootstraps with the next step's value)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("r", "v", "nv", "term", "end", "mu", "pi")}
    for _ in range(n_envs):
        v = rng.normal(size=steps + 1)  # v[steps]: the value after the env's last step
        r = rng.normal(size=steps)
        flag = rng.choice(3, size=steps, p=[0.85, 0.08, 0.07])  # 0 run, 1 terminated, 2 trunc
        cut = rng.random(steps) < 0.1
        cut[-1] = True  # the env's data stops: a running episode bootstraps
        for t in range(steps):
            end = bool(flag[t] or cut[t])
            nv = rng.normal() if flag[t] == 2 else (0.0 if flag[t] == 1 else v[t + 1])
            rows["r"].append(r[t])
            rows["v"].append(v[t])
            rows["nv"].append(nv if end else rng.normal())  # not read inside a chain
            rows["term"].append(flag[t] == 1)
            rows["end"].append(end)
            rows["mu"].append(rng.normal(-1.0, 0.3))
            rows["pi"].append(rows["mu"][-1] + rng.normal(0.0, 0.5))
    return {k: np.array(v) for k, v in rows.items()}


def _chains(end: np.ndarray) -> list[range]:
    stops = np.flatnonzero(end) + 1
    starts = np.r_[0, stops[:-1]]
    return [range(a, b) for a, b in zip(starts, stops, strict=True)]


def _next_value(d: dict[str, np.ndarray], t: int) -> float:
    if d["term"][t]:
        return 0.0
    return float(d["nv"][t] if d["end"][t] else d["v"][t + 1])


def _gae_reference(d: dict[str, np.ndarray], gamma: float, lam: float) -> np.ndarray:
    """A_t = sum_l (gamma lam)^l delta_{t+l} over the rest of t's chain (the paper's sum)."""
    adv = np.zeros(len(d["r"]))
    for chain in _chains(d["end"]):
        for t in chain:
            adv[t] = sum(
                (gamma * lam) ** (u - t) * (d["r"][u] + gamma * _next_value(d, u) - d["v"][u])
                for u in range(t, chain.stop)
            )
    return adv


def _vtrace_reference(
    d: dict[str, np.ndarray], gamma: float, rho_bar: float, c_bar: float
) -> tuple[np.ndarray, np.ndarray]:
    """IMPALA eq. 1: v_s = V(x_s) + sum_{t>=s} gamma^{t-s} (prod_{i<t} c_i) rho_t delta_t,
    and the policy-gradient advantage rho_s (r_s + gamma v_{s+1} - V(x_s))."""
    ratio = np.exp(d["pi"] - d["mu"])
    rho, c = np.minimum(rho_bar, ratio), np.minimum(c_bar, ratio)
    vs, adv = np.zeros(len(d["r"])), np.zeros(len(d["r"]))
    for chain in _chains(d["end"]):
        for s in chain:
            total, trace = 0.0, 1.0
            for t in range(s, chain.stop):
                delta = rho[t] * (d["r"][t] + gamma * _next_value(d, t) - d["v"][t])
                total += gamma ** (t - s) * trace * delta
                trace *= c[t]
            vs[s] = d["v"][s] + total
        for s in chain:
            if d["term"][s]:
                nxt = 0.0
            elif s + 1 < chain.stop:
                nxt = vs[s + 1]
            else:
                nxt = _next_value(d, s)
            adv[s] = rho[s] * (d["r"][s] + gamma * nxt - d["v"][s])
    return vs, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (0.98, 0.8), (0.9, 1.0), (0.99, 0.0)])
def test_gae_is_the_papers_sum(seed, gamma, lam):
    d = _scenario(seed)
    assert d["term"].any() and (d["end"] & ~d["term"]).any()  # both kinds of chain end
    got = gae(d["r"], d["v"], d["nv"], d["term"], d["end"], gamma, lam)
    ref = _gae_reference(d, gamma, lam)
    np.testing.assert_allclose(got.advantages, ref, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got.returns, ref + d["v"], rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("rho_bar", "c_bar"), [(1.0, 1.0), (2.0, 0.5), (0.8, 0.8)])
def test_vtrace_is_impala(seed, rho_bar, c_bar):
    d = _scenario(seed)
    gamma = 0.97
    got = vtrace(
        d["mu"], d["pi"], d["r"], d["v"], d["nv"], d["term"], d["end"], gamma, rho_bar, c_bar
    )
    vs, adv = _vtrace_reference(d, gamma, rho_bar, c_bar)
    np.testing.assert_allclose(got.returns, vs, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got.advantages, adv, rtol=0, atol=1e-9)


def test_vtrace_on_policy_is_gae_with_lambda():
    """pi = mu and untruncated traces: V-trace's target is GAE(lambda)'s return."""
    d = _scenario(5)
    est = vtrace(d["mu"], d["mu"], d["r"], d["v"], d["nv"], d["term"], d["end"], 0.99, lam=0.9)
    ref = gae(d["r"], d["v"], d["nv"], d["term"], d["end"], 0.99, 0.9)
    np.testing.assert_allclose(est.returns, ref.returns, rtol=0, atol=1e-9)


def _sb3_buffer(seed: int, n_steps: int, n_envs: int, gamma: float, lam: float):
    """An SB3 RolloutBuffer filled as PPO's collect loop fills it (a truncated step's
    reward gets gamma * V(final obs)), and the same steps in Claw's terms: raw rewards,
    terminated/truncated kept apart, a truncated step's bootstrap value."""
    rng = np.random.default_rng(seed)
    buf = RolloutBuffer(
        n_steps, spaces.Box(-1, 1, (2,)), spaces.Discrete(2), "cpu", lam, gamma, n_envs
    )
    raw = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    values = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    flag = rng.choice(3, size=(n_steps, n_envs), p=[0.85, 0.08, 0.07])
    final_v = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    starts = np.zeros((n_steps, n_envs), np.float32)
    starts[0] = 1.0
    starts[1:] = flag[:-1] > 0
    sb3_rewards = raw + np.where(flag == 2, gamma * final_v, 0.0).astype(np.float32)
    for t in range(n_steps):
        buf.add(
            np.zeros((n_envs, 2), np.float32),
            np.zeros((n_envs, 1)),
            sb3_rewards[t],
            starts[t],
            torch.as_tensor(values[t]),
            torch.zeros(n_envs),
        )
    last_values = rng.normal(size=n_envs).astype(np.float32)
    dones = flag[-1] > 0
    buf.compute_returns_and_advantage(torch.as_tensor(last_values), dones)
    return buf, raw, values, flag, final_v, last_values


@pytest.mark.parametrize(("seed", "n_envs"), [(0, 1), (1, 4), (2, 8)])
def test_gae_equals_sb3_rollout_buffer(seed, n_envs):
    n_steps, gamma, lam = 64, 0.99, 0.95
    buf, raw, values, flag, final_v, last_values = _sb3_buffer(seed, n_steps, n_envs, gamma, lam)
    # Claw's rows: env by env in time order, terminated and truncated apart, the truncated
    # step's own bootstrap value, the env's last step bootstrapping with last_values.
    r = raw.T.ravel()
    v = values.T.ravel()
    term = (flag == 1).T.ravel()
    end = (flag > 0).copy()
    end[-1] = True
    nv = np.where(flag == 2, final_v, 0.0)
    nv[-1] = np.where(flag[-1] == 2, final_v[-1], np.where(flag[-1] == 1, 0.0, last_values))
    got = gae(r, v, nv.T.ravel(), term, end.T.ravel(), gamma, lam)
    # SB3 accumulates in float32 (its buffer's dtype): equal to 1e-6, relative or absolute
    np.testing.assert_allclose(got.advantages, buf.advantages.T.ravel(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.returns, buf.returns.T.ravel(), rtol=1e-6, atol=1e-6)


def test_chains_from_sb3_layout_give_sb3_numbers():
    """An SB3 buffer's own arrays, laid out by chains_from_time_major: SB3's advantages."""
    n_steps, n_envs, gamma, lam = 32, 3, 0.98, 0.8
    buf, _, _, flag, _, last_values = _sb3_buffer(7, n_steps, n_envs, gamma, lam)
    ch = chains_from_time_major(buf.episode_starts, last_values, flag[-1] > 0)
    r, v = buf.rewards.ravel()[ch.order], buf.values.ravel()[ch.order]
    got = gae(r, v, ch.next_values, ch.terminated, ch.chain_end, gamma, lam)
    adv = np.empty(n_steps * n_envs)
    adv[ch.order] = got.advantages
    np.testing.assert_allclose(adv.reshape(n_steps, n_envs), buf.advantages, rtol=1e-6, atol=1e-6)


def test_normalize_is_per_rollout():
    a = np.random.default_rng(0).normal(3.0, 2.0, 1000)
    n = normalize(a)
    assert abs(n.mean()) < 1e-9 and abs(n.std() - 1.0) < 1e-6
