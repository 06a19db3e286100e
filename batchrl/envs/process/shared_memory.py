"""Several Gymnasium envs in one child process. The parent writes all actions into a
shared memory block and sends a short wake-up; the worker writes the results there and
answers with the info dicts. Nothing on the hot path pickles an array. ``_serve`` is the
child of every process transport (``ExternalProcess`` runs an ``EnvWorker`` of one env)."""

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
from batchrl.envs.process.channel import Channel, Frames, WorkerHandle
from batchrl.interrupt import end_own_group, start_worker
from batchrl.envs.spaces import check_space, worker_spaces
from batchrl.envs.worker import RemoteWorker
from batchrl.nested import copy_nested, take

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


def _create_block(size: int) -> shared_memory.SharedMemory:
    """A new block of ``size`` bytes whose pages are reserved now: tmpfs reserves none when
    the block is sized, so where /dev/shm is nearly full the first process to write a page
    there is killed by SIGBUS. Raises the ``OSError`` (``ENOSPC``) instead."""
    shm = shared_memory.SharedMemory(create=True, size=size)
    if hasattr(os, "posix_fallocate"):  # (Linux; the block's descriptor is the stdlib's own)
        try:
            os.posix_fallocate(shm._fd, 0, size)
        except OSError:
            shm.close()
            shm.unlink()
            raise
    return shm


def _pickled(answer: tuple) -> bytes:
    """``answer`` pickled, or the error of a value in it that cannot be (an info, what a
    ``call`` returned): that is the env's error, not the worker's end."""
    try:
        return pickle.dumps(answer, _PICKLE)
    except Exception as exc:
        return pickle.dumps(error_answer(exc), _PICKLE)


