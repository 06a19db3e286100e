"""MuJoCo tasks stepped natively in batches (env.backend = "native", batchrl.envs.mujoco_batch):
the same trajectories as Gymnasium's v5 envs under batchrl's wrappers, bit for bit, through
seeded resets, terminations and truncations; the same training run as backend "workers";
bad input."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.registration import load_env_creator
from gymnasium.error import ResetNeeded

from batchrl.envs.errors import EnvSpecError
from batchrl.envs.factory import batch_env_from, choose_backend, make_batch_env
from batchrl.envs.infos import info_row
from batchrl.envs.wrappers import wrap_env
from helpers import finish, sets, start_train_py

pytest.importorskip("mjbatch")
from batchrl.envs import mujoco_batch  # noqa: E402
from batchrl.envs.mujoco_batch import TASKS, MujocoBatch, ThreadedSims, task_arguments  # noqa: E402


def assert_same_info(got: dict, want: dict) -> None:
    """One env's info from the native batch is Gymnasium's env's: its keys, dtypes and values
    (the terms in the last bits: numpy sums a batch's rows in its own order)."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-12, atol=1e-15, err_msg=key)
        assert np.asarray(got[key]).dtype == np.asarray(value).dtype, key


def started_both(env_id: str, seeds: list[int],
                 **kwargs: Any) -> tuple[MujocoBatch, list[gym.Env]]:
    """The native batch of ``env_id`` and Gymnasium's envs (wrapped as the trainer wraps
    them), both made with ``kwargs`` (``max_episode_steps`` too) and reset with ``seeds``:
    their first observations checked to be the same."""
    native = MujocoBatch(env_id, len(seeds), **kwargs)
    envs = [wrap_env(gym.make(env_id, **kwargs)) for _ in seeds]
    observ, _ = native.reset(seed=np.array(seeds))
    np.testing.assert_array_equal(
        observ, np.stack([env.reset(seed=seed)[0] for env, seed in zip(envs, seeds)]))
    return native, envs


def step_both(native: MujocoBatch, envs: list[gym.Env], ended: np.ndarray, steps: int,
              rng: np.random.Generator) -> tuple[int, int, np.ndarray]:
    """``steps`` random steps of the native batch and of Gymnasium's ``envs`` (those
    ``ended`` start anew first, as next-step autoreset does), checked to be the same bit for
    bit, infos too. Returns the terminations, the truncations and the envs that ended at the
    last."""
    terminations = truncations = 0
    for _ in range(steps):
        # (beyond the action bounds too: both clip)
        actions = rng.uniform(-1.5, 1.5, (len(envs), *native.single_action_space.shape))
        observ, reward, terminated, truncated, info = native.step(actions.astype(np.float32))
        for index, env in enumerate(envs):
            if ended[index]:  # next-step autoreset, from the env's own generator
                first, reset_info = env.reset()
                want = (first, 0.0, False, False, reset_info)
            else:
                want = env.step(actions[index].astype(np.float32))
            got = (observ[index], reward[index], terminated[index], truncated[index])
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:] == tuple(want[1:4]), (index, got[1:], want[1:4])
            assert_same_info(info_row(info, index), want[4])
        ended = terminated | truncated
        terminations += int(terminated.sum())
        truncations += int(truncated.sum())
    return terminations, truncations, ended


