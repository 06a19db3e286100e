"""Child-process plumbing shared by the env workers.

A worker is a child process that serves requests over a ``multiprocessing``
pipe. Every request is answered by exactly one pickled message:
``("ok", value)``, ``("proxy", type_name)`` for attribute values that cannot be
pickled, or ``("error", (type_name, message, traceback, env_index))``.
``Channel`` is the parent's end: it starts the process, keeps track of the
request in flight, and turns a dead, silent or failing worker into the
``EnvError`` that names it.

Children are started with the ``forkserver`` method where it exists (Linux,
macOS), so they never inherit the parent's threads (torch's thread pools make
``fork`` unsafe) yet start in milliseconds: the fork server has already
imported numpy, gymnasium and the worker modules.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable

from batchrl.envs.errors import EnvCrashedError, EnvError, EnvTimeoutError, error_from_answer
from batchrl.envs.process.main_guard import check_main_guard

_POLL_SECONDS = 0.2
# The fork server imports these before it forks any worker.
_WORKER_MODULES = ["batchrl.envs.process.forkserver_signals", "batchrl.envs.process.external",
                   "batchrl.envs.process.shared_memory"]


def context() -> mp.context.BaseContext:
    """The multiprocessing context workers are started with."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_WORKER_MODULES)
        return ctx
    return mp.get_context("spawn")


