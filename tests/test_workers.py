"""EnvWorker: several real Gymnasium envs in one real child process, arrays in
shared memory, finished envs reset ahead of time ("prefetched resets").

Covers trajectories (the same as in-process envs, whatever the mix of members),
reset semantics around the prefetched reset, errors (raised, constructor,
SIGKILL, timeout) with their batch indices, attribute access through
``WorkerEnv``, ``infos=False`` and ``InfoList``, shared-memory hygiene, and
``batch_env_from``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import gymnasium as gym
import numpy as np
import psutil
import pytest

from batchrl.envs import (BatchEnv, EnvAttributeError, EnvCrashedError, EnvRaisedError,
                          EnvTimeoutError, EnvWorker, ExternalProcess, InfoList,
                          RemoteAttribute, WorkerEnv)
from batchrl.envs.errors import EnvSpecError, UnsupportedSpaceError
from batchrl.envs.factory import DEFAULT_TIMEOUT, batch_env_from, split_evenly
from batchrl.hardware import usable_cores
from helpers import (LIMIT_TASKS, REPO, CountingEnv, assert_same_log, fails_at,
                     kill_and_wait, make_cartpole, make_cheetah, mount_namespace, pids_cgroup,
                     raise_site, rollout, run_script, run_stdin_script, sleeps_at, wait_gone)

# Ship this module's env classes and constructors to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ResetCounter(gym.Wrapper):
    """Counts the calls of ``reset`` (readable remotely as ``resets``)."""

    def __init__(self, env):
        super().__init__(env)
        self.resets = 0

    def reset(self, **kwargs):
        self.resets += 1
        return self.env.reset(**kwargs)


def counted_cartpole():
    return ResetCounter(gym.make("CartPole-v1"))


def make_broken_env():
    raise RuntimeError("cannot build this env")


@pytest.fixture
def closing():
    """``closing(obj)`` returns ``obj`` and closes it when the test ends
    (envs, workers, batches; closing twice is fine for all of them)."""
    created = []

    def track(obj):
        created.append(obj)
        return obj

    yield track
    for obj in reversed(created):
        obj.close()


def drawing_cartpole():
    """A CartPole that keeps a draw from NumPy's global generator when it is built."""
    env = gym.make("CartPole-v1")
    env.unwrapped.draw = int(np.random.randint(2**31))
    return env


def test_envs_of_every_worker_and_restart_draw_from_numpys_global_generator_apart(closing):
    # Envs that use np.random (not their own np_random) draw differently in each worker, and
    # in a worker that replaced one.
    workers = [closing(EnvWorker([drawing_cartpole] * 2)) for _ in range(2)]
    draws = [worker.get_attr("unwrapped.draw", index=i) for worker in workers for i in range(2)]
    fresh = closing(workers[0].restart())
    draws += [fresh.get_attr("unwrapped.draw", index=i) for i in range(2)]
    assert len(set(draws)) == 6, draws


# -- trajectories ---------------------------------------------------------------------

# Four envs in each layout, in batch order.
LAYOUTS = {
    "one-worker": lambda make, track: [track(EnvWorker([make] * 4))],
    "two-workers": lambda make, track: [track(EnvWorker([make] * 2)),
                                        track(EnvWorker([make] * 2))],
    "mixed": lambda make, track: [track(make()), track(EnvWorker([make] * 2)),
                                  track(ExternalProcess(make))],
}


@pytest.mark.parametrize("make, dtype", [
    (make_cartpole, None),
    (make_cheetah, np.float32),
    (make_cheetah, np.float64),
], ids=["CartPole", "HalfCheetah-float32", "HalfCheetah-float64"])
def test_worker_layouts_give_the_trajectories_of_in_process_envs(make, dtype, closing):
    reference = closing(BatchEnv([make() for _ in range(4)]))
    expected = rollout(reference, dtype)
    reference.close()

    steps = [entry for entry in expected if entry[0] == "step"]
    terminated = sum(int(entry[3].sum()) for entry in steps)
    truncated = sum(int(entry[4].sum()) for entry in steps)
    if make is make_cartpole:
        assert terminated >= 8 and truncated == 0
    else:
        assert terminated == 0 and truncated >= 8
        assert all(set(info) >= {"x_position", "reward_ctrl"}
                   for entry in steps for info in entry[5])
    assert any(entry[0] == "reset again" for entry in expected)
    assert any(entry[0] == "seeded reset" for entry in expected)

    for name, layout in LAYOUTS.items():
        batch = closing(BatchEnv(layout(make, closing)))
        assert len(batch) == 4, name
        assert batch.observation_space == reference.observation_space
        assert batch.action_space == reference.action_space
        got = rollout(batch, dtype)
        assert_same_log(got, expected)
        batch.close()


# -- reset semantics around the prefetched reset ------------------------------------


def step_until_finished(batch: BatchEnv, mirror: list[gym.Env], action: int = 1) -> list[int]:
    """Step the batch and the in-process ``mirror`` envs alike (checking they
    agree) until an env finishes; return the finished indices."""
    for _ in range(200):
        obs, rewards, terminated, truncated, _ = batch.step(np.full(len(batch), action))
        results = [env.step(action) for env in mirror]
        np.testing.assert_array_equal(obs, np.stack([r[0] for r in results]))
        np.testing.assert_array_equal(terminated, [r[2] for r in results])
        finished = np.flatnonzero(terminated | truncated).tolist()
        if finished:
            return finished
    raise AssertionError("no episode ended")


@pytest.fixture
def worker_cartpoles(closing):
    """A batch of one worker with 2 reset-counting CartPoles, and 2 in-process
    mirrors, all reset with seed 0 (env ``i`` with ``i``)."""
    batch = closing(BatchEnv([closing(EnvWorker([counted_cartpole] * 2, label="cartpole"))]))
    mirror = [closing(counted_cartpole()) for _ in range(2)]
    np.testing.assert_array_equal(batch.reset(seed=0),
                                  np.stack([env.reset(seed=i)[0] for i, env in enumerate(mirror)]))
    return batch, mirror


