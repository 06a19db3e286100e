"""Run a Gymnasium environment in a child process.

The parent talks to the child over a ``multiprocessing`` pipe. Each request is
answered by exactly one message: ``("ok", value)``, ``("proxy", type_name)`` for
attribute values that cannot be pickled, or ``("error", (type, message, tb))``.

Children are started with the ``forkserver`` method where it exists (Linux,
macOS), so they never inherit the parent's threads (torch's thread pools make
``fork`` unsafe) yet start in milliseconds: the fork server has already
imported numpy, gymnasium and this module.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import cloudpickle
import gymnasium as gym

from batchrl.envs.errors import (EnvAttributeError, EnvCrashedError, EnvError,
                                 EnvRaisedError, EnvTimeoutError)

Promise = Callable[[], Any]

_POLL_SECONDS = 0.2


def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["batchrl.envs.external"])
        return ctx
    return mp.get_context("spawn")


def _die_with_parent() -> None:
    """Make this process exit when the process that created the env dies.

    The pipe's EOF already ends an idle worker when the parent dies; this also
    covers a worker stuck inside a long ``step()`` that never reads the pipe.

    On Linux, ``prctl(PR_SET_PDEATHSIG)`` asks the kernel to SIGKILL us when
    our parent process dies. Under ``forkserver`` that parent is the fork
    server, not the process that created the env, and the fork server only
    exits once every worker has closed its copy of the server's "alive" pipe,
    which a busy worker never does. So a watchdog thread also waits on
    ``multiprocessing.parent_process()``'s sentinel, which becomes ready when
    the creating process dies (even by SIGKILL), and then kills this worker.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent is gone
        time.sleep(1.0)  # an idle worker exits cleanly on the pipe's EOF meanwhile
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="batchrl-parent-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(conn, payload: bytes, parent_pid: int) -> None:
    """Child process main loop: build the env, then serve requests until told
    to close or until the parent goes away."""
    _die_with_parent()
    if parent_pid != os.getppid() and not _alive(parent_pid):
        return  # the parent died before prctl was armed
    # Ctrl-C reaches the whole process group; the parent decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send_error(exc: BaseException) -> None:
        conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))

    try:
        env = cloudpickle.loads(payload)()
        conn.send(("ok", (env.observation_space, env.action_space,
                          getattr(env.spec, "id", None))))
    except Exception as exc:  # reported to the parent, which raises it
        send_error(exc)
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
                    value = _resolve(env, args)
                    # Methods and env objects must stay remote: a pickled copy
                    # would silently detach from the worker's live env.
                    if isinstance(value, gym.Env) or (callable(value)
                                                      and not isinstance(value, gym.Space)):
                        conn.send(("proxy", type(value).__name__))
                        continue
                    try:
                        conn.send(("ok", value))
                    except Exception:  # not picklable: hand out a proxy
                        conn.send(("proxy", type(value).__name__))
                elif command == "call":
                    name, call_args, call_kwargs = args
                    conn.send(("ok", _resolve(env, name)(*call_args, **call_kwargs)))
                else:
                    raise ValueError(f"unknown command {command!r}")
            except (BrokenPipeError, ConnectionError):
                break
            except Exception as exc:
                send_error(exc)
    finally:
        try:
            env.close()
        except Exception:
            pass
        conn.close()


def _shutdown(process, conn, timeout: float) -> None:
    """Stop a worker: ask politely, then terminate, then kill."""
    try:
        if process.is_alive():
            try:
                conn.send(("close", None))
                if conn.poll(timeout):
                    conn.recv()
            except (OSError, EOFError, ValueError):
                pass
            process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
    finally:
        conn.close()


def _constructor_label(constructor: Callable[[], gym.Env]) -> str:
    if isinstance(constructor, str):
        return constructor
    name = getattr(constructor, "__qualname__", None) or repr(constructor)
    module = getattr(constructor, "__module__", None)
    return f"{module}.{name}" if module and module != "__main__" else name


