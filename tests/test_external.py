"""ExternalProcess: a real Gymnasium env in a real child process.

Covers forwarding (step/reset/attributes/calls), errors raised in the worker,
workers killed by signals, timeouts, and that no worker outlives close() or
its parent process (exit, SIGKILL, SIGKILL while the worker is busy).
"""

from __future__ import annotations

import json
import os
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

from batchrl.envs import (BatchEnv, EnvAttributeError, EnvCrashedError, EnvError,
                          EnvRaisedError, EnvTimeoutError, ExternalProcess, RemoteAttribute)
import helpers
from helpers import kill_and_wait, raise_site

# Ship this module's env classes and constructors to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CountingEnv(helpers.CountingEnv):
    """``helpers.CountingEnv`` that also says which modules its process imported."""

    def imported(self, module):
        return module in sys.modules


def make_broken_env():
    raise RuntimeError("cannot build this env")


def fails_at(step):
    return lambda: CountingEnv(fail_at=step)


def sleeps_at(step, seconds):
    return lambda: CountingEnv(sleep_at=step, sleep=seconds)


# -- forwarding ------------------------------------------------------------------


def test_step_and_reset_match_the_env_in_process(external):
    env = external("HalfCheetah-v5")
    local = gym.make("HalfCheetah-v5")
    obs, info = env.reset(seed=3)
    local_obs, local_info = local.reset(seed=3)
    np.testing.assert_array_equal(obs, local_obs)
    assert obs.dtype == np.float64 and obs.shape == (17,)
    assert info == local_info
    rng = np.random.default_rng(0)
    for _ in range(10):
        action = rng.uniform(-1, 1, 6).astype(np.float32)
        got, expected = env.step(action), local.step(action)
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[1] == expected[1] and type(got[1]) is type(expected[1])
        assert got[2:4] == expected[2:4]
        assert [type(flag) for flag in got[2:4]] == [bool, bool]  # as Gymnasium's, not numpy's
        assert got[4] == expected[4]


def test_step_and_reset_split_into_async_and_wait_halves(external):
    env = external("CartPole-v1")
    local = gym.make("CartPole-v1")
    assert env.reset_async(seed=5) is None
    np.testing.assert_array_equal(env.reset_wait()[0], local.reset(seed=5)[0])
    assert env.step_async(1) is None
    with pytest.raises(RuntimeError, match=r"step\(\) called while the result of step\(\) "
                                           r"was not received yet; call step_wait\(\) first"):
        env.step(0)
    obs, reward, terminated, truncated, _ = env.step_wait()
    expected = local.step(1)
    np.testing.assert_array_equal(obs, expected[0])
    assert (reward, terminated, truncated) == (1.0, False, False) == expected[1:4]
    with pytest.raises(RuntimeError, match=r"no step\(\) result is pending"):
        env.step_wait()
    np.testing.assert_array_equal(env.step(0)[0], local.step(0)[0])  # still in sync


class DictTupleEnv(gym.Env):
    """Spaces no shared array holds: a Dict observation and a Tuple action."""

    observation_space = gym.spaces.Dict({"position": gym.spaces.Box(-1.0, 1.0, (2,)),
                                         "label": gym.spaces.Text(8)})
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return {"position": np.zeros(2, np.float32), "label": "start"}, {"options": options}

    def step(self, action):
        assert isinstance(action, tuple), action  # the very object the caller passed
        self.count += 1
        observ = {"position": np.full(2, self.count, np.float32), "label": f"step{self.count}"}
        return observ, float(sum(action)), self.count == 2, False, {"action": action}


def test_spaces_beyond_shared_memory_travel_pickled(external):
    env = external(DictTupleEnv)
    assert env.observation_space == DictTupleEnv.observation_space
    observ, info = env.reset(seed=0, options={"a": 1})
    assert observ["label"] == "start" and info == {"options": {"a": 1}}
    observ, reward, terminated, truncated, info = env.step((1, 2))
    assert observ["label"] == "step1" and observ["position"].tolist() == [1.0, 1.0]
    assert (reward, terminated, truncated, info) == (3.0, False, False, {"action": (1, 2)})
    env.step_async((0, 1))
    observ, reward, terminated, *_ = env.step_wait()
    assert observ["label"] == "step2" and (reward, terminated) == (1.0, True)
    assert env.count == 2


