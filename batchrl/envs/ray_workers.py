"""Several Gymnasium envs in one Ray actor, anywhere in a Ray cluster.

``RayEnvWorker`` is ``EnvWorker`` (``batchrl.envs.workers``) for a cluster:
the same interface, the same error types and the same trajectories, but the
envs live in a Ray actor that may sit on another machine. A batch step is one
actor call per worker: the call carries the numpy actions of all of the
worker's envs and its reply the stacked observations, rewards and flags. Ray
inlines such small arrays in the call and the reply instead of going through
the object store, and hands large ones over without copies.

The actor answers every request with ``("ok", value)`` or ``("error", ...)``
as the local workers do, so an env's exception comes back with the actor's
traceback and the env's index. A dead actor (killed, out of memory, or its
node lost) is a ``RayWorkerCrashedError``; no answer within ``timeout`` is an
``EnvTimeoutError``. Finished envs are reset in the actor within the same
call ("prefetched reset"), with ``EnvWorker``'s semantics and for its reason:
a round trip to another machine costs far more than a reset.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs import ray_cluster
from batchrl.envs.batch import _Workers
from batchrl.envs.errors import (EnvError, EnvRaisedError,
                                 EnvTimeoutError, RayWorkerCrashedError)
from batchrl.envs.process import (LazySpaces, answer_attribute, constructor_label, error_message,
                                  remote_error, resolve)
from batchrl.envs.spaces import worker_spaces
from batchrl.envs.workers import InfoList, WorkerEnv


class EnvHost:
    """The Ray actor's body: builds a worker's envs and serves its requests.

    Runs in a Ray worker process (``ray.remote(EnvHost)``). Every method
    answers ``("ok", value)`` or ``error_message(...)``: exceptions of the
    envs never escape, so that Ray's own errors always mean a broken actor.
    """

    def __init__(self, payload: bytes, prefetch_reset: bool, send_infos: bool):
        self._payload = payload
        self.prefetch_reset = prefetch_reset
        self.send_infos = send_infos
        self.envs: list[gym.Env] = []

    def build(self) -> tuple:
        """Build the envs; answers their spaces and where this actor runs."""
        import ray
        for index, constructor in enumerate(cloudpickle.loads(self._payload)):
            try:
                self.envs.append(constructor())
            except Exception as exc:
                return error_message(exc, index)
        self._payload = b""
        spaces = [(env.observation_space, env.action_space) for env in self.envs]
        context = ray.get_runtime_context()
        where = (ray.util.get_node_ip_address(), context.get_node_id(), os.getpid())
        return ("ok", (spaces, where))

    def _rows(self, count: int) -> np.ndarray:
        space = self.envs[0].observation_space
        return np.empty((count, *space.shape), space.dtype)

    def step(self, actions: np.ndarray) -> tuple:
        """Step env ``i`` with ``actions[i]``; answers ``(observ, reward,
        terminated, truncated, infos, resets)``, where ``resets`` lists
        ``(index, observ, info)`` of the envs reset after their episode ended.

        An env that raises does not stop the others, as in ``EnvWorker``:
        they are stepped too, and the first error is the answer.
        """
        count = len(self.envs)
        observ = self._rows(count)
        reward = np.zeros(count, np.float64)
        terminated = np.zeros(count, bool)
        truncated = np.zeros(count, bool)
        infos: list[dict] = []
        resets = []
        error = None
        for index, env in enumerate(self.envs):
            try:
                # A copy: Ray's arrays are read-only views of the request.
                obs, reward[index], terminated[index], truncated[index], info = env.step(
                    np.array(actions[index]))
                observ[index] = obs
                infos.append(info)
                if self.prefetch_reset and (terminated[index] or truncated[index]):
                    reset_obs, reset_info = env.reset()
                    resets.append((index, np.asarray(reset_obs, observ.dtype),
                                   reset_info if self.send_infos else None))
            except Exception as exc:
                error = error or error_message(exc, index)
        if error is not None:
            return error
        return ("ok", (observ, reward, terminated, truncated,
                       infos if self.send_infos else None, resets))

    def reset(self, indices: list[int], seeds: list, options: dict | None) -> tuple:
        """Reset the envs at ``indices``; answers ``(observ, infos)``."""
        observ = self._rows(len(indices))
        infos = []
        index = None
        try:
            for row, (index, seed) in enumerate(zip(indices, seeds)):
                observ[row], info = self.envs[index].reset(seed=seed, options=options)
                infos.append(info)
        except Exception as exc:
            return error_message(exc, index)
        return ("ok", (observ, infos))

    def getattr(self, index: int, name: str) -> tuple:
        """Env ``index``'s attribute ``name``: a copy, or a proxy marker."""
        try:
            return answer_attribute(self.envs[index], name)
        except Exception as exc:
            return error_message(exc, index)

    def call(self, index: int, name: str, args: tuple, kwargs: dict) -> tuple:
        """Call env ``index``'s method ``name``."""
        try:
            return ("ok", resolve(self.envs[index], name)(*args, **kwargs))
        except Exception as exc:
            return error_message(exc, index)

    def close(self) -> None:
        """Close the envs (before the actor is killed)."""
        for env in self.envs:
            try:
                env.close()
            except Exception:
                pass
        self.envs = []