def _serve(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the envs, attach the block, serve until ``close`` or EOF.
    It leads a process group, so that what its envs start dies with it (``kill_group``)."""
    try:
        if not start_worker(parent_pid, own_group=True):
            return
    except RuntimeError as exc:  # (its watchdog thread: none left under the process limit)
        with contextlib.suppress(OSError):  # (the parent went away meanwhile)
            conn.send(error_answer(RuntimeError(
                f"the worker process cannot start a thread ({exc}): is the limit on processes "
                f"and threads reached (ulimit -u, a container's pids.max)?")))
        return
    # Forked from one fork server, every worker (a restarted one too) would start from its
    # NumPy global state: envs that draw from np.random would repeat each other's draws.
    # (Python's random module reseeds itself after a fork.)
    np.random.seed()
    shm = arrays = host = None
    orphaned = False  # the parent went away without asking this worker to close
    try:
        try:
            constructors, prefetch_reset, send_infos, cpu = cloudpickle.loads(payload)
        except Exception as exc:  # (constructors this process cannot rebuild)
            conn.send(error_answer(exc))
            return
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError as exc:  # (a core this process may not use: the caller's error)
                conn.send(error_answer(OSError(f"cannot pin the worker to cpu {cpu}: {exc}")))
                return
        host = EnvHost(prefetch_reset, send_infos)
        answer = host.build(constructors)
        try:  # (by value: spaces of classes the main script defines too)
            conn.send_bytes(cloudpickle.dumps(answer))
        except Exception as exc:
            answer = error_answer(exc)
            conn.send(answer)
        if answer[0] != "ok":
            return
        command, name = conn.recv()
        if command != "attach":
            return  # the parent gave up (spaces it rejects, or close)
        # No block (name None) for spaces it cannot hold: the answers carry the arrays.
        shm = None if name is None else _attach_untracked(name)
        env = host.envs[0]
        arrays = StepArrays(len(host.envs), env.observation_space, env.action_space,
                            None if shm is None else shm.buf)
        conn.send(("ok", None))
        actions: dict[bytes, np.ndarray] = {}  # views of the action block, by dtype
        frames = Frames(conn)
        while True:
            try:
                message = frames.recv()
            except (EOFError, OSError):
                orphaned = True  # the parent is gone
                break
            if message[:1] == _STEP:
                view = actions.get(message)
                if view is None:
                    view = actions[message] = arrays.actions(np.dtype(message[1:].decode()))
                frames.send(_pickled(host.step(view, arrays, arrays.autoreset)))
                continue
            command, args = pickle.loads(message)
            if command == "close":
                frames.send(pickle.dumps(("ok", None), _PICKLE))
                break
            try:
                if command == "reset":
                    answer = arrays.carry(host.reset(*args, arrays))
                elif command == "step":  # arrays not shared: the actions came pickled
                    actions, autoreset = args
                    answer = arrays.carry(host.step(actions, arrays, autoreset))
                elif command in ("getattr", "call"):
                    answer = getattr(host, command)(*args)
                else:
                    answer = error_answer(ValueError(f"unknown command {command!r}"))
                frames.send(_pickled(answer))
            except (BrokenPipeError, ConnectionError):
                orphaned = True
                break
    except (EOFError, OSError):
        orphaned = True  # the parent went away during start-up
    finally:
        try:
            if host is not None:
                host.close()
            if shm is not None:
                if arrays is not None:
                    arrays.detach()
                with contextlib.suppress(BufferError):  # a view lives on: unmapped at exit
                    shm.close()
            conn.close()
        finally:
            if orphaned:  # (no parent to end what the envs started: the fork server may
                end_own_group()  # have reaped this worker before it learnt of the death)


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
      any_space: accept spaces a batch cannot hold (Dict, Tuple, Text...; else
        ``UnsupportedSpaceError``): their arrays travel pickled in the requests and answers
        (``StepArrays.carry``), as ``ExternalProcess`` needs.

    Follows the ``Worker`` protocol with the errors of ``ExternalProcess``.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 prefetch_reset: bool = True, infos: bool = True, cpu: int | None = None,
                 construct_timeout: float | None = None, any_space: bool = False):
        super().__init__("EnvWorker", constructors, label, prefetch_reset, infos)
        self.any_space = any_space
        self._options = dict(constructors=self._constructors, label=self.label, infos=infos,
                             cpu=cpu, prefetch_reset=prefetch_reset,
                             construct_timeout=construct_timeout, any_space=any_space)
        self._channel = Channel(_serve, cloudpickle.dumps((self._calls, prefetch_reset, infos,
                                                           cpu)),
                                self.label, timeout, construct_timeout)
        self._shm: shared_memory.SharedMemory | None = None
        self._arrays: StepArrays | None = None
        self._shared = True  # set by _construct
        self._action_views: dict[np.dtype, np.ndarray] = {}

    def close(self, wait: bool = True) -> None:
        """Stop the worker process (``wait=False``: kill it at once, as one that failed
        may hang) and free the shared block. Idempotent."""
        super().close(wait)
        if self._arrays is not None:
            self._arrays.detach()
            self._arrays = None
            self._action_views.clear()
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def restart(self) -> "EnvWorker":
        """Kill this worker; a fresh ``EnvWorker`` with the same constructors and options."""
        self.close(wait=False)
        return EnvWorker(timeout=self.timeout, **self._options)

    def __repr__(self) -> str:
        return f"EnvWorker({self.label!r}, num_envs={self.num_envs}, pid={self.pid})"

    @property
    def shares_arrays(self) -> bool:
        """Whether the step arrays live in shared memory (else, with ``any_space``,
        they travel pickled)."""
        self._ready()
        return self._shared

    def _attach(self, name: str | None) -> None:
        """Give the worker the shared memory ``name`` (``None``: none). A failure here, a
        timeout or an interrupt too, is final: the construction's answer is used up, so the
        worker is stopped and later calls raise the error again."""
        try:
            self._channel.send("attach", pickle.dumps(("attach", name), _PICKLE))
            self._channel.receive("attach")
        except BaseException as exc:
            self._construct_error = exc if isinstance(exc, EnvError) else EnvError(
                self.label, "attach", f"interrupted ({type(exc).__name__}) while the worker "
                f"attached its shared memory")
            self.close()
            raise

    def _construct(self) -> tuple[gym.Space, gym.Space]:
        obs_space, act_space = worker_spaces(self.label, self._channel.receive("construct")[1])
        if not self.any_space:
            try:
                check_space("observation", obs_space)
                check_space("action", act_space)
            except UnsupportedSpaceError:
                self.close()
                raise
        arrays = StepArrays(self.num_envs, obs_space, act_space)
        self._shared = arrays.shared
        if not arrays.shared:
            self._attach(None)
            self._arrays = arrays
            return obs_space, act_space
        try:
            shm = _create_block(arrays.size)
        except OSError as exc:
            self.close()
            raise EnvError(self.label, "construct", f"cannot get {arrays.size:,} bytes of "
                           f"shared memory for its worker's arrays ({exc.strerror or exc}); "
                           f"free space in /dev/shm (df -h /dev/shm) or set "
                           f"env.backend = 'inline'") from None
        try:
            self._attach(shm.name)
        except BaseException:
            shm.close()
            raise
        finally:
            shm.unlink()  # the worker has it open (or failed): no crash can leak it now
        arrays.attach(shm.buf)
        self._shm, self._arrays = shm, arrays
        return obs_space, act_space

    def _send_step(self, actions: np.ndarray, autoreset: np.ndarray | None) -> None:
        if self._channel.pending is not None:  # before the writes: they would change its actions
            raise self._channel.busy("step")
        arrays = self._arrays
        if not arrays.shared:
            self._channel.send("step", pickle.dumps(("step", (actions, autoreset)), _PICKLE))
            return
        arrays.autoreset[...] = False if autoreset is None else autoreset
        if actions.dtype.itemsize > ACTION_ITEMSIZE:
            actions = actions.astype(np.float64)
        view = self._action_views.get(actions.dtype)
        if view is None:
            view = self._action_views[actions.dtype] = arrays.actions(actions.dtype)
        view[...] = actions
        self._channel.send("step", _STEP + actions.dtype.str.encode())

    def _receive_step(self, copy: bool) -> tuple:
        arrays = self._arrays
        answer = self._channel.receive("step")[1]
        if not arrays.shared:
            answer = arrays.take(answer)  # fresh arrays: no copy needed
            copy = False
        infos, resets = answer
        observ = (arrays.observ, arrays.reward, arrays.terminated, arrays.truncated)
        if copy:
            observ = tuple(copy_nested(value) for value in observ)
        first = arrays.reset_observ
        resets = [(index, copy_nested(take(first, index)) if arrays.shared else first[index],
                   info) for index, info in resets]
        return (*observ, infos, resets)

    def _send_reset(self, indices: list[int], seeds: list, options: dict | None) -> None:
        self._channel.send("reset", pickle.dumps(("reset", (indices, seeds, options)), _PICKLE))

    def _receive_reset(self, indices: list[int]) -> tuple[np.ndarray, list[dict]]:
        infos = self._arrays.take(self._channel.receive("reset")[1])
        return take(self._arrays.reset_observ, indices), infos

    def _ask(self, command: str, args: tuple) -> tuple[str, Any]:
        self._channel.send(command, cloudpickle.dumps((command, args)))
        return self._channel.receive(command)
