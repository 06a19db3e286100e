"""Gymnasium's MuJoCo locomotion tasks stepped natively in batches: one vector env whose
simulations step in mjbatch's C++ thread pool (the GIL released), joined to batchrl as a
``BatchEnv`` member through ``env.backend = "vector"`` with
``env.vector_id = "batchrl.envs.mujoco_batch:make_vector"`` (the ``native`` extra).

Each simulation is a persistent ``MjData`` stepped by ``mj_step`` as Gymnasium's env steps
its own, so a trajectory is Gymnasium's v5 one (``wrap_env``'s action clipping and 32-bit
observations included) for the same initial state and actions; resets draw their noise from
one generator per env seeded as Gymnasium seeds its env's. Observations, rewards and
terminations are computed for the whole batch in numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space


@dataclasses.dataclass(frozen=True)
class Task:
    """The v5 keyword arguments of a locomotion task that this module computes itself, with
    Gymnasium's defaults (``xml_file`` and ``frame_skip`` go to Gymnasium, which builds the
    model). ``velocity_noise``: Gymnasium's reset draws ``qvel`` noise from a ``"normal"``
    or ``"uniform"`` distribution; ``clip_velocity``: observed velocities are clipped to
    [-10, 10]; ``healthy_*``: ``None`` where the task has no such condition."""

    forward_reward_weight: float = 1.0
    ctrl_cost_weight: float = 1e-3
    healthy_reward: float = 0.0
    terminate_when_unhealthy: bool = False
    healthy_z_range: tuple[float, float] | None = None
    healthy_angle_range: tuple[float, float] | None = None
    healthy_state_range: tuple[float, float] | None = None
    reset_noise_scale: float = 5e-3
    exclude_current_positions_from_observation: bool = True
    velocity_noise: str = "uniform"
    clip_velocity: bool = True


TASKS = {
    "HalfCheetah-v5": Task(ctrl_cost_weight=0.1, reset_noise_scale=0.1,
                           velocity_noise="normal", clip_velocity=False),
    "Hopper-v5": Task(healthy_reward=1.0, terminate_when_unhealthy=True,
                      healthy_z_range=(0.7, float("inf")), healthy_angle_range=(-0.2, 0.2),
                      healthy_state_range=(-100.0, 100.0)),
    "Walker2d-v5": Task(healthy_reward=1.0, terminate_when_unhealthy=True,
                        healthy_z_range=(0.8, 2.0), healthy_angle_range=(-1.0, 1.0)),
}
# Keyword arguments of these tasks that only Gymnasium's model building reads.
MODEL_ARGUMENTS = ("xml_file", "frame_skip")


class MujocoBatch(gym.vector.VectorEnv):
    """``num_envs`` copies of the MuJoCo task ``env_id`` (one of ``TASKS``) stepped together.

    Observations ``(num_envs, obs_size)`` float32, rewards ``(num_envs,)`` float32, actions
    ``(num_envs, action_size)``, clipped to the action space as ``wrap_env`` clips them;
    next-step autoreset, and ``reset(seed=..., options={"reset_mask": mask})`` with one seed
    per env reset (``VectorWorker``'s conditions). Episodes are truncated at
    ``max_episode_steps`` or the task's registered limit, whichever is shorter.

    Args:
      env_id: the Gymnasium id, for example ``"HalfCheetah-v5"``.
      max_episode_steps: the time limit (``env.max_length``); none: the registered one.
      num_threads: mjbatch's threads (0: one per usable core, at most one per env).
      kwargs: the task's v5 keyword arguments (``Task``'s fields, ``xml_file``,
        ``frame_skip``).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 num_threads: int = 0, **kwargs: Any):
        from mjbatch import Batch  # (the native extra)

        if env_id not in TASKS:
            raise ValueError(f"no native batched version of {env_id!r}; available: "
                             f"{', '.join(TASKS)} (other envs: env.backend 'workers')")
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        fields = {field.name for field in dataclasses.fields(Task)} - {"velocity_noise",
                                                                       "clip_velocity"}
        unknown = sorted(set(kwargs) - fields - set(MODEL_ARGUMENTS))
        if unknown:
            raise TypeError(f"{env_id} takes no keyword argument {unknown[0]!r} natively; "
                            f"known: {', '.join(sorted(fields | set(MODEL_ARGUMENTS)))}")
        self.task = dataclasses.replace(TASKS[env_id], **{
            name: tuple(value) if isinstance(value, list) else value
            for name, value in kwargs.items() if name in fields})
        # Gymnasium builds the model (and checks the arguments); its env is not stepped.
        template = gym.make(env_id, **kwargs)
        limit = template.spec.max_episode_steps if template.spec else None
        env = template.unwrapped
        self.model, self.frame_skip, self.dt = env.model, env.frame_skip, env.dt
        self.init_qpos, self.init_qvel = env.init_qpos.copy(), env.init_qvel.copy()
        self.num_envs = num_envs
        self.single_action_space = env.action_space
        space = env.observation_space
        self.single_observation_space = gym.spaces.Box(
            space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        template.close()
        limits = [value for value in (limit, max_episode_steps) if value is not None]
        self.max_episode_steps = min(limits) if limits else None
        self.batch = Batch(self.model, num_envs, num_threads=min(num_threads, num_envs))
        self.qpos, self.qvel = self.batch.bind("qpos"), self.batch.bind("qvel")
        self.ctrl = self.batch.bind("ctrl")
        self._low = self.single_action_space.low.astype(np.float32)
        self._high = self.single_action_space.high.astype(np.float32)
        self._rngs = [seeding.np_random()[0] for _ in range(num_envs)]
        self._elapsed = np.zeros(num_envs, np.int64)
        self._ended = np.zeros(num_envs, bool)

    def _observe(self) -> np.ndarray:
        position = self.qpos[:, 1:] if self.task.exclude_current_positions_from_observation \
            else self.qpos
        velocity = np.clip(self.qvel, -10, 10) if self.task.clip_velocity else self.qvel
        return np.concatenate([position, velocity], axis=1).astype(np.float32)

    def _healthy(self) -> np.ndarray:
        """``(num_envs,)`` bool: each simulation within the task's healthy ranges."""
        task, qpos = self.task, self.qpos
        healthy = np.ones(self.num_envs, bool)
        for values, bounds in ((qpos[:, 1], task.healthy_z_range),
                               (qpos[:, 2], task.healthy_angle_range)):
            if bounds is not None:
                healthy &= (bounds[0] < values) & (values < bounds[1])
        if task.healthy_state_range is not None:
            low, high = task.healthy_state_range
            state = np.concatenate([qpos, self.qvel], axis=1)[:, 2:]
            healthy &= ((low < state) & (state < high)).all(axis=1)
        return healthy

    def _reset(self, indices: np.ndarray) -> None:
        """Gymnasium's ``reset_model`` for the simulations at ``indices``: the initial state
        plus noise from each env's generator."""
        self.batch.reset(indices)
        scale = self.task.reset_noise_scale
        for index in indices:  # (one generator per env: resets only, not every step)
            rng = self._rngs[index]
            self.qpos[index] = self.init_qpos + rng.uniform(-scale, scale, self.model.nq)
            noise = (scale * rng.standard_normal(self.model.nv)
                     if self.task.velocity_noise == "normal"
                     else rng.uniform(-scale, scale, self.model.nv))
            self.qvel[index] = self.init_qvel + noise
        self.batch.forward(indices)
        self._elapsed[indices] = 0
        self._ended[indices] = False

    def reset(self, *, seed: int | np.ndarray | list | None = None,
              options: dict | None = None) -> tuple[np.ndarray, dict]:
        mask = (options or {}).get("reset_mask")
        mask = np.ones(self.num_envs, bool) if mask is None else np.asarray(mask, bool)
        indices = np.flatnonzero(mask)
        if seed is not None:
            seeds = (np.asarray(seed, np.int64).reshape(-1) if not isinstance(seed, int)
                     else seed + np.arange(len(indices)))
            if len(seeds) != len(indices):
                raise ValueError(f"reset: {len(seeds)} seeds for {len(indices)} envs")
            for index, value in zip(indices, seeds):
                if value >= 0:  # (-1: this env keeps its generator)
                    self._rngs[index] = seeding.np_random(int(value))[0]
        self._reset(indices)
        return self._observe(), {"x_position": self.qpos[:, 0].copy()}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray, dict]:
        actions = np.asarray(actions, np.float32)
        shape = (self.num_envs, *self.single_action_space.shape)
        if actions.shape != shape:
            raise ValueError(f"actions must have shape {shape}, got {actions.shape}")
        if not np.isfinite(actions).all():
            raise ValueError(f"actions must be finite; envs "
                             f"{np.flatnonzero(~np.isfinite(actions).all(1)).tolist()} got "
                             f"NaN or inf")
        task, ended = self.task, self._ended.copy()
        stepping = ~ended
        action = np.clip(actions, self._low, self._high)
        before = self.qpos[:, 0].copy()
        self.ctrl[stepping] = action[stepping]
        if stepping.any():
            self.batch.step(stepping, nstep=self.frame_skip)
        if ended.any():  # next-step autoreset: these envs start anew instead
            self._reset(np.flatnonzero(ended))
        x_velocity = (self.qpos[:, 0] - before) / self.dt
        forward = task.forward_reward_weight * x_velocity
        ctrl_cost = task.ctrl_cost_weight * np.square(action).sum(axis=1)
        healthy = self._healthy()
        survive = healthy * task.healthy_reward
        reward = forward + survive - ctrl_cost
        terminated = ~healthy & task.terminate_when_unhealthy & stepping
        self._elapsed[stepping] += 1
        truncated = (np.zeros(self.num_envs, bool) if self.max_episode_steps is None
                     else (self._elapsed >= self.max_episode_steps) & stepping)
        reward[ended] = 0.0
        self._ended = terminated | truncated
        info = {"x_position": self.qpos[:, 0].copy(), "x_velocity": x_velocity,
                "reward_forward": forward, "reward_ctrl": -ctrl_cost}
        if task.healthy_reward:
            info["reward_survive"] = survive
        # (float32 as wrap_env's rewards)
        return self._observe(), reward.astype(np.float32), terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        self.closed = True


def make_vector(num_envs: int, env_id: str = "HalfCheetah-v5",
                max_episode_steps: int | None = None, num_threads: int = 0,
                **kwargs: Any) -> MujocoBatch:
    """``MujocoBatch(env_id, num_envs, ...)``, for ``env.vector_id =
    "batchrl.envs.mujoco_batch:make_vector"`` with ``env.kwargs = {env_id = "Hopper-v5"}``."""
    return MujocoBatch(env_id, num_envs, max_episode_steps, num_threads, **kwargs)
