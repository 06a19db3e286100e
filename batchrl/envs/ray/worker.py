"""Several Gymnasium envs in one Ray actor, anywhere in a Ray cluster: ``RayEnvWorker``
is ``EnvWorker`` for a cluster, with one actor call per worker and batch step."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs.ray import cluster as ray_cluster
from batchrl.envs.errors import (EnvRaisedError, EnvTimeoutError,
                                 RayWorkerCrashedError, error_from_answer)
from batchrl.envs.host import EnvHost, StepArrays
from batchrl.envs.spaces import worker_spaces
from batchrl.envs.worker import RemoteWorker
from batchrl.nested import copy_nested, take


class RayEnvHost:
    """The Ray actor's body (``ray.remote(RayEnvHost)``): an ``EnvHost`` and its
    step arrays. Methods answer as ``EnvHost``'s: env exceptions never escape,
    so Ray's own errors always mean a broken actor."""

    def __init__(self, payload: bytes, prefetch_reset: bool, send_infos: bool):
        self._payload = payload
        self.host = EnvHost(prefetch_reset, send_infos)
        self.arrays: StepArrays | None = None

    def build(self) -> tuple:
        """Build the envs; answers their spaces and where this actor runs."""
        import ray
        answer = self.host.build(cloudpickle.loads(self._payload))
        self._payload = b""
        if answer[0] != "ok":
            return answer
        env = self.host.envs[0]
        self.arrays = StepArrays(len(self.host.envs), env.observation_space, env.action_space)
        where = (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                 os.getpid())
        return ("ok", (answer[1], where))

    def step(self, actions: np.ndarray, autoreset: np.ndarray | None = None) -> tuple:
        """Step env ``i`` with ``actions[i]`` (reset it if ``autoreset[i]``); answers
        ``(observ, reward, terminated, truncated, infos, resets)`` as
        ``RemoteWorker._receive_step`` returns them."""
        arrays = self.arrays
        answer = self.host.step(actions, arrays, autoreset)
        if answer[0] != "ok":
            return answer
        infos, resets = answer[1]
        # Copies: the reply is serialized after this returns; the next step overwrites.
        first = arrays.reset_observ
        return ("ok", (copy_nested(arrays.observ), arrays.reward.copy(),
                       arrays.terminated.copy(), arrays.truncated.copy(), infos,
                       # (an object row is replaced at each step, not written into)
                       [(index, copy_nested(take(first, index)) if arrays.shared
                         else first[index], info) for index, info in resets]))

    def reset(self, indices: list[int], seeds: list, options: dict | None) -> tuple:
        """Reset the envs at ``indices``; answers ``(observ, infos)``."""
        answer = self.host.reset(indices, seeds, options, self.arrays)
        if answer[0] != "ok":
            return answer
        return ("ok", (take(self.arrays.reset_observ, indices), answer[1]))

    def ask(self, command: str, args: tuple) -> tuple:
        """``EnvHost.getattr(*args)`` or ``EnvHost.call(*args)``, by ``command``."""
        return getattr(self.host, command)(*args)

    def close(self) -> None:
        """Close the envs (before the actor is killed)."""
        self.host.close()


