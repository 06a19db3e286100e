"""Decoupled collection: the rollout queue (rounds, back-pressure, dtypes), weight versions and
the lag limit, collectors in the trainer with the in-process and worker layouts, faults, Ctrl-C
and bad input. Every collector here is a real child process stepping real Gymnasium envs."""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

import batchrl.trainer as trainer_module
from batchrl.algos.impala import IMPALA
from batchrl.algos.ppo import BatchPPO
from batchrl.collectors import CollectorError, CollectorSpec, LocalCollectors, collector_seed
from batchrl.collectors.collector import Replacements
from batchrl.checkpoint import list_checkpoints, load_checkpoint
from batchrl.config import ConfigError, available_configs, build_config, load_config
from batchrl.envs import BatchEnv
from batchrl.envs.factory import make_batch_env
from batchrl.envs.process.channel import context
from batchrl.hardware import core_share, pinnable_cores
from batchrl.metrics import read_metrics
from batchrl.testing.envs import uint8_cartpole
from batchrl.testing.faults import FaultyEnv
from batchrl.trainer import Trainer, check_collectors, collector_plan
from helpers import (descendants, finish, ray_pickles_by_value, run_stdin_script, sets,
                     start_train_py, wait_for, wait_gone)

pytestmark = pytest.mark.timeout(180)


def make_env(env_id: str, backend: str, index: int, num_envs: int, seed: int):
    if env_id == "uint8":  # the env layer's wrappers would make the observations float32
        return BatchEnv([uint8_cartpole() for _ in range(num_envs)], blocking=True)
    return make_batch_env(env_id, num_envs, 200, backend=backend, workers=1,
                          normalize_ranges=False)


def make_algorithm(observation_space, action_space, num_agents):
    return BatchPPO(observation_space, action_space, num_agents, rollout_length=8,
                    max_length=200, update_epochs=1, inference="eager", update_threads=1)


def make_impala(observation_space, action_space, num_agents):
    return IMPALA(observation_space, action_space, num_agents, rollout_length=8)


def pool(env_id="CartPole-v1", agents=4, collectors=2, backend="inline",
         algorithm=make_algorithm, **options):
    """Collectors of ``env_id`` with a learner of 8-step rollouts (BatchPPO unless
    ``algorithm`` builds another)."""
    env = make_env(env_id, "inline", 0, agents, 0)
    learner = algorithm(env.observation_space, env.action_space, agents)
    spec = CollectorSpec(functools.partial(make_env, env_id, backend), algorithm,
                         num_agents=agents, collectors=collectors, rollout_length=8, seed=3)
    collectors = LocalCollectors(spec, env.observation_space, env.action_space,
                                 learner.behaviour_fields(), learner.acting_state(), **options)
    env.close()
    return collectors, learner


def test_every_batch_is_one_rollout_of_every_agent_in_order():
    collectors, learner = pool()
    with collectors:
        for update in range(4):
            rollout, metas = collectors.receive()
            assert rollout.agents.tolist() == [0, 1, 2, 3]
            assert [meta["collector"] for meta in metas] == [0, 1]
            assert rollout.observ.shape == (4, 9, 4) and rollout.action.dtype == torch.int64
            assert rollout.behaviour["mean_or_logits"].shape == (4, 8, 2)
            assert rollout.valid.all()
            # Only a collector's first rollout starts new episodes (its envs were reset).
            assert [meta["fresh"] for meta in metas] == [update == 0] * 2
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
    # close() asked them to stop: they closed their envs and exited, none was killed.
    assert [process.exitcode for process in collectors._processes] == [0, 0]


def test_each_rollouts_meta_counts_its_steps_and_the_episodes_that_ended_in_it():
    torch.manual_seed(0)
    collectors, learner = pool(collectors=1)
    received = []
    with collectors:
        for _ in range(6):
            rollout, (meta,) = collectors.receive()
            received.append((rollout, meta))
            collectors.publish(learner.acting_state())
    # The episodes as the rollouts tell them, from the first (fresh) one on.
    score, length = torch.zeros(4), torch.zeros(4)
    for rollout, meta in received:
        ended = []
        for t in range(8):
            score += rollout.reward[:, t]
            length += 1
            done = rollout.done[:, t].bool()
            ended += zip(score[done].tolist(), length[done].tolist())
            score[done], length[done] = 0.0, 0.0
        assert meta["steps"] == 4 * 8 and meta["env_restarts"] == 0
        assert meta["episodes"] == len(ended)
        assert meta["score_sum"] == pytest.approx(sum(s for s, _ in ended))
        assert meta["score_squares"] == pytest.approx(sum(s * s for s, _ in ended))
        assert meta["length_sum"] == sum(n for _, n in ended)
    assert sum(meta["episodes"] for _, meta in received) >= 2


def test_impala_learns_on_policy_from_collectors_at_lag_zero():
    """With ``max_policy_lag=0`` each rollout was acted by the weights and observation
    statistics that the learner has when it learns it: the ratios V-trace sees are 1."""
    torch.manual_seed(0)
    collectors, learner = pool(algorithm=make_impala, max_policy_lag=0)
    with collectors:
        for update in range(4):
            rollout, metas = collectors.receive()
            assert rollout.version.tolist() == [update] * 4 == [collectors.version] * 4
            summary = learner.learn(rollout)
            assert summary["impala/rho_mean"] == pytest.approx(1.0, abs=1e-4)
            assert summary["impala/rho_clipped"] == 0.0
            collectors.publish(learner.acting_state())
    assert learner.observ_normalizer.count == 4 * 4 * 8


def test_a_rollout_continues_the_episodes_of_the_last():
    collectors, learner = pool(collectors=1)
    with collectors:
        rollouts = [collectors.receive()[0]]
        while not rollouts[-1].done.any() and len(rollouts) < 20:  # (until an episode ends)
            collectors.publish(learner.acting_state())
            rollouts.append(collectors.receive()[0])
        collectors.publish(learner.acting_state())
        rollouts.append(collectors.receive()[0])
    for first, second in zip(rollouts, rollouts[1:]):
        # The observation after a rollout is the one the next starts from.
        running = first.done[:, -1] == 0
        assert torch.equal(first.observ[running, -1], second.observ[running, 0])
    # Where an episode ended, final_observ holds its last observation, and the observation
    # after the step is the new episode's first (CartPole's resets are within 0.05 of 0).
    ended = rollouts[-2]
    done = ended.done.bool()
    assert done.any()
    assert torch.all((ended.final_observ.abs().sum(-1) > 0) == done)
    after = ended.observ[:, 1:][done]
    assert bool((after.abs() <= 0.05).all())
    assert bool((ended.final_observ[done] != after).any(-1).all())


@pytest.mark.parametrize("limit", [0, 1])
def test_the_lag_limit_holds_and_collectors_wait_for_it(limit):
    collectors, learner = pool(max_policy_lag=limit, queue_size=3)
    with collectors:
        # Rounds 0 .. limit need no new weights; then the collectors wait, with slots free.
        wait_for(lambda: collectors.queued == 2 * (limit + 1), 60, "the first rounds")
        time.sleep(0.5)
        assert collectors.queued == 2 * (limit + 1)
        lags = []
        for _ in range(6):
            rollout, metas = collectors.receive()
            time.sleep(0.05)  # a slow learner: the collectors would run ahead
            lags += (collectors.version - rollout.version).tolist()
            assert {meta["version"] for meta in metas} == set(rollout.version.tolist())
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
        # Version 6 is out: each collector took round 7 + limit, and waits for newer weights.
        wait_for(lambda: list(collectors.shared.rounds) == [8 + limit] * 2, 60,
                 "the collectors to wait for newer weights")
    assert max(lags) == limit  # (round `limit` was collected by version 0)
    # They were waiting for newer weights when asked to stop: they stopped, none was killed.
    assert [process.exitcode for process in collectors._processes] == [0, 0]