@pytest.mark.parametrize("env_id, kwargs, limit", [
    ("HalfCheetah-v5", {}, 60),
    ("Hopper-v5", {}, 25),
    ("Walker2d-v5", {}, 25),
    ("Hopper-v5", {"ctrl_cost_weight": 0.01, "healthy_angle_range": (-0.3, 0.3),
                   "exclude_current_positions_from_observation": False,
                   "forward_reward_weight": 2.0, "healthy_reward": 0.5}, 25),
    ("HalfCheetah-v5", {"frame_skip": 2, "reset_noise_scale": 0.5}, 40),
    ("Reacher-v5", {}, 30),
    ("Reacher-v5", {"reward_dist_weight": 2.0, "reward_control_weight": 0.5, "frame_skip": 3},
     None),
    ("Ant-v5", {}, 40),
    ("Ant-v5", {"contact_cost_weight": 1e-3, "healthy_z_range": (0.3, 0.9), "main_body": "torso",
                "include_cfrc_ext_in_observation": False, "forward_reward_weight": 2.0,
                "healthy_reward": 0.5, "exclude_current_positions_from_observation": False}, 30),
    ("Humanoid-v5", {}, 30),
    ("Humanoid-v5", {"include_cinert_in_observation": False, "contact_cost_weight": 1e-6,
                     "exclude_current_positions_from_observation": False,
                     "terminate_when_unhealthy": False}, 50),
])
def test_native_trajectories_are_gymnasiums(env_id, kwargs, limit):
    count, seeds = 3, [11, 12, 13]
    native = MujocoBatch(env_id, count, max_episode_steps=limit, **kwargs)
    envs = [wrap_env(gym.make(env_id, max_episode_steps=limit, **kwargs)) for _ in seeds]
    observ, info = native.reset(seed=np.array(seeds))
    resets = [env.reset(seed=seed) for env, seed in zip(envs, seeds)]
    np.testing.assert_array_equal(observ, np.stack([first for first, _ in resets]))
    for index, (_, reset_info) in enumerate(resets):
        assert_same_info(info_row(info, index), reset_info)
    assert native.single_observation_space == envs[0].observation_space
    terminations, truncations, _ = step_both(native, envs, np.zeros(count, bool), 300,
                                             np.random.default_rng(0))
    terminates = (env_id not in ("HalfCheetah-v5", "Reacher-v5")
                  and kwargs.get("terminate_when_unhealthy", True))
    assert truncations and (terminations > 0) == terminates
    # A seeded reset of some envs, as BatchEnv resets them.
    mask = np.array([False, True, True])
    observ, info = native.reset(seed=np.array([5, -1]), options={"reset_mask": mask})
    assert info_row(info, 0) == {}
    for index, reset in ((1, envs[1].reset(seed=5)), (2, envs[2].reset())):
        np.testing.assert_array_equal(observ[index], reset[0])
        assert_same_info(info_row(info, index), reset[1])
    native.close()


INF = float("inf")


@pytest.mark.parametrize("env_id, kwargs, limit", [
    # Hopper falls below its (default) healthy height when its angle may be anything.
    ("Hopper-v5", {"healthy_angle_range": (-INF, INF)}, 200),
    # Walker2d tilts beyond its (default) healthy angle when its height may be anything.
    ("Walker2d-v5", {"healthy_z_range": (-INF, INF)}, 200),
    # Hopper's state range covers the state after its x position and height only.
    ("Hopper-v5", {"healthy_state_range": (-1.0, 1.0)}, 100),
])
def test_each_health_condition_ends_episodes_as_gymnasiums(env_id, kwargs, limit):
    seeds = [11, 12, 13]
    native, envs = started_both(env_id, seeds, max_episode_steps=limit, **kwargs)
    terminations, _, _ = step_both(native, envs, np.zeros(len(seeds), bool), 300,
                                   np.random.default_rng(0))
    assert terminations > 0
    native.close()


@pytest.mark.parametrize("env_id, unreachable", [("Hopper-v5", (10.0, INF)),
                                                 ("Ant-v5", (10.0, 20.0))])
@pytest.mark.parametrize("terminate", [True, False])
def test_unhealthy_states_end_episodes_only_when_asked(env_id, unreachable, terminate):
    """Every state is unhealthy (a healthy height out of reach): with
    ``terminate_when_unhealthy`` each episode ends at its first step, and the step that starts
    the next one (its initial state unhealthy too) is no termination; without, no episode
    ends. As Gymnasium's env, step for step."""
    kwargs = {"healthy_z_range": unreachable, "terminate_when_unhealthy": terminate}
    seeds = [11, 12]
    native, envs = started_both(env_id, seeds, **kwargs)
    terminations, _, _ = step_both(native, envs, np.zeros(len(seeds), bool), 6,
                                   np.random.default_rng(0))
    assert terminations == (3 * len(seeds) if terminate else 0)
    native.close()


