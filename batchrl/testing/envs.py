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


class PixelSide(gym.Env):
    """A pixel task small enough to learn in seconds: each step shows a ``size`` x ``size``
    grayscale image (``Box(0, 255, (1, size, size), uint8)``) with a bright square in its left
    or right half, on a noisy background; action 0 (left) or 1 (right) earns 1.0 when it names
    the square's side. Episodes last ``length`` steps: a random policy scores ``length / 2``,
    one that reads the image ``length``."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 36, length: int = 10, render_mode: str | None = None):
        self.size, self.length, self.render_mode = size, length, render_mode
        self.observation_space = gym.spaces.Box(0, 255, (1, size, size), np.uint8)
        self.action_space = gym.spaces.Discrete(2)

    def _show(self) -> np.ndarray:
        size = self.size
        image = self.np_random.integers(0, 64, (1, size, size), dtype=np.uint8)
        self.side = int(self.np_random.integers(2))
        side = size // 2
        row = int(self.np_random.integers(0, size - side // 2 + 1))
        column = self.side * side + int(self.np_random.integers(0, side - side // 2 + 1))
        image[0, row:row + side // 2, column:column + side // 2] = 255
        self.image = image
        return image

    def reset(self, *, seed: int | None = None,
              options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.steps = 0
        return self._show(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float(int(action) == self.side)
        self.steps += 1
        return self._show(), reward, False, self.steps >= self.length, {}

    def render(self) -> np.ndarray:
        return np.repeat(self.image[0][..., None], 3, axis=2)


def pixel_side(**kwargs: Any) -> gym.Env:
    """``env.id = "batchrl.testing.envs:pixel_side"``: see ``PixelSide``."""
    return PixelSide(**kwargs)


class ImageAndFlag(PixelSide):
    """``PixelSide`` with a structured observation: the image and a ``flag`` (``Box(-1, 1, (2,),
    float32)``) whose first value, -1 or +1, says whether the action earning 1.0 names the
    square's side (+1) or the other one (-1); the second value is noise. Neither part alone beats
    a random policy's ``length / 2``: a network must combine the image with the vector.
    Observations are ``{"image": ..., "flag": ...}`` (``Dict``) or, with
    ``tuple_observations``, ``(image, flag)`` (``Tuple``). ``flips=False`` keeps the flag at +1:
    ``PixelSide`` with a vector beside the image."""

    def __init__(self, size: int = 36, length: int = 10, tuple_observations: bool = False,
                 flips: bool = True, render_mode: str | None = None):
        super().__init__(size, length, render_mode)
        self.flips = flips
        image = self.observation_space
        flag = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.tuple_observations = tuple_observations
        self.observation_space = (gym.spaces.Tuple((image, flag)) if tuple_observations
                                  else gym.spaces.Dict({"image": image, "flag": flag}))

    def _show(self) -> Any:
        image = super()._show()
        self.flipped = self.flips and bool(self.np_random.integers(2))
        flag = np.array([-1.0 if self.flipped else 1.0, self.np_random.uniform(-1, 1)],
                        np.float32)
        return (image, flag) if self.tuple_observations else {"image": image, "flag": flag}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        reward = float((int(action) == self.side) != self.flipped)
        self.steps += 1
        return self._show(), reward, False, self.steps >= self.length, {}


def image_and_flag(**kwargs: Any) -> gym.Env:
    """``env.id = "batchrl.testing.envs:image_and_flag"``: see ``ImageAndFlag``."""
    return ImageAndFlag(**kwargs)


class UnevenEpisodes(gym.Env):
    """Episodes whose length depends on the env: one seeded with an even seed plays episodes of
    ``short`` steps with reward 0, one seeded with an odd seed episodes of ``long`` steps with
    reward 1 per step (it keeps its kind over unseeded resets). For checking that evaluations
    count each env's episodes alike, however long they are."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, short: int = 2, long: int = 20):
        self.lengths = (short, long)
        self.odd = False
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None
              ) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self.odd = bool(seed % 2)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        done = self.t >= self.lengths[self.odd]
        return np.zeros(1, np.float32), float(self.odd), done, False, {}


def uneven_episodes(**kwargs: Any) -> gym.Env:
    """``env.id = "batchrl.testing.envs:uneven_episodes"``: see ``UnevenEpisodes``."""
    return UnevenEpisodes(**kwargs)
