"""The demo's learner: a small double DQN in torch (CPU), trained from popped batches.

A batch of a recipe with ``n_step`` > 1 carries the n-step return in ``reward`` and adds
``discount`` (gamma^m) and ``done``; the target is ``reward + discount * (1 - done) *
Q_target(next_obs, argmax_a Q(next_obs, a))``. The loss is weighted by the batch's
importance ``weights`` (prioritized replay), and :meth:`DQN.update` returns the TD errors
that become the steps' new priorities.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from orchestrator.adapters.torch import to_tensor


def mlp(obs_dim: int, n_actions: int, hidden: int = 128) -> nn.Module:
    """Q-network for vector observations."""
    return nn.Sequential(
        nn.Linear(obs_dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, n_actions),
    )


class ConvQ(nn.Module):
    """Q-network for NHWC uint8 images (scaled to [0, 1] here, not in the data path)."""

    def __init__(self, shape: tuple[int, int, int], n_actions: int) -> None:
        super().__init__()
        h, w, c = shape
        self.body = nn.Sequential(  # the Nature DQN's first two layers, narrower
            nn.Conv2d(c, 16, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            n = self.body(torch.zeros(1, c, h, w)).shape[1]
        self.head = nn.Sequential(nn.Linear(n, 64), nn.ReLU(), nn.Linear(64, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.permute(0, 3, 1, 2).float() / 255.0))


def to_arrays(net: nn.Module) -> dict[str, np.ndarray]:
    """The network's parameters and buffers as numpy arrays (for :mod:`weights`)."""
    return {k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}


def layout(net: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of what :func:`to_arrays` gives: what a reader expects."""
    return {k: (v.dtype.str, v.shape) for k, v in to_arrays(net).items()}


def load_arrays(net: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})


def greedy(net: nn.Module, obs: Any) -> int:
    with torch.no_grad():
        return int(net(torch.as_tensor(np.asarray(obs))[None]).argmax(1).item())


class DQN:
    """Double DQN with a hard-copied target network, Huber loss and gradient clipping."""

    def __init__(
        self, net: nn.Module, *, lr: float = 1e-3, target_every: int = 250, clip: float = 10.0
    ) -> None:
        self.net = net
        self.target = copy.deepcopy(net).requires_grad_(False)
        self.opt = torch.optim.Adam(net.parameters(), lr=lr)
        self.target_every = target_every
        self.clip = clip
        self.steps = 0

    def update(self, batch: Mapping[str, np.ndarray], weights: np.ndarray) -> np.ndarray:
        """One gradient step on ``batch``; returns |TD error| per row."""
        # Popped arrays are read-only (views of the batch): to_tensor copies those once.
        obs, next_obs = to_tensor(batch["obs"]), to_tensor(batch["next_obs"])
        action = to_tensor(batch["action"]).long().reshape(-1, 1)
        reward = to_tensor(batch["reward"]).float()
        discount = to_tensor(batch["discount"]).float()
        done = to_tensor(batch["done"]).float()
        q = self.net(obs).gather(1, action).squeeze(1)
        with torch.no_grad():
            best = self.net(next_obs).argmax(1, keepdim=True)
            q_next = self.target(next_obs).gather(1, best).squeeze(1)
            target = reward + discount * (1.0 - done) * q_next
        td = target - q
        w = to_tensor(weights).float()
        loss = (w * nn.functional.smooth_l1_loss(q, target, reduction="none")).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.opt.step()
        self.steps += 1
        if self.steps % self.target_every == 0:
            self.target.load_state_dict(self.net.state_dict())
        return td.detach().abs().numpy()
