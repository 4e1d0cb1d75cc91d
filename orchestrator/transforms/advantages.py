"""Advantage estimates for on-policy data: GAE(gamma, lambda) and V-trace, numpy only.

The prefetch workers run these on a rollout before cutting it into minibatches
(docs/recipes.md, "On-policy"); anything else holding the same arrays (an SB3 rollout
buffer) can call them too. Every function takes flat rows grouped in *chains*: the steps
of one actor's segment of one episode, contiguous and in time order, a chain's last row
marked in ``chain_end``. Row ``t`` of a chain is followed by row ``t + 1``; at a chain's
last row the state after it is described by ``next_values`` (its value: the segment's
bootstrap, or the value of the episode's next step, stored outside the rollout) and
``terminated``:

- ``terminated[t]``: the episode ended at ``t`` in a terminal state: nothing bootstraps,
  ``V(s_{t+1}) = 0`` whatever ``next_values`` says;
- otherwise (a segment cut mid-episode, or a truncated episode, whose ``next_values`` is
  the value of its final observation): ``V(s_{t+1}) = next_values[t]``.

Inside a chain ``next_values`` is not read: the successor's ``values`` is the next value.
:func:`chains_from_time_major` turns Stable-Baselines3's ``(n_steps, n_envs)`` buffer into
this layout. The recursions run once over the rows in float64, a Python loop over floats:
4-5 us a row on the CI machine at load 14, 10 ms for a 2,048-step rollout (a loop
vectorised over chains was slower: numpy's per-call cost times the longest chain).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Estimate(NamedTuple):
    """Per row: the advantage the policy gradient uses and the value target."""

    advantages: np.ndarray  # float64
    returns: np.ndarray  # float64: the critic's target


def _next_values(values: np.ndarray, next_values: np.ndarray, chain_end: np.ndarray) -> np.ndarray:
    """V(s_{t+1}) per row before termination: the successor's value inside a chain, the
    given ``next_values`` at a chain's end."""
    succ = np.empty_like(values)
    succ[:-1] = values[1:]
    if len(succ):
        succ[-1] = 0.0
    return np.where(chain_end, next_values, succ)


def backward(x: np.ndarray, decay: np.ndarray) -> np.ndarray:
    """``y[t] = x[t] + decay[t] * y[t + 1]`` from the last row back (``y[N] = 0``); a zero
    ``decay`` separates chains. float64."""
    xs, ds = np.asarray(x, np.float64).tolist(), np.asarray(decay, np.float64).tolist()
    out, acc = [0.0] * len(xs), 0.0
    for t in range(len(xs) - 1, -1, -1):
        acc = xs[t] + ds[t] * acc
        out[t] = acc
    return np.array(out, np.float64)


def _arrays(*arrays: np.ndarray) -> list[np.ndarray]:
    out = [np.asarray(a) for a in arrays]
    n = len(out[0])
    if any(a.shape != (n,) for a in out):
        raise ValueError(f"every array must be 1-d of one length: {[a.shape for a in out]}")
    return out


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    chain_end: np.ndarray,
    gamma: float,
    lam: float,
) -> Estimate:
    """Generalised advantage estimation (Schulman et al. 2016) over chains:

    ``delta_t = r_t + gamma * (1 - term_t) * V(s_{t+1}) - V(s_t)``,
    ``A_t = delta_t + gamma * lam * (1 - term_t) * (1 - end_t) * A_{t+1}``,
    ``returns_t = A_t + V(s_t)`` (TD(lambda)), as SB3's
    ``RolloutBuffer.compute_returns_and_advantage``."""
    r, v, nv, term, end = _arrays(rewards, values, next_values, terminated, chain_end)
    r, v = r.astype(np.float64), v.astype(np.float64)
    alive = 1.0 - term.astype(np.float64)
    nxt = _next_values(v, nv.astype(np.float64), end.astype(bool))
    delta = r + gamma * alive * nxt - v
    adv = backward(delta, gamma * lam * alive * (1.0 - end.astype(np.float64)))
    return Estimate(adv, adv + v)


