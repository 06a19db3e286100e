"""Run a Gymnasium environment in a child process (one env per process).

The parent talks to the child over a ``multiprocessing`` pipe; the protocol and
the process life cycle are ``batchrl.envs.process.channel``'s. Observations travel
pickled, so any space works here. ``EnvWorker`` (``batchrl.envs.process.shared_memory``)
hosts several envs per process instead, with arrays in shared memory. In a
``BatchEnv`` an ``ExternalProcess`` is a ``ProcessWorker`` of one env.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvCrashedError, EnvError, EnvRaisedError
from batchrl.envs.host import attribute_answer, error_answer, resolve
from batchrl.envs.process.channel import Channel, WorkerHandle, constructor_label, start_worker
from batchrl.envs.worker import RemoteAttribute, Worker, reset_arguments


def _worker(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the env, then serve requests until told
    to close or until the parent goes away."""
    if not start_worker(parent_pid):
        return
    try:
        env = cloudpickle.loads(payload)()
        conn.send(("ok", (env.observation_space, env.action_space,
                          getattr(env.spec, "id", None))))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(error_answer(exc))
        conn.close()
        return

    try:
        while True:
            try:
                command, args = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if command == "close":
                conn.send(("ok", None))
                break
            try:
                if command == "step":
                    obs, reward, terminated, truncated, info = env.step(args)
                    conn.send(("ok", (obs, reward, bool(terminated), bool(truncated), info)))
                elif command == "reset":
                    conn.send(("ok", env.reset(**args)))
                elif command == "getattr":
                    conn.send(attribute_answer(env, args))
                elif command == "call":
                    name, call_args, call_kwargs = args
                    conn.send(("ok", resolve(env, name)(*call_args, **call_kwargs)))
                else:
                    raise ValueError(f"unknown command {command!r}")
            except (BrokenPipeError, ConnectionError):
                break
            except Exception as exc:
                conn.send(error_answer(exc))
    finally:
        try:
            env.close()
        except Exception:
            pass
        conn.close()


