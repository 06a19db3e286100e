"""Gymnasium's MuJoCo tasks stepped natively in batches (``TASKS``): one vector env whose
simulations step in mjbatch's C++ thread pool (the GIL released), joined to batchrl as a
``BatchEnv`` member by ``env.backend = "native"`` (the ``native`` extra), which is backend
``"vector"`` with ``env.vector_id = "batchrl.envs.mujoco_batch:make_vector"``.

Each simulation is a persistent ``MjData`` stepped by ``mj_step`` as Gymnasium's env steps
its own, so a trajectory is Gymnasium's v5 one (``wrap_env``'s action clipping and 32-bit
observations included) for the same initial state and actions; resets draw their noise from
one generator per env seeded as Gymnasium seeds its env's. Observations, rewards and
terminations are computed for the whole batch in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space


class Task:
    """What a task computes on top of its simulations ``sims`` (a ``MujocoBatch``: its live
    ``(num_envs, ...)`` views ``qpos``, ``qvel``, ``body_position(name)``), for the whole
    batch in numpy. Its dataclass fields are the task's v5 keyword arguments with Gymnasium's
    defaults, besides ``xml_file`` and ``frame_skip`` (Gymnasium builds the model); fields
    with ``metadata={"fixed": True}`` are the task's own, not arguments."""

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One env's initial ``(qpos, qvel)``, drawn as Gymnasium's ``reset_model`` draws
        them from the env's generator ``rng``."""
        raise NotImplementedError

    def before_step(self, sims: Any) -> np.ndarray:
        """What ``outcome`` needs from the state before a step: the x positions."""
        return sims.qpos[:, 0].copy()

    def observe(self, sims: Any) -> np.ndarray:
        """The observations ``(num_envs, obs_size)`` float64."""
        raise NotImplementedError

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """Each env's reward and whether it terminated, after a step from ``before`` with the
        clipped ``action``, and the step's infos (arrays)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Locomotion(Task):
    """HalfCheetah, Hopper and Walker2d: forward speed rewarded, control penalised, and
    (``healthy_*``, ``None`` where the task has no such condition) a healthy state.
    ``velocity_noise``: Gymnasium's reset draws ``qvel`` noise from a ``"normal"`` or
    ``"uniform"`` distribution; ``clip_velocity``: observed velocities are clipped to
    [-10, 10] (these two are the task's, not keyword arguments)."""

    forward_reward_weight: float = 1.0
    ctrl_cost_weight: float = 1e-3
    healthy_reward: float = 0.0
    terminate_when_unhealthy: bool = False
    healthy_z_range: tuple[float, float] | None = None
    healthy_angle_range: tuple[float, float] | None = None
    healthy_state_range: tuple[float, float] | None = None
    reset_noise_scale: float = 5e-3
    exclude_current_positions_from_observation: bool = True
    velocity_noise: str = dataclasses.field(default="uniform", metadata={"fixed": True})
    clip_velocity: bool = dataclasses.field(default=True, metadata={"fixed": True})

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale = self.reset_noise_scale
        qpos = init_qpos + rng.uniform(-scale, scale, init_qpos.size)
        noise = (scale * rng.standard_normal(init_qvel.size) if self.velocity_noise == "normal"
                 else rng.uniform(-scale, scale, init_qvel.size))
        return qpos, init_qvel + noise

    def observe(self, sims: Any) -> np.ndarray:
        qpos = sims.qpos[:, 1:] if self.exclude_current_positions_from_observation else sims.qpos
        velocity = np.clip(sims.qvel, -10, 10) if self.clip_velocity else sims.qvel
        return np.concatenate([qpos, velocity], axis=1)

    def _healthy(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        healthy = np.ones(len(qpos), bool)
        for values, bounds in ((qpos[:, 1], self.healthy_z_range),
                               (qpos[:, 2], self.healthy_angle_range)):
            if bounds is not None:
                healthy &= (bounds[0] < values) & (values < bounds[1])
        if self.healthy_state_range is not None:
            low, high = self.healthy_state_range
            state = np.concatenate([qpos, qvel], axis=1)[:, 2:]
            healthy &= ((low < state) & (state < high)).all(axis=1)
        return healthy

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        qpos, qvel = sims.qpos, sims.qvel
        x_velocity = (qpos[:, 0] - before) / sims.dt
        forward = self.forward_reward_weight * x_velocity
        ctrl_cost = self.ctrl_cost_weight * np.square(action).sum(axis=1)
        healthy = self._healthy(qpos, qvel)
        survive = healthy * self.healthy_reward
        info = {"x_position": qpos[:, 0].copy(), "x_velocity": x_velocity,
                "reward_forward": forward, "reward_ctrl": -ctrl_cost}
        if self.healthy_reward:
            info["reward_survive"] = survive
        return (forward + survive - ctrl_cost, ~healthy & self.terminate_when_unhealthy,
                info)


@dataclasses.dataclass(frozen=True)
class Reacher(Task):
    """Reacher: the fingertip's distance to a random target penalised, and control."""

    reward_dist_weight: float = 1.0
    reward_control_weight: float = 1.0

    @staticmethod
    def _to_target(sims: Any) -> np.ndarray:
        return sims.body_position("fingertip") - sims.body_position("target")

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        qpos = rng.uniform(-0.1, 0.1, init_qpos.size) + init_qpos
        while True:  # Gymnasium's rejection sampling of the target, draw for draw
            goal = rng.uniform(-0.2, 0.2, 2)
            if np.linalg.norm(goal) < 0.2:
                break
        qpos[-2:] = goal
        qvel = init_qvel + rng.uniform(-0.005, 0.005, init_qvel.size)
        qvel[-2:] = 0
        return qpos, qvel

    def observe(self, sims: Any) -> np.ndarray:
        theta = sims.qpos[:, :2]
        return np.concatenate([np.cos(theta), np.sin(theta), sims.qpos[:, 2:],
                               sims.qvel[:, :2], self._to_target(sims)[:, :2]], axis=1)

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        distance = -np.linalg.norm(self._to_target(sims), axis=1) * self.reward_dist_weight
        control = -np.square(action).sum(axis=1) * self.reward_control_weight
        return (distance + control, np.zeros(sims.num_envs, bool),
                {"reward_dist": distance, "reward_ctrl": control})


TASKS: dict[str, Task] = {
    "HalfCheetah-v5": Locomotion(ctrl_cost_weight=0.1, reset_noise_scale=0.1,
                                 velocity_noise="normal", clip_velocity=False),
    "Hopper-v5": Locomotion(healthy_reward=1.0, terminate_when_unhealthy=True,
                            healthy_z_range=(0.7, float("inf")),
                            healthy_angle_range=(-0.2, 0.2),
                            healthy_state_range=(-100.0, 100.0)),
    "Walker2d-v5": Locomotion(healthy_reward=1.0, terminate_when_unhealthy=True,
                              healthy_z_range=(0.8, 2.0), healthy_angle_range=(-1.0, 1.0)),
    "Reacher-v5": Reacher(),
}
# Keyword arguments of these tasks that only Gymnasium's model building reads.
MODEL_ARGUMENTS = ("xml_file", "frame_skip")


def task_arguments(env_id: str) -> set[str]:
    """The v5 keyword arguments ``TASKS[env_id]`` computes with (besides
    ``MODEL_ARGUMENTS``)."""
    return {field.name for field in dataclasses.fields(TASKS[env_id])
            if not field.metadata.get("fixed")}


def steps_natively(env_id: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``MujocoBatch`` steps ``env_id`` with ``kwargs``: a task of ``TASKS``, keyword
    arguments it knows, and mjbatch (the ``native`` extra) installed."""
    if env_id not in TASKS or importlib.util.find_spec("mjbatch") is None:
        return False
    return set(kwargs or {}) <= task_arguments(env_id) | set(MODEL_ARGUMENTS)


class MujocoBatch(gym.vector.VectorEnv):
    """``num_envs`` copies of the MuJoCo task ``env_id`` (one of ``TASKS``) stepped together,
    the simulations by mjbatch, the rest by the env's ``Task``.

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
        task = TASKS[env_id]
        fields = task_arguments(env_id)
        unknown = sorted(set(kwargs) - fields - set(MODEL_ARGUMENTS))
        if unknown:
            raise TypeError(f"{env_id} takes no keyword argument {unknown[0]!r} natively; "
                            f"known: {', '.join(sorted(fields | set(MODEL_ARGUMENTS)))}")
        self.task = dataclasses.replace(task, **{
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
        self.ctrl, self._xpos = self.batch.bind("ctrl"), self.batch.bind("xpos")
        self._bodies: dict[str, int] = {}
        self._low = self.single_action_space.low.astype(np.float32)
        self._high = self.single_action_space.high.astype(np.float32)
        self._rngs = [seeding.np_random()[0] for _ in range(num_envs)]
        self._elapsed = np.zeros(num_envs, np.int64)
        self._ended = np.zeros(num_envs, bool)

    def body_position(self, name: str) -> np.ndarray:
        """The position of body ``name`` in each simulation, ``(num_envs, 3)`` (MjData's
        ``xpos``: after a step, of the last substep's start, as Gymnasium reads it)."""
        index = self._bodies.get(name)
        if index is None:
            import mujoco

            index = self._bodies[name] = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY,
                                                           name)
        return self._xpos[:, index]

    def _observe(self) -> np.ndarray:
        return self.task.observe(self).astype(np.float32)

    def _reset(self, indices: np.ndarray) -> None:
        """Gymnasium's ``reset_model`` for the simulations at ``indices``: the initial state
        plus noise from each env's generator."""
        self.batch.reset(indices)
        for index in indices:  # (one generator per env: resets only, not every step)
            self.qpos[index], self.qvel[index] = self.task.reset_state(
                self._rngs[index], self.init_qpos, self.init_qvel)
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
        return self._observe(), {}

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
        ended = self._ended.copy()
        stepping = ~ended
        action = np.clip(actions, self._low, self._high)
        before = self.task.before_step(self)
        self.ctrl[stepping] = action[stepping]
        if stepping.any():
            self.batch.step(stepping, nstep=self.frame_skip)
        if ended.any():  # next-step autoreset: these envs start anew instead
            self._reset(np.flatnonzero(ended))
        reward, terminated, info = self.task.outcome(self, before, action)
        terminated &= stepping
        self._elapsed[stepping] += 1
        truncated = (np.zeros(self.num_envs, bool) if self.max_episode_steps is None
                     else (self._elapsed >= self.max_episode_steps) & stepping)
        reward[ended] = 0.0
        self._ended = terminated | truncated
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
