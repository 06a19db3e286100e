"""Env faults: clear errors, NaN/inf detection and restarts of failed workers.

Every fault is real: ``FaultyEnv`` raises, aborts, segfaults, exits or hangs
inside a real worker process, or returns NaN/inf values.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos.base import Algorithm
from batchrl.config import ConfigError, load_config
from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import (EnvCrashedError, EnvError, EnvNonFiniteError,
                                 EnvRaisedError, EnvSpecError, EnvTimeoutError)
from batchrl.envs.process.external import ExternalProcess
from batchrl.envs.factory import batch_env_from
from batchrl.testing.faults import FaultyEnv, make
from batchrl.tensor_env import TensorBatchEnv
from batchrl.envs.process.shared_memory import EnvWorker
from batchrl.simulation import Simulation, flush, simulate
from batchrl.trainer import Trainer
from helpers import REPO, TRAIN_PY, fails_at, scalar_events, sets

# Constructors defined here reach the env workers by value: they do not import this module
# (and torch with it) to build their envs.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ZEROS = np.zeros(4, np.int64)


class CountingEnv(gym.Env):
    """Observation and reward: the steps since the last reset. Never ends
    by itself; ``length`` truncates episodes."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 1000):
        self.length = length
        self.count = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.count += 1
        return (np.array([self.count], np.float32), float(self.count), False,
                self.count >= self.length, {})


def faulty_counting(fault: str, at_step: int, length: int = 1000, **kwargs) -> FaultyEnv:
    return FaultyEnv(CountingEnv(length), fault, at_step=at_step, **kwargs)


def cartpole(fault: str, at_step: int, **kwargs):
    return functools.partial(make, "CartPole-v1", fault=fault, at_step=at_step, **kwargs)


def step_until_error(batch: BatchEnv, steps: int) -> EnvError:
    with pytest.raises(EnvError) as info:
        for _ in range(steps):
            batch.step(np.zeros(len(batch), np.int64))
    return info.value


@pytest.fixture
def closing():
    envs = []

    def register(env):
        envs.append(env)
        return env

    yield register
    for env in envs:
        env.close()


# -- errors without restarts ---------------------------------------------------

@pytest.mark.parametrize("backend", ["workers", "process"])
@pytest.mark.parametrize("fault, error_type, detail", [
    ("raise", EnvRaisedError, "RuntimeError: injected fault in step 3"),
    ("abort", EnvCrashedError, "killed by signal SIGABRT"),
    ("segfault", EnvCrashedError, "killed by signal SIGSEGV"),
    ("exit", EnvCrashedError, "exited with code 3"),
    ("hang", EnvTimeoutError, "no answer from the env worker"),
])
def test_a_fault_is_a_clear_error_within_seconds(closing, backend, fault, error_type, detail):
    # Only env 2 is faulty; every env is in a worker (no share in this process).
    constructors = [functools.partial(faulty_counting, fault, 3 if i == 2 else 10**9)
                    for i in range(4)]
    if backend == "workers":
        members = [EnvWorker(group, label="counting", timeout=1.0, construct_timeout=60)
                   for group in (constructors[:2], constructors[2:])]
    else:
        members = [ExternalProcess(c, label="counting", timeout=1.0, construct_timeout=60)
                   for c in constructors]
    batch = closing(BatchEnv(members))
    batch.reset(seed=0)
    start = time.monotonic()
    error = step_until_error(batch, 5)
    assert time.monotonic() - start < 8
    assert isinstance(error, error_type)
    text = str(error)
    assert "counting" in text and "failed in step()" in text and detail in text
    if fault == "raise":
        assert error.env_index == 2 and "Traceback in the env worker" in text
        assert "faults.py" in error.remote_traceback  # where it was raised
    elif backend == "process":
        assert error.env_index == 2
    else:  # the whole worker hosting envs 2 and 3 died or hangs
        assert error.env_indices == range(2, 4) and text.startswith("envs 2-3 (counting")
    # Pickled whole (a Ray collector's error reaches the driver so): the same error.
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is error_type and str(again) == text
    assert again.__dict__ == error.__dict__


def test_an_env_stepped_in_this_process_names_itself(closing):
    batch = closing(BatchEnv([CountingEnv(), FaultyEnv(CountingEnv(), "raise", at_step=2)]))
    batch.reset(seed=0)
    error = step_until_error(batch, 3)
    assert isinstance(error, EnvRaisedError) and error.env_index == 1
    assert "RuntimeError: injected fault in step 2" in str(error)
    assert "CountingEnv" in str(error)  # no spec: the env's class names it