class DictTupleFailingEnv(DictTupleEnv):
    """``DictTupleEnv`` raising in its second step and in a reset with options."""

    def reset(self, *, seed=None, options=None):
        if options == {"fail": True}:
            raise RuntimeError("bad options")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.count == 1:
            self.count += 1
            raise ValueError("boom in a pickled step")
        return super().step(action)


def test_errors_of_an_env_whose_arrays_travel_pickled_are_raised(external):
    env = external(DictTupleFailingEnv, label="pickled")
    env.reset(seed=0)
    env.step((0, 0))
    with pytest.raises(EnvRaisedError, match=r"pickled failed in step\(\): ValueError: "
                                             r"boom in a pickled step") as info:
        env.step((0, 0))
    assert info.value.remote_type == "ValueError"
    with pytest.raises(EnvRaisedError, match=r"pickled failed in reset\(\): RuntimeError: "
                                             r"bad options"):
        env.reset(options={"fail": True})
    # The worker keeps serving.
    observ, info = env.reset(options={"a": 1})
    assert observ["label"] == "start" and info == {"options": {"a": 1}}
    assert env.step((1, 1))[0]["label"] == "step1"


def test_attributes_are_forwarded(external):
    env = external("HalfCheetah-v5")
    assert env.label == "HalfCheetah-v5"
    assert env.spec.id == "HalfCheetah-v5"
    assert env.spec.max_episode_steps == 1000
    assert env.metadata["render_fps"] == 20
    unwrapped = env.unwrapped
    assert isinstance(unwrapped, RemoteAttribute)  # an env stays remote
    assert "HalfCheetahEnv" in repr(unwrapped) and "'unwrapped'" in repr(unwrapped)
    assert unwrapped.frame_skip == 5
    assert unwrapped.dt == pytest.approx(0.05)
    # A method comes back as a proxy that calls it remotely.
    assert isinstance(env.get_wrapper_attr, RemoteAttribute)
    assert env.get_wrapper_attr("frame_skip") == 5


def test_call_runs_methods_remotely(external):
    env = external("HalfCheetah-v5")
    local = gym.make("HalfCheetah-v5")
    obs, _ = env.call("reset", seed=11)
    np.testing.assert_array_equal(obs, local.reset(seed=11)[0])
    np.testing.assert_array_equal(env.call("unwrapped.state_vector"),
                                  local.unwrapped.state_vector())
    np.testing.assert_array_equal(env.unwrapped.get_body_com("torso"),
                                  local.unwrapped.get_body_com("torso"))
    counting = external(CountingEnv)
    assert counting.call("double", 21) == 42
    assert counting.call("double", 4, offset=1) == 9


def test_spaces_are_cached_in_the_parent(external):
    env = external("HalfCheetah-v5")
    local = gym.make("HalfCheetah-v5")
    assert env.observation_space == local.observation_space
    assert env.action_space == local.action_space
    assert env.observation_space is env.observation_space
    kill_and_wait(env.pid)
    # No round trip to the (dead) worker is needed for the spaces.
    assert env.observation_space == local.observation_space
    assert env.action_space == local.action_space


def test_workers_do_not_import_torch(external):
    # Workers fork from a server that preloads batchrl.envs.process.shared_memory; torch
    # (seconds to import) must not come with it.
    env = external(CountingEnv)
    assert env.call("imported", "gymnasium") is True
    assert env.call("imported", "torch") is False


def test_labels_name_the_constructor(external):
    assert external(CountingEnv).label == f"{__name__}.CountingEnv"
    assert external(CountingEnv, label="counting").label == "counting"
    with pytest.raises(TypeError, match="needs a callable returning a gymnasium.Env .* got int"):
        ExternalProcess(42)


# -- errors raised in the worker -----------------------------------------------------