def _reason(exc: Exception) -> str:
    """Ray's explanation of a dead actor in one line: its first sentence and the
    cause ("...because its node has died"), without the indented details."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith(("\t", " "))]
    text = " ".join(lines[:2]) or "no reason given"
    return f"{type(exc).__name__}: {text[:400]}"


@functools.cache
def _actor_class(ray: Any) -> Any:
    return ray.remote(RayEnvHost)


class RayEnvWorker(RemoteWorker):
    """A Ray actor hosting ``len(constructors)`` Gymnasium envs.

    Args:
      constructors, label, prefetch_reset, infos, timeout, construct_timeout: as for ``EnvWorker``
        (construction includes placing the actor); the constructors run on the node Ray picks, which
        needs batchrl and the env's packages.
      resources: Ray resources reserved for the actor, e.g. ``{"CPU": 1}`` or
        ``{"CPU": 1, "env_node": 1}`` (see ``ray_cluster.actor_options``).
      address: the Ray cluster to join if not connected yet (``ray_cluster.acquire``).
      scheduling_strategy: Ray's placement of the actor; ``"SPREAD"`` puts the workers of a batch on
        different nodes where resources allow.

    Behaves as ``EnvWorker`` (``step`` may return read-only arrays), but a dead actor or lost node
    is a ``RayWorkerCrashedError``. ``node_ip``, ``node_id`` and ``pid`` say where the actor runs.
    """

    def __init__(self, constructors: Sequence[Callable[[], gym.Env] | str],
                 label: str | None = None, timeout: float | None = None,
                 construct_timeout: float | None = None, prefetch_reset: bool = True,
                 infos: bool = True, resources: dict[str, float] | None = None,
                 address: str = "", scheduling_strategy: Any = "SPREAD"):
        super().__init__("RayEnvWorker", constructors, label, prefetch_reset, infos)
        resources = {"CPU": 1} if resources is None else dict(resources)
        options = ray_cluster.actor_options(resources)  # checks them before connecting
        self.timeout = timeout
        self.construct_timeout = timeout if construct_timeout is None else construct_timeout
        self.resources = resources
        self._options = dict(constructors=self._constructors, label=label, address=address,
                             construct_timeout=construct_timeout, resources=resources, infos=infos,
                             prefetch_reset=prefetch_reset, scheduling_strategy=scheduling_strategy)
        self._ray = ray_cluster.acquire(address)
        self.closed = False
        try:
            self._actor = _actor_class(self._ray).options(
                **options, scheduling_strategy=scheduling_strategy, max_restarts=0,
                max_task_retries=0).remote(cloudpickle.dumps(self._calls), prefetch_reset, infos)
            self._built = self._actor.build.remote()
        except BaseException:
            self.closed = True
            ray_cluster.release()
            raise
        self.node_ip: str | None = None
        self.node_id: str | None = None
        self.pid: int | None = None
        # The request in flight: (operation, its answer's object ref), kept from the
        # *_async half for ray.get in the *_wait half.
        self._pending: tuple[str, Any] | None = None

    def close(self) -> None:
        """Close the envs and kill the actor; disconnect from Ray if this was
        the last Ray worker of a connection batchrl made. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._spaces is not None:  # ask it to close its envs, briefly
                self._ray.wait([self._actor.close.remote()], timeout=2.0)
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: S110 - already dead or Ray disconnected: nothing to stop
            pass
        finally:
            ray_cluster.release()

    def restart(self) -> "RayEnvWorker":
        """Kill this worker's actor; a fresh one with the same constructors and options."""
        fresh = RayEnvWorker(timeout=self.timeout, **self._options)
        self._spaces = None  # no polite close: the old actor may hang or be gone
        self.close()
        return fresh

    def __repr__(self) -> str:
        where = f", node={self.node_ip}" if self.node_ip else ""
        return f"RayEnvWorker({self.label!r}, num_envs={self.num_envs}{where})"

    def _receive(self, ref: Any, operation: str, limit: float | None) -> Any:
        """The answer ``ref`` to ``operation``; Ray's and the envs' errors as ``EnvError``s."""
        exceptions = self._ray.exceptions
        try:
            kind, value = self._ray.get(ref, timeout=limit)
        except exceptions.GetTimeoutError:
            where = f" on node {self.node_ip}" if self.node_ip else ""
            detail = f"no answer from the Ray actor{where} within {limit} s"
            if operation == "construct":
                detail = (f"the Ray actor was not placed, or did not build its envs, within "
                          f"{limit} s (it asks for {self.resources}; are they free on some "
                          f"node?)")
            raise EnvTimeoutError(self.label, operation, detail) from None
        except exceptions.RayTaskError as exc:  # a failure of the actor code, not of an env
            cause = getattr(exc, "cause", None) or exc
            raise EnvRaisedError(self.label, operation, type(cause).__name__, str(cause),
                                 str(exc)) from None
        except exceptions.RayError as exc:  # the actor died, or its node was lost
            raise RayWorkerCrashedError(self.label, operation, self.node_ip,
                                        _reason(exc)) from None
        if kind == "error":
            raise error_from_answer(self.label, operation, value)
        return kind, value

    def _construct(self) -> tuple[gym.Space, gym.Space]:
        _, (spaces, where) = self._receive(self._built, "construct", self.construct_timeout)
        self.node_ip, self.node_id, self.pid = where
        return worker_spaces(self.label, spaces)

    def _check_idle(self, operation: str) -> None:
        """Raise if a request's answer is still due (one in flight at most)."""
        if self._pending is not None:
            raise RuntimeError(f"{self.label}: {operation}() called while the result of "
                               f"{self._pending[0]}() was not received yet; call "
                               f"{self._pending[0]}_wait() first")

    def _take(self, operation: str) -> Any:
        """The answer to the ``operation`` in flight."""
        if self._pending is None or self._pending[0] != operation:
            raise RuntimeError(f"{self.label}: no {operation}() result is pending")
        ref, self._pending = self._pending[1], None
        return self._receive(ref, operation, self.timeout)[1]

    def _send_step(self, actions: np.ndarray, autoreset: np.ndarray | None) -> None:
        self._check_idle("step")
        self._pending = ("step", self._actor.step.remote(actions, autoreset))

    def _receive_step(self, copy: bool) -> tuple:
        return self._take("step")  # new arrays already (read-only ones, from Ray)

    def _send_reset(self, indices: list[int], seeds: list, options: dict | None) -> None:
        self._check_idle("reset")
        self._pending = ("reset", self._actor.reset.remote(indices, seeds, options))

    def _receive_reset(self, indices: list[int]) -> tuple[np.ndarray, list[dict]]:
        return self._take("reset")

    def _ask(self, command: str, args: tuple) -> tuple[str, Any]:
        return self._receive(self._actor.ask.remote(command, args), command, self.timeout)

    @property
    def actor(self) -> Any:
        """The Ray actor handle (for ``ray.kill`` and inspection)."""
        return self._actor
