"""Helpers shared by the tests: envs with scripted faults, rollouts compared
across transports, and checks on real processes.

Env classes and constructors defined here reach worker processes and Ray
actors by value (cloudpickle), so that they need not be importable there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import cloudpickle
import gymnasium as gym
import numpy as np
import psutil
import torch

from batchrl.algos import Algorithm
from batchrl.envs import BatchEnv, InfoList

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEED = 123


@contextlib.contextmanager
def ray_pickles_by_value(module_name: str) -> Iterator[None]:
    """Within: Ray ships the functions of test module ``module_name`` by value (its own
    cloudpickle, with which Ray's workers unpickle collectors' and learners' callables; they
    cannot import tests/)."""
    from ray import cloudpickle as ray_cloudpickle

    module = sys.modules[module_name]
    ray_cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        ray_cloudpickle.unregister_pickle_by_value(module)
NUM_STEPS = 200
make_cartpole = functools.partial(gym.make, "CartPole-v1")
make_cheetah = functools.partial(gym.make, "HalfCheetah-v5", max_episode_steps=30)


class CountingEnv(gym.Env):
    """Observation and reward are the number of steps since the last reset.

    Raises ``ValueError("boom at step N")`` in step ``fail_at`` and sleeps
    ``sleep`` seconds in step ``sleep_at``.
    """

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, fail_at=None, sleep_at=None, sleep=0.0):
        self.fail_at = fail_at
        self.sleep_at = sleep_at
        self.sleep = sleep
        self.count = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return np.zeros(1, np.float32), {"reset": True}

    def step(self, action):
        self.count += 1
        if self.count == self.fail_at:
            raise ValueError(f"boom at step {self.count}")
        if self.count == self.sleep_at:
            time.sleep(self.sleep)
        return (np.array([self.count], np.float32), float(self.count), False, False,
                {"count": self.count})

    def double(self, x, offset=0):
        return 2 * x + offset


def fails_at(step):
    return lambda: CountingEnv(fail_at=step)


def sleeps_at(step, seconds):
    return lambda: CountingEnv(sleep_at=step, sleep=seconds)


def raise_site(function, statement: str) -> str:
    """How a traceback names the line of ``function`` holding ``statement``.

    Returns ``"line N, in name"``. cloudpickle ships code defined in a test
    module by value under a placeholder file name (``<dynamic-code>`` since
    cloudpickle 3.1.3), so a worker's traceback may not quote the source line;
    the line number and the function name are there with any version.
    """
    lines, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if statement in line)
    return f"line {first + offset}, in {function.__name__}"


def kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)


def rollout(batch: BatchEnv, dtype) -> list[tuple]:
    """Seeded reset, then NUM_STEPS steps with seeded random actions. Finished
    envs are reset without a seed (answered by the prefetched reset in a
    worker); now and then one more env is reset mid-episode (a real reset in
    the worker, possibly in the same request as prefetched ones), some resets
    are repeated at once, and some finished envs are reset with a seed."""
    rng = np.random.default_rng(0)
    n = len(batch)
    space = batch.action_space
    log = [("reset", list(range(n)), batch.reset(seed=SEED))]
    for t in range(NUM_STEPS):
        if isinstance(space, gym.spaces.Discrete):
            actions = rng.integers(0, space.n, size=n)
        else:
            actions = rng.uniform(-1.0, 1.0, size=(n, *space.shape)).astype(dtype)
        obs, rewards, terminated, truncated, infos = batch.step(actions)
        assert isinstance(infos, InfoList) and len(infos) == n
        log.append(("step", obs, rewards, terminated, truncated, list(infos)))
        indices = np.flatnonzero(terminated | truncated).tolist()
        if t % 9 == 4 and (t // 9) % n not in indices:
            indices.append((t // 9) % n)
        if not indices:
            continue
        if t % 50 == 25:
            log.append(("seeded reset", indices, batch.reset(indices, seed=1000 + t)))
        else:
            log.append(("reset", indices, batch.reset(indices)))
        if t % 4 == 0:
            log.append(("reset again", indices, batch.reset(indices)))
    return log


class Sequential:
    """The reference of every batch env: plain Gymnasium envs in this process, stepped one
    after the other and batched as ``BatchEnv`` documents it (env ``i`` of a seeded reset
    gets ``seed + i``; Dict and Tuple observations as Gymnasium's vector envs batch them).
    None of batchrl's env code runs in it."""

    def __init__(self, envs: list[gym.Env]):
        self.envs = envs
        self.observation_space = envs[0].observation_space
        self.action_space = envs[0].action_space

    def __len__(self) -> int:
        return len(self.envs)

    def _batch(self, observations: list) -> Any:
        if isinstance(self.observation_space, (gym.spaces.Dict, gym.spaces.Tuple)):
            out = gym.vector.utils.create_empty_array(self.observation_space, len(observations))
            return gym.vector.utils.concatenate(self.observation_space, observations, out)
        return np.stack(observations)

    def reset(self, indices=None, seed=None):
        indices = range(len(self.envs)) if indices is None else indices
        return self._batch([self.envs[i].reset(seed=None if seed is None else seed + i)[0]
                            for i in indices])

    def step(self, actions, autoreset=None):
        results = [env.reset()[:1] + (0.0, False, False, {"reset": True})
                   if autoreset is not None and autoreset[i] else env.step(action)
                   for i, (env, action) in enumerate(zip(self.envs, actions))]
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (self._batch(list(obs)), np.asarray(rewards, np.float64),
                np.asarray(terminated, bool), np.asarray(truncated, bool),
                InfoList([(len(infos), list(infos))]))

    def close(self) -> None:
        for env in self.envs:
            env.close()


def assert_same_log(got: list[tuple], expected: list[tuple]) -> None:
    assert len(got) == len(expected)
    for entry, (g, e) in enumerate(zip(got, expected)):
        assert g[0] == e[0], f"entry {entry}"
        for g_item, e_item in zip(g[1:], e[1:]):
            if isinstance(e_item, list):
                assert g_item == e_item, f"entry {entry} ({e[0]})"
            else:  # arrays, or dicts and tuples of them (dtypes and shapes included)
                assert_same_value(g_item, e_item, f"entry {entry} ({e[0]})")


# -- processes ------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "train.py"


def sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def gloo_threads() -> list[str]:
    """The names of this process's threads that a gloo process group or a
    ``torch.distributed`` store runs (Linux names them in /proc)."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # (a thread that just ended)
            names.append(Path(f"/proc/self/task/{thread}/comm").read_text().strip())
    return [name for name in names if "gloo" in name or "tcpstore" in name]


def gloo_threads_left(timeout: float = 10.0) -> list[str]:
    """``gloo_threads()`` once there are none, or after ``timeout`` seconds: a store's thread
    may end a moment after its process group was destroyed."""
    deadline = time.monotonic() + timeout
    while (left := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def in_session(session: int) -> list[int]:
    """The pids of the processes of session ``session`` (``start_new_session=True`` makes a
    child's pid its session's id): its descendants even after it was reaped, when their
    parent is init."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                members.append(process.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return members


def running(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still run (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_gone(pids: list[int], timeout: float) -> list[str]:
    """Wait until none of ``pids`` runs; the command lines of those still running."""
    deadline = time.monotonic() + timeout
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = []
    for pid in running(pids):
        try:
            left.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
            os.kill(pid, signal.SIGKILL)  # never leave them behind
        except (psutil.Error, ProcessLookupError):
            pass
    return left


def scalar_events(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's view of the run: (step, value) per scalar tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


# -- Gymnasium vector envs ------------------------------------------------

def assert_same_value(got, expected, where: str = "") -> None:
    """``got`` equals ``expected`` down to array dtypes and shapes (tuples, dicts
    of arrays with ``_key`` masks, object arrays of observations)."""
    if isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for index, (g, e) in enumerate(zip(got, expected)):
            assert_same_value(g, e, f"{where}[{index}]")
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), \
            f"{where}: keys {sorted(got)} != {sorted(expected)}"
        for key in expected:
            assert_same_value(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__}"
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), \
            f"{where}: {got.dtype} {got.shape} != {expected.dtype} {expected.shape}"
        if expected.dtype == object:
            for index, (g, e) in enumerate(zip(got, expected)):
                assert_same_value(g, e, f"{where}[{index}]")
        else:
            np.testing.assert_array_equal(got, expected, err_msg=where)
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: {got!r} != {expected!r}"


def assert_same_vector_steps(env, reference, seed: int, steps: int) -> None:
    """``env`` and ``reference`` (Gymnasium vector envs) return the same for a
    seeded reset and ``steps`` steps of the same random actions."""
    assert_same_value(env.reset(seed=seed), reference.reset(seed=seed), "reset")
    reference.action_space.seed(seed)
    for t in range(steps):
        actions = reference.action_space.sample()
        assert_same_value(env.step(actions), reference.step(actions), f"step {t}")


# -- videos ---------------------------------------------------------------

class PushedForward(gym.Wrapper):
    """Moves the model's root ``push`` metres along x before every step, so that even
    an untrained policy travels far (for camera tests)."""

    def __init__(self, env: gym.Env, push: float):
        super().__init__(env)
        self.push = push

    def step(self, action):
        self.unwrapped.data.qpos[0] += self.push
        return self.env.step(action)


def make_pushed_cheetah(push: float = 0.25, **kwargs) -> gym.Env:
    """HalfCheetah-v5 pushed forward ``push`` metres per step (``helpers:make_pushed_cheetah``)."""
    return PushedForward(gym.make("HalfCheetah-v5", **kwargs), push)


def agent_pixels(frame: np.ndarray) -> int:
    """Pixels of HalfCheetah's body in an RGB frame: its tan and pink geoms, against a
    grey floor and sky (their red channel well above the blue one)."""
    rgb = frame[..., :3].astype(np.int32)
    return int(((rgb[..., 0] - rgb[..., 2] > 40) & (rgb[..., 0] > 90)).sum())


def run_script(path: Path, source: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Write ``source`` to ``path`` and run it as a main script (workers import it again as
    ``__mp_main__``), with this checkout's batchrl; its output as text."""
    path.write_text(source)
    return subprocess.run([sys.executable, str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def run_stdin_script(source: str, *args: str, timeout: float = 120
                     ) -> subprocess.CompletedProcess:
    """``source`` run as ``python - ARGS`` (a main script without a file, which child
    processes cannot import again), with this checkout's batchrl; its output as text."""
    return subprocess.run([sys.executable, "-", *args], input=source, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def mount_namespace() -> list[str]:
    """The command prefix that runs a command in a mount namespace of its own (where a test
    may mount a small or read-only tmpfs); skips the test where none can be made (not root,
    no ``unshare``)."""
    import pytest
    prefix = ["unshare", "--mount", "--propagation", "private"]
    try:
        made = subprocess.run([*prefix, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        made = False
    if not made:
        pytest.skip("needs a mount namespace of its own (root, unshare)")
    return prefix


# A script's start (for ``run_stdin_script``): limit_tasks() joins the pids cgroup argv[1],
# with room for argv[2] more processes and threads than this process has.
LIMIT_TASKS = """
import os, sys

def limit_tasks():
    group, room = sys.argv[1], int(sys.argv[2])
    with open(os.path.join(group, "cgroup.procs"), "w") as file:
        file.write(str(os.getpid()))
    with open(os.path.join(group, "pids.current")) as file:
        tasks = int(file.read())
    with open(os.path.join(group, "pids.max"), "w") as file:
        file.write(str(tasks + room))
"""

@contextlib.contextmanager
def pids_cgroup() -> Iterator[Path]:
    """A new cgroup of the ``pids`` controller (v1, or v2 where the root lends it), removed
    after: a process that writes its pid to ``cgroup.procs`` there and a number to
    ``pids.max`` can start only so many processes and threads. Skips the test where none can
    be made (not root, no such controller)."""
    import pytest
    root = Path("/sys/fs/cgroup/pids")
    if not root.is_dir():
        root = Path("/sys/fs/cgroup")
        controls = root / "cgroup.subtree_control"
        if not (controls.exists() and "pids" in controls.read_text().split()):
            pytest.skip("needs the cgroup pids controller")
    group = root / f"batchrl-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup ({exc})")
    try:
        yield group
    finally:
        deadline = time.monotonic() + 30
        while True:  # (empty once the processes that joined it are gone)
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def start_train_py(*args: str, cwd: Path = REPO, hangup: Any = signal.SIG_DFL
                   ) -> subprocess.Popen:
    """train.py in its own process group (so that a signal to the group
    reaches it and its children as Ctrl-C in a terminal would), with SIGHUP's
    action ``hangup`` (``SIG_IGN``: as under nohup; by default as from a terminal,
    whatever this process does with it)."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(TRAIN_PY), *args, "--no-progress"],
                            cwd=cwd, env=environ, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"train.py did not exit within {timeout} s:\n{stdout}\n{stderr}")
    return process.returncode, stdout, stderr


def assert_same(a: object, b: object, path: str = "state") -> None:
    """``a`` and ``b`` are equal nested dicts/lists of tensors, arrays and scalars."""
    import torch  # (only for the tests that compare states)
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    else:
        assert a == b, path


def seeded_tensor_env(name: str, num_envs: int, seed: int):
    """A ``TensorBatchEnv`` of ``num_envs`` wrapped ``gym.make(name)`` envs stepped in this
    process, env ``i``'s RNG seeded ``seed + i`` (``simulate``'s later unseeded resets go on
    from those generators)."""
    from batchrl.tensor_env import TensorBatchEnv
    from batchrl.envs import wrap_env
    env = TensorBatchEnv(BatchEnv([wrap_env(gym.make(name)) for _ in range(num_envs)]))
    env.reset(seed=seed)
    return env


def assert_continues_alike(algo, twin) -> None:
    """``twin`` (loaded from ``algo``'s state) takes the same gradient step as ``algo`` from the
    same random state, to the same state bit for bit (off-policy algorithms)."""
    import torch

    twin.load_state_dict(copy.deepcopy(algo.state_dict()))
    rng = torch.get_rng_state()
    algo.gradient_step()
    torch.set_rng_state(rng)
    twin.gradient_step()
    assert_same(algo.state_dict(), twin.state_dict(), "state")


def interrupting_after(count: int) -> tuple[Callable[[], None], list[int]]:
    """An ``interrupt_check`` for an algorithm that raises ``Interrupted(SIGINT)`` at its call
    after ``count`` (as the trainer's does once Ctrl-C came), and the list of its calls."""
    from batchrl.interrupt import Interrupted
    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        if len(calls) > count:
            raise Interrupted(signal.SIGINT)

    return check, calls


class Minimal(Algorithm):
    """Only the abstract methods: every optional attribute left at its default."""

    def begin_episodes(self, agent_indices):
        return {}

    def perform(self, agent_indices, observ):
        return torch.zeros(len(agent_indices), dtype=torch.int64), {}

    def experience(self, *args):
        return {}

    def end_episodes(self, agent_indices):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
