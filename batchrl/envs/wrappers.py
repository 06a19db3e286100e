"""The env wrappers the trainer applies (Gymnasium's own), and when and in which order."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import (ClipAction, RescaleAction, RescaleObservation, TimeLimit,
                                TransformObservation, TransformReward)

from batchrl.pixels import is_pixel_space

__all__ = ["ClipAction", "TimeLimit", "range_normalize", "convert_to_32bit", "wrap_env"]


def _finite_box(space: gym.Space) -> bool:
    return (isinstance(space, gym.spaces.Box) and not is_pixel_space(space)
            and bool(np.isfinite(space.low).all() and np.isfinite(space.high).all()))


def range_normalize(env: gym.Env) -> gym.Env:
    """Rescale finite Box observation and action ranges to ``[-1, 1]``; other spaces (like
    most MuJoCo observations, with infinite bounds) and ``uint8`` pixels stay as they are.
    Integer observations become ``float32`` first (rescaled as integers they would round);
    a dimension whose bounds are equal (a constant) becomes 0; integer action Boxes stay as
    they are (the env takes integers in their own range)."""
    space = env.observation_space
    if _finite_box(space):
        if not np.issubdtype(space.dtype, np.floating):
            env = _float32_observations(env)
        space = env.observation_space
        constant = space.low == space.high
        if constant.any():
            # RescaleObservation divides by high - low: bounds of low -+ 1 map the constant
            # to 0 by the same arithmetic (the observations pass unchanged).
            low, high = space.low.copy(), space.high.copy()
            low[constant] -= 1
            high[constant] += 1
            env = TransformObservation(env, lambda obs: obs,
                                       gym.spaces.Box(low, high, dtype=space.dtype))
        env = RescaleObservation(env, np.float32(-1), np.float32(1))
    action = env.action_space
    if _finite_box(action) and np.issubdtype(action.dtype, np.floating):
        env = RescaleAction(env, np.float32(-1), np.float32(1))
    return env


def _float32_observations(env: gym.Env) -> gym.Env:
    """``env`` with its Box observations as ``float32``, unless they are that or pixels."""
    space = env.observation_space
    if (isinstance(space, gym.spaces.Box) and space.dtype != np.float32
            and not is_pixel_space(space)):
        # Not DtypeObservation: it builds the new Box from float64 bounds and
        # warns about the lost precision on every env construction.
        space32 = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32),
                                 dtype=np.float32)
        env = TransformObservation(env, lambda obs: np.asarray(obs, np.float32), space32)
    return env


def convert_to_32bit(env: gym.Env) -> gym.Env:
    """Make Box observations other than ``uint8`` pixels (``is_pixel_space``) ``float32``,
    and rewards ``np.float32``."""
    return TransformReward(_float32_observations(env), np.float32)


def check_time_limit(max_episode_steps: int) -> None:
    """Raise ``ValueError`` unless the time limit is a positive step count."""
    if max_episode_steps <= 0:
        raise ValueError(f"max_episode_steps must be positive, got {max_episode_steps}")


def wrap_env(env: gym.Env, max_episode_steps: int | None = None,
             normalize_ranges: bool = True) -> gym.Env:
    """Apply the trainer's wrappers in BatchPPO's order: ``TimeLimit`` (when ``max_episode_steps``
    is given), ``range_normalize`` (if ``normalize_ranges``), ``ClipAction`` (Box actions: the env
    clips sampled Gaussian actions, not the policy) and ``convert_to_32bit``. An env's registered
    time limit stays beneath this ``TimeLimit`` (the shorter ends episodes);
    ``resolve_constructor``'s ``max_episode_steps`` replaces it."""
    if max_episode_steps is not None:
        check_time_limit(max_episode_steps)
        env = TimeLimit(env, max_episode_steps)
    if normalize_ranges:
        env = range_normalize(env)
    if isinstance(env.action_space, gym.spaces.Box):
        bounds = env.action_space
        env = ClipAction(env)
        # Gymnasium shows the clipped space unbounded (it takes any action); the algorithms
        # see the range the env acts in (SAC squashes its actions into it).
        env.action_space = bounds
    return convert_to_32bit(env)
