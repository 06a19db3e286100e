"""Several Gymnasium envs in one child process, with arrays in shared memory.

One worker per core beats one process per env when a step is cheap (a
MuJoCo step costs less than a pickled pipe round trip): the parent writes the
actions of all of a worker's envs into a shared-memory block and sends a
two-byte wake-up message; the worker's ``EnvHost`` steps its envs one after
the other, writes observations, rewards and flags into the block and answers
with one small message carrying the info dicts. Nothing on the hot path
pickles an array. Finished envs are reset in the worker within the same
round trip (``EnvHost``'s prefetched reset); turn ``prefetch_reset`` off for
a reset with ``options`` but no seed right after an episode end to see the
env's random generator as an in-process env would.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing import shared_memory
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError, UnsupportedSpaceError
from batchrl.envs.host import ACTION_ITEMSIZE, EnvHost, StepArrays, error_answer
from batchrl.envs.process.channel import Channel, Frames, WorkerHandle, constructor_label, start_worker
from batchrl.envs.spaces import check_space, worker_spaces
from batchrl.envs.worker import Promise, RemoteWorker, check_constructors

_STEP = b"S"
_PICKLE = pickle.HIGHEST_PROTOCOL


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open an existing block without registering it with the resource
    tracker: the parent owns (and has already unlinked) it."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    # Before 3.13, opening a block always registers it, and the tracker would
    # report it as leaked (or unlink it) when it outlives this process.
    from multiprocessing import resource_tracker
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name)
    finally:
        resource_tracker.register = register


def _serve(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the envs, attach the shared block, then
    serve requests until told to close or until the parent goes away."""
    if not start_worker(parent_pid):
        return
    shm = None
    arrays = None
    host = None
    try:
        constructors, prefetch_reset, send_infos, cpu = cloudpickle.loads(payload)
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {cpu})
        host = EnvHost(prefetch_reset, send_infos)
        answer = host.build(constructors)
        conn.send(answer)
        if answer[0] != "ok":
            return
        command, name = conn.recv()
        if command != "attach":
            return  # the parent gave up (spaces it rejects, or close)
        shm = _attach_untracked(name)
        env = host.envs[0]
        arrays = StepArrays(len(host.envs), env.observation_space, env.action_space, shm.buf)
        conn.send(("ok", None))
        actions: dict[bytes, np.ndarray] = {}  # views of the action block, by dtype
        frames = Frames(conn)
        while True:
            try:
                message = frames.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if message[:1] == _STEP:
                view = actions.get(message)
                if view is None:
                    view = actions[message] = arrays.actions(np.dtype(message[1:].decode()))
                frames.send(pickle.dumps(host.step(view, arrays), _PICKLE))
                continue
            command, args = pickle.loads(message)
            if command == "close":
                frames.send(pickle.dumps(("ok", None), _PICKLE))
                break
            try:
                if command == "reset":
                    answer = host.reset(*args, arrays)
                elif command == "getattr":
                    answer = host.getattr(*args)
                elif command == "call":
                    answer = host.call(*args)
                else:
                    answer = error_answer(ValueError(f"unknown command {command!r}"))
                frames.send(pickle.dumps(answer, _PICKLE))
            except (BrokenPipeError, ConnectionError):
                break
    except (EOFError, OSError):
        pass  # the parent went away during start-up
    finally:
        if host is not None:
            host.close()
        if shm is not None:
            if arrays is not None:
                arrays.detach()
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        conn.close()