def test_without_a_limit_the_lag_is_bounded_by_the_queue():
    collectors, learner = pool(queue_size=2)
    with collectors:
        wait_for(lambda: collectors.queued == 6, 60, "the queues to fill")
        lags = []
        for _ in range(8):
            rollout, _ = collectors.receive()
            time.sleep(0.1)
            lags += (collectors.version - rollout.version).tolist()
            collectors.publish(learner.acting_state())
    # (round 2 was collected by version 0; later ones wait for a slot the learner frees)
    assert 2 <= max(lags) <= 3


def test_a_full_queue_stops_the_collectors():
    collectors, _ = pool(queue_size=2)
    with collectors:
        # Three slots each: all filled, and each collector waits for a free one.
        wait_for(lambda: collectors.queued == 6, 60, "the queue to fill")
        time.sleep(1.0)
        assert list(collectors.shared.rounds) == [3, 3] and collectors.queued == 6
        collectors.receive()
        wait_for(lambda: list(collectors.shared.rounds) == [4, 4], 10, "one more round")
    # Waiting for a free slot, they heard the stop: none was killed.
    assert [process.exitcode for process in collectors._processes] == [0, 0]


@pytest.mark.parametrize("algorithm", [make_algorithm, make_impala], ids=["ppo", "impala"])
def test_an_acting_state_is_a_copy_that_another_copy_loads(algorithm):
    env = make_env("CartPole-v1", "inline", 0, 2, 0)
    learner = algorithm(env.observation_space, env.action_space, 2)
    actor = algorithm(env.observation_space, env.action_space, 2)
    env.close()
    observ = torch.randn(5, 4)
    acted = learner.act(observ, deterministic=True)
    state = learner.acting_state()
    assert any(name.startswith("observ_normalizer.") for name in state)
    with torch.no_grad():
        for parameter in learner.policy.parameters():
            parameter.add_(1.0)  # (after the copy: the state keeps the weights it was given)
    actor.load_acting_state(state)
    (action, record), (copy_action, copy_record) = acted, actor.act(observ, deterministic=True)
    assert torch.equal(action, copy_action) and record.keys() == copy_record.keys()
    assert all(torch.equal(record[key], copy_record[key]) for key in record)


def test_weights_reach_the_collectors_with_their_version():
    collectors, learner = pool(collectors=1, max_policy_lag=0)
    with collectors:
        # The collectors' weights are a copy: the learner's own stay out of shared memory.
        for name, value in learner.acting_state().items():
            assert collectors.shared.weights[name].data_ptr() != value.data_ptr(), name
        rollout, _ = collectors.receive()
        assert rollout.version.tolist() == [0] * 4
        with torch.no_grad():
            for parameter in learner.policy.parameters():
                parameter.add_(1.0)
        collectors.publish(learner.acting_state())
        rollout, _ = collectors.receive()
    assert rollout.version.tolist() == [1] * 4
    # The collector acted with the new weights: the recorded logits are the learner's own.
    observ = rollout.observ[:, :-1].reshape(-1, 4).float()
    _, behaviour = learner.act(observ)
    assert torch.allclose(behaviour["mean_or_logits"],
                          rollout.behaviour["mean_or_logits"].reshape(-1, 2), atol=1e-5)


@pytest.mark.slow
def test_a_collector_killed_while_it_waits_for_a_slot_is_replaced_after_its_queued_rollouts():
    """SIGKILL where a collector spends its time when the learner is behind: waiting on its
    queue of free slots (whose lock it then takes to its grave), with two finished rollouts
    the learner has not taken yet. Its successor keeps them and starts at the round after."""
    reports = []
    collectors, learner = pool(queue_size=1, max_restarts=1, report=reports.append)
    with collectors:
        wait_for(lambda: collectors.queued == 4, 60, "the queues to fill")  # rounds 0 and 1
        os.kill(collectors.pids[0], signal.SIGKILL)
        wait_for(lambda: collectors._processes[0].exitcode is not None, 10, "its exit")
        # (receive() supervises only while it waits, and rounds 0 and 1 wait for it: noticed
        # here, the replacement is rebuilt around the rollouts still queued)
        collectors._supervise()
        assert len(reports) == 1 and "collector 0 failed (exited with code -9); replaced" \
            in reports[0], reports
        assert collectors.restarts == 1
        # Its successor gets no slot that holds a rollout the learner has not copied yet,
        # and begins at the first round not received.
        assert collectors.shared.free[0].qsize() == 0 and collectors.shared.rounds[0] == 2
        rollouts, metas = [], []
        for _ in range(4):
            rollout, meta = collectors.receive()
            assert rollout.agents.tolist() == [0, 1, 2, 3]
            rollouts.append(rollout)
            metas.append(meta)
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
    # Rounds 0 and 1 are the dead collector's own, intact: round 1 continues round 0.
    first, second = rollouts[0], rollouts[1]
    running = first.done[:2, -1] == 0
    assert torch.equal(first.observ[:2][running, -1], second.observ[:2][running, 0])
    # Its successor starts at round 2 (new envs), not earlier, not later...
    assert [meta[0]["fresh"] for meta in metas] == [True, False, True, False]
    assert [meta[1]["fresh"] for meta in metas] == [True, False, False, False]
    # ... with seeds of its own: its envs' first states are not its predecessor's.
    assert not torch.equal(rollouts[2].observ[:2, 0], rollouts[0].observ[:2, 0])


def test_collectors_that_fail_together_are_each_replaced_once():
    """Both collectors killed at once: both successors start and deliver, and the pool counts
    two restarts. (Each successor gets only its own queues: the other's, replaced while it
    starts, no longer exist.)"""
    reports = []
    collectors, learner = pool(queue_size=1, max_restarts=4, report=reports.append)
    with collectors:
        wait_for(lambda: collectors.queued == 4, 60, "the queues to fill")
        for pid in collectors.pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(process.exitcode is not None for process in collectors._processes),
                 10, "their exits")
        collectors._supervise()
        for update in range(4):
            rollout, _ = collectors.receive(within(60, f"batch {update}"))
            assert rollout.agents.tolist() == [0, 1, 2, 3]
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
        assert [process.exitcode for process in collectors._processes] == [None, None]
    assert collectors.restarts == 2, reports
    assert [line.split(" failed")[0] for line in reports] == ["collector 0", "collector 1"]


def faulty_env(fault, at_step, once_file, index, num_envs, seed):
    """CartPole envs stepped in the collector's process; collector 0's first env injects
    ``fault`` at its ``at_step``-th step, once (``once_file``): not in its successor."""
    envs = [gym.make("CartPole-v1") for _ in range(num_envs)]
    if index == 0:
        envs[0] = FaultyEnv(envs[0], fault, at_step=at_step, once_file=str(once_file))
    return BatchEnv(envs, blocking=True)