def test_the_factory_label_names_the_constructor(closing):
    batch = closing(batch_env_from(cartpole("raise", 2), 2, workers=1, share_main=False,
                                   label="batchrl.testing.faults:make"))
    batch.reset(seed=0)
    error = step_until_error(batch, 3)
    assert "batchrl.testing.faults:make" in str(error)


@pytest.mark.parametrize("fault, what", [("nan_observ", "observation"),
                                         ("inf_reward", "reward")])
def test_non_finite_values_name_the_env_and_its_step(closing, fault, what):
    constructors = [functools.partial(faulty_counting, fault, 4 if i == 1 else 10**9)
                    for i in range(3)]
    batch = closing(BatchEnv([CountingEnv(), EnvWorker(constructors, label="counting")]))
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    batch.reset([2])  # env 2's episode restarts: its 4th step is the episode's 3rd
    error = step_until_error(batch, 5)
    assert isinstance(error, EnvNonFiniteError)
    assert error.env_index == 2  # env 1 of the worker is env 2 of the batch
    assert error.episode_step == 3 and error.what == what
    assert str(error).startswith(f"env 2 (counting) failed in step(): returned a NaN or "
                                 f"infinite {what} at step 3 of its episode")


def test_a_non_finite_first_observation_is_an_error(closing):
    batch = closing(BatchEnv([FaultyEnv(CountingEnv(), "nan_observ", at_step=2,
                                        in_reset=True)]))
    batch.reset(seed=0)
    with pytest.raises(EnvNonFiniteError, match="as its first observation"):
        batch.reset([0])


# -- restarts ---------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["raise", "abort", "hang", "nan_observ"])
def test_a_failed_worker_is_restarted(closing, gone, fault):
    constructors = [functools.partial(faulty_counting, fault, 3 if i == 2 else 10**9)
                    for i in range(4)]
    workers = [EnvWorker(group, label="counting", timeout=1.0, construct_timeout=60)
               for group in (constructors[:2], constructors[2:])]
    batch = closing(BatchEnv(workers, max_restarts=1))
    batch.reset(seed=0)
    old_pid = batch.workers[1].pid
    for _ in range(2):
        observ, reward, *_ = batch.step(ZEROS)
        assert len(batch.restarted[0]) == 0
    observ, reward, terminated, truncated, infos = batch.step(ZEROS)
    # Envs 2 and 3 shared the failed worker: both start new episodes.
    rows, fresh = batch.restarted
    assert rows.tolist() == [2, 3] and fresh.tolist() == [[0.0], [0.0]]
    assert observ[:, 0].tolist() == [3.0, 3.0, 0.0, 0.0]
    assert reward.tolist() == [3.0, 3.0, 0.0, 0.0]
    assert not terminated.any() and not truncated.any() and list(infos) == [{}] * 4
    assert batch.restarts == 1 and batch.restart_events[0].env_indices == range(2, 4)
    assert "restarted envs 2-3 (restart 1) after: " in str(batch.restart_events[0])
    assert batch.workers[1].pid != old_pid and not gone([old_pid], 5)
    observ, *_ = batch.step(ZEROS)
    assert observ[:, 0].tolist() == [4.0, 4.0, 1.0, 1.0] and len(batch.restarted[0]) == 0
    # The fresh env faults again at its own step 3: the run has no restart left.
    error = step_until_error(batch, 3)
    assert error.env_indices == range(2, 4) or error.env_index == 2
    assert "not restarted: this run used all its max_restarts=1 restarts" in str(error)


def test_a_failure_in_reset_restarts_the_worker_and_returns_the_asked_rows(closing):
    worker = EnvWorker([functools.partial(faulty_counting, "abort", 3, in_reset=True),
                        functools.partial(faulty_counting, "abort", 10**9)],
                       label="counting", prefetch_reset=False)
    batch = closing(BatchEnv([CountingEnv(), worker], max_restarts=2))
    batch.reset(seed=0)
    batch.step(np.zeros(3, np.int64))
    assert batch.reset([1]).shape == (1, 1)  # env 1's second reset
    batch.step(np.zeros(3, np.int64))
    observ = batch.reset([0, 1])  # env 1's third reset aborts its worker
    assert observ[:, 0].tolist() == [0.0, 0.0]
    rows, fresh = batch.restarted
    assert rows.tolist() == [1, 2] and fresh.shape == (2, 1)  # env 2 restarted too