def _reason(exc: Exception) -> str:
    """Ray's explanation of a dead actor in one line: its first sentence and
    the cause (e.g. "...because its node has died"), without the indented
    details (actor id, pid...)."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith(("\t", " "))]
    text = " ".join(lines[:2]) or "no reason given"
    return f"{type(exc).__name__}: {text[:400]}"


@functools.cache
def _actor_class(ray: Any) -> Any:
    return ray.remote(EnvHost)


class RayEnvWorker(LazySpaces):
    """A Ray actor hosting ``len(constructors)`` Gymnasium envs.

    Args:
      constructors: one callable per env returning a ``gymnasium.Env``
        (shipped with cloudpickle), or Gymnasium id strings. All envs must
        have equal spaces. They are called on the node Ray picks, so the env's
        packages (and batchrl) must be installed there.
      label: name used in error messages (default: the first constructor's).
      timeout: seconds to wait for a step, reset or attribute answer before
        ``EnvTimeoutError``; ``None`` waits as long as the actor lives.
      construct_timeout: the limit for placing the actor and building the
        envs (``None``: ``timeout``). An actor that Ray cannot place (the
        resources it asks for are taken) also ends in ``EnvTimeoutError``.
      prefetch_reset, infos: as for ``EnvWorker``.
      resources: Ray resources reserved for the actor, e.g. ``{"CPU": 1}``
        or ``{"CPU": 1, "env_node": 1}`` (see ``ray_cluster.actor_options``).
      address: the Ray cluster to join if this process is not connected yet
        (see ``ray_cluster.acquire``).
      scheduling_strategy: Ray's placement of the actor; ``"SPREAD"`` puts
        the workers of a batch on different nodes where resources allow.

    ``step``, ``reset``, ``get_attr``, ``call``, ``env(i)`` and ``restarted``
    behave as ``EnvWorker``'s (results of ``step`` may be read-only arrays).
    Errors: ``EnvRaisedError`` (with the actor's traceback and the env's
    index in ``worker_env_index``) when an env raised, ``EnvTimeoutError``,
    and ``RayWorkerCrashedError`` (an ``EnvCrashedError``) when the actor died
    or its node was lost. ``node_ip``, ``node_id`` and ``pid`` say where the
    actor runs. ``close()`` kills the actor; it is idempotent.

    ``BatchEnv`` combines workers: ``BatchEnv([RayEnvWorker(...), ...])``.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 construct_timeout: float | None = None, prefetch_reset: bool = True,
                 infos: bool = True, resources: dict[str, float] | None = None,
                 address: str = "", scheduling_strategy: Any = "SPREAD"):
        constructors = list(constructors)
        if not constructors:
            raise ValueError("RayEnvWorker needs at least one env constructor")
        for constructor in constructors:
            if not (callable(constructor) or isinstance(constructor, str)):
                raise TypeError(f"RayEnvWorker needs callables returning a gymnasium.Env or "
                                f"Gymnasium id strings, got {type(constructor).__name__}")
        resources = {"CPU": 1} if resources is None else dict(resources)
        options = ray_cluster.actor_options(resources)  # checks them before connecting
        self.label = label or constructor_label(constructors[0])
        self.num_envs = len(constructors)
        self.timeout = timeout
        self.construct_timeout = timeout if construct_timeout is None else construct_timeout
        self.prefetch_reset = prefetch_reset
        self.infos = infos
        self.resources = resources
        self._options = (constructors, label, construct_timeout, prefetch_reset, infos,
                         resources, address, scheduling_strategy)
        calls = [functools.partial(gym.make, c) if isinstance(c, str) else c
                 for c in constructors]
        self._ray = ray_cluster.acquire(address)
        self.closed = False
        try:
            self._actor = _actor_class(self._ray).options(
                **options, scheduling_strategy=scheduling_strategy, max_restarts=0,
                max_task_retries=0).remote(cloudpickle.dumps(calls), prefetch_reset, infos)
            self._built = self._actor.build.remote()
        except BaseException:
            self.closed = True
            ray_cluster.release()
            raise
        self._spaces: tuple[gym.Space, gym.Space] | None = None
        self._construct_error: EnvError | None = None
        self._prefetched: dict[int, tuple[np.ndarray, dict | None]] = {}
        self.node_ip: str | None = None
        self.node_id: str | None = None
        self.pid: int | None = None

    # -- life cycle --------------------------------------------------------------

    def close(self) -> None:
        """Close the envs and kill the actor; disconnect from Ray if this was
        the last Ray worker of a connection batchrl made. Idempotent."""
        if self.closed:
            return
        self.closed = True
        ray = self._ray
        try:
            if self._spaces is not None:  # ask it to close its envs, briefly
                ray.wait([self._actor.close.remote()], timeout=2.0)
            ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: S110 - already dead or Ray disconnected: nothing to stop
            pass
        finally:
            ray_cluster.release()

    def restarted(self) -> "RayEnvWorker":
        """Kill this worker's actor and return a fresh ``RayEnvWorker`` with
        the same constructors and options (placed wherever Ray finds room)."""
        constructors, label, construct_timeout, prefetch_reset, infos, resources, address, \
            strategy = self._options
        fresh = RayEnvWorker(constructors, label, self.timeout, construct_timeout,
                             prefetch_reset, infos, resources, address, strategy)
        self._spaces = None  # no polite close: the old actor may hang or be gone
        self.close()
        return fresh

    def batch_member(self) -> "_RayMember":
        """How ``BatchEnv`` drives this worker."""
        return _RayMember(self)

    def __len__(self) -> int:
        return self.num_envs

    def __enter__(self) -> "RayEnvWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f", node={self.node_ip}" if self.node_ip else ""
        return f"RayEnvWorker({self.label!r}, num_envs={self.num_envs}{where})"

    # -- answers --------------------------------------------------------------------

    def _receive(self, ref: Any, operation: str, limit: float | None) -> Any:
        """The value of the answer ``ref`` to ``operation``; Ray's failures
        and the envs' errors raised as ``EnvError``s."""
        exceptions = self._ray.exceptions
        try:
            kind, value = self._ray.get(ref, timeout=limit)
        except exceptions.GetTimeoutError:
            where = f" on node {self.node_ip}" if self.node_ip else ""
            if operation == "construct":
                detail = (f"the Ray actor was not placed, or did not build its envs, within "
                          f"{limit} s (it asks for {self.resources}; are they free on some "
                          f"node?)")
            else:
                detail = f"no answer from the Ray actor{where} within {limit} s"
            raise EnvTimeoutError(self.label, operation, detail) from None
        except exceptions.RayTaskError as exc:  # a failure of the actor code, not of an env
            cause = getattr(exc, "cause", None) or exc
            raise EnvRaisedError(self.label, operation, type(cause).__name__, str(cause),
                                 str(exc)) from None
        except exceptions.RayError as exc:  # the actor died, or its node was lost
            raise RayWorkerCrashedError(self.label, operation, self.node_ip,
                                        _reason(exc)) from None
        if kind == "error":
            raise remote_error(self.label, operation, value)
        return kind, value

    def _ready(self) -> None:
        """Wait for the actor's envs to be built (once); checks their spaces."""
        if self._spaces is not None:
            return
        if self._construct_error is not None:
            raise self._construct_error
        if self.closed:
            raise EnvError(self.label, "construct", "the env was closed")
        try:
            _, (spaces, where) = self._receive(self._built, "construct",
                                               self.construct_timeout)
        except EnvTimeoutError:
            raise  # still pending: waited for again on the next call
        except EnvError as exc:
            self._construct_error = exc
            self.close()
            raise
        self.node_ip, self.node_id, self.pid = where
        try:
            self._spaces = worker_spaces(self.label, spaces)
        except EnvError as exc:
            self._construct_error = exc
            self.close()
            raise

    def _check_open(self, operation: str) -> None:
        self._ready()
        if self.closed:
            raise EnvError(self.label, operation, "the env was closed")

    # -- stepping -------------------------------------------------------------------

    def step(self, actions: np.ndarray, blocking: bool = True) -> Any:
        """Step every env with its row of ``actions`` (``(num_envs,
        *act_shape)``) in one actor call; returns ``(observ, reward,
        terminated, truncated, infos)`` (first dimension ``num_envs``) or,
        with ``blocking=False``, a promise of it."""
        self._check_open("step")
        answer = self._actor.step.remote(np.asarray(actions))
        self._prefetched.clear()  # a stepped env is no longer fresh from its reset

        def result() -> tuple:
            _, (observ, reward, terminated, truncated, infos, resets) = self._receive(
                answer, "step", self.timeout)
            for index, reset_obs, reset_info in resets:
                self._prefetched[index] = (reset_obs, reset_info)
            return (observ, reward, terminated, truncated,
                    InfoList([(self.num_envs, infos)]))

        return result() if blocking else result

    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        """Reset the envs at local ``indices`` (all when ``None``) with one
        seed (or ``None``) each; returns ``(observ, infos)`` or a promise.
        Envs reset in the actor after their episode ended answer a reset
        without seed or options at once, without a call."""
        self._check_open("reset")
        indices = list(range(self.num_envs)) if indices is None else [int(i) for i in indices]
        seeds = [None] * len(indices) if seeds is None else list(seeds)
        if len(seeds) != len(indices):
            raise ValueError(f"got {len(seeds)} seeds for {len(indices)} envs to reset")
        fresh = {} if options is not None else {
            i: self._prefetched.pop(i) for i, seed in zip(indices, seeds)
            if seed is None and i in self._prefetched}
        remote = [(i, s) for i, s in zip(indices, seeds) if i not in fresh]
        for i, _ in remote:
            self._prefetched.pop(i, None)  # really reset again: the prefetched one is stale
        answer = (self._actor.reset.remote([i for i, _ in remote], [s for _, s in remote],
                                           options) if remote else None)

        def result() -> tuple[np.ndarray, list[dict]]:
            rows = {i: (obs, info or {}) for i, (obs, info) in fresh.items()}
            if answer is not None:
                _, (observ, infos) = self._receive(answer, "reset", self.timeout)
                rows.update(zip([i for i, _ in remote], zip(observ, infos)))
            return np.stack([rows[i][0] for i in indices]), [rows[i][1] for i in indices]

        return result() if blocking else result

    # -- attributes -----------------------------------------------------------------

    def get_attr(self, name: str, index: int = 0) -> Any:
        """Env ``index``'s attribute ``name`` (dotted paths allowed): a copy,
        or a ``RemoteAttribute`` proxy for methods and unpicklable values."""
        from batchrl.envs.external import RemoteAttribute
        self._check_open("getattr")
        kind, value = self._receive(self._actor.getattr.remote(index, name), "getattr",
                                    self.timeout)
        if kind == "proxy":
            return RemoteAttribute(self.env(index), name, value)
        return value

    def call(self, name: str, *args: Any, index: int = 0, **kwargs: Any) -> Any:
        """Call env ``index``'s method ``name`` and return its result."""
        self._check_open("call")
        return self._receive(self._actor.call.remote(index, name, args, kwargs), "call",
                             self.timeout)[1]

    def env(self, index: int) -> WorkerEnv:
        """A handle on env ``index`` of this worker (attribute access and calls)."""
        if not 0 <= index < self.num_envs:
            raise IndexError(f"env index {index} out of range for a worker with "
                             f"{self.num_envs} envs")
        return WorkerEnv(self, index)

    @property
    def actor(self) -> Any:
        """The Ray actor handle (for ``ray.kill`` and inspection)."""
        return self._actor


class _RayMember(_Workers):
    """A ``BatchEnv`` member: a ``RayEnvWorker`` and its envs."""

    def step(self, actions: np.ndarray, blocking: bool) -> Any:
        return self.env.step(actions, blocking)