def test_prefetched_reset_answers_a_reset_without_seed(worker_cartpoles):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    # The worker has already reset the finished envs (once each), the others not.
    resets = [batch.envs[i].resets for i in range(2)]
    assert resets == [2 if i in finished else 1 for i in range(2)]
    obs = batch.reset(finished)
    np.testing.assert_array_equal(obs, np.stack([mirror[i].reset()[0] for i in finished]))
    # Answered from the prefetched reset: no further reset in the worker.
    assert [batch.envs[i].resets for i in range(2)] == resets
    # And on through more episode ends.
    for _ in range(3):
        finished = step_until_finished(batch, mirror, action=0)
        np.testing.assert_array_equal(batch.reset(finished),
                                      np.stack([mirror[i].reset()[0] for i in finished]))
    assert [batch.envs[i].resets for i in range(2)] == [env.resets for env in mirror]


def test_seeded_reset_after_an_episode_end_is_a_real_reset(worker_cartpoles, closing):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    obs = batch.reset(finished, seed=[123] * len(finished))
    fresh = closing(gym.make("CartPole-v1")).reset(seed=123)[0]
    np.testing.assert_array_equal(obs, np.stack([fresh] * len(finished)))
    for i in finished:
        mirror[i].reset(seed=123)
    # Both envs carry on from there exactly like the in-process ones,
    # including the next episode ends and prefetched resets.
    for _ in range(3):
        finished = step_until_finished(batch, mirror, action=0)
        np.testing.assert_array_equal(batch.reset(finished),
                                      np.stack([mirror[i].reset()[0] for i in finished]))


def test_reset_twice_without_a_step_resets_twice(worker_cartpoles):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    first = batch.reset(finished)  # the prefetched one
    second = batch.reset(finished)  # a real one, in the worker
    np.testing.assert_array_equal(first, np.stack([mirror[i].reset()[0] for i in finished]))
    np.testing.assert_array_equal(second, np.stack([mirror[i].reset()[0] for i in finished]))
    assert not np.array_equal(first, second)
    assert [batch.envs[i].resets for i in range(2)] == [env.resets for env in mirror]
    # All envs at once (a mix of fresh and not fresh ones), twice.
    step_until_finished(batch, mirror)
    for _ in range(2):
        np.testing.assert_array_equal(batch.reset(), np.stack([env.reset()[0] for env in mirror]))
    np.testing.assert_array_equal(batch.step(np.array([1, 1]))[0],
                                  np.stack([env.step(1)[0] for env in mirror]))


def test_a_reset_after_a_seeded_one_is_a_real_reset(worker_cartpoles):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    batch.reset(finished, seed=[123] * len(finished))
    for i in finished:
        mirror[i].reset(seed=123)
    # Not the reset the worker made as the episode ended: that one is stale now.
    np.testing.assert_array_equal(batch.reset(finished),
                                  np.stack([mirror[i].reset()[0] for i in finished]))


def test_a_reset_after_an_autoreset_step_is_a_real_reset(worker_cartpoles):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    autoreset = np.isin(np.arange(2), finished)
    observ = batch.step(np.ones(2, np.int64), autoreset)[0]
    np.testing.assert_array_equal(observ, np.stack(
        [env.reset()[0] if reset else env.step(1)[0] for env, reset in zip(mirror, autoreset)]))
    # The autoreset used the worker's reset at the episode end: this one is new.
    np.testing.assert_array_equal(batch.reset(finished),
                                  np.stack([mirror[i].reset()[0] for i in finished]))
    assert [batch.envs[i].resets for i in finished] == [mirror[i].resets for i in finished]


def test_an_autoreset_step_after_a_seeded_reset_is_a_real_reset(worker_cartpoles):
    batch, mirror = worker_cartpoles
    finished = step_until_finished(batch, mirror)
    batch.reset(finished, seed=[123] * len(finished))  # not the prefetched reset: a real one
    for i in finished:
        mirror[i].reset(seed=123)
    autoreset = np.isin(np.arange(2), finished)
    observ = batch.step(np.ones(2, np.int64), autoreset)[0]
    np.testing.assert_array_equal(observ, np.stack(
        [env.reset()[0] if reset else env.step(1)[0] for env, reset in zip(mirror, autoreset)]))


def test_a_step_after_an_autoreset_step_steps_every_env(closing):
    worker = closing(EnvWorker([CountingEnv] * 2))
    worker.reset()
    worker.step(np.zeros(2, np.int64))
    observ, reward, *_ = worker.step(np.zeros(2, np.int64), np.array([True, False]))
    assert observ.ravel().tolist() == [0.0, 2.0] and reward.tolist() == [0.0, 2.0]
    # No autoreset given: every env is stepped, none reset again.
    observ, reward, *_ = worker.step(np.zeros(2, np.int64))
    assert observ.ravel().tolist() == [1.0, 3.0] and reward.tolist() == [1.0, 3.0]


def short_counted_cartpole():
    return ResetCounter(gym.make("CartPole-v1", max_episode_steps=3))


def test_a_truncated_episode_is_reset_ahead_too(closing):
    worker = closing(EnvWorker([short_counted_cartpole] * 2))
    mirror = [closing(short_counted_cartpole()) for _ in range(2)]
    worker.reset(seeds=[0, 1])
    for _ in range(3):
        _, _, terminated, truncated, _ = worker.step(np.zeros(2, np.int64))
    assert truncated.all() and not terminated.any()
    assert [worker.env(i).resets for i in range(2)] == [2, 2]  # the prefetched resets
    observ, _ = worker.reset()  # answered from them
    assert [worker.env(i).resets for i in range(2)] == [2, 2]
    for i, env in enumerate(mirror):
        env.reset(seed=i)
        for _ in range(3):
            env.step(0)
    np.testing.assert_array_equal(observ, np.stack([env.reset()[0] for env in mirror]))


OPTIONS = {"low": -0.001, "high": 0.001}  # CartPole's initial state range (default ±0.05)


def test_reset_with_options_goes_to_the_worker(worker_cartpoles):
    batch, mirror = worker_cartpoles
    # Before any episode end: the same as in process.
    np.testing.assert_array_equal(batch.reset([1], options=OPTIONS),
                                  mirror[1].reset(options=OPTIONS)[0][None])
    finished = step_until_finished(batch, mirror)
    resets = [batch.envs[i].resets for i in finished]
    obs = batch.reset(finished, options=OPTIONS)
    # Not the prefetched observation (drawn from ±0.05): the env was reset
    # again, with the options.
    assert np.abs(obs).max() <= 0.001
    assert [batch.envs[i].resets for i in finished] == [r + 1 for r in resets]
    # With a seed too, after an episode end, the result is the in-process one.
    np.testing.assert_array_equal(batch.reset(seed=7),
                                  np.stack([env.reset(seed=7 + i)[0]
                                            for i, env in enumerate(mirror)]))
    step_until_finished(batch, mirror)
    np.testing.assert_array_equal(
        batch.reset(seed=[5, 6], options=OPTIONS),
        np.stack([env.reset(seed=s, options=OPTIONS)[0] for env, s in zip(mirror, [5, 6])]))