def test_restarts_need_worker_processes():
    with pytest.raises(EnvSpecError, match="needs envs in worker processes"):
        batch_env_from(cartpole("raise", 2), 2, backend="inline", max_restarts=1)
    with pytest.raises(ConfigError, match="restart_crashed_envs needs envs in worker"):
        load_config("cartpole", ["env.restart_crashed_envs=true"])  # cartpole is inline
    batch = batch_env_from(cartpole("raise", 10**9), 3, workers=1, max_restarts=1)
    try:
        assert len(batch.workers) == 1 and batch.workers[0].num_envs == 3  # no share
    finally:
        batch.close()


def test_max_restarts_below_zero_is_rejected():
    with pytest.raises(ValueError, match="max_restarts must be >= 0, got -1"):
        BatchEnv([CountingEnv()], max_restarts=-1)


def test_every_worker_restarted_in_one_step_is_listed_and_keeps_its_options(closing):
    # Env 0 of each worker raises in its second step: both workers fail in one step.
    constructors = [fails_at(2), fails_at(10**9)]
    workers = [EnvWorker(constructors, label=f"counting{i}", timeout=30.0, infos=False)
               for i in range(2)]
    batch = closing(BatchEnv(workers, max_restarts=2))
    batch.reset(seed=0)
    batch.step(ZEROS)
    observ, reward, *_ = batch.step(ZEROS)
    rows, fresh = batch.restarted
    assert sorted(rows.tolist()) == [0, 1, 2, 3] and not fresh.any()
    assert not observ.any() and not reward.any() and batch.restarts == 2
    assert sorted(event.env_indices.start for event in batch.restart_events) == [0, 2]
    assert all(old.closed for old in workers) and not set(workers) & set(batch.workers)
    assert [(w.label, w.timeout, w.infos) for w in batch.workers] == [
        ("counting0", 30.0, False), ("counting1", 30.0, False)]
    # A reset reports the restarts of its own round trip only: none.
    batch.reset([1])
    assert len(batch.restarted[0]) == 0 and batch.restarted[1].shape == (0, 1)


def test_a_restarted_external_process_keeps_its_label_and_timeout(closing):
    members = [ExternalProcess(fails_at(at_step), label="counting", timeout=30.0)
               for at_step in (10**9, 2)]
    batch = closing(BatchEnv(members, max_restarts=1))
    batch.reset(seed=0)
    batch.step(np.zeros(2, np.int64))
    observ, *_ = batch.step(np.zeros(2, np.int64))
    assert observ[:, 0].tolist() == [2.0, 0.0] and batch.restarted[0].tolist() == [1]
    fresh = batch.workers[1]
    assert isinstance(fresh, ExternalProcess) and fresh is not members[1] and members[1].closed
    assert fresh.label == "counting" and fresh.timeout == 30.0 and batch.envs[1] is fresh
    assert str(batch.restart_events[0]) == (
        "restarted env 1 (restart 1) after: env 1 (counting) failed in step(): "
        "ValueError: boom at step 2")


def test_a_non_finite_value_after_an_autoreset_counts_steps_from_that_reset(closing):
    # The faulty env's 4th step call is the 2nd of the episode that the autoreset began.
    batch = closing(BatchEnv([CountingEnv(), FaultyEnv(CountingEnv(), "nan_observ", at_step=4)]))
    batch.reset(seed=0)
    batch.step(np.zeros(2, np.int64))
    batch.step(np.zeros(2, np.int64))
    batch.step(np.zeros(2, np.int64), autoreset=np.array([False, True]))
    batch.step(np.zeros(2, np.int64))
    error = step_until_error(batch, 1)
    assert isinstance(error, EnvNonFiniteError) and error.env_index == 1
    assert error.episode_step == 2 and "at step 2 of its episode" in str(error)