@pytest.mark.parametrize("part", ["cinert", "cvel", "qfrc_actuator", "cfrc_ext"])
def test_each_humanoid_observation_part_can_be_left_out(part):
    """``include_<part>_in_observation=False`` leaves that part alone out of Humanoid's
    observations, as Gymnasium's env does."""
    kwargs = {f"include_{part}_in_observation": False}
    seeds = [11, 12]
    native, envs = started_both("Humanoid-v5", seeds, **kwargs)
    assert native.single_observation_space == envs[0].observation_space
    step_both(native, envs, np.zeros(len(seeds), bool), 5, np.random.default_rng(0))
    native.close()


@pytest.mark.parametrize("env_id", sorted(TASKS))
def test_native_defaults_are_gymnasiums(env_id):
    """Each keyword argument a native task computes with is one Gymnasium's env takes, and
    defaults to Gymnasium's value (which its env keeps as ``_name``); the task's other fields
    are conditions the env does not have."""
    env = gym.make(env_id).unwrapped
    task = TASKS[env_id]
    takes = inspect.signature(load_env_creator(gym.spec(env_id).entry_point)).parameters
    assert task_arguments(env_id) == {field.name for field in dataclasses.fields(task)
                                      if not field.metadata.get("fixed") and field.name in takes}
    for field in dataclasses.fields(task):
        if field.name not in task_arguments(env_id) and not field.metadata.get("fixed"):
            assert getattr(task, field.name) in (None, False, 0.0), field.name
    for name in sorted(task_arguments(env_id)):
        ours = getattr(task, name)
        theirs = getattr(env, f"_{name}")
        assert (tuple(theirs) if isinstance(ours, tuple) else theirs) == ours, name
    env.close()


def test_a_seed_of_zero_seeds_the_first_env():
    """``reset(seed=0)`` seeds the envs 0, 1, ... as Gymnasium's vector envs do: the first
    env's seed 0 is a seed (only -1 keeps an env's generator)."""
    native = MujocoBatch("HalfCheetah-v5", 2)
    first, _ = native.reset(seed=0)
    again, _ = native.reset(seed=0)
    np.testing.assert_array_equal(first, again)
    for index in range(2):
        np.testing.assert_array_equal(
            first[index], wrap_env(gym.make("HalfCheetah-v5")).reset(seed=index)[0])
    observ, _ = native.reset(seed=np.array([0]), options={"reset_mask": np.array([True, False])})
    np.testing.assert_array_equal(observ[0], first[0])
    # An int seeds env i with seed + i whichever envs the mask resets, as SyncVectorEnv's.
    observ, _ = native.reset(seed=5, options={"reset_mask": np.array([False, True])})
    np.testing.assert_array_equal(
        observ[1], wrap_env(gym.make("HalfCheetah-v5")).reset(seed=6)[0])
    native.close()


def test_a_longer_time_limit_replaces_the_registered_one():
    """``max_episode_steps`` replaces the task's registered time limit (Reacher-v5's: 50) as
    ``gym.make``'s does (and ``env.max_length`` under backend ``"workers"``), a longer one
    too."""
    native, envs = started_both("Reacher-v5", [1, 2], max_episode_steps=60)
    _, truncations, ended = step_both(native, envs, np.zeros(2, bool), 60,
                                      np.random.default_rng(0))
    assert truncations == 2 and ended.all()
    native.close()


