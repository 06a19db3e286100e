"""One Gymnasium env in a child process, with the env's own API: a front over an ``EnvWorker``
of that env alone, so that it has the same child, wire format and errors. Any space works:
arrays that shared memory cannot hold travel pickled (``EnvWorker(any_space=True)``)."""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np

from batchrl.envs.process.shared_memory import EnvWorker
from batchrl.envs.worker import WorkerFront
from batchrl.nested import copy_nested, take


class ExternalProcess(WorkerFront):
    """A Gymnasium env living in a child process.

    Args:
      constructor: a callable returning a ``gymnasium.Env`` (shipped with cloudpickle, so lambdas
        and closures work), or a Gymnasium id.
      label: name used in error messages (default: the id or the constructor's name).
      timeout, construct_timeout: seconds to wait for any answer, and for building the env, before
        ``EnvTimeoutError`` (see ``Channel``).

    ``step``/``reset`` behave like the env's own; ``step_async(action)`` then ``step_wait()`` (and
    ``reset_async``/``reset_wait``) split them, one request in flight at a time. Observations of a
    fixed-shape numeric space come back in the space's dtype, rewards as float64, flags as bool.
    Attributes come back as copies, or ``RemoteAttribute`` proxies. Errors: ``EnvRaisedError``
    with the child's traceback, ``EnvCrashedError`` for a dead worker, ``EnvTimeoutError``.
    ``close()`` also runs at exit; the worker exits when the parent dies, even by SIGKILL. In a
    ``BatchEnv`` it is its ``worker``, an ``EnvWorker`` of one env.
    """

    def __init__(self, constructor: Callable[[], gym.Env] | str, label: str | None = None,
                 timeout: float | None = None, construct_timeout: float | None = None):
        if not (callable(constructor) or isinstance(constructor, str)):
            raise TypeError(f"ExternalProcess needs a callable returning a gymnasium.Env "
                            f"or a Gymnasium id string, got {type(constructor).__name__}")
        self._constructor = constructor
        self._construct_timeout = construct_timeout
        # The env's own reset sequence: no reset ahead of the user's.
        self.worker = EnvWorker([constructor], label, timeout, prefetch_reset=False,
                                construct_timeout=construct_timeout, any_space=True)
        self.label = self.worker.label

    def restart(self) -> "ExternalProcess":
        """Kill this process; a fresh one with the same constructor, label and timeouts."""
        self.worker.close(wait=False)
        return ExternalProcess(self._constructor, self.label, self.timeout,
                               self._construct_timeout)

    def __repr__(self) -> str:
        return f"ExternalProcess({self.label!r}, pid={self.pid})"

    @property
    def observation_space(self) -> gym.Space:
        return self.worker.observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.worker.action_space

    @property
    def pid(self) -> int | None:
        """Process id of the worker."""
        return self.worker.pid

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for an answer (``None``: as long as the worker lives)."""
        return self.worker.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self.worker.timeout = value

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self.worker.closed

    def close(self) -> None:
        """Stop the worker process. Safe to call more than once."""
        self.worker.close()

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Step the remote env; returns Gymnasium's 5-tuple."""
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: Any) -> None:
        """Send the env ``action``; ``step_wait`` returns the result."""
        worker = self.worker
        if worker.shares_arrays:
            actions = np.asarray(action)[None]
        else:  # kept as given: the env gets the very object
            actions = np.empty(1, object)
            actions[0] = action
        worker.step_async(actions)

    def step_wait(self) -> tuple[Any, float, bool, bool, dict]:
        """``(observation, reward, terminated, truncated, info)`` of the step sent."""
        observ, reward, terminated, truncated, infos = self.worker.step_wait(copy=False)
        first = copy_nested(take(observ, 0)) if self.worker.shares_arrays else observ[0]
        return first, reward[0], bool(terminated[0]), bool(truncated[0]), infos[0]

    def reset(self, *, seed: int | None = None,
              options: dict | None = None) -> tuple[Any, dict]:
        """Reset the remote env; returns ``(observation, info)``."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, *, seed: int | None = None, options: dict | None = None) -> None:
        """Send the env a reset; ``reset_wait`` returns the result."""
        self.worker.reset_async([0], [seed], options)

    def reset_wait(self) -> tuple[Any, dict]:
        """``(observation, info)`` of the reset sent."""
        observ, infos = self.worker.reset_wait()
        return take(observ, 0), infos[0]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the env's method ``name`` (dotted paths allowed) and return its result."""
        return self.worker.call_env(0, name, args, kwargs)

    def get_attr(self, name: str) -> Any:
        """Return the env's attribute ``name`` (dotted paths allowed)."""
        return self.worker.get_attr(name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "worker":  # not set: __init__ failed
            raise AttributeError(name)
        return self.get_attr(name)