@pytest.mark.parametrize("blocking", [False, True], ids=["parallel", "blocking"])
def test_workers_failing_in_one_step_are_restarted_in_batch_order(closing, blocking):
    """Failures of one step are handled in batch order in both modes: the first failed
    worker is restarted first, and the one that finds no restart left is the last."""
    workers = [EnvWorker([fails_at(2)], label="counting")
               for _ in range(3)]
    batch = closing(BatchEnv(workers, blocking=blocking, max_restarts=2))
    batch.reset(seed=0)
    batch.step(np.zeros(3, np.int64))
    error = step_until_error(batch, 1)
    assert error.env_index == 2 and "not restarted" in str(error)
    assert [event.env_indices for event in batch.restart_events] == [range(0, 1), range(1, 2)]
    assert batch.restarted[0].tolist() == [0, 1]


class EpisodeChecker(Algorithm):
    """Acts with zeros and checks that every episode it is told has ended
    has exactly the steps that the (counting) env saw since its reset."""

    def __init__(self, num_agents: int):
        self.steps = torch.zeros(num_agents, dtype=torch.int64)
        self.last = torch.zeros(num_agents)
        self.begun: list[int] = []
        self.ended: list[tuple[int, int]] = []

    def begin_episodes(self, agent_indices):
        self.begun += agent_indices.tolist()
        self.steps[agent_indices] = 0
        return {}

    def perform(self, agent_indices, observ):
        return torch.zeros(len(agent_indices), dtype=torch.int64), {}

    def experience(self, agent_indices, observ, action, reward, done, next_observ,
                   terminated):
        self.steps[agent_indices] += 1
        self.last[agent_indices] = next_observ[:, 0]
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def end_episodes(self, agent_indices):
        for agent in agent_indices.tolist():
            assert self.steps[agent] == int(self.last[agent]), "partial episode"
            self.ended.append((agent, int(self.steps[agent])))
        return {}


def run_over_a_restart(closing, tmp_path, make_algo) -> Algorithm:
    """25 steps of three counting envs (episodes of 10 steps) whose agents 1 and 2 share a
    worker that segfaults once, in their 7th step, and is restarted; returns the algorithm."""
    once = str(tmp_path / "fired")
    worker = EnvWorker([functools.partial(faulty_counting, "segfault", 7, length=10,
                                          once_file=once),
                        functools.partial(faulty_counting, "raise", 10**9, length=10)],
                       label="counting")
    env = TensorBatchEnv(closing(BatchEnv([CountingEnv(10), worker], max_restarts=1)))
    algo = make_algo(env)
    simulate(env, algo, reset=True)
    for _ in range(24):
        simulate(env, algo)
    assert Path(once).exists() and env.batch_env.restarts == 1
    return algo


def test_simulate_begins_new_episodes_for_restarted_agents(closing, tmp_path):
    algo = run_over_a_restart(closing, tmp_path, lambda env: EpisodeChecker(3))
    # The worker of agents 1 and 2 crashed in their 7th step (call 7): they
    # begin anew there, and their next episodes end 10 steps later (call 17).
    assert algo.begun == [0, 1, 2, 1, 2, 0, 1, 2, 0]
    # Only whole episodes ended (end_episodes checks each against the env).
    assert algo.ended == [(0, 10), (1, 10), (2, 10), (0, 10)]


def test_a_replay_buffer_never_samples_the_step_a_restart_took_the_place_of(closing, tmp_path):
    from batchrl.algos.dqn import DQN
    algo = run_over_a_restart(closing, tmp_path, lambda env: DQN(
        env.observation_space, env.action_space, 3, buffer_size=300,
        learning_starts=10**6))  # (it only fills its buffer)
    # Agents 1 and 2's worker crashed in their 7th step (the buffer's row 6): their "step"
    # there ended in a new episode's first observation (0) and is never drawn; their episodes
    # end at the step before. Every drawn step counts on by one, or ends an episode at 10.
    torch.manual_seed(0)
    batch = algo.buffer.sample(5000)
    observ, following = batch["observ"].flatten(), batch["next_observ"].flatten()
    assert torch.all(following == observ + 1), set(zip(observ.tolist(), following.tolist()))
    assert (observ == 6).any()  # agent 0's step there is drawn
    assert algo.buffer.valid[6].tolist() == [True, False, False]
    assert algo.buffer.tensors["done"][5].tolist() == [False, True, True]
    # The two non-steps are no env steps: 25 batch steps of 3 agents, less those 2.
    assert algo.env_steps == 25 * 3 - 2


