"""Several Gymnasium envs in one child process, with arrays in shared memory.

One worker per core beats one process per env when a step is cheap (a
HalfCheetah step takes ~60 µs, less than a pickled pipe round trip): the
parent writes the actions of all of a worker's envs into a shared-memory
block and sends a two-byte wake-up message; the worker steps its envs one
after the other, writes observations, rewards and flags into the block and
answers with one small message carrying the info dicts. Nothing on the hot
path pickles an array.

A worker also resets an env as soon as its episode ends, inside the same
round trip ("prefetched reset"). ``reset()`` of that env without a seed or
options then answers from the block at once. The env went through exactly the
calls it would have seen otherwise (step, then reset with no seed), so
trajectories are the same, and a reset with a seed re-seeds as usual. Two
cases differ from an in-process env: a ``step()`` of a finished env without a
reset in between (Gymnasium forbids that anyway), and a reset with
``options`` but no seed right after an episode end, which comes after the
prefetched reset has drawn from the env's random generator. Turn
``prefetch_reset`` off where that matters.
"""

from __future__ import annotations

import collections.abc
import copyreg
import functools
import io
import math
import os
import pickle
import sys
from multiprocessing import shared_memory
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError, EnvTimeoutError, UnsupportedSpaceError
from batchrl.envs.process import (Channel, Frames, LazySpaces, WorkerHandle, answer_attribute, constructor_label, error_message,
                                  resolve, start_worker)
from batchrl.envs.spaces import check_space, worker_spaces

_STEP = b"S"
_PICKLE = pickle.HIGHEST_PROTOCOL
# Actions travel in the dtype the caller gave (so a float32 batch reaches the
# env as float32, exactly as with in-process envs); this many bytes per value
# are reserved for them.
_ACTION_ITEMSIZE = 8


