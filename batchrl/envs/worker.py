"""``Worker``, the protocol of every ``BatchEnv`` member, and ``RemoteWorker``, its
shared part for envs served elsewhere by an ``EnvHost``; subclasses add the transport.
``WorkerFront`` is a one-env object in front of a ``Worker`` (``ExternalProcess``)."""

from __future__ import annotations

import abc
import contextlib
import functools
import pickle
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError, EnvTimeoutError, UnsupportedSpaceError
from batchrl.envs.infos import InfoList
from batchrl.envs.host import RESET_AGAIN, StepArrays
from batchrl.nested import is_nested_space, stack_as, unstack

#: What ``step_wait`` returns: observations ``(num_envs, *obs_shape)`` in the space's dtype,
#: rewards ``(num_envs,)`` float64, terminated and truncated ``(num_envs,)`` bool, the infos.
StepResult = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Sequence[dict]]


class Closeable:
    """``with obj:`` calls ``obj.close()`` at the end of the block."""

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def close_all(closeables: Sequence[Any]) -> None:
    """Close each of ``closeables`` in order, every one even if another raises (a worker
    process left running otherwise); the last error is raised, chained to those before."""
    with contextlib.ExitStack() as stack:
        for closeable in reversed(closeables):  # (the stack closes the last pushed first)
            stack.callback(closeable.close)


class Worker(Closeable, abc.ABC):
    """``num_envs`` envs with equal spaces, stepped together here, in a child process or in a Ray
    actor.

    Every transport is driven through one pair per request, as Stable-Baselines3's vector envs:
    ``step_async(actions)`` sends ``(num_envs, *act_shape)`` actions and ``step_wait()`` returns
    ``(observ, reward, terminated, truncated, infos)`` (a ``StepResult``); ``reset_async(indices,
    seeds, options)`` and ``reset_wait()`` give ``(observ, infos)`` of the envs at local
    ``indices``. One request is in flight at most (a second is a ``RuntimeError``); ``step`` and
    ``reset`` are the two halves back to back. Errors are ``EnvError``s, raised by either half; a
    single env's carries its local index in ``worker_env_index``.

    ``step_async(..., autoreset=mask)`` resets the envs where the bool ``(num_envs,)`` mask is
    true (without seed or options) instead of stepping them, as Gymnasium's next-step autoreset
    does: their rows are the first observations, zero rewards, false flags and the reset infos.
    """

    label: str
    num_envs: int
    observation_space: gym.Space  # shared by all envs
    action_space: gym.Space
    #: The envs step in the calling process, in ``step_wait`` (``BatchEnv`` waits for them
    #: before the others, which step meanwhile).
    in_process: bool = False

    @abc.abstractmethod
    def step_async(self, actions: np.ndarray, autoreset: np.ndarray | None = None) -> None:
        """Send env ``i`` the action ``actions[i]``, or a reset if ``autoreset[i]``. Until
        ``step_wait`` the worker may still read ``actions`` and ``autoreset``."""

    @abc.abstractmethod
    def step_wait(self, copy: bool = True) -> StepResult:
        """The result of the step ``step_async`` sent. With ``copy=False`` the arrays may be
        views of the worker's buffers, valid until its next request, restart or close (after
        those, reading them may crash the process: copy what you keep)."""

    @abc.abstractmethod
    def reset_async(self, indices: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None,
                    options: dict | None = None) -> None:
        """Send a reset to the envs at local ``indices`` (all when ``None``), one seed (or
        ``None``) each, and ``options`` to all of them."""

    @abc.abstractmethod
    def reset_wait(self) -> tuple[np.ndarray, list[dict]]:
        """``(observ, infos)`` of the reset ``reset_async`` sent: ``(len(indices),
        *obs_shape)`` observations and the info dicts, in the order of ``indices``."""

    def step(self, actions: np.ndarray, autoreset: np.ndarray | None = None,
             copy: bool = True) -> StepResult:
        """``step_async`` then ``step_wait``."""
        self.step_async(actions, autoreset)
        return self.step_wait(copy)

    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None,
              options: dict | None = None) -> tuple[np.ndarray, list[dict]]:
        """``reset_async`` then ``reset_wait``."""
        self.reset_async(indices, seeds, options)
        return self.reset_wait()

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