def test_a_rollout_completed_by_a_restart_leaves_the_restarted_agents_out_of_its_update(
        closing, tmp_path):
    """Agents 1 and 2's env restarts in the rollout's last step (7 of 7): BatchPPO updates at
    once, before begin_episodes; their segments, that non-step included, take no part."""
    from batchrl.algos.ppo import BatchPPO

    class Recording(BatchPPO):
        def update(self, *args, **kwargs):
            self.valid.append(self.memory.data()["valid"].clone())
            return super().update(*args, **kwargs)

    def make_algo(env):
        algo = Recording(env.observation_space, env.action_space, 3, rollout_length=7,
                         max_length=10, update_epochs=1, inference="eager", update_threads=1)
        algo.valid = []
        return algo

    algo = run_over_a_restart(closing, tmp_path, make_algo)
    first, second, third = algo.valid  # (steps 1-7, 8-14, 15-21)
    assert first.tolist() == [[True] * 7, [False] * 7, [False] * 7]
    assert second.all() and third.all()


def test_a_rollout_completed_by_a_restart_is_learned_with_that_step_cut(closing, tmp_path):
    """The same for a ``RolloutAlgorithm`` (IMPALA): the restarted agents' non-step is not
    valid and ends their episodes (bootstrapping from nothing), as ``begin_episodes`` would."""
    from batchrl.algos.impala import IMPALA

    class Recording(IMPALA):
        def learn(self, rollout):
            self.rollouts.append(rollout.clone())
            return super().learn(rollout)

    def make_algo(env):
        algo = Recording(env.observation_space, env.action_space, 3, rollout_length=7)
        algo.rollouts = []
        return algo

    algo = run_over_a_restart(closing, tmp_path, make_algo)
    first = algo.rollouts[0]
    assert first.valid[:, 6].tolist() == [True, False, False]
    assert first.done[:, 6].tolist() == [0.0, 1.0, 1.0]
    assert first.valid[:, :6].all() and all(rollout.valid.all() for rollout in algo.rollouts[1:])


def test_training_survives_a_crashed_env_and_counts_the_restart(tmp_path, capsys):
    once = str(tmp_path / "fired")
    config = load_config("cartpole", [
        'env.id="batchrl.testing.faults:make"', "env.backend=process", "env.num_agents=3",
        f'env.kwargs={{env_id="CartPole-v1", fault="abort", at_step=40, once_file="{once}"}}',
        "env.restart_crashed_envs=true", "env.max_restarts=2", "algorithm.update_every=3",
        "train.eval_episodes=3", "train.steps=300", "train.device=cpu"])
    Trainer(config, tmp_path / "run", progress=False).run()
    out = capsys.readouterr().out
    assert Path(once).exists()
    assert "restarted env " in out and "killed by signal SIGABRT" in out
    assert "[1 of at most 2 in this run]" in out
    assert scalar_events(tmp_path / "run")["env/restarts"][-1][1] == 1.0
    from batchrl.checkpoint import latest_checkpoint, load_checkpoint
    counters = load_checkpoint(latest_checkpoint(tmp_path / "run"))["counters"]
    assert counters["env_restarts"] == 1
    # The restarted env was reset in that step (of an evaluation), not stepped: one env step
    # fewer than whole steps of the batch.
    assert (counters["steps"] + counters["eval_steps"]) % 3 == 2, counters


def test_a_resumed_run_has_only_what_is_left_of_its_restarts(tmp_path, capsys):
    """env.max_restarts bounds the run over all its sessions: a run that spent its one restart
    resumes with none left, and the next crash stops it. (The crashes come in the first
    training phase of a session, in its envs' fifth step.)"""
    from batchrl.checkpoint import latest_checkpoint, load_checkpoint
    once = tmp_path / "fired"
    values = [
        'env.id="batchrl.testing.faults:make"', "env.backend=process", "env.num_agents=3",
        f'env.kwargs={{env_id="CartPole-v1", fault="abort", at_step=5, once_file="{once}"}}',
        "env.restart_crashed_envs=true", "env.max_restarts=1", "algorithm.update_every=3",
        "train.eval_episodes=3", "train.device=cpu"]
    Trainer(load_config("cartpole", values + ["train.steps=150"]), tmp_path / "run",
            progress=False).run()
    assert once.exists() and "[1 of at most 1 in this run]" in capsys.readouterr().out
    counters = load_checkpoint(latest_checkpoint(tmp_path / "run"))["counters"]
    assert counters["env_restarts"] == 1
    # The restarted env was reset in that step, not stepped: one env step fewer than whole
    # steps of the batch.
    assert counters["steps"] % 3 == 2 and counters["eval_steps"] % 3 == 0, counters
    once.unlink()  # the new session's env workers crash once more
    with pytest.raises(EnvCrashedError, match="killed by signal SIGABRT"):
        Trainer(load_config("cartpole", values + ["train.steps=300"]), tmp_path / "run",
                progress=False).run()
    assert once.exists() and "restarted env" not in capsys.readouterr().out