def pool_of(make, step_timeout=None, **options):
    """Two collectors of two CartPole envs each, built by ``make(index, num_envs, seed)``
    (``pool``'s learner, 8-step rollouts); ``options`` for ``LocalCollectors``."""
    env = make_env("CartPole-v1", "inline", 0, 4, 0)
    learner = make_algorithm(env.observation_space, env.action_space, 4)
    env.close()
    spec = CollectorSpec(make, make_algorithm, num_agents=4, collectors=2, rollout_length=8,
                         seed=3, step_timeout=step_timeout)
    collectors = LocalCollectors(spec, env.observation_space, env.action_space,
                                 learner.behaviour_fields(), learner.acting_state(), **options)
    return collectors, learner


def faulty_pool(tmp_path, fault, at_step, **options):
    """``pool_of`` collectors, collector 0's first env faulty (``faulty_env``)."""
    return pool_of(functools.partial(faulty_env, fault, at_step, tmp_path / "fired"),
                   **options)


def within(seconds, what):
    """A ``receive`` check that fails the test once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    def check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
    return check


class HangsInClose(gym.Wrapper):
    """An env that a failed step left broken: its ``close`` never returns."""

    def close(self):
        time.sleep(3600)


def broken_env(once_file, index, num_envs, seed):
    """As ``faulty_env`` with ``"raise"`` at step 12, whose env then hangs in close."""
    envs = [gym.make("CartPole-v1") for _ in range(num_envs)]
    if index == 0:
        envs[0] = HangsInClose(FaultyEnv(envs[0], "raise", at_step=12,
                                         once_file=str(once_file)))
    return BatchEnv(envs, blocking=True)


@pytest.mark.slow
def test_a_collector_whose_envs_hang_in_close_after_an_error_ends_and_is_replaced(tmp_path):
    """Envs stepped in the collector's own process: one raises in a step, then hangs in its
    close. The step watchdog watches the close too: the collector ends (exit code 1, the
    traceback on stderr) and is replaced, instead of leaving the learner waiting for ever."""
    reports = []
    collectors, learner = pool_of(functools.partial(broken_env, tmp_path / "fired"),
                                  step_timeout=2.0, max_restarts=1, report=reports.append)
    with collectors:
        for _ in range(3):
            rollout, _ = collectors.receive(within(60, "a batch"))
            assert rollout.agents.tolist() == [0, 1, 2, 3]
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
    assert (tmp_path / "fired").exists()
    assert len(reports) == 1 and reports[0].startswith("collector 0 failed (exited with "
                                                       "code 1"), reports


@pytest.mark.slow
def test_a_collector_that_dies_after_sending_its_first_rollout_is_replaced(tmp_path):
    """Collector 0 sends round 0, then fails in round 1 before the learner looked at its
    queue: the rollout it sent counts (it got going), so it is replaced, not a failure of the
    run; its successor starts at round 1, and round 0 is the dead collector's own. (An error,
    not an abrupt exit: a collector flushes what it sent before it exits with its error.)"""
    reports = []
    collectors, learner = faulty_pool(tmp_path, "raise", 12, max_restarts=1,
                                      report=reports.append)
    with collectors:
        wait_for(lambda: collectors._processes[0].exitcode is not None, 60, "its exit")
        collectors._supervise()  # (before anything drained its queue)
        assert collectors.restarts == 1 and len(reports) == 1, reports
        assert reports[0].startswith("collector 0 failed (") and \
            "injected fault in step 12); replaced" in reports[0], reports
        # Both queues full again: the successor filled only the slots round 0 does not hold.
        wait_for(lambda: collectors.queued == 6, 60, "the queues to fill")
        rollouts, metas = [], []
        for _ in range(3):
            rollout, meta = collectors.receive(within(60, "a batch"))
            assert rollout.agents.tolist() == [0, 1, 2, 3]
            rollouts.append(rollout)
            metas.append(meta)
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
    # Round 0 starts from the first process's seeds, round 1 from its successor's: env j
    # resets first with the seed of its collector's incarnation plus j.
    for round_, incarnation in ((0, 0), (1, 1)):
        seed = collector_seed(collectors.spec, 0, incarnation)
        for j in range(2):
            start = torch.as_tensor(gym.make("CartPole-v1").reset(seed=seed + j)[0])
            assert torch.equal(rollouts[round_].observ[j, 0], start), (round_, j)
    # Collector 0: round 0 from the first process, rounds 1 and 2 from its successor.
    assert [meta[0]["fresh"] for meta in metas] == [True, True, False]
    assert [meta[1]["fresh"] for meta in metas] == [True, False, False]


@pytest.mark.slow
def test_a_collector_that_dies_with_nothing_queued_is_replaced_at_the_next_round(tmp_path):
    """At lag 0, collector 0 dies in round 1 after the learner took round 0: nothing of it
    is queued, and its successor starts at round 1 (the learner's next), not at another."""
    reports = []
    collectors, learner = faulty_pool(tmp_path, "exit", 12, max_restarts=1, max_policy_lag=0,
                                      report=reports.append)
    with collectors:
        metas = []
        for update in range(3):
            rollout, meta = collectors.receive(within(60, f"batch {update}"))
            assert rollout.version.tolist() == [update] * 4
            metas.append(meta)
            learner.learn(rollout)
            collectors.publish(learner.acting_state())
    assert len(reports) == 1 and "collector 0 failed (exited with code 3)" in reports[0]
    assert [meta[0]["fresh"] for meta in metas] == [True, True, False]
    assert [meta[1]["fresh"] for meta in metas] == [True, False, False]
    assert collectors._waiting == {}  # (no stale round of the successor's left behind)


def failing_env(log_dir, index, num_envs, seed):
    """CartPole envs stepped in the collector's process; collector 0's first env raises in
    its 12th step in every incarnation (each injection leaves a file in ``log_dir``)."""
    envs = [gym.make("CartPole-v1") for _ in range(num_envs)]
    if index == 0:
        envs[0] = FaultyEnv(envs[0], "raise", at_step=12, log_dir=str(log_dir))
    return BatchEnv(envs, blocking=True)


@pytest.mark.slow
def test_a_collector_killed_while_it_writes_its_error_leaves_its_successor_free_to_report(
        tmp_path):
    """Collector 0 is killed (as by the OOM killer) while it writes its error line, so the
    lock of the queue it writes to stays held for ever: the test holds it for the dead
    process. Its successor fails too, and its error line reaches the learner through a queue
    of its own, instead of the successor hanging on that lock with the learner waiting."""
    reports = []
    collectors, _ = pool_of(functools.partial(failing_env, tmp_path), max_restarts=1,
                            report=reports.append)
    with collectors:
        lock = collectors.shared.errors[0]._wlock  # (multiprocessing's; shared with children)
        lock.acquire()
        try:
            wait_for(lambda: any(tmp_path.iterdir()), 60, "the first fault")
            time.sleep(0.5)  # (its error line waits for the lock)
            os.kill(collectors.pids[0], signal.SIGKILL)
            # (rounds 0 and 1 come first, from the first collector 0 and its successor, unless
            # the successor's error in round 2 overtakes collector 1's rollouts)
            with pytest.raises(CollectorError, match=r"collector 0 failed \(EnvRaisedError: "
                               r".*injected fault in step 12\) after 1 replacements"):
                for round_ in range(3):
                    collectors.receive(within(60, f"round {round_}"))
        finally:
            lock.release()
    assert len(reports) == 1 and "collector 0 failed (exited with code -9)" in reports[0], \
        reports
    assert len(list(tmp_path.iterdir())) == 2


class RaisesAtLength(gym.Wrapper):
    """Raises in its 12th step with an error whose one line is longer than a pipe holds."""

    def __init__(self, env):
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 12:
            raise RuntimeError("x" * 100_000)
        return self.env.step(action)


def long_error_env(index, num_envs, seed):
    envs = [gym.make("CartPole-v1") for _ in range(num_envs)]
    if index == 0:
        envs[0] = RaisesAtLength(envs[0])
    return BatchEnv(envs, blocking=True)


@pytest.mark.slow
def test_a_collector_error_longer_than_a_pipe_holds_arrives_cut_short():
    """The learner reads a collector's error line after the collector exited, and the
    collector exits once the line is written: a line longer than the pipe holds arrives cut
    short instead of the two waiting for each other for ever."""
    collectors, _ = pool_of(long_error_env)
    with collectors:
        # (round 0 comes first, unless the error in round 1 overtakes collector 1's rollout)
        cut = r"RuntimeError: x+ \[\.\.\.\]\) after 0 "
        with pytest.raises(CollectorError, match=cut) as error:
            for round_ in range(2):
                collectors.receive(within(60, f"round {round_}"))
    assert len(str(error.value)) < 2_200


def test_closing_kills_a_collector_that_does_not_stop(tmp_path):
    """Collector 0's env hangs in a step (no step timeout): it never hears the stop, and
    close() kills it once its timeout has passed; collector 1 stops by itself."""
    collectors, _ = faulty_pool(tmp_path, "hang", 3)
    try:
        wait_for(lambda: (tmp_path / "fired").exists(), 60, "the hang")
        pids = collectors.pids
    finally:
        collectors.close(timeout=2.0)
    assert [process.exitcode for process in collectors._processes] == [-signal.SIGKILL, 0]
    assert wait_gone(pids, timeout=10) == []


def test_a_collector_never_copies_weights_that_a_publish_is_rewriting():
    """The sequence lock: while the learner rewrites the weights (odd sequence), a collector
    waits; then it gets the new version with the new values, in tensors of its own."""
    from batchrl.collectors.local import _Shared, _SharedLink
    shared = _Shared(context(), [[]], {"w": torch.zeros(3)}, None)
    try:
        link = _SharedLink(shared, 0, [])
        assert link.weights(-1) is None  # (nothing published yet)
        shared.version.value = 0
        version, state = link.weights(-1)
        assert version == 0 and torch.equal(state["w"], torch.zeros(3))
        assert state["w"].data_ptr() != shared.weights["w"].data_ptr()  # (a copy)
        assert link.weights(0) is None  # (nothing newer)
        # A publish half done: the version bumped, a part of the weights written.
        shared.sequence.value += 1
        shared.version.value = 1
        shared.weights["w"][0] = 1.0
        got = []
        reader = threading.Thread(target=lambda: got.append(link.weights(0)), daemon=True)
        reader.start()
        reader.join(1.0)
        assert reader.is_alive() and got == []  # (waits while the publish is under way)
        shared.weights["w"][1:] = 1.0
        shared.sequence.value += 1
        reader.join(30.0)
        assert len(got) == 1
        version, state = got[0]
        assert version == 1 and torch.equal(state["w"], torch.ones(3))

        class PublishedDuringTheCopy(dict):
            """Weights that the learner publishes anew (version 2) while they are copied."""
            def items(self):
                items = super().items()
                if shared.version.value == 1:
                    shared.sequence.value += 1
                    self["w"].fill_(2.0)
                    shared.version.value = 2
                    shared.sequence.value += 1
                return items

        shared.weights = PublishedDuringTheCopy(shared.weights)
        version, state = link.weights(0)  # (the copy overlapped a publish: copied again)
        assert version == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
        # A publish that failed half done (the learner's error stops the collectors): a
        # waiting collector hears the stop and goes on with the weights it has, to stop.
        shared.sequence.value += 1
        reader = threading.Thread(target=lambda: got.append(link.weights(2)), daemon=True)
        reader.start()
        reader.join(0.5)
        assert reader.is_alive()
        shared.stop.value = 1
        reader.join(5.0)
        assert not reader.is_alive() and got[-1] is None
    finally:
        shared.sequence.value = 0
        for channel in (*shared.free, *shared.full, *shared.errors):
            channel.cancel_join_thread()
            channel.close()


def test_collectors_of_one_seed_collect_the_same_first_rollout():
    first = []
    for _ in range(2):
        torch.manual_seed(0)  # (the learner's initial weights, which the collectors act with)
        collectors, _ = pool(collectors=1)
        with collectors:
            first.append(collectors.receive()[0])
    assert torch.equal(first[0].observ, first[1].observ)
    assert torch.equal(first[0].action, first[1].action)
    assert torch.equal(first[0].behaviour["mean_or_logits"], first[1].behaviour["mean_or_logits"])


class DrawsAtReset(gym.Wrapper):
    """Its first observation of an episode begins with a draw from NumPy's global generator."""

    def reset(self, **kwargs):
        observ, info = self.env.reset(**kwargs)
        observ = observ.copy()
        observ[0] = np.random.random()
        return observ, info


def drawing_env(index, num_envs, seed):
    return BatchEnv([DrawsAtReset(gym.make("CartPole-v1")) for _ in range(num_envs)],
                    blocking=True)


def test_each_collector_draws_from_global_generators_seeded_its_own_way():
    """Envs (or algorithms) that draw from NumPy's global generator: each collector's draws
    are its own, and a second pool of the same seed repeats them."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)  # (the learner's initial weights, which the collectors act with)
        collectors, _ = pool_of(drawing_env)
        with collectors:
            draws.append(collectors.receive(within(60, "a batch"))[0].observ[:, 0, 0])
    assert len(set(draws[0].tolist())) == 4, draws  # (two envs of each collector)
    assert torch.equal(draws[0], draws[1]), draws


def test_replacements_end_at_max_restarts_and_a_first_collector_that_never_delivered_fails():
    lines = []
    replacements = Replacements(2, 1, lines.append)
    with pytest.raises(CollectorError, match="^collector 1 failed before its first rollout: "
                                             "boom$"):
        replacements.failed(1, "boom")
    replacements.delivered[0] = True
    assert replacements.failed(0, "x") == 1 and replacements.count == 1
    assert lines == ["collector 0 failed (x); replaced [1 of at most 1]"]
    with pytest.raises(CollectorError, match=r"^collector 0 failed \(y\) after 1 replacements "
                                             r"\(at most 1: env.max_restarts\)$"):
        replacements.failed(0, "y")


def test_each_collector_and_its_env_workers_keep_to_a_share_of_the_cores():
    """Two collectors of this machine: each process is pinned to its half of the cores, and
    pins its env worker there, instead of both pinning their workers to the first core."""
    cores = pinnable_cores()
    if len(cores) < 2:
        pytest.skip("needs an affinity mask of at least two cores and no CPU quota below it")
    collectors, _ = pool(backend="workers")
    with collectors:
        collectors.receive(within(60, "a batch"))  # (their env workers are up)
        for index, pid in enumerate(collectors.pids):
            share = core_share(cores, index, 2)
            assert psutil.Process(pid).cpu_affinity() == share
            below = [psutil.Process(child).cpu_affinity() for child in descendants(pid)]
            assert all(set(affinity) <= set(share) for affinity in below), (share, below)
            assert [share[0]] in below, (share, below)  # (its env worker)


def test_uint8_observations_travel_as_uint8():
    collectors, learner = pool("uint8", collectors=1)
    with collectors:
        rollout, _ = collectors.receive()
        learner.learn(rollout)
    assert rollout.observ.dtype == torch.uint8 and rollout.final_observ.dtype == torch.uint8
    assert rollout.observ.float().std() > 10  # quantised CartPole states, not a cast of [-1, 1]


def test_collectors_with_their_envs_in_worker_processes():
    collectors, learner = pool(backend="workers")
    with collectors:
        rollout, _ = collectors.receive()
        learner.learn(rollout)
        for pid in collectors.pids:  # its fork server and env worker at least
            assert len(psutil.Process(pid).children(recursive=True)) >= 2
    assert rollout.agents.tolist() == [0, 1, 2, 3]


# --- the trainer ---------------------------------------------------------------------------

def config(**train):
    values = {"env": {"id": "Pendulum-v1", "num_agents": 4, "max_length": 200,
                      "backend": "inline"},
              "train": {"steps": 3200, "eval_episodes": 2, "eval_every": 10, "device": "cpu",
                        "collectors": 2, **train},
              "algorithm": {"rollout_length": 40, "update_epochs": 2, "inference": "eager",
                            "update_threads": 1}}
    return values


@pytest.mark.slow
def test_training_with_collectors_logs_the_lag_and_resumes(tmp_path, monkeypatch):
    sessions = []  # each pool's session: a resumed run's collectors seed their envs anew
    monkeypatch.setattr(trainer_module, "LocalCollectors", lambda spec, *args, **kwargs: (
        sessions.append(spec.session) or LocalCollectors(spec, *args, **kwargs)))
    values = config()
    record = Trainer(build_config(values), tmp_path, progress=False).run()
    assert record["phase"] == "eval" and record["episodes"] == 2
    records = read_metrics(tmp_path)
    updates = [r for r in records if r["phase"] == "update"]
    assert len(updates) == 3200 // 160
    assert all(r["collectors_lag_mean"] <= r["collectors_lag_max"] <= 3 for r in updates)
    # The collectors act on while the learner takes its 2 epochs: rollouts lag behind it.
    assert max(r["collectors_lag_max"] for r in updates) >= 1
    assert all(r["collectors_steps_per_s"] > 0 and r["learner_steps_per_s"] > 0
               for r in updates)
    trains = [r for r in records if r["phase"] == "train"]
    assert trains[-1]["step"] == 3200 and trains[-1]["episodes"] == 1600 // 200
    # The episodes that ended in an update's rollouts, under the collectors' prefix.
    ended = [r for r in updates if "collectors_episodes" in r]
    assert ended and all(math.isfinite(r["collectors_score"]) and r["collectors_length"] > 0
                         for r in ended)
    assert sum(r["collectors_episodes"] for r in ended) >= 3200 // 200 - 4
    # Resume: a longer budget goes on from the checkpoint.
    values["train"]["steps"] = 4800
    Trainer(build_config(values), tmp_path, progress=False).run()
    steps = [r["step"] for r in read_metrics(tmp_path) if r["phase"] == "train"]
    assert steps == [1600, 3200, 4800]
    assert len(sessions) == 2 and sessions[0] == 0 < sessions[1], sessions


def test_the_trainer_counts_the_steps_and_logs_no_lag_when_collectors_wait_for_each_update(
        tmp_path, monkeypatch):
    sessions = []  # each pool's session: a resumed run's collectors seed their envs anew
    monkeypatch.setattr(trainer_module, "LocalCollectors", lambda spec, *args, **kwargs: (
        sessions.append(spec.session) or LocalCollectors(spec, *args, **kwargs)))
    values = {"env": {"id": "CartPole-v1", "num_agents": 2, "max_length": 200,
                      "backend": "inline"},
              "train": {"steps": 64, "eval_episodes": 0, "device": "cpu", "collectors": 1,
                        "max_policy_lag": 0},
              "algorithm": {"class": "batchrl.algos.impala:IMPALA", "rollout_length": 8}}
    trainer = Trainer(build_config(values), tmp_path, progress=False)
    trainer.run()
    updates = [r for r in read_metrics(tmp_path) if r["phase"] == "update"]
    # Each update learns one 8-step rollout of both agents, acted by the learner's weights.
    assert [r["step"] for r in updates] == [16, 32, 48, 64] and trainer.counters.steps == 64
    assert all(r["collectors_lag_mean"] == r["collectors_lag_max"] == 0 for r in updates)
    values["train"]["steps"] = 96
    resumed = Trainer(build_config(values), tmp_path, progress=False)
    resumed.run()
    assert resumed.counters.steps == 96
    assert sessions == [0, trainer.counters.phases] and sessions[1] > 0


@pytest.mark.parametrize("fault, why", [("exit", "exited with code 3"),
                                        ("raise", "EnvRaisedError: env 0 (Pendulum-v1) failed "
                                                  "in step(): RuntimeError: injected fault")])
@pytest.mark.slow
def test_a_collector_that_fails_is_replaced(tmp_path, capsys, monkeypatch, fault, why):
    begun = []  # the learner's agents that begin new episodes, per call in training
    original = BatchPPO.begin_episodes

    def begin_episodes(self, agent_indices):
        if self.training:
            begun.append(agent_indices.tolist())
        return original(self, agent_indices)

    monkeypatch.setattr(BatchPPO, "begin_episodes", begin_episodes)
    once = tmp_path / "fired"
    values = config(steps=4800)
    values["env"].update(id="batchrl.testing.faults:make", kwargs={
        "env_id": "Pendulum-v1", "fault": fault, "at_step": 300, "once_file": str(once)})
    trainer = Trainer(build_config(values), tmp_path / "run", progress=False)
    trainer.run()
    lines = capsys.readouterr().out.splitlines()
    assert once.exists()
    replaced = [line for line in lines if "replaced" in line]
    assert len(replaced) == 1 and why in replaced[0], lines
    assert trainer.counters.steps == 4800
    # Every collector's first rollout, and its replacement's, starts new episodes: no running
    # return (reward_scale) carries over from episodes the reset cut.
    index = int(replaced[0].split("collector ")[1].split()[0])
    assert begun == [[0, 1, 2, 3], [[0, 1], [2, 3]][index]]


@pytest.mark.slow
def test_a_collector_whose_inline_env_hangs_ends_itself_and_is_replaced(tmp_path):
    """No worker times out an env stepped in the collector's own process: its watchdog ends
    the collector, with its traceback, instead of leaving the learner waiting for ever. (In
    train.py's own process: the collectors' stderr is that of the fork server, started once.)"""
    once = tmp_path / "fired"
    process = start_train_py(
        "--config", "pendulum", "--logdir", str(tmp_path / "run"), "--steps", "4800",
        *sets("env.num_agents=4", "env.backend=inline", "env.timeout=2",
              "train.collectors=2", "train.eval_episodes=2", "algorithm.rollout_length=40",
              'env.id="batchrl.testing.faults:make"',
              f'env.kwargs={{env_id="Pendulum-v1", fault="hang", at_step=300, '
              f'once_file="{once}"}}',
              "env.eval_kwargs={at_step=1000000}"))  # (the learner's own envs step inline)
    code, stdout, stderr = finish(process, 120)
    assert code == 0 and once.exists(), f"{stdout}\n{stderr}"  # (whole, as a string)
    replaced = [line for line in stdout.splitlines() if "replaced" in line]
    assert len(replaced) == 1 and "exited with code 1" in replaced[0], stdout
    assert "Timeout (0:00:04)!" in stderr and "in _fire" in stderr, stderr  # (where it hung)
    assert "Final evaluation" in stdout


def test_evaluation_envs_of_other_spaces_than_the_collectors_are_refused_at_once(tmp_path):
    """With collectors the learner's envs only evaluate: env.eval_kwargs that change the
    spaces are a config error before the log directory holds the run, as without them."""
    values = config()
    values["env"].update(id="HalfCheetah-v5", max_length=50,
                         eval_kwargs={"exclude_current_positions_from_observation": False})
    with pytest.raises(ConfigError, match=r"^env.eval_kwargs builds envs whose observation "
                                          r"space is Box\(-inf, inf, \(18,\), float32\), "
                                          r"not the training envs' Box\(-inf, inf, \(17,\)"):
        Trainer(build_config(values), tmp_path / "run", progress=False).run()
    assert not (tmp_path / "run").exists()


STDIN_SCRIPT = """
import sys
from batchrl.config import build_config
from batchrl.trainer import Trainer
values = {"env": {"id": "Pendulum-v1", "num_agents": 4, "max_length": 200, "backend": "inline"},
          "train": {"steps": 640, "eval_episodes": 0, "device": "cpu", "collectors": 2},
          "algorithm": {"rollout_length": 40, "update_epochs": 1, "inference": "eager",
                        "update_threads": 1}}
Trainer(build_config(values), sys.argv[1], progress=False).run()
print("trained", flush=True)
"""


@pytest.mark.slow
def test_collectors_start_from_a_script_read_from_stdin(tmp_path):
    """``python - <<EOF`` has no main file that the collector processes could import again:
    they start without it, as env workers do."""
    result = run_stdin_script(STDIN_SCRIPT, str(tmp_path / "run"))
    assert result.returncode == 0 and result.stdout == "trained\n", result.stderr
    assert read_metrics(tmp_path / "run")[-1]["step"] == 640


def test_a_collector_that_cannot_start_stops_the_run_with_its_error(tmp_path):
    values = config()
    values["env"].update(id="batchrl.testing.faults:make", kwargs={
        "env_id": "Pendulum-v1", "fault": "raise", "in_reset": True, "at_step": 1})
    with pytest.raises(CollectorError, match="collector [01] failed before its first rollout: "
                                             ".*injected fault in reset 1"):
        Trainer(build_config(values), tmp_path, progress=False).run()


def test_train_py_reports_a_collector_that_cannot_start_in_one_line(tmp_path):
    process = start_train_py(
        "--config", "pendulum", "--logdir", str(tmp_path / "run"),
        *sets("env.num_agents=4", "env.backend=inline", "train.collectors=2",
              "algorithm.rollout_length=40", 'env.id="batchrl.testing.faults:make"',
              'env.kwargs={env_id="Pendulum-v1", fault="raise", in_reset=true, at_step=1}'))
    code, stdout, stderr = finish(process, 90)
    assert code == 1, (stdout, stderr)
    assert stderr.startswith("error: collector ") and "failed before its first rollout" in stderr
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("change, message", [
    ({"train": {"max_policy_lag": -1}}, "max_policy_lag must be >= 0"),
    ({"env": {"num_agents": 1}}, r"train.collectors \(2\) must be at most env.num_agents "
                                 r"\(1\)"),
    ({"algorithm": {"network": "recurrent", "rollout_length": "none"}},
     "BatchPPO with network='recurrent' cannot run with collectors"),
    ({"algorithm": {"class": "batchrl.algos.reinforce:Reinforce"}},
     "Reinforce does not implement behaviour_fields, act, acting_state, load_acting_state, "
     "learn"),
])
def test_bad_collector_settings_are_one_line_errors(tmp_path, change, message):
    values = config()
    for section, keys in change.items():
        if section == "algorithm" and "class" in keys:
            values["algorithm"] = dict(keys)
        else:
            values[section].update(keys)
    with pytest.raises(ConfigError, match=message) as error:
        Trainer(build_config(values), tmp_path, progress=False).run()
    assert "\n" not in str(error.value)
    assert not (tmp_path / "config.json").exists()  # nothing started


def test_a_recurrent_batchppo_refuses_to_act_or_learn_as_a_collector_would():
    """The decoupled methods say why they cannot serve a recurrent policy (instead of the
    GRU's complaint about a state of width 0)."""
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    algo = BatchPPO(space, gym.spaces.Discrete(2), 2, network="recurrent", gru_size=4,
                    inference="eager")
    for call in (lambda: algo.act(torch.zeros(2, 3)), lambda: algo.learn(None)):
        with pytest.raises(NotImplementedError, match="^BatchPPO with network='recurrent' "
                                                      "cannot run with collectors"):
            call()


def test_a_learner_error_stops_the_collectors_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    learn = BatchPPO.learn
    calls = []

    def failing(self, rollout):
        calls.append(1)
        if len(calls) == 15:  # in the second phase
            raise RuntimeError("a learner bug")
        return learn(self, rollout)

    monkeypatch.setattr(BatchPPO, "learn", failing)
    with pytest.raises(RuntimeError, match="a learner bug"):  # (no checkpoint was due yet)
        Trainer(build_config(config(checkpoint_every=2)), tmp_path, progress=False).run()
    assert list_checkpoints(tmp_path)  # the first phase's boundary, kept in memory until then
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["counters"]["steps"] == 1600
    # (the fixture no_leaked_workers checks that no collector is left running)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_a_signal_checkpoints_and_stops_every_collector(tmp_path, signum):
    logdir = tmp_path / "run"
    process = start_train_py(
        "--config", "pendulum", "--logdir", str(logdir),
        *sets("env.num_agents=4", "env.backend=workers", "env.workers=1", "train.collectors=2",
              "train.device=cpu", "train.steps=1000000", "train.eval_episodes=2",
              "train.eval_every=5", "algorithm.rollout_length=50", "algorithm.update_epochs=2",
              "algorithm.update_threads=1"))
    try:
        wait_for(lambda: len(read_metrics(logdir)) >= 12 or process.poll() is not None, 120,
                 "two phases")
        assert process.poll() is None, process.communicate()
        children = descendants(process.pid)
        assert len(children) >= 5  # fork server, two collectors and their env workers
        os.killpg(process.pid, signum)
        signalled = time.monotonic()
        code, stdout, stderr = finish(process)
        stopped_in = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 128 + signum, (stdout, stderr)
    assert stopped_in < 20, stopped_in
    assert "Traceback" not in stderr, stderr
    assert wait_gone(children, timeout=10) == []
    assert "checkpoint at step" in stdout and list_checkpoints(logdir)


# --- a Ray cluster of two nodes on 127.0.0.1 -------------------------------------------------

def _collector_processes(nodes) -> list:
    return nodes.processes(command="RayCollector")


def _collector_processes_left(nodes) -> list[str]:
    """The collector processes still running a while after their actors were killed (Ray
    frees a killed actor's CPUs before its process has exited)."""
    return wait_gone([process.pid for process in _collector_processes(nodes)], 10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collectors_spread_over_a_ray_cluster_and_one_killed_is_replaced(cluster, tmp_path,
                                                                          capsys):
    import ray
    import threading
    values = config(steps=12800, eval_episodes=0)
    values["env"].update(backend="ray", ray_address=cluster.address, ray_resources={"CPU": 1})
    trainer = Trainer(build_config(values), tmp_path, progress=False)
    killed: list[int] = []

    def kill_one() -> None:  # once rollouts flow, SIGKILL one collector's actor process
        wait_for(lambda: len([r for r in read_metrics(tmp_path) if r["phase"] == "update"])
                 >= 3, 120, "three updates")
        process = _collector_processes(cluster)[0]
        killed.append(process.pid)
        process.kill()

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    trainer.run()
    killer.join(5)
    lines = capsys.readouterr().out.splitlines()
    assert killed and trainer.counters.steps == 12800
    placed = [line for line in lines if "collectors on Ray nodes" in line]
    assert placed and len(set(placed[0].rsplit("nodes ", 1)[1].split(", "))) == 2, lines
    replaced = [line for line in lines if "replaced" in line]
    assert len(replaced) == 1 and "collector" in replaced[0], lines
    # Every actor is gone and its CPU free again; no collector process is left.
    cluster.wait_idle()
    assert _collector_processes_left(cluster) == []
    assert ray.is_initialized()  # the test's own connection is left alone


RAY_STARTS = """
import sys
import ray
from batchrl.train import main

calls = []
for name in ("init", "shutdown"):
    def counted(*args, _name=name, _real=getattr(ray, name), **kwargs):
        calls.append(_name)
        return _real(*args, **kwargs)
    setattr(ray, name, counted)
code = main(["--config", "cartpole", "--logdir", sys.argv[1], "--no-progress",
             "--set", "env.num_agents=2", "--set", "algorithm.rollout_length=32",
             "--set", "train.collectors=2", "--set", "env.backend='ray'",
             "--set", "train.steps=128", "--set", "train.eval_episodes=1"])
print("calls:", calls, "code:", code)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_collectors_on_a_private_instance_start_it_once(tmp_path):
    """The check that the cluster has room for the collectors and the collectors themselves
    share one private Ray instance: it is not stopped and started again between them."""
    pytest.importorskip("ray")
    result = run_stdin_script(RAY_STARTS, str(tmp_path / "run"), timeout=280)
    assert "calls: ['init', 'shutdown'] code: 0" in result.stdout, result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replacement_the_shrunken_cluster_has_no_room_for_stops_the_run(cluster, tmp_path,
                                                                         monkeypatch):
    import threading
    from batchrl.collectors.ray import RayCollectors
    monkeypatch.setattr(RayCollectors, "placement_timeout", 5.0)
    cluster.start("lost", 1)
    cluster.wait_idle()
    # The one collector needs the node that is lost: its replacement fits nowhere else.
    values = config(steps=1_000_000, eval_episodes=0, collectors=1)
    values["env"].update(backend="ray", ray_address=cluster.address,
                         ray_resources={"CPU": 1, "lost_node": 0.1})
    trainer = Trainer(build_config(values), tmp_path, progress=False)
    lost = []

    def lose_the_node() -> None:
        wait_for(lambda: any(r["phase"] == "update" for r in read_metrics(tmp_path)), 120,
                 "an update")
        lost.append(time.monotonic())
        assert cluster.kill(["lost"]) == []

    killer = threading.Thread(target=lose_the_node, daemon=True)
    killer.start()
    with pytest.raises(CollectorError, match=r"collector 0's replacement found no room on the "
                                             r"Ray cluster within 5 s: 1 collector with "
                                             r"env.ray_resources=\{'CPU': 1, 'lost_node': 0.1\}: "
                                             r"lost_node=0.1 needed in all, but the Ray cluster "
                                             r"has lost_node=0; add nodes"):
        trainer.run()
    killer.join(5)
    assert lost and time.monotonic() - lost[0] < 30
    cluster.wait_idle()
    assert _collector_processes_left(cluster) == []


def test_more_collectors_than_the_cluster_holds_is_an_error_before_work_starts(cluster,
                                                                                tmp_path):
    values = config(collectors=4)
    values["env"].update(backend="ray", ray_address=cluster.address, num_agents=4,
                         ray_resources={"CPU": 1})
    with pytest.raises(ConfigError, match=r"4 collectors with env.ray_resources=\{'CPU': 1\}: "
                                          r"CPU=4 needed in all, but the Ray cluster has "
                                          r"CPU=3"):
        Trainer(build_config(values), tmp_path, progress=False).run()
    assert not (tmp_path / "config.json").exists()  # (nothing written: start it again)
    cluster.wait_idle()


@pytest.fixture
def ray_pool(cluster):
    """``pool``'s collectors as Ray actors on the test cluster (2 CPUs on the head, 1 on the
    second node), driven directly: no training loop."""
    from batchrl.collectors.ray import RayCollectors

    def make(spec_env=None, agents=4, collectors=2, **options):
        env = make_env("CartPole-v1", "inline", 0, agents, 0)
        learner = make_algorithm(env.observation_space, env.action_space, agents)
        spec = CollectorSpec(spec_env or functools.partial(make_env, "CartPole-v1", "inline"),
                             make_algorithm, num_agents=agents, collectors=collectors,
                             rollout_length=8, seed=3)
        env.close()
        return RayCollectors(spec, env.observation_space, env.action_space,
                             learner.behaviour_fields(), learner.acting_state(),
                             address=cluster.address, **options), learner

    with ray_pickles_by_value(__name__):
        yield make
    cluster.wait_idle()  # every actor is gone, failed ones too


@pytest.mark.slow  # (the local queue's twin and the hub's rules without Ray are not)
@pytest.mark.parametrize("limit", [0, 1])
def test_ray_collectors_hold_the_lag_limit(ray_pool, limit):
    collectors, learner = ray_pool(max_policy_lag=limit, queue_size=3)
    with collectors:
        wait_for(lambda: collectors.queued >= 2 * (limit + 1), 60, "the first rounds")
        time.sleep(1.0)
        assert collectors.queued == 2 * (limit + 1)  # then they wait for new weights
        lags = []
        for _ in range(4):
            rollout, metas = collectors.receive()
            lags += (collectors.version - rollout.version).tolist()
            assert {meta["version"] for meta in metas} == set(rollout.version.tolist())
            collectors.publish(learner.acting_state())
    assert max(lags) == limit


@pytest.mark.slow  # (as the test above)
def test_ray_collectors_without_a_limit_fill_only_their_queue(ray_pool):
    collectors, _ = ray_pool(queue_size=1)
    with collectors:
        wait_for(lambda: collectors.queued >= 4, 60, "the queues to fill")
        time.sleep(1.0)
        assert collectors.queued == 4  # 1 + queue_size rounds of 2 collectors, no more
        assert collectors.receive()[0].agents.tolist() == [0, 1, 2, 3]


def test_the_ray_hub_keeps_the_rules_of_the_local_queue():
    """The hub of ``RayCollectors`` as a plain object (no Ray): a collector starts round ``k``
    while at most ``queue_size`` rounds before it wait for the learner and once version
    ``k - max_policy_lag`` is out; the learner takes whole rounds; a late rollout of a
    replaced collector is dropped."""
    from batchrl.collectors.ray import _Hub
    hub = _Hub(2, queue_size=1, max_lag=None)
    hub.publish(0, ["ref 0"])
    assert [hub.may_start(round_) for round_ in range(3)] == ["go", "go", "wait"]
    assert hub.newest(-1) == (0, ["ref 0"]) and hub.newest(0) is None
    hub.deliver(0, 0, {"round": 0}, {"collector": 0})
    assert hub.take() is None and hub.queued() == 1  # (collector 1's is missing)
    hub.deliver(0, 1, {"round": 0}, {"collector": 1})
    hub.deliver(1, 0, {"round": 1}, {"collector": 0})
    assert hub.take() == [({"round": 0}, {"collector": 0}), ({"round": 0}, {"collector": 1})]
    assert hub.queued() == 1 and [hub.next_round(index) for index in (0, 1)] == [2, 1]
    assert [hub.may_start(round_) for round_ in range(1, 4)] == ["go", "go", "wait"]
    hub.deliver(1, 1, {"round": 1, "by": "successor"}, {"collector": 1})
    hub.deliver(1, 1, {"round": 1, "by": "predecessor"}, {"collector": 1})  # too late
    hub.deliver(0, 1, {"round": 0, "by": "predecessor"}, {"collector": 1})  # taken before
    assert hub.queued() == 2 and hub.take()[1][0]["by"] == "successor"
    assert hub.take() is None
    hub.stop()
    assert hub.may_start(2) == "stop"
    for limit in (0, 1):
        hub = _Hub(1, queue_size=5, max_lag=limit)
        hub.publish(0, ["ref 0"])
        assert [hub.may_start(round_) for round_ in range(limit + 2)] == (
            ["go"] * (limit + 1) + ["wait"])
        hub.publish(1, ["ref 1"])
        assert hub.may_start(limit + 1) == "go"


class Holder:
    """An actor that holds the CPUs it was placed with."""

    def ready(self) -> bool:
        return True


@pytest.mark.timeout(150)
def test_a_stop_asked_for_while_collectors_wait_for_room_ends_the_wait(ray_pool):
    """The cluster has the CPUs but another actor holds them: the collectors wait for them,
    and a stop asked for meanwhile (the trainer's Ctrl-C check) ends the wait at once."""
    import ray

    holder = ray.remote(num_cpus=2)(Holder).remote()  # (the head node's 2 CPUs)
    try:
        assert ray.get(holder.ready.remote(), timeout=60)
        calls = []

        def check() -> None:
            calls.append(time.monotonic())
            if len(calls) > 2:  # (after a second or so of waiting)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):  # (before: a wait for ever)
            ray_pool(collectors=1, resources={"CPU": 2}, check=check)
        assert len(calls) == 3
    finally:
        ray.kill(holder)


def failing_cartpoles(path, index: int, num_envs: int, seed: int) -> BatchEnv:
    """CartPoles that raise at their 20th step; each collector process's seed is noted in
    ``path`` (the test cluster's nodes share this machine)."""
    with open(path, "a") as seeds:
        seeds.write(f"{seed}\n")
    return BatchEnv([FaultyEnv(gym.make("CartPole-v1"), "raise", at_step=20)
                     for _ in range(num_envs)], blocking=True)


def test_a_failed_ray_collector_is_replaced_with_seeds_of_its_own_and_its_error(ray_pool,
                                                                               tmp_path):
    reports = []
    collectors, learner = ray_pool(functools.partial(failing_cartpoles, tmp_path / "seeds"),
                                   agents=1, collectors=1, max_restarts=1,
                                   report=reports.append)
    with collectors, pytest.raises(CollectorError) as error:
        for _ in range(20):  # 2 rounds, a failure, a replacement's 2 rounds, a failure
            collectors.receive()
            collectors.publish(learner.acting_state())
    replaced = [line for line in reports if "replaced" in line]
    assert len(replaced) == 1 and collectors.restarts == 1, reports
    assert "RuntimeError: injected fault in step 20" in replaced[0], replaced  # the env's own
    seeds = (tmp_path / "seeds").read_text().split()
    assert len(seeds) == 2 and seeds[0] != seeds[1], seeds  # the replacement's own seeds
    assert "after 1 replacements (at most 1: env.max_restarts)" in str(error.value)


def test_a_lost_hub_is_a_collector_error_of_one_line(ray_pool):
    """The hub holds the queued rollouts: without it the run cannot go on, and says why in
    one line rather than with Ray's traceback."""
    import ray

    collectors, learner = ray_pool(agents=2, collectors=1)
    with collectors:
        collectors.receive()
        ray.kill(collectors.hub, no_restart=True)
        with pytest.raises(CollectorError, match=r"^the collectors' hub \(a Ray actor on the "
                                                 r"learner's node\) was lost: ActorDiedError: "
                                                 r"[^\n]*$"):
            for _ in range(50):  # (a few calls may still be answered)
                collectors.publish(learner.acting_state())
                collectors.receive()


def test_agents_split_unevenly_still_make_one_batch_of_all():
    collectors, learner = pool(agents=5, collectors=2)
    with collectors:
        rollout, metas = collectors.receive()
        learner.learn(rollout)
    assert rollout.agents.tolist() == [0, 1, 2, 3, 4]
    assert [meta["steps"] for meta in metas] == [3 * 8, 2 * 8]


@pytest.mark.parametrize("name", [n for n in available_configs()
                                  if "reinforce" not in n and not n.startswith("sac/")])
def test_every_shipped_config_can_run_with_collectors(name):
    """All but REINFORCE's (a Monte-Carlo method needs whole episodes, not rollouts: its
    one-line error is tested above) and SAC's (it learns from a replay buffer)."""
    config = load_config(name, ["train.collectors=3", "train.device=cpu"])
    env = make_batch_env(config.env.id, 1, config.env.max_length, config.env.kwargs,
                         backend="inline")
    algo = config.make_algorithm(env.observation_space, env.action_space,
                                 config.env.num_agents, torch.device("cpu"))
    env.close()
    check_collectors(config, algo)
    updates, eval_every = collector_plan(config, algo, config.env.num_agents)
    assert updates >= 1 and eval_every >= 1 and algo.rollout_length >= 1


@pytest.mark.parametrize("num_agents", [8, 16_384])
def test_collectors_restarts_and_sessions_never_share_an_env_seed(num_agents):
    spec = CollectorSpec(make_env=None, make_algorithm=None, num_agents=num_agents,
                         collectors=2, rollout_length=8, seed=3)
    seeds = []  # (each env j of a collector resets first with its seed + j)
    for session in (0, 7):  # a fresh run, and one resumed after 7 phases
        spec.session = session
        for incarnation in range(3):
            for index in range(2):
                start = collector_seed(spec, index, incarnation)
                seeds += range(start, start + len(spec.agents(index)))
    assert len(set(seeds)) == len(seeds)
    spec.session = 0
    # A fresh run's second collector: 7919 on (as before), or as many as the first has envs.
    assert collector_seed(spec, 1, 0) == 3 * 1_000_003 + max(7919, num_agents // 2)