def test_step_error_is_raised_with_type_message_and_worker_traceback(external):
    env = external(fails_at(3), label="counting")
    env.reset()
    assert env.step(0)[1] == 1.0
    assert env.step(0)[1] == 2.0
    start = time.monotonic()
    with pytest.raises(EnvRaisedError) as info:
        env.step(0)
    assert time.monotonic() - start < 3.0
    error = info.value
    assert (error.remote_type, error.remote_message) == ("ValueError", "boom at step 3")
    assert error.operation == "step" and error.label == "counting" and error.env_index is None
    assert "Traceback (most recent call last)" in error.remote_traceback
    message = str(error)
    assert message.startswith("counting failed in step(): ValueError: boom at step 3\n")
    assert "Traceback in the env worker:" in message
    assert ", in step\n" in message
    assert raise_site(CountingEnv.step, "raise ValueError") in message
    # The worker survives the error and keeps serving.
    assert env.step(0)[1] == 4.0
    assert env.reset()[1] == {"reset": True}
    assert env.step(0)[1] == 1.0


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "parallel"])
def test_step_error_in_batch_names_the_env_index(external, blocking):
    envs = [external(fails_at(3 if i == 1 else 100), label="counting") for i in range(3)]
    batch = BatchEnv(envs, blocking=blocking)
    batch.reset()
    batch.step([0, 0, 0])
    batch.step([0, 0, 0])
    start = time.monotonic()
    with pytest.raises(EnvRaisedError) as info:
        batch.step([0, 0, 0])
    assert time.monotonic() - start < 3.0
    assert info.value.env_index == 1
    message = str(info.value)
    assert message.startswith("env 1 (counting) failed in step(): ValueError: boom at step 3\n")
    assert "Traceback in the env worker:" in message and ", in step\n" in message
    # Every answer was received: the next step is answered by the right envs.
    obs, rewards, _, _, infos = batch.step([0, 0, 0])
    np.testing.assert_array_equal(rewards, [4.0, 4.0, 4.0])
    assert [info["count"] for info in infos] == [4, 4, 4]


def test_constructor_error_is_raised_with_its_traceback(external):
    env = external(make_broken_env)
    with pytest.raises(EnvRaisedError) as info:
        env.observation_space
    error = info.value
    assert error.operation == "construct"
    assert (error.remote_type, error.remote_message) == ("RuntimeError", "cannot build this env")
    message = str(error)
    assert message.startswith(f"{__name__}.make_broken_env failed in construct(): "
                              "RuntimeError: cannot build this env\n")
    assert "in make_broken_env" in message
    assert raise_site(make_broken_env, "raise RuntimeError") in message


def test_unknown_gymnasium_id_is_raised(external):
    with pytest.raises(EnvRaisedError) as info:
        external("NoSuchEnv-v0").reset()
    assert info.value.remote_type == "NameNotFound"
    assert "NoSuchEnv" in str(info.value) and "construct()" in str(info.value)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "parallel"])
def test_constructor_error_in_batch_names_the_env_index(external, blocking):
    envs = [external("CartPole-v1"), external("CartPole-v1"), external(make_broken_env)]
    with pytest.raises(EnvRaisedError) as info:
        BatchEnv(envs, blocking=blocking)
    assert info.value.env_index == 2
    assert str(info.value).startswith(f"env 2 ({__name__}.make_broken_env) failed in "
                                      "construct(): RuntimeError: cannot build this env")


def test_missing_attributes_are_attribute_errors(external):
    env = external("HalfCheetah-v5")
    assert not hasattr(env, "no_such_attribute")
    assert getattr(env, "no_such_attribute", "default") == "default"
    with pytest.raises(AttributeError) as info:
        env.no_such_attribute
    assert isinstance(info.value, EnvAttributeError) and isinstance(info.value, EnvRaisedError)
    assert info.value.remote_type == "AttributeError"
    assert "'TimeLimit' object has no attribute 'no_such_attribute'" in str(info.value)
    assert "failed in getattr()" in str(info.value)
    assert not hasattr(env.unwrapped, "no_such_attribute")
    assert hasattr(env.unwrapped, "frame_skip")
    with pytest.raises(EnvAttributeError, match="failed in call"):
        env.call("no_such_method")
    assert not hasattr(env, "_private")  # never forwarded
    # A call that raises is an EnvRaisedError, not an AttributeError.
    with pytest.raises(EnvRaisedError) as info:
        env.call("unwrapped.get_body_com", "no_such_body")
    assert not isinstance(info.value, AttributeError)
    assert env.spec.id == "HalfCheetah-v5"  # still serving


# -- crashes and timeouts --------------------------------------------------------------


@pytest.mark.timeout(30)
def test_killed_idle_worker_raises_crashed_error(external):
    env = external("CartPole-v1", label="cartpole")
    env.reset(seed=0)
    pid = env.pid
    kill_and_wait(pid)
    start = time.monotonic()
    with pytest.raises(EnvCrashedError) as info:
        env.step(0)
    assert time.monotonic() - start < 5.0
    assert info.value.exitcode == -signal.SIGKILL and info.value.pid == pid
    assert str(info.value) == (f"cartpole failed in step(): the env worker process (pid {pid}) "
                               f"was killed by signal SIGKILL")
    with pytest.raises(EnvCrashedError, match="SIGKILL"):
        env.reset()
    start = time.monotonic()
    env.close()
    env.close()
    assert time.monotonic() - start < 3.0