def test_restarts_of_the_evaluation_envs_count_in_the_run(tmp_path, capsys):
    """env.eval_kwargs gives evaluations envs of their own: their restarts are reported, logged
    and spend the run's one env.max_restarts budget with the training envs' (here 1: the
    training envs' later fault stops the run)."""
    config = load_config("cartpole", [
        'env.id="batchrl.testing.faults:make"', "env.backend=process", "env.num_agents=3",
        f'env.kwargs={{env_id="CartPole-v1", fault="abort", at_step=300, '
        f'once_file="{tmp_path / "train"}"}}',
        f'env.eval_kwargs={{at_step=20, once_file="{tmp_path / "eval"}"}}',
        "env.restart_crashed_envs=true", "env.max_restarts=1", "algorithm.update_every=3",
        "train.eval_episodes=3", "train.steps=1500", "train.device=cpu"])
    with pytest.raises(EnvCrashedError, match="killed by signal SIGABRT"):
        Trainer(config, tmp_path / "run", progress=False).run()
    out = capsys.readouterr().out
    assert (tmp_path / "eval").exists() and (tmp_path / "train").exists()
    assert "[1 of at most 1 in this run]" in out
    assert scalar_events(tmp_path / "run")["env/restarts"][-1][1] == 1.0


# The hang waits out the timeout; the segfault checks the same report and resume sooner.
@pytest.mark.parametrize("fault, detail", [
    pytest.param("hang", "no answer from the env worker", marks=pytest.mark.slow),
    ("segfault", "killed by signal SIGSEGV")])
