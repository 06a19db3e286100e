"""Several Gymnasium envs in one child process. The parent writes all actions into a
shared memory block and sends a short wake-up; the worker writes the results there and
answers with the info dicts. Nothing on the hot path pickles an array."""

from __future__ import annotations

import contextlib
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
from batchrl.envs.process.channel import Channel, Frames, WorkerHandle, start_worker
from batchrl.envs.spaces import check_space, worker_spaces
from batchrl.envs.worker import Promise, RemoteWorker

_STEP = b"S"
_PICKLE = pickle.HIGHEST_PROTOCOL


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open a block without the resource tracker: the parent owns (and unlinked) it."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    # Else the tracker would report the block as leaked (or unlink it) at our exit.
    from multiprocessing import resource_tracker
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name)
    finally:
        resource_tracker.register = register


def _serve(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the envs, attach the block, serve until ``close`` or EOF."""
    if not start_worker(parent_pid):
        return
    shm = arrays = host = None
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
                frames.send(pickle.dumps(host.step(view, arrays, arrays.autoreset), _PICKLE))
                continue
            command, args = pickle.loads(message)
            if command == "close":
                frames.send(pickle.dumps(("ok", None), _PICKLE))
                break
            try:
                if command == "reset":
                    answer = host.reset(*args, arrays)
                elif command in ("getattr", "call"):
                    answer = getattr(host, command)(*args)
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
            with contextlib.suppress(BufferError):  # a view lives on: unmapped at exit
                shm.close()
        conn.close()


class EnvWorker(WorkerHandle, RemoteWorker):
    """A child process hosting ``len(constructors)`` Gymnasium envs.

    Args:
      constructors: per env, a callable or Gymnasium id as ``ExternalProcess`` takes;
        all envs must have equal spaces.
      label, timeout, construct_timeout: as for ``ExternalProcess`` (default label:
        the first constructor's).
      prefetch_reset: reset an env in the worker as its episode ends: a later seedless
        ``reset()`` is free (off: one with ``options`` sees the env's RNG as in-process).
      infos: send the info dicts to the parent (``False``: empty dicts, no pickling).
      cpu: pin the worker to this core (Linux), against two busy workers on one.

    Follows the ``Worker`` protocol with the errors of ``ExternalProcess``.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 prefetch_reset: bool = True, infos: bool = True, cpu: int | None = None,
                 construct_timeout: float | None = None):
        super().__init__("EnvWorker", constructors, label, prefetch_reset, infos)
        self._options = dict(constructors=self._constructors, label=self.label, infos=infos,
                             cpu=cpu, prefetch_reset=prefetch_reset,
                             construct_timeout=construct_timeout)
        self._channel = Channel(_serve, cloudpickle.dumps((self._calls, prefetch_reset, infos,
                                                           cpu)),
                                self.label, timeout, construct_timeout)
        self._shm: shared_memory.SharedMemory | None = None
        self._arrays: StepArrays | None = None
        self._action_views: dict[np.dtype, np.ndarray] = {}

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
        """Kill this worker; a fresh ``EnvWorker`` with the same constructors and options."""
        self._channel.close(wait=False)
        self.close()  # frees the shared block
        return EnvWorker(timeout=self.timeout, **self._options)

    def __repr__(self) -> str:
        return f"EnvWorker({self.label!r}, num_envs={self.num_envs}, pid={self.pid})"

    def _construct(self) -> tuple[gym.Space, gym.Space]:
        obs_space, act_space = worker_spaces(self.label, self._channel.receive("construct")[1])
        try:
            check_space("observation", obs_space)
            check_space("action", act_space)
        except UnsupportedSpaceError:
            self.close()
            raise
        arrays = StepArrays(self.num_envs, obs_space, act_space)
        shm = shared_memory.SharedMemory(create=True, size=arrays.size)
        try:
            self._channel.send("attach", pickle.dumps(("attach", shm.name), _PICKLE))
            self._channel.receive("attach")
        except EnvError:
            shm.close()
            raise
        finally:
            shm.unlink()  # the worker has it open (or failed): no crash can leak it now
        arrays.attach(shm.buf)
        self._shm, self._arrays = shm, arrays
        return obs_space, act_space

    def _send_step(self, actions: np.ndarray, copy: bool,
                   autoreset: np.ndarray | None) -> Promise:
        self._arrays.autoreset[...] = False if autoreset is None else autoreset
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
