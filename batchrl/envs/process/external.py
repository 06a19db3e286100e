"""One Gymnasium env in a child process; observations travel pickled, so any space
works. In a ``BatchEnv`` an ``ExternalProcess`` is a ``ProcessWorker`` of one env."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, Sequence

import cloudpickle
import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvCrashedError, EnvError, EnvRaisedError
from batchrl.envs.host import attribute_answer, error_answer, resolve
from batchrl.envs.process.channel import Channel, WorkerHandle, start_worker
from batchrl.envs.worker import RemoteAttribute, Worker, constructor_label, reset_arguments


def _worker(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the env, serve requests until ``close`` or EOF."""
    if not start_worker(parent_pid):
        return
    try:
        env = cloudpickle.loads(payload)()
        conn.send(("ok", (env.observation_space, env.action_space)))
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
        with contextlib.suppress(Exception):
            env.close()
        conn.close()


class ExternalProcess(WorkerHandle):
    """A Gymnasium env living in a child process.

    Args:
      constructor: a callable returning a ``gymnasium.Env`` (shipped with cloudpickle, so lambdas
        and closures work), or a Gymnasium id.
      label: name used in error messages (default: the id or the constructor's name).
      timeout, construct_timeout: seconds to wait for any answer, and for building the env, before
        ``EnvTimeoutError`` (see ``Channel``).

    ``step``/``reset`` behave like the env's own (``blocking=False``: a promise of the result; one
    request in flight at a time). Attributes come back as copies, or ``RemoteAttribute`` proxies.
    Errors: ``EnvRaisedError`` with the child's traceback, ``EnvCrashedError`` for a dead worker.
    ``close()`` also runs at exit; the worker exits when the parent dies, even by SIGKILL.
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
        self._construct_error: EnvError | None = None
        self._constructor = constructor
        self._channel = Channel(_worker, cloudpickle.dumps(constructor), self.label, timeout,
                                construct_timeout)

    def restart(self) -> "ExternalProcess":
        """Kill this process; a fresh one with the same constructor, label and timeouts."""
        self._channel.close(wait=False)
        return ExternalProcess(self._constructor, self.label, self.timeout,
                               self._channel.construct_timeout)

    def __repr__(self) -> str:
        return f"ExternalProcess({self.label!r}, pid={self.pid})"

    @property
    def observation_space(self) -> gym.Space:
        return self._ready()[0]

    @property
    def action_space(self) -> gym.Space:
        return self._ready()[1]

    def _ready(self) -> tuple[gym.Space, gym.Space]:
        if self._spaces is None:
            if self._construct_error is not None:
                raise self._construct_error  # the env never existed: say so every time
            try:
                _, self._spaces = self._channel.receive("construct")
            except (EnvRaisedError, EnvCrashedError) as exc:
                self._construct_error = exc
                raise
        return self._spaces

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
        return RemoteAttribute(self, name, *value) if kind == "proxy" else value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get_attr(name)

    def _request(self, command: str, args: Any, blocking: bool, raw: bool = False) -> Any:
        if self._channel.closed:
            raise EnvError(self.label, command, "the env was closed")
        self._ready()
        self._channel.send(command, pickle.dumps((command, args), pickle.HIGHEST_PROTOCOL))

        def result() -> Any:
            answer = self._channel.receive(command)
            return answer if raw else answer[1]

        return result() if blocking else result


class ProcessWorker(Worker):
    """An ``ExternalProcess`` as a ``Worker`` of one env (a batch dimension of 1)."""

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

    def step(self, actions: np.ndarray, blocking: bool = True, copy: bool = True,
             autoreset: np.ndarray | None = None) -> Any:
        reset = autoreset is not None and bool(autoreset[0])
        promise = (self.process.reset(blocking=False) if reset else
                   self.process.step(actions[0], blocking=False))

        def result() -> tuple:
            if reset:
                (obs, info), reward, terminated, truncated = promise(), 0.0, False, False
            else:
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