def vtrace(
    behaviour_log_probs: np.ndarray,
    target_log_probs: np.ndarray,
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    chain_end: np.ndarray,
    gamma: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> Estimate:
    """V-trace (Espeholt et al. 2018, IMPALA, eq. 1 and section 4.2) over chains, for
    actions drawn by a behaviour policy mu and evaluated for a target policy pi whose
    critic gave ``values`` and ``next_values``:

    ``rho_t = min(rho_bar, pi/mu)``, ``c_t = lam * min(c_bar, pi/mu)``,
    ``delta_t = rho_t * (r_t + gamma * (1 - term_t) * V(s_{t+1}) - V(s_t))``,
    ``v_t = V(s_t) + delta_t + gamma * (1 - term_t) * (1 - end_t) * c_t * (v_{t+1} - V(s_{t+1}))``;
    ``returns`` is ``v_t`` (the critic's target), ``advantages`` the policy gradient's
    ``rho_t * (r_t + gamma * (1 - term_t) * v_{t+1} - V(s_t))`` with ``v_{t+1}`` the
    bootstrap ``V(s_{t+1})`` at a chain's end. With pi = mu, ``rho_bar``, ``c_bar`` >= 1
    and ``lam`` it is GAE(lambda)'s target."""
    mu, pi, r, v, nv, term, end = _arrays(
        behaviour_log_probs, target_log_probs, rewards, values, next_values, terminated, chain_end
    )
    ratio = np.exp(pi.astype(np.float64) - mu.astype(np.float64))
    rho, c = np.minimum(rho_bar, ratio), lam * np.minimum(c_bar, ratio)
    v, end = v.astype(np.float64), end.astype(bool)
    alive = 1.0 - term.astype(np.float64)
    nxt = _next_values(v, nv.astype(np.float64), end)
    delta = rho * (r.astype(np.float64) + gamma * alive * nxt - v)
    vs = v + backward(delta, gamma * alive * (1.0 - end) * c)
    vs_next = np.where(end, nxt, np.r_[vs[1:], 0.0])
    adv = rho * (r + gamma * alive * vs_next - v)
    return Estimate(adv, vs)


def normalize(advantages: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """``(A - mean) / (std + eps)`` over the whole rollout (population std), as SB3's PPO
    normalises (it does so per minibatch; per rollout, every minibatch sees one scale)."""
    a = np.asarray(advantages, np.float64)
    return (a - a.mean()) / (a.std() + eps) if len(a) else a


class Chains(NamedTuple):
    """A time-major buffer's rows as chains (see the module docstring), and where each
    row came from."""

    order: np.ndarray  # int64 per row: the flat time-major index ``t * n_envs + env``
    chain_end: np.ndarray  # bool per row
    terminated: np.ndarray  # bool per row
    next_values: np.ndarray  # float64 per row (read at chain ends)


def chains_from_time_major(
    episode_starts: np.ndarray, last_values: np.ndarray, dones: np.ndarray
) -> Chains:
    """SB3's ``RolloutBuffer`` layout as chains: each env's column, in time order, cut
    where the next step starts an episode. SB3 adds ``gamma * V(final obs)`` to a
    truncated step's reward while collecting, so every episode end is terminal here; the
    column's last step bootstraps with ``last_values`` unless ``dones``. Take the buffer's
    ``rewards``, ``values`` (flattened time-major) at ``order``; scatter the results back
    with ``out[order] = result``."""
    starts = np.asarray(episode_starts, bool)
    t_steps, n_envs = starts.shape
    nxt_start = np.zeros_like(starts)
    nxt_start[:-1] = starts[1:]
    end = nxt_start.copy()
    end[-1] = True
    term = nxt_start.copy()
    term[-1] = np.asarray(dones, bool).reshape(n_envs)
    nv = np.zeros((t_steps, n_envs), np.float64)
    nv[-1] = np.asarray(last_values, np.float64).reshape(n_envs)
    flat = np.arange(t_steps * n_envs).reshape(t_steps, n_envs)
    order = flat.T.ravel()  # env by env, each in time order
    return Chains(order, end.T.ravel(), term.T.ravel(), nv.T.ravel())