@pytest.mark.timeout(30)
def test_worker_killed_during_a_step_raises_crashed_error(external):
    env = external(sleeps_at(1, 60), label="sleepy")
    env.reset()
    env.step_async(0)
    time.sleep(0.3)  # the worker is now inside time.sleep(60)
    start = time.monotonic()
    os.kill(env.pid, signal.SIGKILL)
    with pytest.raises(EnvCrashedError) as info:
        env.step_wait()
    assert time.monotonic() - start < 5.0
    assert info.value.exitcode == -signal.SIGKILL
    assert "sleepy failed in step()" in str(info.value) and "SIGKILL" in str(info.value)
    # No request is left pending: the next call finds the dead worker too.
    with pytest.raises(EnvCrashedError, match=r"sleepy failed in reset\(\).*SIGKILL"):
        env.reset()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "parallel"])
def test_killed_worker_in_batch_names_the_env_index(external, blocking):
    batch = BatchEnv([external("Pendulum-v1") for _ in range(3)], blocking=blocking)
    batch.reset(seed=0)
    batch.step(np.zeros((3, 1), np.float32))
    pid = batch[2].pid
    kill_and_wait(pid)
    start = time.monotonic()
    with pytest.raises(EnvCrashedError) as info:
        batch.step(np.zeros((3, 1), np.float32))
    assert time.monotonic() - start < 5.0
    assert info.value.env_index == 2
    assert str(info.value) == (f"env 2 (Pendulum-v1) failed in step(): the env worker process "
                               f"(pid {pid}) was killed by signal SIGKILL")
    # The live envs answered too: they can still be reset one by one.
    assert batch.reset([0, 1], seed=0).shape == (2, 3)


@pytest.mark.timeout(30)
def test_timeout_raises_and_late_answers_are_dropped(external):
    env = external(sleeps_at(1, 1.0), timeout=0.3, label="slow")
    env.reset()
    start = time.monotonic()
    with pytest.raises(EnvTimeoutError, match=r"slow failed in step\(\): no answer from the env "
                                              r"worker \(pid \d+\) within 0.3 s"):
        env.step(0)  # step 1 takes 1 s
    assert 0.3 <= time.monotonic() - start < 2.5
    env.timeout = 10.0
    # The late answer to step 1 is dropped; each request gets its own answer.
    obs, reward, _, _, info = env.step(0)
    assert reward == 2.0 and info == {"count": 2}
    obs, info = env.reset()
    assert info == {"reset": True}
    assert env.call("double", 3) == 6


def slow_constructor():
    time.sleep(1.0)
    return CountingEnv()


@pytest.mark.timeout(30)
def test_construct_timeout_can_be_waited_out(external):
    env = external(slow_constructor, timeout=0.3, label="slow")
    with pytest.raises(EnvTimeoutError, match=r"slow failed in construct\(\)"):
        env.observation_space
    env.timeout = 10.0
    assert env.observation_space == CountingEnv.observation_space
    assert env.reset()[1] == {"reset": True}


def test_a_returned_observation_is_not_changed_by_later_calls(external):
    env = external(CountingEnv)
    first, _ = env.reset(seed=0)
    observ = env.step(0)[0]
    env.step(0)
    env.reset()
    assert first.tolist() == [0.0] and observ.tolist() == [1.0]


# -- closing ------------------------------------------------------------------------------


def test_close_is_idempotent_and_stops_the_worker(gone):
    env = ExternalProcess("CartPole-v1")
    env.reset(seed=0)
    pid = env.pid
    assert psutil.pid_exists(pid)
    env.close()
    env.close()
    assert env.closed
    assert gone([pid], timeout=3.0) == []
    with pytest.raises(EnvError, match=r"CartPole-v1 failed in step\(\): the env was closed"):
        env.step(0)


def test_a_step_in_flight_at_close_is_not_waited_for(gone):
    env = ExternalProcess("CartPole-v1")
    env.reset(seed=0)
    env.step_async(0)
    env.close()
    assert gone([env.pid], timeout=3.0) == []
    # Not read from the closed connection (whose descriptor a new one may have now).
    with pytest.raises(EnvError, match=r"CartPole-v1 failed in step\(\): the env was closed"):
        env.step_wait()


