"""The env wrappers the trainer applies, built from Gymnasium's own.

Gymnasium already ships ``TimeLimit``, ``ClipAction``, ``RescaleAction``,
``RescaleObservation``, ``TransformObservation`` and ``TransformReward``; this
module only decides when each applies and in which order.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import (ClipAction, RescaleAction, RescaleObservation, TimeLimit,
                                TransformObservation, TransformReward)

__all__ = ["ClipAction", "TimeLimit", "range_normalize", "convert_to_32bit", "wrap_env"]


def _finite_box(space: gym.Space) -> bool:
    return (isinstance(space, gym.spaces.Box)
            and bool(np.isfinite(space.low).all() and np.isfinite(space.high).all()))


def range_normalize(env: gym.Env) -> gym.Env:
    """Rescale finite Box observation and action ranges to ``[-1, 1]``.

    Spaces with an infinite bound (most MuJoCo observations) or that are not a
    Box are left alone, so policies always see and emit unit-range values
    where the env defines a range.
    """
    if _finite_box(env.observation_space):
        env = RescaleObservation(env, np.float32(-1), np.float32(1))
    if _finite_box(env.action_space):
        env = RescaleAction(env, np.float32(-1), np.float32(1))
    return env


def convert_to_32bit(env: gym.Env) -> gym.Env:
    """Make float observations ``float32`` and rewards ``np.float32``."""
    space = env.observation_space
    if isinstance(space, gym.spaces.Box) and space.dtype != np.float32:
        # Not DtypeObservation: it builds the new Box from float64 bounds and
        # warns about the lost precision on every env construction.
        space32 = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32),
                                 dtype=np.float32)
        env = TransformObservation(env, lambda obs: np.asarray(obs, np.float32), space32)
    return TransformReward(env, np.float32)


def check_time_limit(max_episode_steps: int) -> None:
    """Raise ``ValueError`` unless the time limit is a positive step count."""
    if max_episode_steps <= 0:
        raise ValueError(f"max_episode_steps must be positive, got {max_episode_steps}")


def wrap_env(env: gym.Env, max_episode_steps: int | None = None,
             normalize_ranges: bool = True) -> gym.Env:
    """Apply the trainer's wrappers in BatchPPO's order.

    ``TimeLimit`` (when ``max_episode_steps`` is given), then
    ``range_normalize`` (unless ``normalize_ranges`` is false), ``ClipAction``
    (Box actions only, so sampled Gaussian actions outside the range are
    clipped by the env, not by the policy) and ``convert_to_32bit``.

    An env from ``gymnasium.make`` keeps its registered time limit beneath
    this ``TimeLimit``, so the shorter of the two ends its episodes; to
    replace the registered one, build the env with ``resolve_constructor``'s
    ``max_episode_steps`` (as ``make_batch_env`` does) instead.
    """
    if max_episode_steps is not None:
        check_time_limit(max_episode_steps)
        env = TimeLimit(env, max_episode_steps)
    if normalize_ranges:
        env = range_normalize(env)
    if isinstance(env.action_space, gym.spaces.Box):
        env = ClipAction(env)
    return convert_to_32bit(env)