class _Block:
    """The shared arrays of one worker with ``num_envs`` envs.

    ``observ`` and ``reset_observ`` are ``(num_envs, *obs_shape)`` in the
    observation space's dtype, ``reward`` ``(num_envs,)`` float64,
    ``terminated``/``truncated`` ``(num_envs,)`` bool; ``action_bytes`` is raw
    storage that ``actions(dtype)`` views as ``(num_envs, *act_shape)``.
    """

    def __init__(self, num_envs: int, obs_space: gym.Space, act_space: gym.Space, buffer=None):
        obs_shape = (num_envs, *obs_space.shape)
        self._act_shape = (num_envs, *act_space.shape)
        fields = [("observ", obs_shape, obs_space.dtype),
                  ("reset_observ", obs_shape, obs_space.dtype),
                  ("action_bytes", (math.prod(self._act_shape) * _ACTION_ITEMSIZE,), np.uint8),
                  ("reward", (num_envs,), np.float64),
                  ("terminated", (num_envs,), np.bool_),
                  ("truncated", (num_envs,), np.bool_)]
        offset = 0
        layout = []
        for name, shape, dtype in fields:
            offset = -(-offset // 64) * 64  # cache-line aligned
            layout.append((name, shape, np.dtype(dtype), offset))
            offset += math.prod(shape) * np.dtype(dtype).itemsize
        self.size = max(offset, 1)
        self._layout = layout
        if buffer is not None:
            self.attach(buffer)

    def attach(self, buffer) -> None:
        for name, shape, dtype, offset in self._layout:
            setattr(self, name, np.ndarray(shape, dtype, buffer=buffer, offset=offset))

    def actions(self, dtype: np.dtype) -> np.ndarray:
        count = math.prod(self._act_shape)
        return self.action_bytes[:count * dtype.itemsize].view(dtype).reshape(self._act_shape)

    def detach(self) -> None:
        for name, *_ in self._layout:
            setattr(self, name, None)


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


def _numpy_scalar_reducers() -> dict:
    """Pickle numpy scalars as ``type(python_value)``: twice as fast as
    numpy's own reduction for info dicts like MuJoCo's (``x_position``...)
    and the same objects after unpickling."""
    table = copyreg.dispatch_table.copy()
    for kind in (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
                 np.uint64, np.uint32, np.uint16, np.uint8, np.bool_):
        table[kind] = functools.partial(_reduce_scalar, kind)
    return table


def _reduce_scalar(kind: type, value: np.generic) -> tuple:
    return kind, (value.item(),)


_REDUCERS = _numpy_scalar_reducers()


def _dumps(obj: Any) -> bytes:
    file = io.BytesIO()
    pickler = pickle.Pickler(file, _PICKLE)
    pickler.dispatch_table = _REDUCERS
    pickler.dump(obj)
    return file.getvalue()


def _step_all(envs: list[gym.Env], block: _Block, actions: np.ndarray, prefetch_reset: bool,
              send_infos: bool) -> tuple:
    """Step every env with its row of ``actions``; returns the answer message.

    An env that raises does not stop the others (as with one process per
    env): they are stepped and stored, and the first error is the answer.
    """
    # A copy: after a timeout the parent may write the next actions meanwhile.
    actions = actions.copy()
    infos, resets = [], []
    error = None
    for index, env in enumerate(envs):
        try:
            obs, reward, term, trunc, info = env.step(actions[index])
            block.observ[index] = obs
            block.reward[index] = reward
            block.terminated[index] = term
            block.truncated[index] = trunc
            if send_infos:
                infos.append(info)
            if prefetch_reset and (term or trunc):
                reset_obs, reset_info = env.reset()
                block.reset_observ[index] = reset_obs
                resets.append((index, _dumps(reset_info) if send_infos else None))
        except Exception as exc:
            error = error or error_message(exc, index)
            infos.append({})
    if error is not None:
        return error
    # The infos stay pickled until the parent reads them: most loops never do.
    return ("ok", (_dumps(infos) if send_infos else None, resets))


def _serve(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the envs, attach the shared block, then
    serve requests until told to close or until the parent goes away."""
    if not start_worker(parent_pid):
        return
    envs: list[gym.Env] = []
    shm = None
    try:
        constructors, prefetch_reset, send_infos, cpu = cloudpickle.loads(payload)
        if cpu is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {cpu})
        for index, constructor in enumerate(constructors):
            try:
                envs.append(constructor())
            except Exception as exc:
                conn.send(error_message(exc, index))
                return
        conn.send(("ok", [(env.observation_space, env.action_space,
                           getattr(env.spec, "id", None)) for env in envs]))
        command, name = conn.recv()
        if command != "attach":
            return  # the parent gave up (spaces it rejects, or close)
        shm = _attach_untracked(name)
        block = _Block(len(envs), envs[0].observation_space, envs[0].action_space, shm.buf)
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
                    view = actions[message] = block.actions(np.dtype(message[1:].decode()))
                frames.send(pickle.dumps(
                    _step_all(envs, block, view, prefetch_reset, send_infos), _PICKLE))
                continue
            command, args = pickle.loads(message)
            if command == "close":
                frames.send(pickle.dumps(("ok", None), _PICKLE))
                break
            index = None
            try:
                if command == "reset":
                    indices, seeds, options = args
                    infos = []
                    for index, seed in zip(indices, seeds):
                        obs, info = envs[index].reset(seed=seed, options=options)
                        block.reset_observ[index] = obs
                        infos.append(info)
                    answer = ("ok", infos)
                elif command == "getattr":
                    index, name = args
                    answer = answer_attribute(envs[index], name)
                elif command == "call":
                    index, name, call_args, call_kwargs = args
                    answer = ("ok", resolve(envs[index], name)(*call_args, **call_kwargs))
                else:
                    raise ValueError(f"unknown command {command!r}")
                frames.send(pickle.dumps(answer, _PICKLE))
            except (BrokenPipeError, ConnectionError):
                break
            except Exception as exc:
                frames.send(pickle.dumps(error_message(exc, index), _PICKLE))
    except (EOFError, OSError):
        pass  # the parent went away during start-up
    finally:
        for env in envs:
            try:
                env.close()
            except Exception:
                pass
        if shm is not None:
            block = None
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        conn.close()


class EnvWorker(WorkerHandle, LazySpaces):
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

    ``step(actions)`` takes ``(num_envs, *act_shape)`` actions and returns
    ``(observ, reward, terminated, truncated, infos)`` for this worker's envs:
    arrays with first dimension ``num_envs`` (observations in the observation
    space's dtype, rewards float64, flags bool) and a list of info dicts.
    ``reset(indices, seeds)`` returns ``(observ, infos)`` for the envs at
    ``indices`` (local to this worker). With ``blocking=False`` both return a
    promise; only one request may be in flight. ``env(i)`` is a handle on env
    ``i`` that forwards attribute access. Errors are those of
    ``ExternalProcess``; an ``EnvError`` from one env carries its local index
    in ``worker_env_index``.

    ``BatchEnv`` combines workers: ``BatchEnv([EnvWorker(...), ...])``.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 prefetch_reset: bool = True, infos: bool = True, cpu: int | None = None,
                 construct_timeout: float | None = None):
        constructors = list(constructors)
        if not constructors:
            raise ValueError("EnvWorker needs at least one env constructor")
        for constructor in constructors:
            if not (callable(constructor) or isinstance(constructor, str)):
                raise TypeError(f"EnvWorker needs callables returning a gymnasium.Env or "
                                f"Gymnasium id strings, got {type(constructor).__name__}")
        self.label = label or constructor_label(constructors[0])
        self.num_envs = len(constructors)
        self.prefetch_reset = prefetch_reset
        calls = [_make_by_id(c) if isinstance(c, str) else c for c in constructors]
        self.infos = infos
        self._options = (constructors, self.label, prefetch_reset, infos, cpu,
                         construct_timeout)
        self._channel = Channel(_serve, cloudpickle.dumps((calls, prefetch_reset, infos, cpu)),
                                self.label, timeout, construct_timeout)
        self._spaces: tuple[gym.Space, gym.Space] | None = None
        self._construct_error: EnvError | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._block: _Block | None = None
        self._prefetched: dict[int, bytes | None] = {}  # local index -> pickled reset info
        self._action_views: dict[np.dtype, np.ndarray] = {}

    # -- life cycle --------------------------------------------------------

    def close(self) -> None:
        """Stop the worker process and free the shared block. Idempotent."""
        super().close()
        if self._block is not None:
            self._block.detach()
            self._block = None
            self._action_views.clear()
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def restarted(self) -> "EnvWorker":
        """Close this worker (killing it if it hangs) and return a fresh
        ``EnvWorker`` with the same constructors and options."""
        self._discard()
        self.close()  # frees the shared block
        constructors, label, prefetch_reset, infos, cpu, construct_timeout = self._options
        return EnvWorker(constructors, label, self.timeout, prefetch_reset, infos, cpu,
                         construct_timeout)

    def __len__(self) -> int:
        return self.num_envs

    def __repr__(self) -> str:
        return f"EnvWorker({self.label!r}, num_envs={self.num_envs}, pid={self.pid})"

    # -- start-up -------------------------------------------------------------

    def _ready(self) -> None:
        if self._block is not None:
            return
        if self._construct_error is not None:
            raise self._construct_error
        channel = self._channel
        if channel.closed:
            raise EnvError(self.label, "construct", "the env was closed")
        try:
            _, spaces = channel.receive("construct")
            obs_space, act_space = worker_spaces(self.label, [pair[:2] for pair in spaces])
            check_space("observation", obs_space)
            check_space("action", act_space)
            block = _Block(self.num_envs, obs_space, act_space)
            shm = shared_memory.SharedMemory(create=True, size=block.size)
            try:
                channel.send("attach", pickle.dumps(("attach", shm.name), _PICKLE))
                channel.receive("attach")
            finally:
                # Once the worker has it open the name is not needed: unlinking
                # now means no crash of either process can leak the block.
                shm.unlink()
        except EnvTimeoutError:
            raise  # construction stays pending: wait again on the next call
        except UnsupportedSpaceError:
            self.close()
            raise
        except EnvError as exc:
            self._construct_error = exc  # the envs never existed: say so every time
            self.close()
            raise
        block.attach(shm.buf)
        self._shm, self._block = shm, block
        self._spaces = (obs_space, act_space)

    # -- stepping -------------------------------------------------------------

    def step(self, actions: np.ndarray, blocking: bool = True) -> Any:
        """Step every env of this worker; see the class docstring."""
        return self._step(actions, blocking, copy=True)

    def _step(self, actions: np.ndarray, blocking: bool, copy: bool) -> Any:
        """``step``; with ``copy=False`` the arrays are views of the shared
        block, valid until the next request."""
        self._ready()
        actions = np.asarray(actions)
        if actions.dtype.itemsize > _ACTION_ITEMSIZE:
            actions = actions.astype(np.float64)
        view = self._action_views.get(actions.dtype)
        if view is None:
            view = self._action_views[actions.dtype] = self._block.actions(actions.dtype)
        view[...] = actions
        self._channel.send("step", _STEP + actions.dtype.str.encode())
        self._prefetched.clear()  # a stepped env is no longer fresh from its reset

        def result() -> tuple:
            _, (infos, resets) = self._channel.receive("step")
            for index, info in resets:
                self._prefetched[index] = info
            block = self._block
            arrays = (block.observ, block.reward, block.terminated, block.truncated)
            if copy:
                arrays = tuple(array.copy() for array in arrays)
            return (*arrays, InfoList([(self.num_envs, infos)]))

        return result() if blocking else result

    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        """Reset the envs at local ``indices`` (all when ``None``) with one
        seed (or ``None``) each; returns ``(observ, infos)`` or a promise."""
        self._ready()
        indices = list(range(self.num_envs)) if indices is None else [int(i) for i in indices]
        seeds = [None] * len(indices) if seeds is None else list(seeds)
        if len(seeds) != len(indices):
            raise ValueError(f"got {len(seeds)} seeds for {len(indices)} envs to reset")
        fresh = [] if options is not None else [
            i for i, seed in zip(indices, seeds) if seed is None and i in self._prefetched]
        fresh_set = set(fresh)
        remote = [(i, s) for i, s in zip(indices, seeds) if i not in fresh_set]
        for i, _ in remote:
            self._prefetched.pop(i, None)  # really reset again: the prefetched one is stale
        if remote:
            self._channel.send("reset", pickle.dumps(
                ("reset", ([i for i, _ in remote], [s for _, s in remote], options)), _PICKLE))

        def result() -> tuple[np.ndarray, list[dict]]:
            infos = {i: _loads_info(self._prefetched.pop(i)) for i in fresh}
            if remote:
                _, remote_infos = self._channel.receive("reset")
                infos.update(zip([i for i, _ in remote], remote_infos))
            return self._block.reset_observ[indices], [infos[i] for i in indices]

        return result() if blocking else result

    # -- attributes -------------------------------------------------------------

    def get_attr(self, name: str, index: int = 0) -> Any:
        """Env ``index``'s attribute ``name`` (dotted paths allowed): a copy,
        or a ``RemoteAttribute`` proxy for methods and unpicklable values."""
        from batchrl.envs.external import RemoteAttribute
        kind, value = self._request("getattr", (index, name))
        if kind == "proxy":
            return RemoteAttribute(self.env(index), name, value)
        return value

    def call(self, name: str, *args: Any, index: int = 0, **kwargs: Any) -> Any:
        """Call env ``index``'s method ``name`` and return its result."""
        return self._request("call", (index, name, args, kwargs))[1]

    def env(self, index: int) -> "WorkerEnv":
        """A handle on env ``index`` of this worker."""
        if not 0 <= index < self.num_envs:
            raise IndexError(f"env index {index} out of range for a worker with "
                             f"{self.num_envs} envs")
        return WorkerEnv(self, index)

    def _request(self, command: str, args: tuple) -> tuple[str, Any]:
        self._ready()
        self._channel.send(command, cloudpickle.dumps((command, args)))
        return self._channel.receive(command)


class WorkerEnv:
    """One env of an ``EnvWorker``: spaces, attribute access and method calls
    are forwarded to it (``handle.unwrapped.frame_skip``)."""

    def __init__(self, worker: EnvWorker, index: int):
        self.worker = worker
        self.index = index
        self.label = worker.label

    @property
    def observation_space(self) -> gym.Space:
        return self.worker.observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.worker.action_space

    def get_attr(self, name: str) -> Any:
        return self.worker.get_attr(name, index=self.index)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.worker.call(name, *args, index=self.index, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get_attr(name)

    def __repr__(self) -> str:
        return f"<env {self.index} of {self.worker!r}>"


def _loads_info(blob: bytes | None) -> dict:
    return {} if blob is None else pickle.loads(blob)


class InfoList(collections.abc.Sequence):
    """The info dicts of a batch step, unpickled on first access.

    Built from ``(count, part)`` pairs, where a part is a list of dicts, the
    pickled list, or ``None`` for ``count`` empty dicts. Behaves like a
    read-only list (``len``, indexing, iteration, ``==`` with a list).
    """

    def __init__(self, parts: Sequence[tuple[int, Any]]):
        self._parts = list(parts)
        self._length = sum(count for count, _ in self._parts)
        self._items: list[dict] | None = None

    def _load(self) -> list[dict]:
        if self._items is None:
            items: list[dict] = []
            for count, part in self._parts:
                if part is None:
                    items.extend({} for _ in range(count))
                elif isinstance(part, bytes):
                    items.extend(pickle.loads(part))
                else:
                    items.extend(part)
            self._items = items
            self._parts = []
        return self._items

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - list semantics
        return self._load()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, InfoList)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._load())

    @classmethod
    def join(cls, lists: Sequence[Any]) -> "InfoList":
        """One ``InfoList`` of several (or of plain lists), without unpickling."""
        parts: list[tuple[int, Any]] = []
        for infos in lists:
            if isinstance(infos, InfoList) and infos._items is None:
                parts.extend(infos._parts)
            else:
                parts.append((len(infos), list(infos)))
        return cls(parts)


def _make_by_id(env_id: str) -> Callable[[], gym.Env]:
    return lambda: gym.make(env_id)