def test_a_partial_reset_leaves_an_ended_env_to_its_autoreset():
    """Env 0's episode ends (the time limit) while env 1 is reset alone: env 0 still starts
    anew at the next step, as Gymnasium's next-step autoreset does (the reset mask clears
    only the masked envs' autoreset)."""
    native, envs = started_both("HalfCheetah-v5", [1, 2], max_episode_steps=5)
    rng = np.random.default_rng(0)
    step_both(native, envs, np.zeros(2, bool), 2, rng)
    mask = np.array([False, True])
    observ, _ = native.reset(seed=np.array([7]), options={"reset_mask": mask})
    np.testing.assert_array_equal(observ[1], envs[1].reset(seed=7)[0])
    _, _, ended = step_both(native, envs, np.zeros(2, bool), 3, rng)
    assert ended.tolist() == [True, False]  # env 0 reached its limit
    observ, _ = native.reset(seed=np.array([8]), options={"reset_mask": mask})
    np.testing.assert_array_equal(observ[1], envs[1].reset(seed=8)[0])
    step_both(native, envs, np.array([True, False]), 3, rng)
    native.close()


def test_a_reset_of_ended_episodes_replaces_their_autoreset():
    """Both episodes end (the time limit) and env 0 is reset with ``reset_mask``, as
    ``BatchEnv`` resets ended envs: at the next step env 0 steps its new episode (not starts
    anew again) while env 1 starts anew by its next-step autoreset."""
    native, envs = started_both("HalfCheetah-v5", [1, 2], max_episode_steps=2)
    rng = np.random.default_rng(0)
    _, _, ended = step_both(native, envs, np.zeros(2, bool), 2, rng)
    assert ended.all()
    observ, _ = native.reset(seed=np.array([3]), options={"reset_mask": np.array([True, False])})
    np.testing.assert_array_equal(observ[0], envs[0].reset(seed=3)[0])
    step_both(native, envs, np.array([False, True]), 3, rng)
    native.close()


@pytest.mark.parametrize("env_id", ["Ant-v5", "HalfCheetah-v5"])
def test_the_simulations_take_the_threads_asked_for(env_id, monkeypatch):
    """Ant's simulations step in ``ThreadedSims``, HalfCheetah's in mjbatch: ``num_threads``
    threads (0: one per usable core, which the affinity mask and a CPU quota bound, not one
    per logical CPU), at most one per env."""
    monkeypatch.setattr(mujoco_batch, "usable_cores", lambda: 1)
    for threads, count, want in ((3, 4, 3), (0, 4, 1), (8, 2, 2)):
        native = MujocoBatch(env_id, count, num_threads=threads)
        try:
            assert isinstance(native.batch, ThreadedSims) == (env_id == "Ant-v5")
            assert native.batch.num_threads == want, (threads, count)
        finally:
            native.close()


def test_the_native_backend_keeps_max_length():
    """``make_batch_env``'s ``max_length`` (``env.max_length``) is the native batch's time
    limit."""
    batch = make_batch_env("HalfCheetah-v5", 2, max_length=3, backend="native")
    try:
        batch.reset(seed=0)
        for step in range(1, 4):
            _, _, terminated, truncated, _ = batch.step(np.zeros((2, 6), np.float32))
            assert not terminated.any() and truncated.tolist() == [step == 3] * 2, step
    finally:
        batch.close()


def test_native_actions_follow_normalize_ranges():
    """Humanoid's actions span [-0.4, 0.4]: with ``normalize_ranges`` (the default) the native
    envs take [-1, 1] and rescale as ``wrap_env``; without, the task's own range."""
    for normalize in (True, False):
        native = MujocoBatch("Humanoid-v5", 2, normalize_ranges=normalize)
        env = wrap_env(gym.make("Humanoid-v5"), normalize_ranges=normalize)
        bound = 1.0 if normalize else 0.4  # (wrap_env's ClipAction shows it unbounded)
        np.testing.assert_allclose(native.single_action_space.high, bound)
        np.testing.assert_allclose(native.single_action_space.low, -bound)
        native.reset(seed=np.array([4, 5]))
        env.reset(seed=4)
        action = np.linspace(-1.2, 1.2, 17, dtype=np.float32)
        for _ in range(3):
            observ, reward, *_ = native.step(np.stack([action, action]))
            want, want_reward, *_ = env.step(action)
            np.testing.assert_array_equal(observ[0], want)
            assert reward[0] == want_reward
        native.close()