def test_reset_with_options_after_an_episode_end_differs_only_with_prefetch(closing):
    """The documented exception: the prefetched reset has drawn from the env's
    RNG, so reset(options=...) without a seed right after an episode end
    differs from in-process; with prefetch_reset=False it is the same."""
    for prefetch in (False, True):
        worker = closing(EnvWorker([counted_cartpole] * 2, prefetch_reset=prefetch))
        batch = closing(BatchEnv([worker]))
        mirror = [closing(counted_cartpole()) for _ in range(2)]
        batch.reset(seed=0)
        for index, env in enumerate(mirror):
            env.reset(seed=index)
        finished = step_until_finished(batch, mirror)
        same = np.array_equal(batch.reset(finished, options=OPTIONS),
                              np.stack([mirror[i].reset(options=OPTIONS)[0] for i in finished]))
        assert same != prefetch


# -- errors ---------------------------------------------------------------------------


def test_step_error_in_a_worker_names_the_global_env_index(closing):
    worker = closing(EnvWorker([CountingEnv, fails_at(3), CountingEnv], label="counting"))
    batch = closing(BatchEnv([CountingEnv(), worker, CountingEnv()]))
    batch.reset()
    batch.step([0] * 5)
    batch.step([0] * 5)
    start = time.monotonic()
    with pytest.raises(EnvRaisedError) as info:
        batch.step([0] * 5)
    assert time.monotonic() - start < 3.0
    error = info.value
    assert error.env_index == 2 and error.env_indices is None
    assert error.worker_env_index == 1
    assert (error.remote_type, error.remote_message) == ("ValueError", "boom at step 3")
    assert error.operation == "step" and error.label == "counting"
    assert "Traceback (most recent call last)" in error.remote_traceback
    assert ", in step\n" in error.remote_traceback
    assert raise_site(CountingEnv.step, "raise ValueError") in error.remote_traceback
    message = str(error)
    assert message.startswith("env 2 (counting) failed in step(): ValueError: boom at step 3\n")
    assert "Traceback in the env worker:" in message
    # The worker survives and keeps serving; no stale answer is left behind.
    # (Env 3, after the failing one in the same worker, was not stepped in the
    # failed step, unlike with one process per env: its count is not checked.)
    _, rewards, _, _, infos = batch.step([0] * 5)
    np.testing.assert_array_equal(rewards[[0, 1, 2, 4]], [4.0, 4.0, 4.0, 4.0])
    assert [infos[i]["count"] for i in (0, 1, 2, 4)] == [4, 4, 4, 4]
    np.testing.assert_array_equal(batch.reset(), np.zeros((5, 1), np.float32))
    assert batch.step([0] * 5)[1].tolist() == [1.0] * 5


def test_envs_after_a_failing_env_in_the_same_worker_are_still_stepped(closing):
    worker = closing(EnvWorker([fails_at(1), CountingEnv], label="counting"))
    batch = closing(BatchEnv([worker, closing(ExternalProcess(CountingEnv))]))
    batch.reset()
    with pytest.raises(EnvRaisedError):
        batch.step([0, 0, 0])
    assert batch.step([0, 0, 0])[1].tolist() == [2.0, 2.0, 2.0]  # got [2.0, 1.0, 2.0]


def test_the_first_of_several_failing_envs_in_a_worker_is_named(closing):
    worker = closing(EnvWorker([CountingEnv, fails_at(2), fails_at(2)], label="counting"))
    worker.reset()
    worker.step(np.zeros(3, np.int64))
    with pytest.raises(EnvRaisedError) as info:
        worker.step(np.zeros(3, np.int64))
    assert info.value.worker_env_index == 1


def test_constructor_error_in_a_worker_names_the_global_env_index(closing):
    worker = closing(EnvWorker([CountingEnv, CountingEnv, make_broken_env], label="counting"))
    with pytest.raises(EnvRaisedError) as info:
        BatchEnv([closing(CountingEnv()), worker])
    error = info.value
    assert error.env_index == 3 and error.operation == "construct"
    assert (error.remote_type, error.remote_message) == ("RuntimeError",
                                                         "cannot build this env")
    assert str(error).startswith("env 3 (counting) failed in construct(): RuntimeError: "
                                 "cannot build this env\n")
    assert "in make_broken_env" in error.remote_traceback
    # The worker is gone, and says why on every later call.
    assert worker.closed
    with pytest.raises(EnvRaisedError, match="cannot build this env"):
        worker.reset()


@pytest.mark.timeout(30)
def test_killed_worker_names_its_env_range(closing):
    worker = closing(EnvWorker([CountingEnv] * 3, label="counting"))
    batch = closing(BatchEnv([CountingEnv(), CountingEnv(), CountingEnv(), worker,
                              CountingEnv()]))
    batch.reset()
    batch.step([0] * 7)
    pid = worker.pid
    kill_and_wait(pid)
    start = time.monotonic()
    with pytest.raises(EnvCrashedError) as info:
        batch.step([0] * 7)
    assert time.monotonic() - start < 5.0
    error = info.value
    assert error.env_indices == range(3, 6) and error.env_index is None
    assert error.exitcode == -signal.SIGKILL and error.pid == pid
    assert str(error) == (f"envs 3-5 (counting, one worker process) failed in step(): the env "
                          f"worker process (pid {pid}) was killed by signal SIGKILL")
    with pytest.raises(EnvCrashedError, match=r"^envs 3-5 .* failed in reset\(\).*SIGKILL"):
        batch.reset([4])
    # The other envs still work.
    np.testing.assert_array_equal(batch.reset([0, 6, 2]), np.zeros((3, 1), np.float32))
    start = time.monotonic()
    batch.close()
    assert time.monotonic() - start < 3.0


FULL_SHM_SCRIPT = textwrap.dedent("""
    import os
    from batchrl.envs import EnvWorker
    from batchrl.envs.errors import EnvError

    if __name__ == "__main__":
        fd = os.open("/dev/shm/filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:  # (until /dev/shm, a tmpfs of 64 KiB here, is full)
                os.write(fd, b"x" * 4096)
        except OSError:
            pass
        os.close(fd)
        worker = EnvWorker(["CartPole-v1"] * 2, label="cartpoles")
        try:
            worker.observation_space
        except EnvError as exc:
            print(exc)
        worker.close()
""")