def test_batch_close_is_idempotent_and_stops_all_workers(gone):
    with BatchEnv([ExternalProcess("CartPole-v1") for _ in range(3)]) as batch:
        batch.reset(seed=0)
        pids = [env.pid for env in batch.envs]
    batch.close()
    assert all(env.closed for env in batch.envs)
    assert gone(pids, timeout=3.0) == []


class CloseRaisesEnv(CountingEnv):
    def close(self):
        self.close_calls = getattr(self, "close_calls", 0) + 1
        raise RuntimeError("the viewer is gone")


def test_an_env_whose_close_raises_leaves_no_other_member_open(external, gone):
    here = [CloseRaisesEnv(), CloseRaisesEnv()]
    worker = external(CountingEnv)
    batch = BatchEnv([*here, worker])
    batch.reset(seed=0)
    with pytest.raises(RuntimeError, match="the viewer is gone"):
        batch.close()
    assert [env.close_calls for env in here] == [1, 1]
    assert worker.closed and gone([worker.pid], timeout=3.0) == []


@pytest.mark.timeout(30)
def test_close_stops_a_worker_busy_in_a_long_step(gone):
    env = ExternalProcess(sleeps_at(1, 60))
    env.reset()
    env.step_async(0)
    time.sleep(0.3)
    start = time.monotonic()
    env.close()
    assert time.monotonic() - start < 8.0
    assert gone([env.pid], timeout=2.0) == []


# -- the parent process dies ------------------------------------------------------------

PARENT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import gymnasium as gym, numpy as np, psutil
    from batchrl.envs import BatchEnv, ExternalProcess

    mode, marker = sys.argv[1], sys.argv[2]

    class SleepyEnv(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)
        def reset(self, *, seed=None, options=None):
            return np.zeros(1, np.float32), {}
        def step(self, action):
            open(marker, "w").close()
            time.sleep(60)
            return np.zeros(1, np.float32), 0.0, False, False, {}

    if mode == "busy":
        envs = [ExternalProcess(SleepyEnv) for _ in range(2)]
    else:
        envs = [ExternalProcess("CartPole-v1") for _ in range(3)]
    batch = BatchEnv(envs)
    batch.reset(seed=0)
    if mode == "busy":
        envs[0].step_async(0)
        while not os.path.exists(marker):
            time.sleep(0.01)
    else:
        batch.step(np.zeros(3, np.int64))
    print(json.dumps({
        "workers": [env.pid for env in envs],
        "descendants": [p.pid for p in psutil.Process().children(recursive=True)],
    }), flush=True)
    if mode == "exit":
        sys.exit(0)
    time.sleep(600)
""")


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    """Start one parent process per scenario at once, so that their start-ups
    (Python, gymnasium, a fork server each) overlap."""
    tmp = tmp_path_factory.mktemp("parents")
    procs = {mode: subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, mode, str(tmp / f"{mode}.marker")],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        for mode in ("exit", "kill", "busy")}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def run_parent(proc: subprocess.Popen, gone, kill: bool) -> None:
    line = proc.stdout.readline()
    assert line, f"the parent process failed (exit code {proc.wait()})"
    pids = json.loads(line)
    workers, descendants = pids["workers"], pids["descendants"]
    try:
        assert len(workers) in (2, 3) and set(workers) <= set(descendants)
        # The fork server and resource tracker are descendants too.
        assert len(descendants) > len(workers)
        if kill:
            assert gone(descendants, timeout=0.0) == descendants  # all running now
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(5) == -signal.SIGKILL
        else:
            assert proc.wait(10) == 0
        assert gone(descendants, timeout=5.0) == []
    finally:
        for pid in gone(descendants, timeout=0.0):
            os.kill(pid, signal.SIGKILL)  # never leave them behind, even on failure


@pytest.mark.timeout(60)
def test_no_worker_remains_after_the_parent_exits(parents, gone):
    run_parent(parents["exit"], gone, kill=False)


@pytest.mark.timeout(60)
def test_no_worker_remains_after_the_parent_is_killed(parents, gone):
    run_parent(parents["kill"], gone, kill=True)


@pytest.mark.timeout(60)
def test_busy_worker_exits_when_the_parent_is_killed(parents, gone):
    run_parent(parents["busy"], gone, kill=True)