def test_bad_input_is_a_clear_error():
    native = MujocoBatch("Hopper-v5", 2)
    native.reset(seed=0)
    with pytest.raises(ValueError, match=r"actions must have shape \(2, 3\), got \(2, 4\)"):
        native.step(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"actions must be finite; envs \[1\] got NaN or inf"):
        native.step(np.array([[0, 0, 0], [0, np.nan, 0]], np.float32))
    with pytest.raises(ValueError, match=r"reset: 1 seeds for 2 envs"):
        native.reset(seed=np.array([3]))
    with pytest.raises(ValueError, match=r"reset: seeds must be >= 0 \(-1: keep the env's "
                                         r"generator\), got -3"):
        native.reset(seed=-3)
    for mask in ([True, False, True], [0, 1]):
        with pytest.raises(ValueError, match=r"reset_mask must be a bool array of shape \(2,\)"):
            native.reset(options={"reset_mask": mask})
    with pytest.raises(ValueError, match="max_episode_steps must be positive, got 0"):
        MujocoBatch("Hopper-v5", 2, max_episode_steps=0)
    with pytest.raises(ResetNeeded, match=r"step\(\) before reset\(\)"):
        MujocoBatch("Hopper-v5", 2).step(np.zeros((2, 3), np.float32))
    # A body the model lacks (a typo in env.kwargs) is MuJoCo's error, at construction: the
    # native batch does not read another body's position instead.
    with pytest.raises(KeyError, match="Invalid name 'torsoo'. Valid names: .*'torso'"):
        MujocoBatch("Ant-v5", 2, main_body="torsoo")
    with pytest.raises(TypeError, match="takes no keyword argument 'healthy_rewards'"):
        MujocoBatch("Hopper-v5", 2, healthy_rewards=2.0)
    with pytest.raises(ValueError, match="no native batched version of 'Swimmer-v5'; available: "
                                         "HalfCheetah-v5, "):
        MujocoBatch("Swimmer-v5", 2)
    with pytest.raises(EnvSpecError, match="env backend 'native' steps HalfCheetah-v5, Hopper-v5, "
                                           "Walker2d-v5, Reacher-v5, Ant-v5, Humanoid-v5 in "
                                           "batches, not 'Swimmer-v5'"):
        make_batch_env("Swimmer-v5", 2, backend="native")
    # Keyword arguments are checked before any env is built: the native batch's own
    # parameters too, which the factory sets (the env id, its threads).
    for kwargs, named in [({"healthy_rewards": 2.0}, "healthy_rewards"),
                          ({"env_id": "Walker2d-v5", "num_threads": 1}, "env_id, num_threads")]:
        with pytest.raises(EnvSpecError, match=f"env backend 'native' takes no env.kwargs "
                                               f"{named} for Hopper-v5; it takes "
                                               f"ctrl_cost_weight, .*xml_file \\(others: "):
            make_batch_env("Hopper-v5", 2, backend="native", kwargs=kwargs)


