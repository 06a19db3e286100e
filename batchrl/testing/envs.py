"""Small envs for tests and set-up checks that Gymnasium does not ship."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Uint8CartPole(gym.ObservationWrapper):
    """CartPole-v1 with its observation quantised to ``uint8`` (``Box(0, 255, (4,), uint8)``),
    as pixels are: for checking that observations of that dtype travel unconverted."""

    # Half-ranges of the quantised cart position, velocity, pole angle and angular velocity.
    _SCALE = np.array([2.4, 3.0, 0.21, 3.5], np.float64)

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (4,), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        unit = np.clip(observation / self._SCALE, -1.0, 1.0)
        return np.round((unit + 1.0) * 127.5).astype(np.uint8)


def uint8_cartpole(**kwargs: Any) -> gym.Env:
    """``env.id = "batchrl.testing.envs:uint8_cartpole"``: see ``Uint8CartPole``."""
    return Uint8CartPole(gym.make("CartPole-v1", **kwargs))