class RemoteAttribute:
    """Stands for an attribute of a remote env that cannot be pickled.

    Attribute access on it is forwarded further (``env.unwrapped.model.nq``)
    and calling it calls the remote method (``env.unwrapped.render()``).
    """

    def __init__(self, env: "ExternalProcess", path: str, type_name: str):
        self._env = env
        self._path = path
        self._type_name = type_name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._env.get_attr(f"{self._path}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._env.call(self._path, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<remote {self._type_name} {self._path!r} of {self._env.label}>"


class ExternalProcess:
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
                 timeout: float | None = None):
        if isinstance(constructor, str):
            env_id = constructor
            constructor = lambda: gym.make(env_id)  # noqa: E731
            label = label or env_id
        elif not callable(constructor):
            raise TypeError(f"ExternalProcess needs a callable returning a gymnasium.Env "
                            f"or a Gymnasium id string, got {type(constructor).__name__}")
        self.label = label or _constructor_label(constructor)
        self.timeout = timeout
        self._pending: str | None = None
        self._stale = 0  # answers still due to requests that timed out
        self._closed = False
        self._spaces: tuple[gym.Space, gym.Space] | None = None
        self._spec_id: str | None = None
        self._construct_error: EnvError | None = None
        ctx = _context()
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=_worker, args=(child_conn, cloudpickle.dumps(constructor), os.getpid()),
            name=f"batchrl-env:{self.label}", daemon=True)
        self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _shutdown, self._process, self._conn, 2.0)
        self._pending = "construct"

    # -- life cycle --------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Process id of the worker."""
        return self._process.pid

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the worker process. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "ExternalProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ExternalProcess({self.label!r}, pid={self.pid})"

    # -- spaces ------------------------------------------------------------

    def _ready(self) -> None:
        if self._spaces is not None:
            return
        if self._construct_error is not None:
            raise self._construct_error  # the env never existed: say so every time
        try:
            obs_space, act_space, spec_id = self._receive("construct")
        except (EnvRaisedError, EnvCrashedError) as exc:
            self._construct_error = exc
            raise
        self._spaces = (obs_space, act_space)
        self._spec_id = spec_id

    @property
    def observation_space(self) -> gym.Space:
        self._ready()
        return self._spaces[0]

    @property
    def action_space(self) -> gym.Space:
        self._ready()
        return self._spaces[1]

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

    # -- transport -----------------------------------------------------------

    def _request(self, command: str, args: Any, blocking: bool, raw: bool = False) -> Any:
        if self._closed:
            raise EnvError(self.label, command, "the env was closed")
        self._ready()
        if self._pending is not None:
            raise RuntimeError(
                f"{self.label}: {command}() called while the result of {self._pending}() "
                f"was not received yet; call the promise first")
        try:
            self._conn.send((command, args))
        except (BrokenPipeError, ConnectionError, OSError):
            raise self._crashed(command) from None
        self._pending = command
        if blocking:
            return self._receive(command, raw)
        return lambda: self._receive(command, raw)

    def _crashed(self, operation: str) -> EnvCrashedError:
        self._process.join(1.0)
        self._pending = None
        return EnvCrashedError(self.label, operation, self._process.exitcode, self._process.pid)

    def _receive(self, operation: str, raw: bool = False) -> Any:
        if self._pending != operation:
            raise RuntimeError(f"{self.label}: no {operation}() result is pending")
        start = time.monotonic()
        while True:
            while not self._conn.poll(_POLL_SECONDS):
                if not self._process.is_alive():
                    raise self._crashed(operation)
                if self.timeout is not None and time.monotonic() - start > self.timeout:
                    if operation != "construct":  # construct stays pending: wait again later
                        # The worker still answers this request when it is done; that
                        # late answer must be dropped, not handed to the next request.
                        self._pending = None
                        self._stale += 1
                    raise EnvTimeoutError(
                        self.label, operation,
                        f"no answer from the env worker (pid {self.pid}) within {self.timeout} s")
            try:
                kind, value = self._conn.recv()
            except (EOFError, ConnectionError, OSError):
                raise self._crashed(operation) from None
            if not self._stale:
                break
            self._stale -= 1  # the late answer to a request that timed out
        self._pending = None
        if kind == "error":
            remote_type, message, tb = value
            cls = EnvAttributeError if remote_type == "AttributeError" else EnvRaisedError
            raise cls(self.label, operation, remote_type, message, tb)
        return (kind, value) if raw else value