class EnvWorker(WorkerHandle, RemoteWorker):
    """A child process hosting ``len(constructors)`` Gymnasium envs.

    Args:
      constructors: one callable per env returning a ``gymnasium.Env``
        (shipped with cloudpickle, so lambdas and closures work), or
        Gymnasium id strings. All envs must have equal spaces.
      label: name used in error messages (default: the first constructor's).
      timeout: seconds to wait for any answer before raising
        ``EnvTimeoutError``; ``None`` waits as long as the worker is alive.
      prefetch_reset: reset an env in the worker as soon as its episode
        ends, so that a later ``reset()`` without seed costs no round trip.
      infos: send the info dicts of ``step`` and ``reset`` to the parent;
        with ``False`` they are empty dicts (pickling MuJoCo's infos costs
        about 5 µs per env step).
      construct_timeout: the limit for building the envs instead of
        ``timeout`` (``None``: ``timeout``).
      cpu: pin the worker to this core (Linux). With one worker per core
        this keeps the scheduler from stacking two busy workers on one core
        for a whole step, which costs up to 20% of the step rate on small
        machines.

    ``step``, ``reset``, ``env(i)`` and ``restart`` follow the ``Worker``
    protocol (``batchrl.envs.worker``). Errors are those of
    ``ExternalProcess``; an ``EnvError`` from one env carries its local index
    in ``worker_env_index``.

    ``BatchEnv`` combines workers: ``BatchEnv([EnvWorker(...), ...])``.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 prefetch_reset: bool = True, infos: bool = True, cpu: int | None = None,
                 construct_timeout: float | None = None):
        constructors = check_constructors("EnvWorker", constructors)
        super().__init__()
        self.label = label or constructor_label(constructors[0])
        self.num_envs = len(constructors)
        self.prefetch_reset = prefetch_reset
        self.infos = infos
        calls = [_make_by_id(c) if isinstance(c, str) else c for c in constructors]
        self._options = (constructors, self.label, prefetch_reset, infos, cpu,
                         construct_timeout)
        self._channel = Channel(_serve, cloudpickle.dumps((calls, prefetch_reset, infos, cpu)),
                                self.label, timeout, construct_timeout)
        self._shm: shared_memory.SharedMemory | None = None
        self._arrays: StepArrays | None = None
        self._action_views: dict[np.dtype, np.ndarray] = {}

    # -- life cycle --------------------------------------------------------

    def close(self) -> None:
        """Stop the worker process and free the shared block. Idempotent."""
        super().close()
        if self._arrays is not None:
            self._arrays.detach()
            self._arrays = None
            self._action_views.clear()
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def restart(self) -> "EnvWorker":
        """Close this worker (killing it if it hangs) and return a fresh
        ``EnvWorker`` with the same constructors and options."""
        self._discard()
        self.close()  # frees the shared block
        constructors, label, prefetch_reset, infos, cpu, construct_timeout = self._options
        return EnvWorker(constructors, label, self.timeout, prefetch_reset, infos, cpu,
                         construct_timeout)

    def __repr__(self) -> str:
        return f"EnvWorker({self.label!r}, num_envs={self.num_envs}, pid={self.pid})"

    # -- transport ------------------------------------------------------------

    def _construct(self) -> tuple[gym.Space, gym.Space]:
        channel = self._channel
        _, spaces = channel.receive("construct")
        obs_space, act_space = worker_spaces(self.label, spaces)
        try:
            check_space("observation", obs_space)
            check_space("action", act_space)
        except UnsupportedSpaceError:
            self.close()
            raise
        arrays = StepArrays(self.num_envs, obs_space, act_space)
        shm = shared_memory.SharedMemory(create=True, size=arrays.size)
        try:
            channel.send("attach", pickle.dumps(("attach", shm.name), _PICKLE))
            channel.receive("attach")
        except EnvError:
            shm.close()
            raise
        finally:
            # Once the worker has it open the name is not needed: unlinking
            # now means no crash of either process can leak the block.
            shm.unlink()
        arrays.attach(shm.buf)
        self._shm, self._arrays = shm, arrays
        return obs_space, act_space

    def _send_step(self, actions: np.ndarray, copy: bool) -> Promise:
        if actions.dtype.itemsize > ACTION_ITEMSIZE:
            actions = actions.astype(np.float64)
        view = self._action_views.get(actions.dtype)
        if view is None:
            view = self._action_views[actions.dtype] = self._arrays.actions(actions.dtype)
        view[...] = actions
        self._channel.send("step", _STEP + actions.dtype.str.encode())

        def result() -> tuple:
            _, (infos, resets) = self._channel.receive("step")
            arrays = self._arrays
            observ = (arrays.observ, arrays.reward, arrays.terminated, arrays.truncated)
            if copy:
                observ = tuple(array.copy() for array in observ)
            resets = [(index, arrays.reset_observ[index].copy(), info)
                      for index, info in resets]
            return (*observ, infos, resets)

        return result

    def _send_reset(self, indices: list[int], seeds: list, options: dict | None) -> Promise:
        self._channel.send("reset", pickle.dumps(("reset", (indices, seeds, options)), _PICKLE))

        def result() -> tuple[np.ndarray, list[dict]]:
            _, infos = self._channel.receive("reset")
            return self._arrays.reset_observ[indices], infos

        return result

    def _ask(self, command: str, args: tuple) -> tuple[str, Any]:
        self._channel.send(command, cloudpickle.dumps((command, args)))
        return self._channel.receive(command)


def _make_by_id(env_id: str) -> Callable[[], gym.Env]:
    return lambda: gym.make(env_id)