@pytest.mark.timeout(60)
def test_a_full_dev_shm_is_an_error_that_says_so_not_a_sigbus(tmp_path):
    """tmpfs reserves no pages when a block is sized: with /dev/shm full, the first process
    to write the worker's arrays was killed by SIGBUS (the worker, or the trainer with no
    word at all). The pages are reserved when the block is made, so it is an EnvError."""
    namespace = mount_namespace()
    script = tmp_path / "full_shm.py"
    script.write_text(FULL_SHM_SCRIPT)
    result = subprocess.run(
        [*namespace, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "
                                 f"{sys.executable} {script}"],
        capture_output=True, text=True, timeout=50, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        r"cartpoles failed in construct\(\): cannot get \d+ bytes of shared memory for its "
        r"worker's arrays \(No space left on device\); free space in /dev/shm \(df -h "
        r"/dev/shm\) or set env.backend = 'inline'\n", result.stdout), result


PROCESS_LIMIT_SCRIPT = LIMIT_TASKS + """
import functools
import gymnasium as gym
from batchrl.envs import EnvError
from batchrl.envs.factory import batch_env_from

limit_tasks()
try:
    batch_env_from(functools.partial(gym.make, "CartPole-v1"), 1, workers=1, pin_workers=False,
                   label="cartpoles").close()
except EnvError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


@pytest.mark.timeout(300)
def test_the_limit_on_processes_is_an_env_error_that_says_so():
    """Under a container's pids.max, with room for ever more processes and threads: the fork
    server cannot fork (it dies, and the parent read EOF), then the worker cannot start its
    watchdog thread (it printed a traceback and exited with code 1, which said nothing of
    why), then the env is built. Each failure is an EnvError whose first line says why."""
    failures = []
    for room in range(1, 30):
        with pids_cgroup() as group:
            result = run_stdin_script(PROCESS_LIMIT_SCRIPT, str(group), str(room))
        assert result.returncode == 0, result.stderr
        assert "Process batchrl-env" not in result.stderr, result.stderr
        if not result.stdout:
            break  # built
        failures.append(result.stdout.splitlines()[0])  # (then the worker's traceback, if any)
    assert failures and result.stdout == "", failures
    limit = (r"EnvError: cartpoles failed in construct\(\): cannot start a worker process "
             r"\(.+\): is the limit on processes and threads reached \(ulimit -u, a "
             r"container's pids.max\)\?")
    thread = (r"EnvRaisedError: env 0 \(cartpoles\) failed in construct\(\): RuntimeError: the "
              r"worker process cannot start a thread \(can't start new thread\): is the limit "
              r"on processes and threads reached \(ulimit -u, a container's pids.max\)\?")
    assert re.fullmatch(limit, failures[0]), failures
    assert all(re.fullmatch(f"{limit}|{thread}", line) for line in failures), failures
    assert re.fullmatch(thread, failures[-1]), failures  # (the last task it starts)


EXIT_REPORTING_SCRIPT = LIMIT_TASKS + """
import multiprocessing as mp
from batchrl.interrupt import exit_reporting

errors = mp.get_context("spawn").Queue()  # (its resource tracker started: a process)
limit_tasks()
exit_reporting("collector 3: ValueError: boom", errors, "ValueError: boom")
"""


@pytest.mark.timeout(60)
def test_a_failed_worker_that_cannot_send_its_error_writes_it_to_stderr():
    """A collector's or learner's error goes through a queue, whose feeder is a thread: with
    none left under the process limit, the line goes to stderr, and the exit code is 1."""
    for room, on_stderr in ((0, True), (1, False)):  # (1: room for the feeder thread)
        with pids_cgroup() as group:
            result = run_stdin_script(EXIT_REPORTING_SCRIPT, str(group), str(room))
        assert result.returncode == 1, result
        # (then, the resource tracker's word on the queue's semaphores, which os._exit left)
        assert result.stderr.startswith("collector 3: ValueError: boom\n") == on_stderr, result


class UnpicklableInfo(CountingEnv):
    """Its second step's info holds what pickle cannot send (a lock)."""

    def step(self, action):
        observ, reward, terminated, truncated, info = super().step(action)
        if self.count == 2:
            import threading
            info = {"lock": threading.Lock()}
        return observ, reward, terminated, truncated, info


@pytest.mark.timeout(30)
def test_an_info_that_cannot_be_sent_is_the_envs_error_not_the_workers_end(closing):
    worker = closing(EnvWorker([UnpicklableInfo, CountingEnv], label="locked"))
    batch = closing(BatchEnv([worker]))
    batch.reset()
    batch.step([0, 0])
    with pytest.raises(EnvRaisedError, match="cannot pickle '_thread.lock' object"):
        batch.step([0, 0])
    assert worker.pid is not None and psutil.pid_exists(worker.pid)  # (it serves on)
    np.testing.assert_array_equal(batch.reset(), np.zeros((2, 1), np.float32))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_core_the_worker_may_not_use_is_named(closing):
    worker = closing(EnvWorker([CountingEnv], cpu=10_000, label="pinned"))
    with pytest.raises(EnvRaisedError, match="cannot pin the worker to cpu 10000"):
        worker.observation_space


@pytest.mark.timeout(30)
def test_an_interrupted_step_leaves_no_stale_answer(closing):
    """Ctrl-C while waiting for a worker: the step is abandoned, its late answer is dropped,
    and the batch steps on with the next step's answers."""
    worker = closing(EnvWorker([sleeps_at(2, 1.0), CountingEnv], label="slow"))
    batch = closing(BatchEnv([worker]))
    batch.reset()
    batch.step([0, 0])

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            batch.step([0, 0])  # (the first env sleeps a second in its second step)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    observ, *_, infos = batch.step([0, 0])
    assert observ[:, 0].tolist() == [3.0, 3.0]  # this step's answer, not the abandoned one's
    # (The infos travel in the answer itself, the observations in shared memory, which the
    # worker may have overwritten with this step's before a stale answer is read.)
    assert [info["count"] for info in infos] == [3, 3]