def die_with_parent() -> None:
    """Make this process exit when the process that created the worker dies.

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


def start_worker(parent_pid: int) -> bool:
    """First thing a worker does: tie its life to the parent's and ignore
    Ctrl-C and SIGTERM (they reach the whole process group; the parent
    decides how to stop, and closes its workers). Returns ``False`` when the
    parent is already gone."""
    die_with_parent()
    if parent_pid != os.getppid() and not _alive(parent_pid):
        return False  # the parent died before prctl was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _shutdown(process, conn, timeout: float) -> None:
    """Stop a worker: ask politely, then kill (workers ignore SIGTERM)."""
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
            process.kill()
            process.join(1.0)
        if not process.is_alive():
            process.close()  # frees its sentinel descriptor now, not at garbage collection
    finally:
        conn.close()


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


_HEADER = struct.Struct("!i")  # multiprocessing.Connection's length prefix


class Frames:
    """Length-prefixed messages over a connection's socket, in the wire
    format of ``multiprocessing.Connection`` (so either end may use the
    connection's own methods), with one ``read`` system call per message
    where ``recv_bytes`` takes two plus a ``poll``: on a hot path of a few
    hundred microseconds per step, the difference is measurable. Bytes read
    beyond one message are kept for the next.
    """

    def __init__(self, conn):
        self.conn = conn
        self.fd = conn.fileno()
        self.buffer = bytearray()

    def send(self, payload: bytes) -> None:
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        while data:
            data = data[os.write(self.fd, data):]

    def pop(self) -> bytes | None:
        """The next complete message already read, or ``None``."""
        buffer = self.buffer
        if len(buffer) < 4:
            return None
        end = 4 + _HEADER.unpack_from(buffer)[0]
        if len(buffer) < end:
            return None
        message = bytes(buffer[4:end])
        del buffer[:end]
        return message

    def fill(self) -> None:
        """Read what is there (blocks until something is); ``EOFError`` when
        the other end is closed."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise EOFError
        self.buffer += chunk

    def recv(self) -> bytes:
        """Block until a whole message is there and return it."""
        message = self.pop()
        while message is None:
            self.fill()
            message = self.pop()
        return message


class Channel:
    """The parent's end of one worker process.

    Args:
      target: the worker's main function, called as
        ``target(conn, payload, parent_pid)`` in the child.
      payload: bytes handed to the child (the pickled constructors).
      label: name used in error messages.
      timeout: seconds to wait for any answer before raising
        ``EnvTimeoutError``; ``None`` waits as long as the worker is alive.
        The late answer to a request that timed out is dropped when it comes;
        a timed-out construction is waited for again on the next request.
      construct_timeout: the limit for the construction instead (building
        envs can take much longer than a step); ``None``: ``timeout``.

    The child's first message answers the pending ``"construct"`` request.
    Only one request may be in flight at a time.
    """

    def __init__(self, target: Callable, payload: bytes, label: str,
                 timeout: float | None = None, construct_timeout: float | None = None):
        self.label = label
        self.timeout = timeout
        self.construct_timeout = construct_timeout
        self.pending: str | None = None
        self._stale = 0  # answers still due to requests that timed out
        self.closed = False
        check_main_guard()
        ctx = context()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn, payload, os.getpid()),
                                   name=f"batchrl-env:{label}", daemon=True)
        self.process.start()
        self._pid = self.process.pid  # kept: the process object is closed on shutdown
        child_conn.close()
        # A cached poll object: Connection.poll() builds a selector per call,
        # which costs more than the rest of a step's round trip.
        self._frames = Frames(self.conn)
        self._poller = select.poll()
        self._poller.register(self._frames.fd, select.POLLIN | select.POLLHUP)
        self._finalizer = weakref.finalize(self, _shutdown, self.process, self.conn, 2.0)
        self.pending = "construct"

    @property
    def pid(self) -> int | None:
        return self._pid

    def close(self, wait: bool = True) -> None:
        """Stop the worker process. Safe to call more than once. With
        ``wait=False`` it is terminated at once instead of asked to close
        (for a worker that failed, which may hang)."""
        if self.closed:
            return
        self.closed = True
        if wait:
            self._finalizer()
        elif self._finalizer.detach() is not None:
            _shutdown(self.process, self.conn, 0.0)

    def send(self, command: str, message: bytes) -> None:
        """Send a request (already pickled, or raw bytes the worker understands)."""
        if self.closed:
            raise EnvError(self.label, command, "the env was closed")
        if self.pending is not None:
            raise RuntimeError(
                f"{self.label}: {command}() called while the result of {self.pending}() "
                f"was not received yet; call the promise first")
        try:
            self._frames.send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            raise self.crashed(command) from None
        self.pending = command

    def crashed(self, operation: str) -> EnvCrashedError:
        """The error for a worker that died while doing ``operation``."""
        self.process.join(1.0)
        self.pending = None
        return EnvCrashedError(self.label, operation, self.process.exitcode, self.process.pid)

    def receive(self, operation: str) -> tuple[str, Any]:
        """Wait for the answer to ``operation``; returns ``(kind, value)`` for
        ``"ok"`` and ``"proxy"`` answers and raises the worker's errors."""
        if self.pending != operation:
            raise RuntimeError(f"{self.label}: no {operation}() result is pending")
        start = time.monotonic()
        frames = self._frames
        while True:
            message = frames.pop()
            if message is not None:
                if not self._stale:
                    break
                self._stale -= 1  # the late answer to a request that timed out
                continue
            while not self._poller.poll(_POLL_SECONDS * 1000):
                if not self.process.is_alive():
                    raise self.crashed(operation)
                limit = self.timeout
                if operation == "construct" and self.construct_timeout is not None:
                    limit = self.construct_timeout
                if limit is not None and time.monotonic() - start > limit:
                    if operation != "construct":  # construct stays pending: wait again later
                        # The worker still answers this request when it is done; that
                        # late answer must be dropped, not handed to the next request.
                        self.pending = None
                        self._stale += 1
                    raise EnvTimeoutError(
                        self.label, operation,
                        f"no answer from the env worker (pid {self.pid}) within {limit} s")
            try:
                frames.fill()
            except (EOFError, ConnectionError, OSError):
                raise self.crashed(operation) from None
        self.pending = None
        kind, value = pickle.loads(message)
        if kind == "error":
            raise error_from_answer(self.label, operation, value)
        return kind, value


class WorkerHandle:
    """The parent's side of a worker process, as seen by users: its pid,
    timeout, ``close()`` and context-manager use, over ``self._channel``."""

    _channel: Channel

    @property
    def pid(self) -> int | None:
        """Process id of the worker."""
        return self._channel.pid

    @property
    def timeout(self) -> float | None:
        """Seconds to wait for an answer (``None``: as long as the worker lives)."""
        return self._channel.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._channel.timeout = value

    @property
    def closed(self) -> bool:
        return self._channel.closed

    def close(self) -> None:
        """Stop the worker process. Safe to call more than once."""
        self._channel.close()

    def _discard(self) -> None:
        """Close after a failure: terminate the process without waiting."""
        self._channel.close(wait=False)

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