class KeptRequest:
    """For a ``Worker`` whose ``*_async`` halves keep the request (``_pending``: ``(kind,
    *arguments)``) and whose ``*_wait`` halves do it: ``_expect`` takes it back."""

    label: str
    _pending: tuple | None = None

    def _expect(self, kind: str | None, method: str) -> tuple | None:
        """The request in flight (cleared) if it is a ``kind`` one (``None``: none is);
        else the ``RuntimeError`` of calling ``method`` now."""
        pending = self._pending
        if (pending and pending[0]) != kind:
            raise RuntimeError(
                f"{self.label}: {method}() called while a {pending[0]} is in flight: call "
                f"{pending[0]}_wait() first" if pending else
                f"{self.label}: {method}() needs a {kind}_async() first")
        self._pending = None
        return pending


class WorkerFront(Closeable, abc.ABC):
    """One env with Gymnasium's single-env API in front of a ``Worker`` of that env alone
    (``ExternalProcess``). A ``BatchEnv`` given one steps its ``worker``, lists the front
    itself among its ``envs`` and ``workers``, and restarts it with ``restart``."""

    worker: Worker

    @abc.abstractmethod
    def restart(self) -> "WorkerFront":
        """Close this front's worker (killing it if it hangs); a fresh front for the same env."""


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


def stack_rows(rows: list, parts: gym.Space | None = None) -> Any:
    """Observations as one ``(len(rows), *shape)`` array, or with ``parts`` (a ``Dict`` or
    ``Tuple`` space whose arrays travel part by part) a nested value of them in its order
    (``batchrl.nested``; a Tuple's value may be a list); values that no array of a fixed
    shape holds (those of ``EnvWorker(any_space=True)``) as a ``(len(rows),)`` object
    array."""
    if parts is not None:
        return stack_as(parts, rows)
    if all(isinstance(row, (np.ndarray, np.generic)) for row in rows):
        return np.stack(rows)
    stacked = np.empty(len(rows), object)
    for index, row in enumerate(rows):
        stacked[index] = row
    return stacked


def load_info(info: Any) -> dict:
    """An info dict that may have travelled pickled (or not at all: ``None``)."""
    return {} if info is None else pickle.loads(info) if isinstance(info, bytes) else info


