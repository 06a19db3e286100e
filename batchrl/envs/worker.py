"""``Worker``, the protocol of every ``BatchEnv`` member, and ``RemoteWorker``, its
shared part for envs served elsewhere by an ``EnvHost``; subclasses add the transport."""

from __future__ import annotations

import abc
import functools
import pickle
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError, EnvTimeoutError
from batchrl.envs.infos import InfoList

Promise = Callable[[], Any]


class Closeable:
    """``with obj:`` calls ``obj.close()`` at the end of the block."""

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Worker(Closeable, abc.ABC):
    """``num_envs`` envs with equal spaces, stepped together here, in a child process or in a Ray
    actor.

    ``step(actions)`` takes ``(num_envs, *act_shape)`` actions and returns
    ``(observ, reward, terminated, truncated, infos)``: arrays of first dimension ``num_envs``
    (observations in the space's dtype, rewards float64, flags bool) and the info dicts. ``reset``
    returns ``(observ, infos)`` of the envs at local ``indices``. With ``blocking=False`` both
    return a promise to call for the result (one request in flight at most). Errors are
    ``EnvError``s; a single env's carries its local index in ``worker_env_index``.

    ``step(..., autoreset=mask)`` resets the envs where the bool ``(num_envs,)`` mask is true
    (without seed or options) instead of stepping them, as Gymnasium's next-step autoreset does:
    their rows are the first observations, zero rewards, false flags and the reset infos.
    """

    label: str
    num_envs: int
    observation_space: gym.Space  # shared by all envs
    action_space: gym.Space
    #: The envs step in the calling process (``BatchEnv`` runs it after the others).
    in_process: bool = False

    @abc.abstractmethod
    def step(self, actions: np.ndarray, blocking: bool = True, copy: bool = True,
             autoreset: np.ndarray | None = None) -> Any:
        """Step env ``i`` with ``actions[i]``, or reset it if ``autoreset[i]``. With
        ``copy=False`` the arrays may be views of the worker's buffers, valid until its
        next request."""

    @abc.abstractmethod
    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        """Reset the envs at local ``indices`` (all when ``None``), one seed (or ``None``) each."""

    @abc.abstractmethod
    def restart(self) -> "Worker":
        """Close this worker (killing it if it hangs); a fresh one with the same envs."""

    @abc.abstractmethod
    def env(self, index: int) -> Any:
        """Env ``index`` (local), or a handle that forwards attribute access to it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the envs and free what the worker holds. Idempotent."""

    def spaces(self) -> list[tuple[gym.Space, gym.Space]]:
        """The ``(observation, action)`` spaces of each env."""
        return [(self.observation_space, self.action_space)] * self.num_envs

    def env_label(self, index: int) -> str:
        """The name of env ``index`` in error messages."""
        return self.label

    def __len__(self) -> int:
        return self.num_envs


def reset_arguments(num_envs: int, indices: Sequence[int] | None,
                    seeds: Sequence[int | None] | None) -> tuple[list[int], list]:
    """``indices`` (all when ``None``) as ints, and one seed per index."""
    indices = list(range(num_envs)) if indices is None else [int(i) for i in indices]
    seeds = [None] * len(indices) if seeds is None else list(seeds)
    if len(seeds) != len(indices):
        raise ValueError(f"got {len(seeds)} seeds for {len(indices)} envs to reset")
    return indices, seeds


def constructor_label(constructor: Any) -> str:
    """A readable name for an env constructor (for error messages)."""
    if isinstance(constructor, str):
        return constructor
    if isinstance(constructor, functools.partial):  # partial(gym.make, "HalfCheetah-v5")
        args = ", ".join(repr(arg) for arg in constructor.args)
        return f"{constructor_label(constructor.func)}({args})"
    name = getattr(constructor, "__qualname__", None) or repr(constructor)
    module = getattr(constructor, "__module__", None)
    return f"{module}.{name}" if module and module != "__main__" else name


def check_constructors(kind: str, constructors: Sequence[Any]) -> list:
    """The constructors as a list: at least one callable or Gymnasium id (else
    ``ValueError``/``TypeError``)."""
    constructors = list(constructors)
    if not constructors:
        raise ValueError(f"{kind} needs at least one env constructor")
    for constructor in constructors:
        if not (callable(constructor) or isinstance(constructor, str)):
            raise TypeError(f"{kind} needs callables returning a gymnasium.Env or "
                            f"Gymnasium id strings, got {type(constructor).__name__}")
    return constructors


def load_info(info: Any) -> dict:
    """An info dict that may have travelled pickled (or not at all: ``None``)."""
    return {} if info is None else pickle.loads(info) if isinstance(info, bytes) else info


