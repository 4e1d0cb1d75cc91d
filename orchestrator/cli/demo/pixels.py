"""CartPole as a small image, drawn with numpy (no display, no extra system libraries)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

SIZE = 84  # as the DrQ papers use for Atari and DeepMind Control
_X_LIMIT = 2.4  # CartPole's track half-width


def render(state: np.ndarray, size: int = SIZE) -> np.ndarray:
    """(size, size, 3) uint8: a grey track, a blue cart at the cart position and a red
    pole at its angle."""
    x, _, theta, _ = (float(v) for v in state)
    img = np.full((size, size, 3), 255, np.uint8)
    track = int(size * 0.75)
    img[track, :] = (160, 160, 160)
    cx = round((x + _X_LIMIT) / (2 * _X_LIMIT) * (size - 1))
    cw, ch = max(2, size // 10), max(2, size // 16)
    img[track - ch : track, max(0, cx - cw) : cx + cw + 1] = (40, 70, 200)
    t = np.linspace(0.0, 1.0, size)
    length = size * 0.45
    px = np.clip(np.round(cx + t * length * np.sin(theta)), 0, size - 1).astype(int)
    py = np.clip(np.round(track - ch - t * length * np.cos(theta)), 0, size - 1).astype(int)
    img[py, px] = (210, 40, 40)
    return img


class Pixels(gym.ObservationWrapper):
    """Observations are :func:`render` images of the wrapped CartPole's state."""

    def __init__(self, env: gym.Env, size: int = SIZE) -> None:
        super().__init__(env)
        self.size = size
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 3), np.uint8)

    def observation(self, observation: Any) -> np.ndarray:
        return render(np.asarray(observation), self.size)