def test_the_default_layout_puts_every_env_under_the_timeout_and_the_crash_report(
        tmp_path, fault, detail):
    """train.py with the default backend and no layout flag: an env that hangs or
    segfaults stops the run with exit 1 and an error naming the env, and the run resumes
    from its last checkpoint."""
    once, logdir = tmp_path / "fired", tmp_path / "run"
    command = [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir", str(logdir),
               "--no-progress"]
    overrides = sets('env.id="batchrl.testing.faults:make"', "env.backend=workers",
                     "env.num_agents=4",
                     "env.timeout=2", "algorithm.update_every=4", "train.eval_episodes=4",
                     "train.steps=3000", "train.device=cpu",
                     f'env.kwargs={{env_id="CartPole-v1", fault="{fault}", at_step=300, '
                     f'once_file="{once}"}}')
    environ = dict(os.environ, PYTHONPATH=str(REPO))
    failed = subprocess.run(command + overrides, env=environ, capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1, failed.stderr
    assert once.exists() and detail in failed.stderr, failed.stderr
    assert "batchrl.testing.faults:make" in failed.stderr
    assert "Resume it with: python train.py --config cartpole" in failed.stderr
    # The fault fired once: the resumed run (config from its logdir) trains to its budget.
    resumed = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from" in resumed.stdout


# --- the simulation's bookkeeping around restarts ------------------------------------------

def crashing_batch(closing, tmp_path: Path, **fault) -> TensorBatchEnv:
    """Env 0 in-process; envs 1 and 2 share a worker whose env 1 crashes once (``fault``:
    ``faulty_counting``'s arguments); episodes of 10 steps (env 1's as given)."""
    once = str(tmp_path / "fired")
    length = fault.pop("length", 10)
    worker = EnvWorker([functools.partial(faulty_counting, length=length, once_file=once,
                                          **fault),
                        functools.partial(faulty_counting, "raise", 10**9, length=10)],
                       label="counting", prefetch_reset=False)
    return TensorBatchEnv(closing(BatchEnv([CountingEnv(10), worker], max_restarts=1)))


def test_restarted_agents_score_their_new_episode_from_the_restart_step(closing, tmp_path):
    """The score returned in the step where an env restarted is the new episode's (zero),
    not the dropped one's."""
    env = crashing_batch(closing, tmp_path, fault="segfault", at_step=7)
    algo, simulation = EpisodeChecker(3), Simulation(env)
    scores = [simulation.step(algo, reset=step == 0)[1].tolist() for step in range(8)]
    assert env.restarted is None and env.batch_env.restarts == 1
    # CountingEnv rewards 1, 2, 3, ...: step 6's running score is 21, step 7's 28.
    assert scores[5] == [21.0, 21.0, 21.0]
    assert scores[6] == [28.0, 0.0, 0.0]  # agents 1 and 2 restarted instead of stepping
    assert scores[7] == [36.0, 1.0, 1.0]
    assert simulation.episode_length.tolist() == [8, 1, 1]


class LaggingChecker(EpisodeChecker):
    experience_may_lag = True

    def __init__(self, num_agents: int):
        super().__init__(num_agents)
        self.calls: list[str] = []

    def begin_episodes(self, agent_indices):
        self.calls.append(f"begin {agent_indices.tolist()}")
        return super().begin_episodes(agent_indices)

    def experience(self, *args):
        self.calls.append("experience")
        return super().experience(*args)

    def steps_lost(self, agent_indices):
        self.calls.append(f"steps_lost {agent_indices.tolist()}")


def test_a_restart_under_overlap_delivers_its_step_before_the_new_episodes(closing, tmp_path):
    """With overlap, the step in which envs restarted is delivered at once: steps_lost, its
    experience, then begin_episodes for the restarted agents, and only whole episodes end."""
    env = crashing_batch(closing, tmp_path, fault="segfault", at_step=7)
    algo = LaggingChecker(3)
    for step in range(25):
        simulate(env, algo, reset=step == 0, overlap=True)
    flush(env)
    assert env.batch_env.restarts == 1
    crash = algo.calls.index("steps_lost [1, 2]")
    assert algo.calls[crash:crash + 3] == ["steps_lost [1, 2]", "experience", "begin [1, 2]"]
    assert algo.begun == [0, 1, 2, 1, 2, 0, 1, 2, 0]
    assert algo.ended == [(0, 10), (1, 10), (2, 10), (0, 10)]


def test_an_env_restarted_by_another_env_s_failed_reset_begins_a_new_episode(closing, tmp_path):
    """A worker that fails while resetting one env restarts the other envs it holds: those
    agents begin new episodes there too (begin_episodes, scores and lengths from zero)."""
    # Env 1 ends after 2 steps; its second reset (at step 3) aborts the worker, which
    # restarts env 2 in the middle of its episode.
    env = crashing_batch(closing, tmp_path, fault="abort", at_step=2, in_reset=True, length=2)
    algo, simulation = EpisodeChecker(3), Simulation(env)
    scores = [simulation.step(algo, reset=step == 0)[1].tolist() for step in range(3)]
    assert env.batch_env.restarts == 1
    assert algo.begun == [0, 1, 2, 1, 2]  # env 2 too, and env 1 once
    assert scores == [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0], [6.0, 1.0, 1.0]]
    assert simulation.episode_length.tolist() == [3, 1, 1]
    for _ in range(12):  # only whole episodes end (EpisodeChecker checks each)
        simulation.step(algo)
    # Env 1 ends every 2 steps, env 0 at step 10 and env 2 ten steps after its restart.
    assert algo.ended == [(1, 2)] * 4 + [(0, 10), (1, 2), (1, 2), (2, 10), (1, 2)]


def test_rows_restarted_by_another_envs_failed_reset_hold_first_observations(closing, tmp_path):
    """Env 1's second reset aborts the worker it shares with env 2: env 2, restarted in the
    middle of its episode, shows its first observation with reward and done zeroed."""
    env = crashing_batch(closing, tmp_path, fault="abort", at_step=2, in_reset=True, length=2)
    env.reset(seed=0)
    for _ in range(2):
        env.step(torch.zeros(3, dtype=torch.int64))
    assert env.observ[:, 0].tolist() == [2.0, 2.0, 2.0] and env.done[1] == 1.0
    env.reset(torch.tensor([1]))
    assert env.batch_env.restarts == 1 and 2 in env.restarted.tolist()
    assert env.observ[:, 0].tolist() == [2.0, 0.0, 0.0]
    assert env.reward.tolist() == [2.0, 0.0, 0.0] and env.done.tolist() == [0.0, 0.0, 0.0]