def test_auto_backend_is_native_where_it_steps_the_env():
    assert choose_backend("Hopper-v5", "auto", {"healthy_reward": 2.0}) == "native"
    assert choose_backend("Hopper-v5", "auto", {"xml_file": "hopper.xml"}) == "native"
    # A keyword argument the native task does not compute, an env it lacks, an option only
    # worker processes have: workers. Other backends stay what they are.
    assert choose_backend("Hopper-v5", "auto", {"render_mode": "rgb_array"}) == "workers"
    assert choose_backend("HalfCheetah-v5", "auto", {"healthy_reward": 1.0}) == "workers"
    assert choose_backend("Swimmer-v5", "auto") == "workers"
    assert choose_backend("Hopper-v5", "auto", worker_layout=True) == "workers"
    assert choose_backend("Hopper-v5", "inline") == "inline"
    native = make_batch_env("HalfCheetah-v5", 2)  # (the default backend: "auto")
    workers = make_batch_env("HalfCheetah-v5", 2, max_restarts=1)
    try:
        assert not native.workers and workers.workers  # (in this process; worker processes)
        assert isinstance(native.envs[0], MujocoBatch)  # (not the inline backend's envs)
        assert len({id(env) for env in native.envs}) == 1
        np.testing.assert_array_equal(native.reset(seed=3), workers.reset(seed=3))
    finally:
        native.close()
        workers.close()
    # env.workers sets the threads of the one native batch.
    threaded = make_batch_env("HalfCheetah-v5", 4, backend="native", workers=3)
    try:
        assert len({id(env) for env in threaded.envs}) == 1  # (each env's handle: the batch)
        assert threaded.envs[0].batch.num_threads == 3
    finally:
        threaded.close()
    # A collector's native batch takes its share of the usable cores (one collector: all).
    from batchrl.config import load_config
    from batchrl.hardware import usable_cores
    from batchrl.trainer import _collector_env
    config = load_config("halfcheetah", ["train.collectors=1", "env.num_agents=4"])
    alone = _collector_env(config, usable_cores(), 0, 4, seed=0)
    try:
        assert alone.envs[0].batch.num_threads == min(usable_cores(), 4)
    finally:
        alone.close()
    # Three collectors on a machine of 8 usable cores: collector 1 of them takes 3.
    config = load_config("halfcheetah", ["train.collectors=3", "env.num_agents=12"])
    second = _collector_env(config, 8, 1, 4, seed=0)
    try:
        assert second.envs[0].batch.num_threads == 3
    finally:
        second.close()
    # Stepping a share in the collector's own process (share_main): one worker fewer.
    config = load_config("halfcheetah", ["train.collectors=2", "env.num_agents=8",
                                         "env.share_main=true"])
    shared = _collector_env(config, 4, 0, 4, seed=0)
    try:
        assert len(shared.workers) == 1 and shared.steps_here
    finally:
        shared.close()
    with pytest.raises(EnvSpecError, match="backend 'native' steps the env ids it knows, not "
                                           "constructors"):
        batch_env_from(lambda: gym.make("Hopper-v5"), 2, backend="native")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["hopper", "humanoid"])
def test_native_backend_trains_exactly_as_the_workers(tmp_path, config):
    records = {}
    for backend in ("workers", "native"):
        logdir = tmp_path / backend
        process = start_train_py("--config", config, "--logdir", str(logdir), "--no-progress",
                                 *sets(f"env.backend={backend}", "env.num_agents=8",
                                       "train.steps=8000", "train.eval_episodes=3",
                                       "algorithm.minibatch_size=200"))
        code, _, stderr = finish(process, 180)
        assert code == 0, stderr
        records[backend] = [json.loads(line)
                            for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    key = [[(r["step"], r["phase"], r["score"], r["episodes"]) for r in records[backend]]
           for backend in ("workers", "native")]
    assert key[0] == key[1] and any(r["phase"] == "eval" for r in records["native"])


def test_auto_backend_with_share_main_uses_workers():
    batch = make_batch_env("Hopper-v5", 2, share_main=True, workers=1, pin_workers=False)
    try:
        assert batch.workers and not isinstance(batch.envs[0], MujocoBatch)
    finally:
        batch.close()


def test_the_native_backend_keeps_the_env_ranges_when_asked():
    # Humanoid's actions span [-0.4, 0.4]; normalize_ranges=False keeps that range.
    ranges = {}
    for normalize in (True, False):
        batch = make_batch_env("Humanoid-v5", 1, backend="native", normalize_ranges=normalize)
        try:
            ranges[normalize] = float(batch.action_space.high.max())
        finally:
            batch.close()
    assert ranges == {True: 1.0, False: pytest.approx(0.4)}


def test_vector_kwargs_must_not_set_what_the_config_sets():
    with pytest.raises(EnvSpecError, match=r"kwargs must not set \['max_episode_steps', "
                                           r"'num_envs'\]"):
        make_batch_env("Hopper-v5", 2, 10, {"env_id": "Hopper-v5", "num_envs": 3,
                                            "max_episode_steps": 5},
                       backend="vector", vector_id="batchrl.envs.mujoco_batch:make_vector")
