"""Several learners (train.learners): gradients averaged over torch.distributed (gloo on
127.0.0.1), identical weights, merged normaliser statistics, the writer's checkpoints and exact
resume, a killed learner, Ctrl-C, torchrun, and the errors before work starts."""

from __future__ import annotations

import functools
import io
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

from batchrl.algos.ppo import BatchPPO
from batchrl.config import ConfigError, load_config
from batchrl.envs.errors import EnvSpecError
from batchrl.hardware import usable_cores
from batchrl.learners import run
from batchrl.parts.distributed import LearnerGroup
from batchrl.parts.normalize import Statistics, StreamingNormalizer
from batchrl.simulation import simulate
from helpers import (REPO, assert_same, descendants, finish, gloo_threads, gloo_threads_left,
                     in_session, ray_pickles_by_value, run_stdin_script, seeded_tensor_env, sets,
                     start_train_py, wait_for, wait_gone)

# HalfCheetah with 4 agents in 50-step rollouts: a training phase of 2,000 steps in a second
# or two; minibatches of 100 steps over both learners.
CHEETAH = ["env.num_agents=4", "env.max_length=100", "train.eval_every=10",
           "train.eval_episodes=2", "train.device=cpu", "algorithm.minibatch_size=100",
           "algorithm.update_epochs=2", "train.keep_checkpoints=100"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_metrics(logdir: Path) -> list[dict]:
    path = logdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def other_learner_pid(process: subprocess.Popen) -> int:
    """Learner 1's pid, from the line a run of two local learners prints once it started it."""
    line = process.stdout.readline()
    while "learners, cores" not in line:
        assert line, process.communicate()
        line = process.stdout.readline()
    return int(line.rsplit(", ", 1)[1])


# --- the collectives and BatchPPO, in two processes --------------------------------------

def _learner(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    learners = LearnerGroup.connect(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        # Three rounds of different data per learner, merged after each.
        normalizer, merged = StreamingNormalizer((3,)), None
        generator = torch.Generator().manual_seed(rank)
        batches = []
        for round_ in range(3):
            batch = torch.randn(17 + 5 * rank + round_, 3, generator=generator) * (1 + rank)
            batches.append(batch)
            normalizer.update(batch)
            merged = learners.merge(normalizer, merged)
        # Gradients: b's only on learner 0 (zeros in its place on learner 1), c's on neither.
        a, b, c = (torch.nn.Parameter(torch.zeros(size)) for size in (2, 3, 1))
        a.grad = torch.full((2,), 1.0 + rank)
        if rank == 0:
            b.grad = torch.full((3,), 4.0)
        learners.average_gradients([a, b, c])
        grads = [None if p.grad is None else p.grad.tolist() for p in (a, b, c)]
        # BatchPPO: 3 updates on each learner's own Pendulum envs.
        torch.manual_seed(0)
        env = seeded_tensor_env("Pendulum-v1", 3, seed=100 * rank)
        algo = BatchPPO(env.observation_space, env.action_space, 3, rollout_length=16,
                        minibatch_size=16, update_epochs=2, policy_layers=(16,),
                        value_layers=(16,), reward_scale="return", inference="eager")
        initial = {k: v.clone() for k, v in algo.policy.state_dict().items()}
        algo.join_learners(learners)
        calls = _count_calls(learners, "average_gradients")
        # (far from zero: their moments' sums must not cancel in float32)
        advantages = torch.randn(4000 + 700 * rank, generator=generator) * (1 + rank) + 300
        moments = [float(m) for m in algo._advantage_moments(advantages)]
        torch.manual_seed(1 + rank)
        update_terms = []
        for _ in range(16 * 3):
            _, _, summary = simulate(env, algo)
            if "ppo/kl" in summary:
                update_terms.append((summary["ppo/kl"], summary["ppo/entropy"],
                                     summary["ppo/beta_next"]))
        env.close()
        state, gradient_steps = algo.state_dict(), len(calls)
        # The collectives on values that differ between the learners. Gradients: learner 0
        # has all of them (no missing one of its own), learner 1 lacks b's.
        for p, grad in zip((a, b, c), (torch.full((2,), 2.0 * rank),
                                       torch.full((3,), 6.0) if rank == 0 else None,
                                       torch.full((1,), 1.0 + rank))):
            p.grad = grad
        learners.average_gradients([a, b, c])
        statistics = Statistics(torch.tensor(1.0 + rank), torch.full((3,), float(rank)),
                                torch.full((3,), 2.0 * rank))
        collectives = {
            "grads": [None if p.grad is None else p.grad.tolist() for p in (a, b, c)],
            "mean": learners.mean(torch.tensor([1.0 + rank, 4.0 * rank])),
            "sum": learners.sum(torch.tensor([1.0 + rank, 4.0 * rank])),
            "broadcast": learners.broadcast({"weights": torch.full((2,), float(rank)),
                                             "rank": rank, "statistics": statistics}),
            "gathered": learners.gather_to_writer(("learner", rank))}
        fed = _fed_ppo(slice(2 * rank, 2 * rank + 2), learners)
        _put(results, rank, {
            "batches": batches, "statistics": tuple(normalizer.statistics()), "grads": grads,
            "policy": state["policy"], "value": state["value"],
            "observ_normalizer": state["observ_normalizer"],
            "reward_normalizer": state["reward_normalizer"], "objective": state["objective"],
            "updates": state["updates"], "env_steps": state["env_steps"],
            "running_return": state["running_return"], "initial": initial,
            "advantages": advantages, "moments": moments,
            "update_terms": update_terms, "gradient_steps": gradient_steps,
            "collectives": collectives, "fed": fed})
    finally:
        learners.close()


def _count_calls(learners: LearnerGroup, name: str) -> list[int]:
    """A list that grows by one at each call of ``learners``'s method ``name``."""
    calls, method = [], getattr(learners, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)
    setattr(learners, name, counted)
    return calls


def _fed_ppo(agents: slice, learners: LearnerGroup | None = None) -> dict:
    """BatchPPO's state and last summary after two epochs of one gradient step each on a
    rollout of 8 synthetic steps by ``agents`` of 4 agents (all of them for one learner;
    ``minibatch_size`` takes all 32 steps)."""
    observ_space = gym.spaces.Box(-10.0, 10.0, (3,), dtype=np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    count = len(range(4)[agents])
    torch.manual_seed(0)
    # (the observations as they come: each learner's running statistics would differ)
    algo = BatchPPO(observ_space, action_space, count, rollout_length=8, minibatch_size=32,
                    update_epochs=2, policy_layers=(8,), value_layers=(8,), max_grad_norm=0.5,
                    normalize_observ=False, inference="eager")
    if learners is not None:
        algo.join_learners(learners)
    generator = torch.Generator().manual_seed(7)
    ids = torch.arange(count)
    algo.begin_episodes(ids)
    for _ in range(8):
        observ, action, next_observ = (torch.randn(4, size, generator=generator)[agents]
                                       for size in (3, 2, 3))
        reward = 1.0 + 2.0 * torch.randn(4, generator=generator)[agents]
        algo.perform(ids, observ)  # (the acting policy's distribution; its sample unused)
        summary = algo.experience(ids, observ, action.clamp(-1, 1), reward,
                                  torch.zeros(count), next_observ, torch.zeros(count))
    state = algo.state_dict()
    return {"policy": state["policy"], "value": state["value"],
            "reward_normalizer": state["reward_normalizer"], "summary": summary}


@pytest.fixture(scope="module")
def two_learners() -> dict[int, dict]:
    return _run_two(_learner)


def test_learners_hold_identical_weights_after_their_updates(two_learners):
    first, second = two_learners[0], two_learners[1]
    assert first["updates"] == second["updates"] == 3
    for name in ("policy", "value", "observ_normalizer", "reward_normalizer", "objective"):
        assert_same(first[name], second[name], name)  # bit for bit
    # They learned (from different data: their envs and returns differ).
    assert any(not torch.equal(first["policy"][k], first["initial"][k]) for k in first["initial"])
    assert not torch.equal(first["running_return"], second["running_return"])
    # The learning-rate clock counts the run's env steps, both learners'.
    assert first["env_steps"] == 2 * 3 * 16 * 3


def test_a_gradient_one_learner_lacks_is_averaged_with_zeros_on_both(two_learners):
    for rank in (0, 1):
        assert two_learners[rank]["grads"] == [[1.5, 1.5], [2.0, 2.0, 2.0], None]


def test_the_kl_penalty_adapts_to_the_kl_over_all_learners(two_learners):
    first, second = two_learners[0]["update_terms"], two_learners[1]["update_terms"]
    assert len(first) == 3 and first == second


def test_advantages_are_normalised_with_the_moments_of_all_learners(two_learners):
    union = torch.cat([two_learners[rank]["advantages"] for rank in (0, 1)]).double()
    for rank in (0, 1):
        assert two_learners[rank]["moments"] == pytest.approx(
            [float(union.mean()), float(union.std())], rel=1e-6)


def test_a_gradient_only_the_other_learner_lacks_is_still_averaged_there(two_learners):
    # Learner 0 had all three gradients: it still tells learner 1 that b had one.
    for rank in (0, 1):
        assert two_learners[rank]["collectives"]["grads"] == [[1.0, 1.0], [3.0, 3.0, 3.0],
                                                              [1.5]]


def test_means_and_sums_over_the_learners_keep_their_kind(two_learners):
    for rank in (0, 1):
        found = two_learners[rank]["collectives"]
        assert found["mean"].dtype == torch.float32 and found["mean"].tolist() == [1.5, 2.0]
        assert found["sum"].dtype == torch.float64 and found["sum"].tolist() == [3.0, 4.0]


def test_the_writers_value_is_broadcast_and_the_learners_gathered_on_it(two_learners):
    for rank in (0, 1):
        assert_same(two_learners[rank]["collectives"]["broadcast"],
                    {"weights": torch.zeros(2), "rank": 0, "statistics": Statistics(
                        torch.tensor(1.0), torch.zeros(3), torch.zeros(3))},
                    "broadcast")
    assert two_learners[0]["collectives"]["gathered"] == [("learner", 0), ("learner", 1)]
    assert two_learners[1]["collectives"]["gathered"] is None


def test_each_learner_takes_its_share_of_a_minibatch_in_every_gradient_step(two_learners):
    # minibatch_size 16 over both learners: 8 of each one's 48 steps, 6 gradient steps an
    # epoch, 2 epochs, 3 updates.
    for rank in (0, 1):
        assert two_learners[rank]["gradient_steps"] == 3 * 2 * 48 // 8


def test_two_learners_on_halves_of_a_batch_learn_as_one_on_all_of_it(two_learners):
    one = _fed_ppo(slice(0, 4))
    for rank in (0, 1):
        fed = two_learners[rank]["fed"]
        for name in ("policy", "value", "reward_normalizer"):
            for key, want in one[name].items():
                torch.testing.assert_close(fed[name][key], want, rtol=1e-5, atol=1e-6,
                                           msg=f"{name}.{key}")
        # The gradient's norm (before clipping), the entropy, the penalty's next beta, and the
        # losses and explained variance of both learners' shares, not the writer's alone.
        for key in ("ppo/grad_norm", "ppo/entropy", "ppo/beta_next", "ppo/policy_loss",
                    "ppo/value_loss", "ppo/total_loss", "ppo/explained_variance"):
            assert fed["summary"][key] == pytest.approx(one["summary"][key], rel=1e-5,
                                                        abs=1e-6), key


def test_merged_statistics_are_one_normalisers_over_the_union(two_learners):
    union = StreamingNormalizer((3,))
    for rank in (0, 1):
        for batch in two_learners[rank]["batches"]:
            union.update(batch)
    expected = union.statistics()
    for rank in (0, 1):
        for got, want in zip(two_learners[rank]["statistics"], expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _preempted_learner(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    learners = LearnerGroup.connect(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        env = seeded_tensor_env("Pendulum-v1", 3, seed=100 * rank)
        algo = BatchPPO(env.observation_space, env.action_space, 3, rollout_length=16,
                        minibatch_size=16, update_epochs=2, policy_layers=(16,),
                        value_layers=(16,), inference="eager")
        algo.join_learners(learners, preemption=0.5)
        calls, collected = 0, []
        while algo.updates < 4:  # learner 1 steps slowly: learner 0 finishes first
            if rank == 1:
                time.sleep(0.02)
            _, _, summary = simulate(env, algo)
            calls += 1
            if "learners/collected" in summary:
                collected.append(summary["learners/collected"])
        env.close()
        _put(results, rank, {"calls": calls, "collected": collected,
                             "env_steps": algo.env_steps, "policy": algo.policy.state_dict()})
    finally:
        learners.close()


def _put(results, rank: int, found: dict) -> None:
    # As bytes: a queued tensor would be shared memory this process must outlive.
    buffer = io.BytesIO()
    torch.save(found, buffer)
    results.put((rank, buffer.getvalue()))


def _run_two(target) -> dict[int, dict]:
    """Run ``target(rank, port, results)`` as learners 0 and 1; what each put, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=target, args=(rank, port, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        return {rank: torch.load(io.BytesIO(data), weights_only=False)
                for rank, data in (results.get(timeout=120) for _ in processes)}
    finally:
        for process in processes:
            process.join(30)
            if process.exitcode is None:
                process.kill()


def _closing_learner(rank: int, port: int, results) -> None:
    learners = LearnerGroup.connect(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight])
    weight.sum().backward()
    learners.average_gradients([weight])
    optimizer.step()  # (torch's first optimiser step imports torch._dynamo)
    during = gloo_threads()
    learners.close()
    del learners
    _put(results, rank, {"during": during, "after": gloo_threads_left()})


def test_closing_the_learners_ends_their_process_groups_threads():
    """An optimiser step made while the group is up must not keep it alive after ``close``."""
    for rank, found in _run_two(_closing_learner).items():
        assert found["during"], "no gloo threads to watch: the test checks nothing"
        assert found["after"] == [], (rank, found["after"])


@pytest.mark.slow
def test_preemption_cuts_the_slow_learners_rollouts_and_keeps_the_weights_identical():
    found = _run_two(_preempted_learner)
    fast, slow = found[0], found[1]
    assert_same(fast["policy"], slow["policy"], "policy")  # the same gradient steps
    # The slow learner's rollouts were cut (at a quarter of 16 x 3 steps at the earliest;
    # the fast one's too, at times, when it was the slower to start), and the learning-rate
    # clock counts the steps the two really took.
    assert 4 * 4 <= slow["calls"] < fast["calls"] <= 4 * 16
    assert fast["env_steps"] == slow["env_steps"] == 3 * (fast["calls"] + slow["calls"])
    assert fast["collected"] == slow["collected"] and min(fast["collected"]) < 1.0


STDIN_SCRIPT = """
import os, sys
import torch.distributed
from batchrl.config import ConfigError, load_config
from batchrl.learners import run
sys.path.insert(0, sys.argv[2])
from helpers import gloo_threads_left
config = load_config("halfcheetah", sys.argv[3:])
cores = os.sched_getaffinity(0)
run(config, sys.argv[1], progress=False)
if torch.distributed.is_initialized():
    print("still in the learners' process group", flush=True)
if gloo_threads_left():
    print("the process group's threads are alive:", gloo_threads_left(0), flush=True)
print("trained on", "all its cores again" if os.sched_getaffinity(0) == cores else
      f"{os.sched_getaffinity(0)} of {cores}", flush=True)
"""


@pytest.mark.slow
def test_local_learners_start_from_a_script_read_from_stdin(tmp_path):
    """``python - <<EOF`` has no main file that the spawned learners could import again:
    they start without it, as env workers do. Learner 0 (the calling process) runs on its
    share of the cores, and has all of them back when ``run`` returns, its process group
    destroyed (and its threads ended)."""
    result = run_stdin_script(STDIN_SCRIPT, str(tmp_path / "run"), str(REPO / "tests"), *CHEETAH,
                              "train.learners=2", "train.steps=2000", "env.backend=inline",
                              timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("trained on all its cores again\n"), result.stdout
    assert "still in the learners' process group" not in result.stdout
    assert "threads are alive" not in result.stdout, result.stdout


# --- train.py with two learners -----------------------------------------------------------

def train(logdir: Path, *args: str, timeout: float = 180) -> tuple[int, str, str]:
    process = start_train_py("--config", "halfcheetah", "--logdir", str(logdir), *args)
    return finish(process, timeout)


@pytest.mark.slow
def test_two_learners_write_one_run_that_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, stdout, stderr = train(straight, *sets(*CHEETAH, "train.learners=2",
                                                 "train.steps=6000"))
    assert code == 0, stderr
    assert re.search(r"2 learners, cores .*: pids \d+, \d+", stdout), stdout
    code, _, stderr = train(resumed, *sets(*CHEETAH, "train.learners=2", "train.steps=4000"))
    assert code == 0, stderr
    code, _, stderr = train(resumed, "--steps", "6000")
    assert code == 0, stderr
    records = [read_metrics(run) for run in (straight, resumed)]
    assert [r["step"] for r in records[0] if r["phase"] == "train"] == [2000, 4000, 6000]
    # Exact on the CPU: the same phases, returns and episode counts either way.
    key = [[(r["step"], r["phase"], r["score"], r["episodes"]) for r in run] for run in records]
    assert key[0] == key[1] and any(r["phase"] == "eval" for r in records[0])
    checkpoint = torch.load(sorted(straight.glob("ckpt-*.pt"))[-1], weights_only=False)
    assert len(checkpoint["learners"]) == 2 and checkpoint["counters"]["steps"] == 6000
    # A budget that ends mid-rollout, then raised: the reset drops each learner's unfinished
    # steps, yet both take the same gradient steps (no collective is left waiting).
    cut = tmp_path / "cut"
    code, _, stderr = train(cut, *sets(*CHEETAH, "train.learners=2", "train.steps=2100"))
    assert code == 0, stderr
    code, _, stderr = train(cut, "--steps", "4000", timeout=120)
    assert code == 0, stderr
    assert [r["step"] for r in read_metrics(cut) if r["phase"] == "train"][-2:] == [2100, 4000]
    assert json.loads((straight / "config.json").read_text())["train"]["learners"] == 2


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="two learners need two cores")
def test_each_learner_keeps_its_own_env_restarts_across_a_resume(tmp_path):
    # One env worker of one of the learners dies once: that learner has used 1 of its
    # env.max_restarts, the other none, in the checkpoint and after the resume.
    logdir, once = tmp_path / "run", tmp_path / "fired"
    faulty = ["env.id=batchrl.testing.faults:make", "env.backend=workers",
              f'env.kwargs={{env_id = "HalfCheetah-v5", fault = "exit", at_step = 150, '
              f'once_file = "{once}"}}', "env.restart_crashed_envs=true", "env.max_restarts=2"]
    code, stdout, stderr = train(logdir, *sets(*CHEETAH, *faulty, "train.learners=2",
                                                "train.steps=2000"))
    assert code == 0 and once.exists(), stderr

    def restarts() -> tuple[list[int], int]:
        state = torch.load(sorted(logdir.glob("ckpt-*.pt"))[-1], weights_only=False)
        return ([part["env_restarts"] for part in state["learners"]],
                state["counters"]["env_restarts"])

    parts, writers = restarts()
    assert sorted(parts) == [0, 1] and writers == parts[0], (parts, writers)
    code, stdout, stderr = train(logdir, "--steps", "4000")
    assert code == 0, stderr
    assert restarts() == (parts, writers)


@pytest.mark.slow
def test_preempting_learners_train_in_whole_updates_and_resume(tmp_path):
    logdir = tmp_path / "run"
    preempting = sets(*CHEETAH, "train.learners=2", "train.preemption_threshold=0.5")
    code, _, stderr = train(logdir, *preempting, "--set", "train.steps=3000")
    assert code == 0, stderr
    code, _, stderr = train(logdir, "--steps", "5000")
    assert code == 0, stderr
    steps = [r["step"] for r in read_metrics(logdir) if r["phase"] == "train"]
    # Phases of 10 updates (at most 2,000 steps); the budget is checked between updates.
    assert steps == sorted(steps) and steps[-1] >= 5000 and len(steps) >= 3
    assert all(later - earlier <= 2000 for earlier, later in zip([0, *steps], steps))
    checkpoint = torch.load(sorted(logdir.glob("ckpt-*.pt"))[-1], weights_only=False)
    # The run's count is the learners' steps summed at each update, the lr clock's too.
    assert checkpoint["counters"]["steps"] == checkpoint["algorithm"]["env_steps"] == steps[-1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill learner 1", "ctrl-c"])
def test_a_learner_that_dies_or_ctrl_c_stops_every_learner(tmp_path, how):
    logdir = tmp_path / "run"
    process = start_train_py("--config", "halfcheetah", "--logdir", str(logdir),
                             *sets(*CHEETAH, "train.learners=2", "train.steps=10000000"))
    try:
        wait_for(lambda: any(logdir.glob("ckpt-*.pt")) or process.poll() is not None, 120,
                 "the first checkpoint")
        assert process.poll() is None, process.communicate()
        children = descendants(process.pid)
        if how == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            other = other_learner_pid(process)
            assert other in children
            os.kill(other, signal.SIGKILL)
        code, stdout, stderr = finish(process, 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_gone(children, timeout=15) == []
    assert "Traceback" not in stderr, stderr
    assert sorted(logdir.glob("ckpt-*.pt")), "the run's work is kept"
    if how == "ctrl-c":
        assert code == 130, (stdout, stderr)
        assert "Resume with:" in stdout
    else:
        assert code == 1, (stdout, stderr)
        assert re.search(rf"error: learner 1 \(pid {other}\) was killed by signal 9", stderr)
        assert "Resume it with:" in stderr


def two_learners_with_site(tmp_path: Path, sitecustomize: str) -> subprocess.Popen:
    """train.py with two local learners into ``tmp_path / "run"``, in a session of its own,
    with ``sitecustomize`` run at the start of each of its Python processes."""
    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "--config", "halfcheetah", "--logdir",
         str(tmp_path / "run"), "--no-progress", *sets(*CHEETAH, "train.learners=2",
                                                       "train.steps=10000000")],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}",
                           PYTHONUNBUFFERED="1"),
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended(process: subprocess.Popen, seconds: float = 90) -> tuple[int, str, str]:
    """``(code, stdout, stderr)`` of a run that must end by itself within ``seconds`` (else
    it is killed) and leave none of its processes behind."""
    try:
        result = finish(process, seconds)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_gone(in_session(process.pid), timeout=15) == []
    return result


# Put on the path of a run, it makes every process that multiprocessing spawns (the learners
# other than learner 0) fail as its training begins: a bug in one learner.
FAILING_LEARNERS = textwrap.dedent("""
    import sys
    if "--multiprocessing-fork" in sys.argv:
        import batchrl.trainer
        def run(self):
            raise ValueError("learner bug\\nits second line")
        batchrl.trainer.Trainer.run = run
""")


@pytest.mark.slow
def test_a_learner_that_raises_is_named_with_its_error(tmp_path):
    # Learner 1 sends its error's first line to learner 0, which ends the run with it (not
    # with gloo's lost connection, nor learner 1's exit code alone).
    process = two_learners_with_site(tmp_path, FAILING_LEARNERS)
    code, stdout, stderr = ended(process)
    assert "2 learners, cores" in stdout, (stdout, stderr)
    assert code == 1, (stdout, stderr)
    assert "error: learner 1 failed: ValueError: learner bug\n" in stderr, stderr
    assert "its second line" not in stderr and "Traceback" not in stderr, stderr


# As FAILING_LEARNERS, with an error whose one line is longer than a pipe holds.
LONG_ERROR_LEARNERS = textwrap.dedent("""
    import sys
    if "--multiprocessing-fork" in sys.argv:
        import batchrl.trainer
        def run(self):
            raise ValueError("x" * 100_000)
        batchrl.trainer.Trainer.run = run
""")


@pytest.mark.slow
def test_a_learner_error_longer_than_a_pipe_holds_arrives_cut_short(tmp_path):
    # Learner 1 sends its line before it exits, and learner 0 reads it once learner 1's exit
    # failed its collective: the whole line would wait for a reader that waits for the exit.
    process = two_learners_with_site(tmp_path, LONG_ERROR_LEARNERS)
    code, stdout, stderr = ended(process)
    assert code == 1, (stdout, stderr)
    assert re.search(r"error: learner 1 failed: ValueError: x{1000,} \[\.\.\.\]\n", stderr), \
        stderr[-300:]
    assert len(stderr) < 5000 and "Traceback" not in stderr, stderr[-300:]


def _report_and_exit(errors, rank: int) -> None:
    errors.put((rank, f"RuntimeError: learner {rank} lost its peer"))
    errors.close()
    errors.join_thread()
    os._exit(1)


def test_a_learner_killed_by_a_signal_is_named_before_the_errors_its_death_caused():
    # Three learners: learner 2 is killed; learner 1's collective fails with it, and learner 1
    # reports that. The run's error names learner 2, which the others' errors come from.
    # (The lists of processes below stand for learners 1, 2, ... of a run.)
    from batchrl.learners.launch import _failure
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    reporting = ctx.Process(target=_report_and_exit, args=(errors, 1))
    killed = ctx.Process(target=time.sleep, args=(60,))
    aborted = ctx.Process(target=os.abort)  # (as NCCL's watchdog ends a failed peer's peers)
    for process in (reporting, killed, aborted):
        process.start()
    killed.kill()
    for process in (reporting, aborted):
        process.join(30)
    try:
        assert _failure([reporting, killed], errors) == (
            f"learner 2 (pid {killed.pid}) was killed by signal 9")
        # With none killed, the first error reported names the run's failure.
        bug = "RuntimeError: learner 1's own bug"
        errors.put((1, bug))
        assert _failure([reporting], errors) == f"learner 1 failed: {bug}"
        # One aborted after it: the error reported still names the failure.
        errors.put((1, bug))
        assert _failure([reporting, aborted], errors) == f"learner 1 failed: {bug}"
        assert _failure([aborted], errors) == (
            f"learner 1 (pid {aborted.pid}) was killed by signal 6")
    finally:
        errors.cancel_join_thread()
        errors.close()


# Put on the path of a run, it makes each learner fail as its training begins, saying on which
# cores it runs: learner 1 (spawned by multiprocessing) first, then learner 0 once learner 1 is
# gone (so that learner 1's error is always the one that names the run's failure).
CORES_OF_THE_LEARNERS = textwrap.dedent("""
    import multiprocessing, os, sys, time
    import batchrl.trainer
    def cores():
        return sorted(os.sched_getaffinity(0))
    if "--multiprocessing-fork" in sys.argv:
        def run(self):
            raise ValueError(f"learner 1 on cores {cores()}")
    else:
        def run(self):
            while any(child.name.startswith("batchrl-learner")
                      for child in multiprocessing.active_children()):
                time.sleep(0.05)
            print(f"learner 0 on cores {cores()}", flush=True)
            raise RuntimeError("learner 0 lost learner 1")
    batchrl.trainer.Trainer.run = run
""")


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="two learners need two cores")
def test_each_local_learner_runs_on_its_own_share_of_the_cores(tmp_path):
    # The cores of this process (train.py's too) split in two halves, learner 0 on the first.
    cores = sorted(os.sched_getaffinity(0))
    shares = [cores[:len(cores) // 2], cores[len(cores) // 2:]]
    process = two_learners_with_site(tmp_path, CORES_OF_THE_LEARNERS)
    code, stdout, stderr = ended(process)
    assert f"2 learners, cores {shares}: pids" in stdout, (stdout, stderr)
    assert f"learner 0 on cores {shares[0]}\n" in stdout, (stdout, stderr)
    assert code == 1, (stdout, stderr)
    assert (f"error: learner 1 failed: ValueError: learner 1 on cores {shares[1]}\n"
            in stderr), stderr


# Put on the path of a run, it makes every learner raise the error ``ERROR`` names (one of the
# user's errors) as its training begins: learner 1 first, then learner 0 once learner 1 is gone
# and its error has reached learner 0's queue.
REJECTED_BY_EVERY_LEARNER = textwrap.dedent("""
    import multiprocessing, os, sys, time
    import batchrl.trainer
    from batchrl.checkpoint import CheckpointError
    from batchrl.config import ConfigError
    from batchrl.envs.errors import EnvSpecError, SpaceMismatchError
    from batchrl.errors import UnsupportedSpaceError
    error = {"ConfigError": ConfigError, "EnvSpecError": EnvSpecError,
             "UnsupportedSpaceError": UnsupportedSpaceError,
             "SpaceMismatchError": SpaceMismatchError,
             "CheckpointError": CheckpointError}[os.environ["ERROR"]]
    def run(self):
        if "--multiprocessing-fork" not in sys.argv:  # learner 0
            while any(child.name.startswith("batchrl-learner")
                      for child in multiprocessing.active_children()):
                time.sleep(0.05)
        raise error("a setting every learner rejects")
    batchrl.trainer.Trainer.run = run
""")


@pytest.mark.parametrize("error", [
    "ConfigError", pytest.param("CheckpointError", marks=pytest.mark.slow),
    pytest.param("EnvSpecError", marks=pytest.mark.slow),
    pytest.param("UnsupportedSpaceError", marks=pytest.mark.slow),
    pytest.param("SpaceMismatchError", marks=pytest.mark.slow)])
def test_the_users_error_is_learner_0s_own_even_when_learner_1_reported_it_first(
        tmp_path, monkeypatch, error):
    # Learner 1 already failed with the same error (its line waits for learner 0): the user's
    # input is still the run's error (exit code 2), not a learner's failure.
    monkeypatch.setenv("ERROR", error)
    process = two_learners_with_site(tmp_path, REJECTED_BY_EVERY_LEARNER)
    code, stdout, stderr = ended(process)
    assert "2 learners, cores" in stdout, (stdout, stderr)
    assert code == 2, (stdout, stderr)
    assert stderr.strip().splitlines()[-1] == "error: a setting every learner rejects", stderr
    assert "learner 1 failed" not in stderr and "Traceback" not in stderr, stderr


# Put on the path of a run, it holds every process that multiprocessing spawns (the learners
# other than learner 0) for a minute before Python goes on: a learner that is slow to start.
SLOW_LEARNERS = textwrap.dedent("""
    import sys, time
    if "--multiprocessing-fork" in sys.argv:
        time.sleep(60)
""")


@pytest.mark.slow
def test_the_learners_meeting_ends_at_once_when_a_learner_dies(tmp_path):
    # Learner 1 has not joined yet (SLOW_LEARNERS). Learner 0 used to wait in C for the full
    # connect timeout (2 minutes).
    process = two_learners_with_site(tmp_path, SLOW_LEARNERS)
    try:
        other = other_learner_pid(process)
        children = descendants(process.pid)
        time.sleep(2.0)  # learner 0 waits for learner 1 meanwhile
        os.kill(other, signal.SIGKILL)
        code, stdout, stderr = finish(process, 45)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_gone(children, timeout=15) == []
    assert "Traceback" not in stderr, stderr
    assert code == 1, (stdout, stderr)
    assert re.search(rf"error: learner 1 \(pid {other}\) was killed by signal 9", stderr)


@pytest.mark.slow
def test_a_second_ctrl_c_quits_while_learner_0_waits_in_a_collective(tmp_path):
    # Learner 1 stops answering: learner 0 waits in gloo's all-reduce (C, up to an hour),
    # where Python runs no signal handler; the second Ctrl-C still ends it at once.
    logdir = tmp_path / "run"
    process = start_train_py("--config", "halfcheetah", "--logdir", str(logdir),
                             *sets(*CHEETAH, "train.learners=2", "train.steps=10000000"))
    try:
        other = other_learner_pid(process)
        wait_for(lambda: any(logdir.glob("ckpt-*.pt")) or process.poll() is not None, 120,
                 "the first checkpoint")
        children = descendants(process.pid)
        os.kill(other, signal.SIGSTOP)
        time.sleep(3.0)  # learner 0 reaches its next collective meanwhile
        os.kill(process.pid, signal.SIGINT)
        time.sleep(2.0)
        assert process.poll() is None  # (the first only asks for a stop)
        os.kill(process.pid, signal.SIGINT)
        code, stdout, stderr = finish(process, 30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == -signal.SIGINT, (stdout, stderr)
    assert "SIGINT again: quitting now" in stderr, stderr
    assert wait_gone(children, timeout=15) == []


@pytest.mark.slow
def test_ctrl_c_stops_torchruns_learners_with_the_writers_checkpoint(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    logdir = tmp_path / "run"
    process = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "batchrl.train",
         "--config", "halfcheetah", "--logdir", str(logdir), "--no-progress",
         *sets(*CHEETAH, "train.steps=10000000")],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(logdir.glob("ckpt-*.pt")) or process.poll() is not None, 120,
                 "the first checkpoint")
        if process.poll() is not None:
            raise AssertionError("torchrun ended before the first checkpoint:\n"
                                 + process.communicate()[1][-4000:])
        children = descendants(process.pid)
        learners = [psutil.Process(pid) for pid in children
                    if "batchrl.train" in " ".join(psutil.Process(pid).cmdline())]
        # Each on its own share of the cores, as the local learners (not both from core 0).
        cores = sorted(os.sched_getaffinity(0))
        assert len(learners) == 2, children
        if len(cores) >= 2:
            assert sorted(p.cpu_affinity() for p in learners) == [cores[:len(cores) // 2],
                                                                 cores[len(cores) // 2:]]
        os.killpg(process.pid, signal.SIGINT)  # (a terminal's Ctrl-C)
        _, stdout, stderr = finish(process, 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_gone(children, timeout=15) == []
    assert stdout.count("Stopped by SIGINT; checkpoint at step") == 1, (stdout, stderr)
    assert "Resume with:" in stdout
    # The saved config holds torchrun's learners: a resume without torchrun starts as many.
    assert json.loads((logdir / "config.json").read_text())["train"]["learners"] == 2
    # The other learner stops quietly (torchrun, hit by the signal too, raises its own
    # SignalException with a traceback).
    assert "Interrupted" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr and stderr.count("Traceback") <= 1, stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_learners_on_a_two_node_ray_cluster(cluster, tmp_path, capsys):
    second = cluster.node_id("second")
    # Each learner steps its envs in processes of its node, learner 0 too: env actors of
    # these resources would wait for ever for the node that learner 1 fills.
    config = load_config("halfcheetah", [*CHEETAH, "train.learners=2", "train.steps=4000",
                                         f"env.ray_address={cluster.address}",
                                         "env.backend=ray", "env.workers=0",
                                         "env.ray_resources={CPU = 1, second_node = 0.5}",
                                         "train.learner_resources={CPU = 1, second_node = 1}"])
    result = run(config, tmp_path, progress=False)
    out = capsys.readouterr().out
    assert f"2 learners: learner 0 here, learner 1 on node {second[:8]}" in out, out
    assert result["step"] == 4000 and result["phase"] == "eval"
    checkpoint = torch.load(sorted(tmp_path.glob("ckpt-*.pt"))[-1], weights_only=False)
    assert len(checkpoint["learners"]) == 2
    cluster.wait_idle()  # the learner's actor and its bundle are gone


def test_a_ray_cluster_without_room_for_the_learners_is_an_error(cluster, tmp_path):
    config = load_config("halfcheetah", [*CHEETAH, "train.learners=3",
                                         f"env.ray_address={cluster.address}",
                                         "env.num_agents=3", "algorithm.minibatch_size=99",
                                         "train.learner_resources={CPU = 2}"])
    with pytest.raises(EnvSpecError, match=r"2 more learners with train.learner_resources="
                                           r"\{'CPU': 2\}: CPU=4 needed in all, but the Ray "
                                           r"cluster has CPU=3"):
        run(config, tmp_path, progress=False)
    cluster.wait_idle()


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def return_none() -> None:
    return None


def test_a_ray_learner_that_fails_is_named_with_its_node(cluster):
    from batchrl.learners.ray import RayLearners

    second = cluster.node_id("second")
    with ray_pickles_by_value(__name__):
        learners = RayLearners(1, {"CPU": 1, "second_node": 1}, cluster.address)
        try:
            learners.start([functools.partial(raise_value_error, "learner bug")])
            line = learners.failure(wait=30.0)
        finally:
            learners.close()
    assert line == f"learner 1 on node {second[:8]} failed: ValueError: learner bug"
    cluster.wait_idle()  # the actor and its bundle are gone


def test_ray_learners_spread_over_the_nodes_and_leave_no_bundle(cluster):
    from batchrl.learners.ray import RayLearners

    with ray_pickles_by_value(__name__):
        learners = RayLearners(2, {"CPU": 1}, cluster.address)
        try:
            nodes = {node for node, _ in learners.nodes}
            learners.start([return_none, return_none])
            assert learners.failure(wait=10.0) is None  # (both returned)
        finally:
            learners.close()
    assert nodes == {cluster.node_id("head"), cluster.node_id("second")}
    cluster.wait_idle()


def test_a_killed_ray_learner_died_and_closing_the_learners_leaves_ray(cluster):
    """``failure`` waits no longer than asked while the learners run; a learner whose actor is
    killed "died" (not "failed"); ``close`` disconnects when batchrl made the connection."""
    import ray
    from batchrl.learners.ray import RayLearners

    ray.shutdown()  # batchrl connects itself
    try:
        learners = RayLearners(1, {"CPU": 1, "second_node": 1}, cluster.address)
        try:
            learners.start([functools.partial(time.sleep, 30)])
            started = time.monotonic()
            assert learners.failure(wait=0.5) is None
            assert time.monotonic() - started < 10
            ray.kill(learners.actors[0])
            line = learners.failure(wait=30.0)
        finally:
            learners.close()
        assert not ray.is_initialized()
    finally:
        if not ray.is_initialized():
            ray.init(address=cluster.address, logging_level="warning")
    assert line.startswith(f"learner 1 on node {cluster.node_id('second')[:8]} died: "), line
    cluster.wait_idle()


def test_ray_learners_no_nodes_can_hold_are_an_error_after_the_placement_timeout(cluster,
                                                                                 monkeypatch):
    from ray.util import placement_group_table

    from batchrl.learners import ray as ray_learners

    monkeypatch.setattr(ray_learners, "PLACEMENT_TIMEOUT_S", 2.0)
    # The cluster's 3 CPUs are as many as asked, but no node has 1.5 CPUs twice or the second
    # node 1.5 at all.
    with pytest.raises(EnvSpecError, match=r"^the Ray cluster did not place 2 learners of "
                                           r"\{'CPU': 1.5\} within 2 s$"):
        ray_learners.RayLearners(2, {"CPU": 1.5}, cluster.address)
    assert {group["state"] for group in placement_group_table().values()} <= {"REMOVED"}
    cluster.wait_idle()


# --- errors before work starts ------------------------------------------------------------

def test_a_preemption_threshold_that_waits_for_all_suggests_one_that_does_not():
    from batchrl.parts.distributed import preemption_count

    for size, suggested in ((3, 0.66), (7, 0.85)):
        with pytest.raises(ValueError, match=f"use at most {suggested:.2f}, or more") as error:
            preemption_count(0.95, size)
        assert str(suggested) in str(error.value)
        assert preemption_count(suggested, size) == size - 1


def test_ray_learners_computing_on_cuda_need_a_gpu_reserved_for_each(monkeypatch, tmp_path):
    # train.device = "auto" where learner 0 has a GPU (stood in for: none here): learners on
    # the CPU beside it could never join its group (NCCL and gloo). Refused before Ray starts.
    import batchrl.learners.launch as launch
    monkeypatch.setattr(launch, "resolve_device", lambda name: torch.device("cuda"))
    config = load_config("halfcheetah", [*CHEETAH, "train.device=auto", "train.learners=2",
                                         "env.ray_address=127.0.0.1:1"])
    with pytest.raises(ConfigError, match=r"train.device = 'auto' is CUDA for learner 0 here, "
                                          r"but train.learner_resources reserves no GPU"):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_only_torchruns_whole_environment_makes_a_process_one_of_its_learners(monkeypatch):
    # A batch system's RANK or WORLD_SIZE alone (SLURM, MPI) leaves a plain run as it is.
    from batchrl.parts.distributed import TORCHRUN_VARIABLES, launched_by_torchrun
    for name in TORCHRUN_VARIABLES:
        monkeypatch.setenv(name, "0" if name == "RANK" else "1")
    assert launched_by_torchrun()
    for name in TORCHRUN_VARIABLES:
        with monkeypatch.context() as patch:
            patch.delenv(name)
            assert not launched_by_torchrun(), name


@pytest.mark.slow
@pytest.mark.parametrize("processes, setting, message", [
    ("2", "train.learners=4", "error: train.learners = 4, but torchrun started 2 processes: "
                              "set --nproc-per-node (times the nodes) to train.learners"),
    ("1", "train.preemption_threshold=0.5",
     "error: train.preemption_threshold cuts the rollouts of some of several learners: set "
     "train.learners >= 2, or the threshold to 0"),
    ("2", "env.backend=ray",
     "error: env.backend = 'ray' or env.ray_address launches the learners on a Ray cluster "
     "from train.py; torchrun places them itself, each stepping its envs in its own "
     "processes: set env.backend = 'workers' and env.ray_address = ''")])
def test_settings_that_torchruns_processes_cannot_run_are_errors(tmp_path, processes, setting,
                                                                 message):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    process = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", processes, "-m", "batchrl.train",
         "--config", "halfcheetah", "--logdir", str(tmp_path / "run"), "--no-progress",
         *sets(*CHEETAH, setting)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, stdout, stderr = finish(process, 120)
    assert code != 0, (stdout, stderr)
    assert message in stderr, stderr
    assert not (tmp_path / "run").exists()
    assert wait_gone(in_session(process.pid), 10) == []


@pytest.mark.parametrize("overrides, message", [
    (["train.learners=0"], "learners must be >= 1, got 0"),
    (["train.learners=2", "env.num_agents=5"],
     "env.num_agents (5) must be divisible by train.learners (2)"),
    (["train.learners=2", "train.collectors=2"], "set train.collectors = 0"),
    (["train.learners=2", "train.preemption_threshold=0.6"],
     "a preemption threshold of 0.6 with 2 learners waits for all 2"),
    (["train.preemption_threshold=0.5"], "set train.learners >= 2, or the threshold to 0"),
    (["train.preemption_threshold=1"], "train.preemption_threshold must be in [0, 1)"),
    (["train.learners=2", "train.device=cuda:1"],
     "train.device = 'cuda:1' puts every learner on one GPU"),
    ([f"train.learners={usable_cores() + 1}", f"env.num_agents={usable_cores() + 1}"],
     "usable CPU cores here: each learner needs at least one"),
])
def test_bad_learner_settings_are_one_line_errors(tmp_path, overrides, message):
    code, stdout, stderr = train(tmp_path / "run", *sets(*CHEETAH, *overrides), timeout=60)
    assert code == 2, (stdout, stderr)
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(usable_cores() < 2, reason="two learners need two cores")
def test_an_algorithm_that_cannot_be_one_of_several_learners_is_named(tmp_path):
    # cartpole updates on whole episodes: learners could take different gradient steps.
    process = start_train_py("--config", "cartpole", "--logdir", str(tmp_path / "run"),
                             *sets("train.learners=2", "env.num_agents=4"))
    code, stdout, stderr = finish(process, 90)
    assert code == 2, (stdout, stderr)
    assert ("error: train.learners = 2: several learners need fixed-length rollouts"
            in stderr), stderr
    assert "learners, cores" not in stdout  # refused before any learner started
    assert wait_gone(in_session(process.pid), 10) == []  # no learner left behind


def test_a_setting_every_learner_rejects_is_the_users_error_not_a_learners_failure(tmp_path):
    # Every learner builds its algorithm and rejects the torso alike, within moments.
    logdir = tmp_path / "run"
    process = start_train_py("--config", "cartpole", "--logdir", str(logdir),
                             *sets("train.learners=2", "env.num_agents=4",
                                   "algorithm.rollout_length=16", "algorithm.torso=nature_cnn"))
    code, stdout, stderr = finish(process, 90)
    assert code == 2, (stdout, stderr)
    assert "error: torso 'nature_cnn' needs image observations" in stderr, stderr
    assert "learner 1 failed" not in stderr and "Traceback" not in stderr
    assert not logdir.exists()  # (the run never began: its directory is gone again)
    assert wait_gone(in_session(process.pid), 10) == []


@pytest.mark.parametrize("name, overrides, message", [
    ("cartpole", [], "several learners need fixed-length rollouts (every learner must take "
     "the same gradient steps per update): set algorithm.rollout_length"),
    ("halfcheetah", ["algorithm.minibatch_size=99"],
     "algorithm.minibatch_size (99) is the batch of a gradient step over all learners and "
     "must be divisible by train.learners (2)"),
    ("sac/hopper", [], "SAC cannot be one of several learners (no join_learners and "
     "synchronize)"),
])
def test_an_algorithm_is_refused_as_one_of_several_learners_from_its_config_alone(
        name, overrides, message):
    from batchrl.config import ConfigError
    from batchrl.trainer import check_learner_support
    config = load_config(name, ["train.learners=2", "env.num_agents=4", *overrides])
    with pytest.raises(ConfigError) as error:
        check_learner_support(config, 2)
    assert str(error.value) == f"train.learners = 2: {message}; or set train.learners = 1"
    check_learner_support(load_config("halfcheetah", ["train.learners=2"]), 2)  # (fine)