@pytest.mark.timeout(30)
def test_timeout_raises_and_the_next_step_is_not_stale(closing):
    worker = closing(EnvWorker([sleeps_at(2, 3.0), CountingEnv], timeout=0.5, label="slow"))
    batch = closing(BatchEnv([CountingEnv(), worker]))
    batch.reset()
    assert batch.step([0, 0, 0])[1].tolist() == [1.0, 1.0, 1.0]
    start = time.monotonic()
    with pytest.raises(EnvTimeoutError) as info:
        batch.step([0, 0, 0])  # env 1 sleeps 3 s in its step 2
    assert 0.5 <= time.monotonic() - start < 2.0
    error = info.value
    assert error.env_indices == range(1, 3) and error.env_index is None
    assert str(error).startswith(
        f"envs 1-2 (slow, one worker process) failed in step(): no answer from the env "
        f"worker (pid {worker.pid}) within 0.5 s")
    time.sleep(max(0.0, start + 3.3 - time.monotonic()))  # the late answer has come
    obs, rewards, terminated, truncated, infos = batch.step([0, 0, 0])
    # Step 3 of every env, not the late answer of step 2.
    np.testing.assert_array_equal(obs, [[3.0], [3.0], [3.0]])
    assert rewards.tolist() == [3.0, 3.0, 3.0]
    assert list(infos) == [{"count": 3}] * 3
    assert not terminated.any() and not truncated.any()
    np.testing.assert_array_equal(batch.reset([2, 1]), np.zeros((2, 1), np.float32))
    assert batch.step([0, 0, 0])[1].tolist() == [4.0, 1.0, 1.0]
    assert batch.envs[2].call("double", 5) == 10