class RemoteWorker(Worker):
    """A ``Worker`` whose envs are built and served elsewhere by an ``EnvHost``.
    Subclasses set ``label``, ``num_envs`` and ``prefetch_reset``, implement the
    transport methods below and keep ``closed`` true once closed. A finished env
    the host already reset answers a later ``reset`` without seed or options at once."""

    prefetch_reset: bool
    closed: bool  # close() was called (or construction failed)
    _spaces: tuple[gym.Space, gym.Space] | None = None
    _construct_error: EnvError | None = None

    def __init__(self, kind: str, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None, prefetch_reset: bool, infos: bool) -> None:
        """Check ``constructors`` (``kind`` names the class in errors); ``_calls`` are
        them as callables (an id becomes ``gym.make(id)``)."""
        self._constructors = check_constructors(kind, constructors)
        self._calls = [functools.partial(gym.make, c) if isinstance(c, str) else c
                       for c in self._constructors]
        self.label = label or constructor_label(self._constructors[0])
        self.num_envs = len(self._constructors)
        self.prefetch_reset = prefetch_reset
        self.infos = infos
        # local index -> (first observation, info) of envs the host reset
        self._prefetched: dict[int, tuple[np.ndarray, Any]] = {}

    @abc.abstractmethod
    def _construct(self) -> tuple[gym.Space, gym.Space]:
        """Wait for the envs to be built; their shared ``(observation, action)`` spaces."""

    @abc.abstractmethod
    def _send_step(self, actions: np.ndarray, copy: bool,
                   autoreset: np.ndarray | None) -> Promise:
        """Send the actions (and the envs to reset instead); the promise gives ``(observ,
        reward, terminated, truncated, infos, resets)``: ``infos`` the info dicts (a list,
        pickled list or ``info_columns`` payload; ``None`` when infos are off), ``resets`` ``(index, observ, info)`` of the envs
        reset after their episode ended."""

    @abc.abstractmethod
    def _send_reset(self, indices: list[int], seeds: list, options: dict | None) -> Promise:
        """Send a reset; the promise gives ``(observ, infos)``."""

    @abc.abstractmethod
    def _ask(self, command: str, args: tuple) -> tuple[str, Any]:
        """A ``"getattr"`` or ``"call"`` request; ``(kind, value)``."""

    def _ready(self) -> None:
        """Wait for the envs to be built (once). A failed construction is raised
        again on every later call; one that timed out is waited for again."""
        if self._spaces is not None:
            return
        if self._construct_error is not None:
            raise self._construct_error
        if self.closed:
            raise EnvError(self.label, "construct", "the env was closed")
        try:
            self._spaces = self._construct()
        except EnvTimeoutError:
            raise
        except EnvError as exc:
            self._construct_error = exc
            self.close()
            raise

    @property
    def observation_space(self) -> gym.Space:
        self._ready()
        return self._spaces[0]

    @property
    def action_space(self) -> gym.Space:
        self._ready()
        return self._spaces[1]

    def _check_open(self, operation: str) -> None:
        self._ready()
        if self.closed:
            raise EnvError(self.label, operation, "the env was closed")

    def step(self, actions: np.ndarray, blocking: bool = True, copy: bool = True,
             autoreset: np.ndarray | None = None) -> Any:
        """Step every env with its row of ``actions``; see ``Worker``."""
        self._check_open("step")
        answer = self._send_step(np.asarray(actions), copy, autoreset)
        self._prefetched.clear()  # a stepped (or reset) env is no longer fresh from its reset

        def result() -> tuple:
            observ, reward, terminated, truncated, infos, resets = answer()
            for index, reset_observ, reset_info in resets:
                self._prefetched[index] = (reset_observ, reset_info)
            return observ, reward, terminated, truncated, InfoList([(self.num_envs, infos)])

        return result() if blocking else result

    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        """Reset the envs at local ``indices``; see ``Worker``."""
        self._check_open("reset")
        indices, seeds = reset_arguments(self.num_envs, indices, seeds)
        fresh = {} if options is not None else {
            i: self._prefetched.pop(i) for i, seed in zip(indices, seeds)
            if seed is None and i in self._prefetched}
        remote = [(i, s) for i, s in zip(indices, seeds) if i not in fresh]
        for i, _ in remote:
            self._prefetched.pop(i, None)  # really reset again: the prefetched one is stale
        answer = (self._send_reset([i for i, _ in remote], [s for _, s in remote], options)
                  if remote else None)

        def result() -> tuple[np.ndarray, list[dict]]:
            if answer is not None and not fresh:
                return answer()
            rows = {i: (observ, load_info(info)) for i, (observ, info) in fresh.items()}
            if answer is not None:
                observ, infos = answer()
                rows.update(zip([i for i, _ in remote], zip(observ, infos)))
            return np.stack([rows[i][0] for i in indices]), [rows[i][1] for i in indices]

        return result() if blocking else result

    def get_attr(self, name: str, index: int = 0) -> Any:
        """Env ``index``'s attribute ``name`` (dotted paths allowed): a copy,
        or a ``RemoteAttribute`` proxy for methods and unpicklable values."""
        self._check_open("getattr")
        kind, value = self._ask("getattr", (index, name))
        return RemoteAttribute(self.env(index), name, *value) if kind == "proxy" else value

    def call(self, name: str, *args: Any, index: int = 0, **kwargs: Any) -> Any:
        """Call env ``index``'s method ``name`` and return its result."""
        self._check_open("call")
        return self._ask("call", (index, name, args, kwargs))[1]

    def env(self, index: int) -> "WorkerEnv":
        """A handle on env ``index`` of this worker."""
        if not 0 <= index < self.num_envs:
            raise IndexError(f"env index {index} out of range for a worker with "
                             f"{self.num_envs} envs")
        return WorkerEnv(self, index)


class WorkerEnv:
    """One env of a ``RemoteWorker``: spaces, attribute access and method
    calls are forwarded to it (``handle.unwrapped.frame_skip``)."""

    def __init__(self, worker: RemoteWorker, index: int):
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


class RemoteAttribute:
    """A method or unpicklable attribute of a remote env (``env``: an ``ExternalProcess``
    or a ``WorkerEnv``): attribute access is forwarded further (``env.unwrapped.model.nq``),
    a call calls the remote method (``env.unwrapped.render()``). ``remote_callable``: whether
    the remote value is callable."""

    def __init__(self, env: Any, path: str, type_name: str, remote_callable: bool = True):
        self._env = env
        self._path = path
        self._type_name = type_name
        self.remote_callable = remote_callable

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._env.get_attr(f"{self._path}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._env.call(self._path, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<remote {self._type_name} {self._path!r} of {self._env.label}>"