class RemoteWorker(Worker):
    """A ``Worker`` whose envs are built and served elsewhere by an ``EnvHost``.
    Subclasses set ``label``, ``num_envs`` and ``prefetch_reset``, implement the
    transport methods below (each send followed by its receive) and keep ``closed``
    true once closed. A finished env the host already reset answers a later ``reset``
    without seed or options at once."""

    prefetch_reset: bool
    closed: bool  # close() was called (or construction failed)
    _spaces: tuple[gym.Space, gym.Space] | None = None
    _construct_error: EnvError | UnsupportedSpaceError | None = None

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
        # A reset_async() awaiting its reset_wait(): (indices, rows served from _prefetched,
        # indices sent to the host).
        self._resetting: tuple[list[int], dict, list[int]] | None = None

    @abc.abstractmethod
    def _construct(self) -> tuple[gym.Space, gym.Space]:
        """Wait for the envs to be built; their shared ``(observation, action)`` spaces."""

    @abc.abstractmethod
    def _send_step(self, actions: np.ndarray, autoreset: np.ndarray | None) -> None:
        """Send the actions (and the envs to reset instead)."""

    @abc.abstractmethod
    def _receive_step(self, copy: bool) -> tuple:
        """The answer to the step sent: ``(observ, reward, terminated, truncated, infos,
        resets)``: ``infos`` the info dicts (a list, pickled list or ``info_columns``
        payload; ``None`` when infos are off), ``resets`` ``(index, observ, info)`` of the
        envs reset after their episode ended."""

    @abc.abstractmethod
    def _send_reset(self, indices: list[int], seeds: list, options: dict | None) -> None:
        """Send a reset of the envs at ``indices``."""

    @abc.abstractmethod
    def _receive_reset(self, indices: list[int]) -> tuple[np.ndarray, list[dict]]:
        """The answer to the reset of ``indices`` sent: ``(observ, infos)``."""

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
        except (EnvError, UnsupportedSpaceError) as exc:
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

    def step_async(self, actions: np.ndarray, autoreset: np.ndarray | None = None) -> None:
        """Send every env its row of ``actions``; see ``Worker``."""
        self._check_open("step")
        if autoreset is not None:
            # The host answers an autoreset with the env's prefetched reset if it holds one;
            # one that a reset() here already handed out must not be handed out again.
            again = [i for i in np.flatnonzero(autoreset) if i not in self._prefetched]
            if again:
                autoreset = np.asarray(autoreset, np.uint8).copy()
                autoreset[again] = RESET_AGAIN
        self._send_step(np.asarray(actions), autoreset)
        self._prefetched.clear()  # a stepped (or reset) env is no longer fresh from its reset

    def step_wait(self, copy: bool = True) -> StepResult:
        """The result of the step sent; see ``Worker``."""
        observ, reward, terminated, truncated, infos, resets = self._receive_step(copy)
        for index, reset_observ, reset_info in resets:
            self._prefetched[index] = (reset_observ, reset_info)
        return observ, reward, terminated, truncated, InfoList([(self.num_envs, infos)])

    def reset_async(self, indices: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None,
                    options: dict | None = None) -> None:
        """Send a reset to the envs at local ``indices`` that need one; see ``Worker``."""
        self._check_open("reset")
        if self._resetting is not None:
            raise RuntimeError(f"{self.label}: reset_async() called twice: call reset_wait() "
                               f"first")
        indices, seeds = reset_arguments(self.num_envs, indices, seeds)
        fresh = {} if options is not None else {
            i: self._prefetched.pop(i) for i, seed in zip(indices, seeds)
            if seed is None and i in self._prefetched}
        remote = [(i, s) for i, s in zip(indices, seeds) if i not in fresh]
        for i, _ in remote:
            self._prefetched.pop(i, None)  # really reset again: the prefetched one is stale
        sent = [i for i, _ in remote]
        if sent:
            self._send_reset(sent, [s for _, s in remote], options)
        self._resetting = (indices, fresh, sent)

    def reset_wait(self) -> tuple[np.ndarray, list[dict]]:
        """``(observ, infos)`` of the reset sent; see ``Worker``."""
        if self._resetting is None:
            raise RuntimeError(f"{self.label}: reset_wait() needs a reset_async() first")
        (indices, fresh, sent), self._resetting = self._resetting, None
        if not fresh:
            return self._receive_reset(sent)
        rows = {i: (observ, load_info(info)) for i, (observ, info) in fresh.items()}
        if sent:
            observ, infos = self._receive_reset(sent)
            rows.update(zip(sent, zip(unstack(observ), infos)))
        nested = is_nested_space(self._spaces[0]) and StepArrays.fits(self._spaces[0], True) \
            and StepArrays.fits(self._spaces[1])
        return (stack_rows([rows[i][0] for i in indices], self._spaces[0] if nested else None),
                [rows[i][1] for i in indices])

    def get_attr(self, name: str, index: int = 0) -> Any:
        """Env ``index``'s attribute ``name`` (dotted paths allowed): a copy,
        or a ``RemoteAttribute`` proxy for methods and unpicklable values."""
        self._check_open("getattr")
        kind, value = self._ask("getattr", (index, name))
        return RemoteAttribute(self.env(index), name, *value) if kind == "proxy" else value

    def call(self, name: str, *args: Any, index: int = 0, **kwargs: Any) -> Any:
        """Call env ``index``'s method ``name`` and return its result."""
        return self.call_env(index, name, args, kwargs)

    def call_env(self, index: int, name: str, args: tuple, kwargs: dict) -> Any:
        """``call`` for a method that takes an ``index`` keyword too."""
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
        return self.worker.call_env(self.index, name, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get_attr(name)

    def __repr__(self) -> str:
        return f"<env {self.index} of {self.worker!r}>"


class RemoteAttribute:
    """A method or unpicklable attribute of a remote env (``env``: its ``WorkerEnv``):
    attribute access is forwarded further (``env.unwrapped.model.nq``),
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