class EchoEnv(gym.Env):
    """Records the actions it is stepped with; sleeps ``sleep`` seconds in its
    first step."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, sleep=0.0):
        self.sleep = sleep
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if self.sleep and not self.actions:
            time.sleep(self.sleep)
        self.actions.append(int(action))
        return np.array([action], np.float32), 0.0, False, False, {}


@pytest.mark.timeout(30)
def test_timed_out_step_keeps_its_actions(closing):
    worker = closing(EnvWorker([lambda: EchoEnv(sleep=1.0), EchoEnv], timeout=0.3))
    worker.reset()
    with pytest.raises(EnvTimeoutError):
        worker.step(np.array([1, 1]))
    worker.timeout = 10.0
    worker.step(np.array([0, 0]))  # sent while the worker still sleeps in the first step
    assert worker.get_attr("actions", index=0) == [1, 0]
    assert worker.get_attr("actions", index=1) == [1, 0]  # got [0, 0]


@pytest.mark.timeout(30)
def test_a_worker_that_times_out_attaching_its_memory_is_stopped_for_good(closing):
    worker = closing(EnvWorker([make_cartpole], timeout=0.3))
    time.sleep(4.0)  # built: the construction's answer waits in the pipe
    os.kill(worker.pid, signal.SIGSTOP)  # descheduled for a moment (a loaded machine)
    for _ in range(2):  # the same error again, not a construction it cannot wait for again
        with pytest.raises(EnvTimeoutError, match=r"attach\(\)"):
            worker.reset()
    assert wait_gone([worker.pid], 10) == []


MAIN_SPACE_SCRIPT = textwrap.dedent("""
    import gymnasium as gym
    import numpy as np
    from batchrl.envs import EnvWorker

    class MyBox(gym.spaces.Box):  # defined by the main script, which workers import as
        pass                      # __mp_main__: pickled by reference it names no class there

    class Env(gym.Env):
        observation_space = MyBox(-1, 1, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.zeros(1, np.float32), {}

    if __name__ == "__main__":
        worker = EnvWorker([Env])
        print(worker.reset()[0].tolist(), flush=True)
        worker.close()
""")


class TextEnv(CountingEnv):
    observation_space = gym.spaces.Text(8)


def test_a_worker_whose_spaces_are_rejected_is_stopped(closing, gone):
    worker = closing(EnvWorker([TextEnv]))
    for _ in range(2):  # (and said again, not "the env was closed")
        with pytest.raises(UnsupportedSpaceError, match="Text"):
            worker.observation_space
    assert worker.closed and gone([worker.pid], timeout=3.0) == []


def test_a_space_class_of_the_main_script_reaches_the_parent(tmp_path):
    result = run_script(tmp_path / "main_space.py", MAIN_SPACE_SCRIPT)
    assert result.returncode == 0 and result.stdout == "[[0.0]]\n", result.stderr


SUSPEND_SCRIPT = textwrap.dedent("""
    import time
    import gymnasium as gym
    import numpy as np
    from batchrl.envs import EnvWorker

    class Slow(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            for _ in range(20):  # (work left after the resume, unlike one sleep's)
                time.sleep(0.05)
            return np.zeros(1, np.float32), 0.0, False, False, {}

    worker = EnvWorker([Slow], timeout=2.0)
    worker.reset()
    print("stepping", flush=True)
    worker.step(np.zeros(1, np.int64))
    print("done", flush=True)
    worker.close()
""")


@pytest.mark.timeout(60)
def test_a_suspended_run_is_not_a_hung_worker():
    """The whole run suspended and resumed (SIGSTOP then SIGCONT of every process, as a job
    scheduler suspends a job) in the middle of a step: the time spent stopped does not count
    against the step's timeout. (A terminal's Ctrl-Z stops the run's process group; the env
    workers lead groups of their own, so it leaves them, idle, running.)"""
    process = subprocess.Popen([sys.executable, "-c", SUSPEND_SCRIPT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               stdin=subprocess.DEVNULL)

    def signal_the_run(signum: int) -> None:
        os.killpg(process.pid, signum)
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(OSError):
                if os.getpgid(child.pid) == child.pid:  # an env worker's group
                    os.killpg(child.pid, signum)

    try:
        assert process.stdout.readline() == "stepping\n"
        time.sleep(0.3)
        signal_the_run(signal.SIGSTOP)
        time.sleep(2.5)  # longer than the timeout (2 s) and the step (1 s)
        signal_the_run(signal.SIGCONT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err
    assert out == "done\n"


# -- attribute access -------------------------------------------------------------------


def test_worker_envs_are_handles_forwarding_attributes(closing):
    worker = closing(EnvWorker(["HalfCheetah-v5"] * 2))
    batch = closing(BatchEnv([closing(gym.make("HalfCheetah-v5")), worker]))
    local = closing(gym.make("HalfCheetah-v5"))
    handles = batch.envs
    assert not isinstance(handles[0], WorkerEnv)
    assert [type(h) for h in handles[1:]] == [WorkerEnv, WorkerEnv]
    assert [h.index for h in handles[1:]] == [0, 1]
    assert all(h.worker is worker for h in handles[1:])
    assert isinstance(batch[2], WorkerEnv) and batch[2].index == 1
    assert handles[2].observation_space == local.observation_space
    assert handles[2].action_space == local.action_space
    with pytest.raises(IndexError, match="out of range"):
        worker.env(2)

    unwrapped = handles[1].unwrapped
    assert isinstance(unwrapped, RemoteAttribute)
    assert unwrapped.frame_skip == 5
    assert unwrapped.dt == pytest.approx(0.05)
    assert handles[2].spec.id == "HalfCheetah-v5"
    assert handles[2].spec.max_episode_steps == 1000
    assert handles[1].get_wrapper_attr("frame_skip") == 5  # a method, called remotely

    batch.reset(seed=3)
    actions = np.full((3, 6), 0.5, np.float32)
    batch.step(actions)
    local.reset(seed=5)  # env 2 has seed 3 + 2
    local.step(actions[2])
    np.testing.assert_array_equal(handles[2].call("unwrapped.state_vector"),
                                  local.unwrapped.state_vector())
    np.testing.assert_array_equal(handles[2].unwrapped.get_body_com("torso"),
                                  local.unwrapped.get_body_com("torso"))
    assert not np.array_equal(handles[1].call("unwrapped.state_vector"),
                              local.unwrapped.state_vector())

    with pytest.raises(AttributeError) as info:
        handles[1].get_attr("no_such_attribute")
    assert isinstance(info.value, EnvAttributeError)
    assert info.value.remote_type == "AttributeError"
    assert "no attribute 'no_such_attribute'" in str(info.value)
    assert not hasattr(handles[1], "no_such_attribute")
    assert getattr(handles[2], "no_such_attribute", "default") == "default"
    assert not hasattr(handles[1].unwrapped, "no_such_attribute")
    assert not hasattr(handles[1], "_private")  # never forwarded
    with pytest.raises(EnvAttributeError, match=r"failed in call\(\)"):
        handles[1].call("no_such_method")
    # Still serving, in step with the in-process env.
    np.testing.assert_array_equal(batch.step(actions)[0][2], local.step(actions[2])[0])


def test_call_reaches_the_right_env_of_a_worker(closing):
    worker = closing(EnvWorker([CountingEnv] * 3))
    worker.reset()
    worker.step(np.zeros(3, np.int64))
    worker.reset([1])
    assert [worker.env(i).count for i in range(3)] == [1, 0, 1]
    assert worker.env(2).call("double", 4, offset=1) == 9
    assert worker.call("double", 21, index=1) == 42
    assert worker.get_attr("count", index=2) == 1
    # (calls whose answer tells the envs apart: env 1 alone was reset)
    assert [worker.env(i).call("get_wrapper_attr", "count") for i in range(3)] == [1, 0, 1]
    assert [worker.call("get_wrapper_attr", "count", index=i) for i in range(3)] == [1, 0, 1]
    assert [worker.get_attr("count", index=i) for i in range(3)] == [1, 0, 1]


def test_attributes_and_methods_under_an_envs_wrappers_are_found(closing):
    cartpoles = closing(EnvWorker([counted_cartpole] * 2))
    assert cartpoles.env(1).resets == 0  # the outer wrapper's
    assert cartpoles.env(1).x_threshold == 2.4  # CartPoleEnv's, under the wrappers
    assert cartpoles.get_attr("gravity", index=1) == 9.8
    cheetah = closing(EnvWorker([make_cheetah]))
    assert cheetah.env(0).frame_skip == 5
    cheetah.reset(seeds=[3])
    local = closing(make_cheetah())
    local.reset(seed=3)
    np.testing.assert_array_equal(cheetah.env(0).call("state_vector"),
                                  local.unwrapped.state_vector())


class GeneratorEnv(CountingEnv):
    def numbers(self):
        return (n for n in range(3))  # (a generator: not picklable)


def test_a_call_result_that_cannot_be_sent_is_the_envs_error(closing):
    worker = closing(EnvWorker([GeneratorEnv], label="generator"))
    with pytest.raises(EnvRaisedError, match=r"generator failed in call\(\): TypeError: .*"
                                             r"'generator'"):
        worker.call("numbers")
    assert worker.call("double", 21) == 42  # still serving


# -- infos ------------------------------------------------------------------------------


def test_infos_false_gives_empty_step_infos(closing):
    with_infos = closing(BatchEnv([closing(EnvWorker([make_cheetah] * 2))]))
    without = closing(BatchEnv([closing(EnvWorker([make_cheetah] * 2, infos=False))]))
    with_infos.reset(seed=0)
    without.reset(seed=0)
    actions = np.full((2, 6), 0.3, np.float32)
    for _ in range(35):  # an episode end (and prefetched reset) at step 30
        got = without.step(actions)
        expected = with_infos.step(actions)
        for g, e in zip(got[:4], expected[:4]):
            np.testing.assert_array_equal(g, e)
        assert isinstance(got[4], InfoList)
        assert len(got[4]) == 2 and list(got[4]) == [{}, {}] and got[4] == [{}, {}]
        assert all("x_position" in info for info in expected[4])
        finished = np.flatnonzero(got[2] | got[3])
        if finished.size:
            np.testing.assert_array_equal(without.reset(finished), with_infos.reset(finished))


def test_info_list_behaves_like_a_read_only_list():
    items = [{"a": 1}, {"b": 2}, {}, {}, {"c": 3}]
    infos = InfoList([(2, pickle.dumps(items[:2])), (2, None), (1, items[4:])])
    assert len(infos) == 5
    assert infos == items and items == infos and infos == InfoList([(5, items)])
    assert infos != items[:4] and infos != [{}] * 5
    assert infos != tuple(items)  # only lists compare equal
    assert infos[0] == {"a": 1} and infos[1] == {"b": 2} and infos[2] == {}
    assert infos[-1] == {"c": 3} and infos[-4] == {"b": 2}
    assert infos[1:3] == [{"b": 2}, {}]
    with pytest.raises(IndexError):
        infos[5]
    assert list(infos) == items and [info for info in infos] == items
    assert list(reversed(infos)) == items[::-1]
    assert {"b": 2} in infos and infos.index({"c": 3}) == 4 and infos.count({}) == 2
    assert repr(infos) == repr(items)
    assert len(InfoList([])) == 0 and list(InfoList([])) == []


def test_info_list_join_keeps_order_and_stays_lazy():
    loaded = InfoList([(1, [{"x": 0}])])
    assert loaded[0] == {"x": 0}
    lazy = InfoList([(2, pickle.dumps([{"y": 1}, {"y": 2}]))])
    broken = InfoList([(3, b"not a pickle")])
    joined = InfoList.join([loaded, [{"z": 3}], lazy, InfoList([(2, None)]), broken])
    assert len(joined) == 9  # nothing unpickled yet: the broken part would fail
    with pytest.raises(pickle.UnpicklingError):
        joined[0]
    good = InfoList.join([loaded, [{"z": 3}], lazy, InfoList([(2, None)])])
    assert good == [{"x": 0}, {"z": 3}, {"y": 1}, {"y": 2}, {}, {}]
    assert lazy == [{"y": 1}, {"y": 2}]  # the parts are shared, not consumed
    assert InfoList.join([]) == []


# -- shared memory hygiene ----------------------------------------------------------------


def shm_blocks() -> set[str]:
    return set(glob.glob("/dev/shm/psm_*"))


def new_blocks(before: set[str], patience: float = 3.0) -> set[str]:
    """The shared-memory names that exist now and not ``before``, once those that other
    tests running beside this one create and unlink within moments have gone (a leaked name
    stays)."""
    deadline = time.monotonic() + patience
    while (extra := shm_blocks() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def mapped_blocks(pid: int | str) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if "/psm_" in line}


@pytest.mark.skipif(not (os.path.isdir("/dev/shm") and os.path.exists("/proc/self/maps")),
                    reason="needs Linux's /dev/shm and /proc")
def test_shared_memory_is_unlinked_at_once_and_unmapped_on_close(closing):
    before = shm_blocks()
    mapped_before = mapped_blocks("self")
    workers = [closing(EnvWorker([make_cartpole] * 2)) for _ in range(2)]
    batch = closing(BatchEnv(workers))
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    # The names are gone while both sides still map the blocks.
    assert new_blocks(before) == set()
    blocks = set()
    for worker in workers:
        mapped = mapped_blocks(worker.pid)
        assert len(mapped) == 1 and all(name.endswith("(deleted)") for name in mapped)
        blocks |= mapped
    assert len(blocks) == 2 and blocks <= mapped_blocks("self")

    # A worker that fails to build its envs, and one that is killed.
    broken = closing(EnvWorker([make_cartpole, make_broken_env]))
    with pytest.raises(EnvRaisedError):
        broken.reset()
    killed = closing(EnvWorker([make_cartpole]))
    killed.reset()
    kill_and_wait(killed.pid)
    with pytest.raises(EnvCrashedError):
        killed.step(np.zeros(1, np.int64))
    batch.close()
    killed.close()
    assert new_blocks(before) == set()
    assert mapped_blocks("self") == mapped_before


SHM_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import numpy as np
    from batchrl.envs import BatchEnv, EnvCrashedError, EnvWorker

    workers = [EnvWorker(["CartPole-v1"] * 2) for _ in range(2)]
    batch = BatchEnv(workers)
    batch.reset(seed=0)
    batch.step(np.zeros(4, np.int64))
    os.kill(workers[1].pid, signal.SIGKILL)
    time.sleep(0.2)
    try:
        batch.step(np.zeros(4, np.int64))
    except EnvCrashedError:
        pass
    batch.close()
    leftover = EnvWorker(["CartPole-v1"])  # left to the interpreter's exit
    leftover.reset()
    print("done", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux's /dev/shm")
def test_no_shared_memory_warning_or_leak_at_interpreter_exit():
    before = shm_blocks()
    result = subprocess.run([sys.executable, "-c", SHM_SCRIPT], capture_output=True,
                            text=True, timeout=50, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "done\n"
    # The resource tracker would warn about (or unlink) blocks it still tracks.
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, \
        result.stderr
    assert new_blocks(before) == set()


# -- the transport ----------------------------------------------------------------------


class ActionEchoEnv(gym.Env):
    """Observes the action it was given, as float64, with the action's dtype in the
    info; its infos hold numpy scalars in a nested dict (not columns: sent pickled), and
    it ends its episode when told to by an action of 9."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2), {"first": {"n": np.int64(7), "x": np.float32(0.5)}}

    def step(self, action):
        return (np.asarray(action, np.float64), 1.0, bool(action[0] == 9), False,
                {"dtype": str(action.dtype),
                 "nested": {"n": np.int64(3), "x": np.float32(0.25), "b": np.bool_(True)}})


def test_actions_of_another_dtype_than_the_last_steps_reach_the_env_as_sent(closing):
    worker = closing(EnvWorker([ActionEchoEnv] * 2))
    worker.reset()
    for dtype in (np.float32, np.float64, np.int64, np.float32, np.int8):
        actions = np.array([[1.5, -2.0], [3.0, 4.25]]).astype(dtype)
        observ, *_, infos = worker.step(actions)
        np.testing.assert_array_equal(observ, actions.astype(np.float64))
        assert [info["dtype"] for info in infos] == [np.dtype(dtype).name] * 2


def test_numpy_scalars_in_infos_keep_their_type_and_value(closing):
    worker = closing(EnvWorker([ActionEchoEnv] * 2))
    batch = closing(BatchEnv([worker]))
    _, infos = batch.reset(return_infos=True)
    for info in infos:
        assert info == {"first": {"n": 7, "x": 0.5}}
        assert type(info["first"]["n"]) is np.int64 and type(info["first"]["x"]) is np.float32
    actions = np.array([[9.0, 0.0], [0.0, 0.0]])
    infos = batch.step(actions)[4]
    for info in infos:
        assert info["nested"] == {"n": 3, "x": 0.25, "b": True}
        assert [type(v) for v in info["nested"].values()] == [np.int64, np.float32, np.bool_]
    # The prefetched reset of env 0 brings its own info, the same as a real reset's.
    _, infos = batch.reset([0], return_infos=True)
    assert infos == [{"first": {"n": 7, "x": 0.5}}]
    assert type(infos[0]["first"]["n"]) is np.int64


class CloseMarksEnv(CountingEnv):
    """Writes its file when closed; raises in ``close`` if told to."""

    def __init__(self, path, fail=False):
        super().__init__()
        self.path, self.fail = path, fail

    def close(self):
        with open(self.path, "w") as file:
            file.write("closed")
        if self.fail:
            raise RuntimeError("the viewer is gone")


def test_a_worker_closes_all_its_envs_even_when_one_close_raises(closing, gone, tmp_path):
    paths = [str(tmp_path / f"env{i}") for i in range(3)]
    worker = closing(EnvWorker([lambda p=p, i=i: CloseMarksEnv(p, fail=i == 0)
                                for i, p in enumerate(paths)]))
    worker.reset()
    pid = worker.pid
    worker.close()
    assert gone([pid], timeout=5.0) == []
    assert [os.path.exists(p) for p in paths] == [True, True, True]


# -- batch_env_from ---------------------------------------------------------------------


def kinds(batch: BatchEnv) -> list[str]:
    return ["worker" if isinstance(env, WorkerEnv) else
            "process" if isinstance(env, ExternalProcess) else "inline" for env in batch.envs]


def test_split_evenly():
    assert split_evenly(5, 3) == [2, 2, 1]
    assert split_evenly(6, 3) == [2, 2, 2]
    assert split_evenly(2, 5) == [1, 1]
    assert split_evenly(7, 1) == [7]
    assert split_evenly(3, 0) == [3]


def test_factory_workers_share_main(closing):
    batch = closing(batch_env_from(make_cartpole, 5, workers=2, share_main=True,
                                   pin_workers=False, label="cartpole"))
    sizes = split_evenly(5, 3)
    assert len(batch) == 5
    assert kinds(batch) == ["inline"] * sizes[0] + ["worker"] * sum(sizes[1:])
    workers = batch.workers
    assert [type(w) for w in workers] == [EnvWorker, EnvWorker]
    assert [w.num_envs for w in workers] == sizes[1:]
    assert len({w.pid for w in workers}) == 2 and os.getpid() not in {w.pid for w in workers}
    assert all(w.label == "cartpole" and w.infos and w.timeout == DEFAULT_TIMEOUT for w in workers)
    assert batch.reset(seed=0).shape == (5, 4)
    assert batch.step(np.ones(5, np.int64))[1].tolist() == [1.0] * 5


def test_factory_workers_only(closing):
    batch = closing(batch_env_from(make_cartpole, 5, workers=2, share_main=False,
                                   pin_workers=False, infos=False, timeout=7.0))
    assert kinds(batch) == ["worker"] * 5
    assert [w.num_envs for w in batch.workers] == split_evenly(5, 2)
    assert all(not w.infos and w.timeout == 7.0 for w in batch.workers)
    batch.reset(seed=0)
    assert list(batch.step(np.zeros(5, np.int64))[4]) == [{}] * 5


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs at least two usable cores")
@pytest.mark.parametrize("share_main", [True, False], ids=["share-main", "workers-only"])
def test_factory_pins_each_worker_to_one_core(closing, share_main):
    cores = sorted(os.sched_getaffinity(0))
    batch = closing(batch_env_from(make_cartpole, 4, workers=2, share_main=share_main,
                                   pin_workers=True))
    affinities = [psutil.Process(w.pid).cpu_affinity() for w in batch.workers]
    assert affinities == [[cores[(i + share_main) % len(cores)]] for i in range(2)]
    unpinned = closing(batch_env_from(make_cartpole, 4, workers=2, share_main=share_main,
                                      pin_workers=False))
    for worker in unpinned.workers:
        assert sorted(psutil.Process(worker.pid).cpu_affinity()) == cores
    assert sorted(os.sched_getaffinity(0)) == cores  # this process is left alone


def test_factory_process_and_inline_backends(closing):
    batch = closing(batch_env_from(make_cartpole, 3, backend="process", timeout=5.0))
    assert kinds(batch) == ["process"] * 3
    assert [type(w) for w in batch.workers] == [ExternalProcess] * 3
    assert len({w.pid for w in batch.workers}) == 3
    assert all(w.timeout == 5.0 for w in batch.workers)
    expected = closing(batch_env_from(make_cartpole, 3, backend="inline"))
    assert kinds(expected) == ["inline"] * 3 and expected.workers == []
    np.testing.assert_array_equal(batch.reset(seed=4), expected.reset(seed=4))
    actions = np.array([0, 1, 1])
    np.testing.assert_array_equal(batch.step(actions)[0], expected.step(actions)[0])


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "threads"},
     r"^unknown env backend 'threads'; valid: auto, workers, process, inline, ray, vector, "
     r"native$"),
    ({"backend": "Workers"},
     r"unknown env backend 'Workers'; valid: auto, workers, process, inline, ray, vector, native"),
    ({"workers": -1}, r"^workers must be >= 0 \(0: one per usable core\), got -1$"),
], ids=["threads", "case", "negative-workers"])
def test_factory_rejects_bad_arguments(kwargs, message):
    with pytest.raises(EnvSpecError, match=message):
        batch_env_from(make_cartpole, 3, **kwargs)