class ExternalProcess(WorkerHandle):
    """A Gymnasium env living in a child process.

    Args:
      constructor: a callable returning a ``gymnasium.Env``; shipped with
        cloudpickle, so lambdas and closures work. A string is taken as a
        Gymnasium id (``gymnasium.make(id)``).
      label: name used in error messages (default: the Gymnasium id or the
        constructor's name).
      timeout: seconds to wait for any answer before raising
        ``EnvTimeoutError``; ``None`` waits as long as the worker is alive.
        The late answer to a request that timed out is dropped when it comes;
        a timed-out construction is waited for again on the next request.
      construct_timeout: the limit for building the env instead (``None``:
        ``timeout``).

    ``step``/``reset`` behave like the env's own. With ``blocking=False`` they
    return a promise: call it to receive the result. Only one request may be
    in flight at a time. Attribute access is forwarded: picklable values come
    back as copies, anything else as a ``RemoteAttribute`` proxy.
    ``observation_space`` and ``action_space`` are cached in the parent.

    Errors raised in the child are raised here as ``EnvRaisedError`` with the
    original type name, message and the worker's traceback; a dead worker is an
    ``EnvCrashedError`` with its exit code or signal. ``close()`` is idempotent
    and also runs at interpreter exit; the worker also exits by itself when
    the parent process dies, even by SIGKILL.
    """

    def __init__(self, constructor: Callable[[], gym.Env] | str, label: str | None = None,
                 timeout: float | None = None, construct_timeout: float | None = None):
        if isinstance(constructor, str):
            env_id = constructor
            constructor = lambda: gym.make(env_id)  # noqa: E731
            label = label or env_id
        elif not callable(constructor):
            raise TypeError(f"ExternalProcess needs a callable returning a gymnasium.Env "
                            f"or a Gymnasium id string, got {type(constructor).__name__}")
        self.label = label or constructor_label(constructor)
        self._spaces: tuple[gym.Space, gym.Space] | None = None
        self._spec_id: str | None = None
        self._construct_error: EnvError | None = None
        self._constructor = constructor
        self._channel = Channel(_worker, cloudpickle.dumps(constructor), self.label, timeout,
                                construct_timeout)

    # -- life cycle --------------------------------------------------------

    def restart(self) -> "ExternalProcess":
        """Close this process (killing it if it hangs) and return a fresh
        ``ExternalProcess`` with the same constructor, label and timeout."""
        self._discard()
        return ExternalProcess(self._constructor, self.label, self.timeout,
                               self._channel.construct_timeout)

    def __repr__(self) -> str:
        return f"ExternalProcess({self.label!r}, pid={self.pid})"

    # -- spaces ------------------------------------------------------------

    @property
    def observation_space(self) -> gym.Space:
        self._ready()
        return self._spaces[0]

    @property
    def action_space(self) -> gym.Space:
        self._ready()
        return self._spaces[1]

    def _ready(self) -> None:
        if self._spaces is not None:
            return
        if self._construct_error is not None:
            raise self._construct_error  # the env never existed: say so every time
        try:
            _, (obs_space, act_space, spec_id) = self._channel.receive("construct")
        except (EnvRaisedError, EnvCrashedError) as exc:
            self._construct_error = exc
            raise
        self._spaces = (obs_space, act_space)
        self._spec_id = spec_id

    # -- forwarded calls -----------------------------------------------------

    def step(self, action: Any, blocking: bool = True) -> Any:
        """Step the remote env; returns Gymnasium's 5-tuple, or a promise of it."""
        return self._request("step", action, blocking)

    def reset(self, *, seed: int | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        """Reset the remote env; returns ``(observation, info)`` or a promise."""
        return self._request("reset", {"seed": seed, "options": options}, blocking)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the env's method ``name`` (dotted paths allowed) and return its result."""
        return self._request("call", (name, args, kwargs), True)

    def get_attr(self, name: str) -> Any:
        """Return the env's attribute ``name`` (dotted paths allowed)."""
        kind, value = self._request("getattr", name, True, raw=True)
        if kind == "proxy":
            return RemoteAttribute(self, name, value)
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get_attr(name)

    def _request(self, command: str, args: Any, blocking: bool, raw: bool = False) -> Any:
        if self._channel.closed:
            raise EnvError(self.label, command, "the env was closed")
        self._ready()
        self._channel.send(command, pickle.dumps((command, args), pickle.HIGHEST_PROTOCOL))
        if blocking:
            return self._receive(command, raw)
        return lambda: self._receive(command, raw)

    def _receive(self, operation: str, raw: bool) -> Any:
        kind, value = self._channel.receive(operation)
        return (kind, value) if raw else value


class ProcessWorker(Worker):
    """An ``ExternalProcess`` as a ``Worker`` of one env: how ``BatchEnv``
    drives it (actions and results gain a batch dimension of 1)."""

    num_envs = 1

    def __init__(self, process: ExternalProcess):
        self.process = process
        self.label = process.label

    @property
    def observation_space(self) -> gym.Space:
        return self.process.observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.process.action_space

    def step(self, actions: np.ndarray, blocking: bool = True, copy: bool = True) -> Any:
        promise = self.process.step(actions[0], blocking=False)

        def result() -> tuple:
            obs, reward, terminated, truncated, info = promise()
            return (np.asarray(obs)[None], np.array([reward], np.float64),
                    np.array([terminated], bool), np.array([truncated], bool), [info])

        return result() if blocking else result

    def reset(self, indices: Sequence[int] | None = None,
              seeds: Sequence[int | None] | None = None, options: dict | None = None,
              blocking: bool = True) -> Any:
        indices, seeds = reset_arguments(1, indices, seeds)
        if indices != [0]:
            raise IndexError(f"a ProcessWorker has one env (index 0), got indices {indices}")
        promise = self.process.reset(seed=seeds[0], options=options, blocking=False)

        def result() -> tuple[np.ndarray, list[dict]]:
            obs, info = promise()
            return np.asarray(obs)[None], [info]

        return result() if blocking else result

    def restart(self) -> "ProcessWorker":
        return ProcessWorker(self.process.restart())

    def env(self, index: int) -> ExternalProcess:
        if index != 0:
            raise IndexError(f"env index {index} out of range for a worker with 1 env")
        return self.process

    def close(self) -> None:
        self.process.close()
