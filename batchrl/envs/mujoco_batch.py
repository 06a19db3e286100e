"""Gymnasium's MuJoCo tasks stepped natively in batches (``TASKS``): one vector env whose
simulations step in native threads (the GIL released), joined to batchrl as a ``BatchEnv``
member by ``env.backend = "native"`` (the ``native`` extra), which is backend ``"vector"`` with
``env.vector_id = "batchrl.envs.mujoco_batch:make_vector"``.

The simulations step in mjbatch's C++ thread pool, except those of the tasks whose observations
or rewards read the contact forces ``cfrc_ext`` (Ant, Humanoid): Gymnasium computes them after
each step with ``mj_rnePostConstraint``, which mjbatch does not call, so these step in
``ThreadedSims`` (a standard-library thread pool calling MuJoCo's ``mj_step`` and
``mj_rnePostConstraint``; the per-simulation Python is small next to their steps).

Each simulation is a persistent ``MjData`` stepped by ``mj_step`` as Gymnasium's env steps
its own, so a trajectory is Gymnasium's v5 one (``wrap_env``'s action clipping and 32-bit
observations included) for the same initial state and actions; resets draw their noise from
one generator per env seeded as Gymnasium seeds its env's. Observations, rewards,
terminations and the infos (Gymnasium's vector env's: an env that starts anew has its reset
infos) are computed for the whole batch in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space
from gymnasium.wrappers.utils import rescale_box

from batchrl.envs.wrappers import check_time_limit
from batchrl.hardware import usable_cores


class Task:
    """What a task computes on top of its simulations ``sims`` (a ``MujocoBatch``: its
    ``(num_envs, ...)`` arrays ``qpos``, ``qvel``, ``body_position(name)`` and ``field(name)``
    of any ``MjData`` field), for the whole batch in numpy. Its dataclass fields are the
    task's v5 keyword arguments with Gymnasium's defaults, besides ``xml_file`` and
    ``frame_skip`` (Gymnasium builds the model); fields with ``metadata={"fixed": True}`` are
    the task's own, not arguments. ``contact_forces``: the task reads ``cfrc_ext``, which
    Gymnasium computes after each step (``ThreadedSims`` steps it)."""

    contact_forces: ClassVar[bool] = False

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

    def state_info(self, sims: Any) -> dict[str, np.ndarray]:
        """Gymnasium's reset infos of the current states (``(num_envs, ...)`` arrays), which
        its step infos hold too: none by default."""
        return {}

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """Each env's reward and whether it terminated, after a step from ``before`` with the
        clipped ``action``, and the step's infos as Gymnasium's env gives them (arrays;
        ``state_info``'s among them)."""
        raise NotImplementedError


def _noisy_state(rng: np.random.Generator, init_qpos: np.ndarray, init_qvel: np.ndarray,
                 scale: float, velocity_noise: str) -> tuple[np.ndarray, np.ndarray]:
    """Gymnasium's ``reset_model`` of the locomotion tasks: positions plus uniform noise in
    ``[-scale, scale]``, velocities plus ``"normal"`` (``scale`` times a standard normal) or
    ``"uniform"`` noise, drawn in that order from ``rng``."""
    qpos = init_qpos + rng.uniform(-scale, scale, init_qpos.size)
    noise = (scale * rng.standard_normal(init_qvel.size) if velocity_noise == "normal"
             else rng.uniform(-scale, scale, init_qvel.size))
    return qpos, init_qvel + noise


@dataclasses.dataclass(frozen=True)
class Locomotion(Task):
    """HalfCheetah, Hopper and Walker2d: forward speed rewarded, control penalised, and
    (``healthy_*``, ``None`` where the task has no such condition) a healthy state.
    ``velocity_noise``: Gymnasium's reset draws ``qvel`` noise from a ``"normal"`` or
    ``"uniform"`` distribution; ``clip_velocity``: observed velocities are clipped to
    [-10, 10]; ``stands`` (Hopper, Walker2d): the infos have the survival reward and the
    torso's height from its initial one; ``not_arguments``: the fields the env's Gymnasium
    version takes no keyword argument for (these four are the task's, not keyword
    arguments)."""

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
    stands: bool = dataclasses.field(default=False, metadata={"fixed": True})
    not_arguments: frozenset[str] = dataclasses.field(default=frozenset(),
                                                      metadata={"fixed": True})

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _noisy_state(rng, init_qpos, init_qvel, self.reset_noise_scale,
                            self.velocity_noise)

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
        info = {**self.state_info(sims), "x_velocity": x_velocity,
                "reward_forward": forward, "reward_ctrl": -ctrl_cost}
        if not self.stands:  # (HalfCheetah)
            return forward - ctrl_cost, np.zeros(len(qpos), bool), info
        healthy = self._healthy(qpos, qvel)
        info["reward_survive"] = survive = healthy * self.healthy_reward
        return (forward + survive - ctrl_cost, ~healthy & self.terminate_when_unhealthy,
                info)

    def state_info(self, sims: Any) -> dict[str, np.ndarray]:
        info = {"x_position": sims.qpos[:, 0].copy()}
        if self.stands:
            info["z_distance_from_origin"] = sims.qpos[:, 1] - sims.init_qpos[1]
        return info


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


def _pair(values: np.ndarray) -> np.ndarray:
    """``(num_envs, 2)`` x and y rows of ``values`` as Gymnasium copies them before a step."""
    return values[:, :2].copy()


@dataclasses.dataclass(frozen=True)
class Ant(Task):
    """Ant: the main body's forward speed rewarded, control and (clipped) contact forces
    penalised, a healthy torso height; the clipped contact forces observed."""

    forward_reward_weight: float = 1.0
    ctrl_cost_weight: float = 0.5
    contact_cost_weight: float = 5e-4
    healthy_reward: float = 1.0
    main_body: int | str = 1
    terminate_when_unhealthy: bool = True
    healthy_z_range: tuple[float, float] = (0.2, 1.0)
    contact_force_range: tuple[float, float] = (-1.0, 1.0)
    reset_noise_scale: float = 0.1
    exclude_current_positions_from_observation: bool = True
    include_cfrc_ext_in_observation: bool = True

    contact_forces: ClassVar[bool] = True

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _noisy_state(rng, init_qpos, init_qvel, self.reset_noise_scale, "normal")

    def before_step(self, sims: Any) -> np.ndarray:
        return _pair(sims.body_position(self.main_body))

    def _clipped_forces(self, sims: Any) -> np.ndarray:
        return np.clip(sims.field("cfrc_ext"), *self.contact_force_range)

    def observe(self, sims: Any) -> np.ndarray:
        qpos = sims.qpos[:, 2:] if self.exclude_current_positions_from_observation else sims.qpos
        parts = [qpos, sims.qvel]
        if self.include_cfrc_ext_in_observation:
            parts.append(self._clipped_forces(sims)[:, 1:].reshape(sims.num_envs, -1))
        return np.concatenate(parts, axis=1)

    def state_info(self, sims: Any) -> dict[str, np.ndarray]:
        qpos = sims.qpos
        return {"x_position": qpos[:, 0].copy(), "y_position": qpos[:, 1].copy(),
                "distance_from_origin": np.linalg.norm(qpos[:, :2], axis=1)}

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        qpos, qvel = sims.qpos, sims.qvel
        velocity = (_pair(sims.body_position(self.main_body)) - before) / sims.dt
        forward = velocity[:, 0] * self.forward_reward_weight
        low, high = self.healthy_z_range
        healthy = (np.isfinite(qpos).all(axis=1) & np.isfinite(qvel).all(axis=1)
                   & (low <= qpos[:, 2]) & (qpos[:, 2] <= high))
        survive = healthy * self.healthy_reward
        ctrl_cost = self.ctrl_cost_weight * np.square(action).sum(axis=1)
        forces = self._clipped_forces(sims).reshape(sims.num_envs, -1)
        contact_cost = self.contact_cost_weight * np.square(forces).sum(axis=1)
        info = {**self.state_info(sims), "x_velocity": velocity[:, 0],
                "y_velocity": velocity[:, 1], "reward_forward": forward,
                "reward_ctrl": -ctrl_cost, "reward_contact": -contact_cost,
                "reward_survive": survive}
        return ((forward + survive) - (ctrl_cost + contact_cost),
                ~healthy & self.terminate_when_unhealthy, info)


@dataclasses.dataclass(frozen=True)
class Humanoid(Task):
    """Humanoid: the centre of mass's forward speed rewarded, control and contact forces
    penalised, a healthy torso height; centre-of-mass inertias and velocities, actuator and
    contact forces observed."""

    forward_reward_weight: float = 1.25
    ctrl_cost_weight: float = 0.1
    contact_cost_weight: float = 5e-7
    contact_cost_range: tuple[float, float] = (-np.inf, 10.0)
    healthy_reward: float = 5.0
    terminate_when_unhealthy: bool = True
    healthy_z_range: tuple[float, float] = (1.0, 2.0)
    reset_noise_scale: float = 1e-2
    exclude_current_positions_from_observation: bool = True
    include_cinert_in_observation: bool = True
    include_cvel_in_observation: bool = True
    include_qfrc_actuator_in_observation: bool = True
    include_cfrc_ext_in_observation: bool = True

    contact_forces: ClassVar[bool] = True

    def reset_state(self, rng: np.random.Generator, init_qpos: np.ndarray,
                    init_qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _noisy_state(rng, init_qpos, init_qvel, self.reset_noise_scale, "uniform")

    @staticmethod
    def _mass_centre(sims: Any) -> np.ndarray:
        mass = sims.model.body_mass
        return (np.einsum("b,nbj->nj", mass, sims.field("xipos")) / mass.sum())[:, :2]

    def before_step(self, sims: Any) -> np.ndarray:
        return self._mass_centre(sims)

    def observe(self, sims: Any) -> np.ndarray:
        count = sims.num_envs
        qpos = sims.qpos[:, 2:] if self.exclude_current_positions_from_observation else sims.qpos
        parts = [qpos, sims.qvel]
        for name, include in (("cinert", self.include_cinert_in_observation),
                              ("cvel", self.include_cvel_in_observation)):
            if include:
                parts.append(sims.field(name)[:, 1:].reshape(count, -1))
        if self.include_qfrc_actuator_in_observation:
            parts.append(sims.field("qfrc_actuator")[:, 6:])
        if self.include_cfrc_ext_in_observation:
            parts.append(sims.field("cfrc_ext")[:, 1:].reshape(count, -1))
        return np.concatenate(parts, axis=1)

    def state_info(self, sims: Any) -> dict[str, np.ndarray]:
        qpos = sims.qpos
        return {"x_position": qpos[:, 0].copy(), "y_position": qpos[:, 1].copy(),
                "tendon_length": sims.field("ten_length").copy(),
                "tendon_velocity": sims.field("ten_velocity").copy(),
                "distance_from_origin": np.linalg.norm(qpos[:, :2], axis=1)}

    def outcome(self, sims: Any, before: np.ndarray,
                action: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        qpos = sims.qpos
        velocity = (self._mass_centre(sims) - before) / sims.dt
        forward = self.forward_reward_weight * velocity[:, 0]
        low, high = self.healthy_z_range
        healthy = (low < qpos[:, 2]) & (qpos[:, 2] < high)
        survive = healthy * self.healthy_reward
        # (the applied controls, float64, as Gymnasium reads them)
        ctrl_cost = self.ctrl_cost_weight * np.square(sims.field("ctrl")).sum(axis=1)
        forces = sims.field("cfrc_ext").reshape(sims.num_envs, -1)
        contact_cost = np.clip(self.contact_cost_weight * np.square(forces).sum(axis=1),
                               *self.contact_cost_range)
        info = {**self.state_info(sims), "x_velocity": velocity[:, 0],
                "y_velocity": velocity[:, 1], "reward_survive": survive,
                "reward_forward": forward, "reward_ctrl": -ctrl_cost,
                "reward_contact": -contact_cost}
        return ((forward + survive) - (ctrl_cost + contact_cost),
                ~healthy & self.terminate_when_unhealthy, info)


TASKS: dict[str, Task] = {
    "HalfCheetah-v5": Locomotion(ctrl_cost_weight=0.1, reset_noise_scale=0.1,
                                 velocity_noise="normal", clip_velocity=False,
                                 not_arguments=frozenset({
                                     "healthy_reward", "terminate_when_unhealthy",
                                     "healthy_z_range", "healthy_angle_range",
                                     "healthy_state_range"})),
    "Hopper-v5": Locomotion(healthy_reward=1.0, terminate_when_unhealthy=True,
                            healthy_z_range=(0.7, float("inf")),
                            healthy_angle_range=(-0.2, 0.2),
                            healthy_state_range=(-100.0, 100.0), stands=True),
    "Walker2d-v5": Locomotion(healthy_reward=1.0, terminate_when_unhealthy=True,
                              healthy_z_range=(0.8, 2.0), healthy_angle_range=(-1.0, 1.0),
                              stands=True, not_arguments=frozenset({"healthy_state_range"})),
    "Reacher-v5": Reacher(),
    "Ant-v5": Ant(),
    "Humanoid-v5": Humanoid(),
}
# Keyword arguments of these tasks that only Gymnasium's model building reads.
MODEL_ARGUMENTS = ("xml_file", "frame_skip")


def task_arguments(env_id: str) -> set[str]:
    """The v5 keyword arguments ``TASKS[env_id]`` computes with (besides
    ``MODEL_ARGUMENTS``): its fields but the task's own and those its env takes no argument
    for (one task class, ``Locomotion``, serves envs with different arguments)."""
    task = TASKS[env_id]
    return {field.name for field in dataclasses.fields(task) if not field.metadata.get("fixed")
            and field.name not in getattr(task, "not_arguments", ())}


def steps_natively(env_id: str, kwargs: dict[str, Any] | None = None) -> bool:
    """Whether ``MujocoBatch`` steps ``env_id`` with ``kwargs``: a task of ``TASKS``, keyword
    arguments it knows, and mjbatch (the ``native`` extra) installed."""
    if env_id not in TASKS or importlib.util.find_spec("mjbatch") is None:
        return False
    return set(kwargs or {}) <= task_arguments(env_id) | set(MODEL_ARGUMENTS)


class ThreadedSims:
    """``num_sims`` simulations of ``model``, one ``MjData`` each, stepped as Gymnasium's
    ``MujocoEnv`` steps its one: ``mj_step``, then ``mj_rnePostConstraint`` (the contact forces
    ``cfrc_ext``, which mjbatch does not compute). A thread pool of ``num_threads`` (0: one
    per usable core; at most one per simulation, the calling thread one of them) steps the
    simulations, each thread taking the next one not yet taken (their steps' costs differ with
    their contacts); MuJoCo releases the GIL in both calls. The part of mjbatch's ``Batch``
    that ``MujocoBatch`` uses.

    ``bind(name)`` gives a ``(num_sims, ...)`` float64 array of an ``MjData`` field: not a
    view, as mjbatch's, but a copy that ``step``, ``reset`` and ``forward`` refresh for the
    simulations they touch. ``step`` applies the rows of ``bind("ctrl")``, ``forward`` sets
    the state from the rows of ``bind("qpos")`` and ``bind("qvel")``."""

    def __init__(self, model: Any, num_sims: int, num_threads: int = 0):
        import mujoco

        self._mujoco, self.model = mujoco, model
        self.datas = [mujoco.MjData(model) for _ in range(num_sims)]
        self.num_threads = max(1, min(num_threads or usable_cores(), num_sims))
        # (The calling thread steps too: the pool has one thread fewer.)
        self._pool = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="mujoco")
                      if self.num_threads > 1 else None)
        self._arrays: dict[str, np.ndarray] = {}
        # Per simulation, (array row, MjData field) pairs refreshed after it changes.
        self._copies: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.datas]
        self._ctrl, self._qpos, self._qvel = (self.bind(name) for name in ("ctrl", "qpos",
                                                                            "qvel"))

    def bind(self, name: str) -> np.ndarray:
        """The ``(num_sims, ...)`` array of the ``MjData`` field ``name`` (see the class
        docstring: a copy kept fresh, built on the first call)."""
        array = self._arrays.get(name)
        if array is None:
            array = self._arrays[name] = np.stack([getattr(data, name) for data in self.datas])
            for index, data in enumerate(self.datas):
                if name != "ctrl":  # (an input: what step applies)
                    self._copies[index].append((array[index], getattr(data, name)))
        return array

    def _refresh(self, index: int) -> None:
        for row, field in self._copies[index]:
            row[...] = field

    def _each(self, ids: np.ndarray | None, run: Callable[[int], None],
              threads: bool) -> None:
        indices = (np.arange(len(self.datas)) if ids is None
                   else np.flatnonzero(ids) if np.asarray(ids).dtype == bool
                   else np.asarray(ids, np.int64))

        queue = iter(indices.tolist())  # (one iterator for all threads: each takes the next)

        def share() -> None:
            for index in queue:
                run(index)
                self._refresh(index)

        if not threads or self._pool is None or len(indices) < 2:
            share()
            return
        futures = [self._pool.submit(share)
                   for _ in range(min(self.num_threads, len(indices)) - 1)]
        try:
            share()
        finally:
            errors = [future.exception() for future in futures]  # (waits for every share)
        for error in errors:
            if error is not None:
                raise error

    def step(self, ids: np.ndarray | None = None, nstep: int = 1) -> None:
        """``nstep`` ``mj_step`` of each simulation ``ids`` selects (a bool mask or indices;
        all when ``None``) with its row of ``ctrl``, then ``mj_rnePostConstraint``."""
        mujoco, model, ctrl = self._mujoco, self.model, self._ctrl

        def run(index: int) -> None:
            data = self.datas[index]
            data.ctrl[:] = ctrl[index]
            mujoco.mj_step(model, data, nstep=nstep)
            mujoco.mj_rnePostConstraint(model, data)

        self._each(ids, run, threads=True)

    def reset(self, ids: np.ndarray | None = None) -> None:
        """``mj_resetData`` then ``mj_forward``, as mjbatch's reset."""
        def run(index: int) -> None:
            self._mujoco.mj_resetData(self.model, self.datas[index])
            self._mujoco.mj_forward(self.model, self.datas[index])

        self._each(ids, run, threads=False)

    def forward(self, ids: np.ndarray | None = None) -> None:
        """The state of each selected simulation set from its rows of ``qpos`` and ``qvel``,
        then ``mj_forward`` (Gymnasium's ``set_state``)."""
        def run(index: int) -> None:
            data = self.datas[index]
            data.qpos[:], data.qvel[:] = self._qpos[index], self._qvel[index]
            self._mujoco.mj_forward(self.model, data)

        self._each(ids, run, threads=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class MujocoBatch(gym.vector.VectorEnv):
    """``num_envs`` copies of the MuJoCo task ``env_id`` (one of ``TASKS``) stepped together,
    the simulations by mjbatch (or ``ThreadedSims``), the rest by the env's ``Task``.

    Observations ``(num_envs, obs_size)`` float32, rewards ``(num_envs,)`` float32, actions
    ``(num_envs, action_size)``, as ``wrap_env`` treats them: with ``normalize_ranges`` in
    ``[-1, 1]``, clipped there and mapped onto the task's range by Gymnasium's
    ``RescaleAction`` arithmetic (else clipped to the task's range); next-step autoreset, and
    ``reset(seed=..., options={"reset_mask": mask})`` with one seed per env reset
    (``VectorWorker``'s conditions). Episodes are truncated at ``max_episode_steps``, which
    replaces the task's registered limit as ``gym.make``'s does (none: the registered limit).

    Args:
      env_id: the Gymnasium id, for example ``"HalfCheetah-v5"``.
      max_episode_steps: the time limit (``env.max_length``); none: the registered one.
      num_threads: the stepping threads (0: one per usable core, at most one per env).
      normalize_ranges: actions in ``[-1, 1]`` (``env.normalize_ranges``).
      kwargs: the task's v5 keyword arguments (``Task``'s fields, ``xml_file``,
        ``frame_skip``).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 num_threads: int = 0, normalize_ranges: bool = True, **kwargs: Any):
        from mjbatch import Batch  # (the native extra)

        if env_id not in TASKS:
            raise ValueError(f"no native batched version of {env_id!r}; available: "
                             f"{', '.join(TASKS)} (other envs: env.backend 'workers')")
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if max_episode_steps is not None:
            check_time_limit(max_episode_steps)
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
        # wrap_env's RescaleAction, through Gymnasium's own arithmetic (identity on [-1, 1]).
        self._rescale: Callable[[np.ndarray], np.ndarray] | None = None
        if normalize_ranges:
            self.single_action_space, _, self._rescale = rescale_box(
                env.action_space, np.float32(-1), np.float32(1))
            if (env.action_space.low == -1).all() and (env.action_space.high == 1).all():
                self._rescale = None  # (its arithmetic is then exactly the identity)
        space = env.observation_space
        self.single_observation_space = gym.spaces.Box(
            space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        template.close()
        self.max_episode_steps = limit if max_episode_steps is None else max_episode_steps
        self.batch = (ThreadedSims(self.model, num_envs, num_threads)
                      if self.task.contact_forces
                      else Batch(self.model, num_envs,
                                 num_threads=min(num_threads or usable_cores(), num_envs)))
        self.qpos, self.qvel = self.batch.bind("qpos"), self.batch.bind("qvel")
        self.ctrl, self._xpos = self.batch.bind("ctrl"), self.batch.bind("xpos")
        self._bodies: dict[str, int] = {}
        self._low = self.single_action_space.low.astype(np.float32)
        self._high = self.single_action_space.high.astype(np.float32)
        self._rngs = [seeding.np_random()[0] for _ in range(num_envs)]
        self._elapsed = np.zeros(num_envs, np.int64)
        self._ended = np.zeros(num_envs, bool)  # episodes that ended at the last step
        self._any_ended = False
        self._reset_keys = tuple(self.task.state_info(self))  # (the reset infos' keys)
        self.task.observe(self)  # (a body name the model lacks is an error here, not later)
        self.task.before_step(self)
        self._needs_reset = True

    def field(self, name: str) -> np.ndarray:
        """The ``MjData`` field ``name`` of each simulation, ``(num_envs, ...)``."""
        return self.batch.bind(name)

    def body_position(self, name: str | int) -> np.ndarray:
        """The position of body ``name`` (or its index) in each simulation, ``(num_envs, 3)``
        (MjData's ``xpos``: after a step, of the last substep's start, as Gymnasium reads
        it)."""
        index = name if isinstance(name, int) else self._bodies.get(name)
        if index is None:  # (MuJoCo's named access: a KeyError listing the valid names)
            index = self._bodies[name] = self.model.body(name).id
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
        self._any_ended = bool(self._ended.any())

    def reset(self, *, seed: int | np.ndarray | list | None = None,
              options: dict | None = None) -> tuple[np.ndarray, dict]:
        mask = (options or {}).get("reset_mask")
        mask = np.ones(self.num_envs, bool) if mask is None else np.asarray(mask)
        if mask.dtype != bool or mask.shape != (self.num_envs,):
            raise ValueError(f"reset_mask must be a bool array of shape ({self.num_envs},), "
                             f"got {mask.dtype} {mask.shape}")
        indices = np.flatnonzero(mask)
        if seed is not None:
            # (an int seeds env i with seed + i, as Gymnasium's vector envs do)
            seeds = (np.asarray(seed, np.int64).reshape(-1) if not isinstance(seed, int)
                     else seed + indices)
            if len(seeds) != len(indices):
                raise ValueError(f"reset: {len(seeds)} seeds for {len(indices)} envs")
            if (seeds < -1).any():
                raise ValueError(f"reset: seeds must be >= 0 (-1: keep the env's generator), "
                                 f"got {seeds.min()}")
            for index, value in zip(indices, seeds):
                if value >= 0:  # (-1: this env keeps its generator)
                    self._rngs[index] = seeding.np_random(int(value))[0]
        self._reset(indices)
        self._needs_reset = False
        return self._observe(), self._masked(self.task.state_info(self), mask)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                 np.ndarray, dict]:
        if self._needs_reset:
            raise ResetNeeded("MujocoBatch: step() before reset()")
        actions = np.asarray(actions, np.float32)
        shape = (self.num_envs, *self.single_action_space.shape)
        if actions.shape != shape:
            raise ValueError(f"actions must have shape {shape}, got {actions.shape}")
        if not np.isfinite(actions).all():
            raise ValueError(f"actions must be finite; envs "
                             f"{np.flatnonzero(~np.isfinite(actions).all(1)).tolist()} got "
                             f"NaN or inf")
        action = np.clip(actions, self._low, self._high)
        if self._rescale is not None:
            action = self._rescale(action)
        before = self.task.before_step(self)
        if not self._any_ended:  # (most steps: every env steps, without masks)
            self.ctrl[:] = action
            self.batch.step(None, nstep=self.frame_skip)
            reward, terminated, info = self.task.outcome(self, before, action)
            self._elapsed += 1
            truncated = (np.zeros(self.num_envs, bool) if self.max_episode_steps is None
                         else self._elapsed >= self.max_episode_steps)
        else:
            ended = self._ended.copy()  # (_reset clears self._ended)
            stepping = ~ended
            self.ctrl[stepping] = action[stepping]
            if stepping.any():
                self.batch.step(stepping, nstep=self.frame_skip)
            self._reset(np.flatnonzero(ended))  # next-step autoreset: these start anew
            reward, terminated, info = self.task.outcome(self, before, action)
            terminated &= stepping
            self._elapsed[stepping] += 1
            truncated = (np.zeros(self.num_envs, bool) if self.max_episode_steps is None
                         else (self._elapsed >= self.max_episode_steps) & stepping)
            reward[ended] = 0.0
            # (as Gymnasium's vector env: the envs that started anew have their reset infos,
            # which the step's infos hold, computed after the reset)
            state = {key: info[key] for key in self._reset_keys}
            info = {**self._masked(info, stepping), **self._masked(state, np.ones_like(ended))}
        self._ended = terminated | truncated
        self._any_ended = bool(self._ended.any())
        # (float32 as wrap_env's rewards)
        return self._observe(), reward.astype(np.float32), terminated, truncated, info

    @staticmethod
    def _masked(info: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
        """``info`` with Gymnasium's ``_key`` masks: the envs whose entries count."""
        return {**info, **{f"_{key}": mask for key in info}}

    def close(self, **kwargs: Any) -> None:
        if isinstance(self.batch, ThreadedSims):
            self.batch.close()
        self.closed = True


def make_vector(num_envs: int, env_id: str = "HalfCheetah-v5",
                max_episode_steps: int | None = None, num_threads: int = 0,
                normalize_ranges: bool = True, **kwargs: Any) -> MujocoBatch:
    """``MujocoBatch(env_id, num_envs, ...)``, for ``env.vector_id =
    "batchrl.envs.mujoco_batch:make_vector"`` with ``env.kwargs = {env_id = "Hopper-v5"}``."""
    return MujocoBatch(env_id, num_envs, max_episode_steps, num_threads, normalize_ranges,
                       **kwargs)