def test_factory_default_workers_leave_a_core_to_a_sharing_main_process(closing):
    envs = 2 * usable_cores() + 2  # (more envs than cores: the cores set the processes)
    batch = closing(batch_env_from(make_cartpole, envs, share_main=True, pin_workers=False))
    assert len(batch.workers) == max(1, usable_cores() - 1)
    assert sum(worker.num_envs for worker in batch.workers) < envs  # this process steps some


def test_factory_auto_backend_runs_constructors_in_workers(closing):
    batch = closing(batch_env_from(make_cartpole, 2, backend="auto", workers=1,
                                   pin_workers=False))
    assert len(batch.workers) == 1 and batch.workers[0].num_envs == 2


def test_factory_restarts_keep_every_env_in_a_worker(closing):
    # share_main is dropped with max_restarts: an env in this process could not be restarted.
    batch = closing(batch_env_from(make_cartpole, 4, workers=1, share_main=True,
                                   max_restarts=1, pin_workers=False))
    assert sum(worker.num_envs for worker in batch.workers) == 4


def test_factory_gives_construction_longer_than_a_step(closing):
    def slow_cartpole():  # (nested: pickled by value for the worker)
        time.sleep(1.0)
        return gym.make("CartPole-v1")

    batch = closing(batch_env_from(slow_cartpole, 1, workers=1, timeout=0.3,
                                   pin_workers=False))
    assert batch.reset(seed=0).shape == (1, 4)


def test_factory_rejects_a_num_envs_that_disagrees_with_the_constructors():
    with pytest.raises(ValueError, match="num_envs=3 but 2 constructors given"):
        batch_env_from([make_cartpole, make_cartpole], 3, backend="inline")
