"""Child-process plumbing of the env workers (``shared_memory._serve``), which answer
each request with one pickled answer in ``batchrl.envs.host``'s format. Children start
with ``forkserver`` where it exists: no inherited threads (torch's pools make ``fork``
unsafe), yet a fast start."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import select
import struct
import time
from typing import Any, Callable

from batchrl.envs.errors import EnvCrashedError, EnvError, EnvTimeoutError, error_from_answer
from batchrl.envs.process.main_guard import check_main_guard, main_not_reimported
from batchrl.envs.worker import Closeable
from batchrl.interrupt import kill_group, signals_held

_POLL_SECONDS = 0.2
# The fork server imports these before it forks any worker.
_WORKER_MODULES = ["batchrl.envs.process.forkserver_signals",
                   "batchrl.envs.process.shared_memory"]


def context() -> mp.context.BaseContext:
    """The multiprocessing context workers are started with (the fork server running)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_WORKER_MODULES)
        # Started (once) with Ctrl-C and SIGTERM held until its preload ignores them: it
        # imports batchrl first, and a signal then would kill it with a traceback.
        with signals_held():
            multiprocessing.forkserver.ensure_running()
        return ctx
    return mp.get_context("spawn")


def _shutdown(process, conn, timeout: float) -> None:
    """Stop a worker: ask politely, then kill (workers ignore SIGTERM); then kill what its
    envs started and left running (a simulator's server, say): the worker leads their
    process group (``_serve``)."""
    pid = process.pid
    alive = False  # (unknown after an error: then only a group no process leads is killed)
    try:
        if process.is_alive():
            with contextlib.suppress(OSError, EOFError, ValueError):
                conn.send(("close", None))
                if conn.poll(timeout):
                    conn.recv()
            process.join(timeout)
        if process.is_alive():
            kill_group(pid)
            process.kill()
            process.join(1.0)
        alive = process.is_alive()
        if not alive:
            process.close()  # frees its sentinel descriptor now, not at garbage collection
    finally:
        conn.close()
        kill_group(pid, reaped=not alive)


_HEADER = struct.Struct("!i")  # multiprocessing.Connection's length prefix


class Frames:
    """Length-prefixed messages on a connection's socket in its own wire
    format, with one ``read`` call per message (``recv_bytes`` takes two and
    a ``poll``). Bytes read beyond one message are kept for the next."""

    def __init__(self, conn: mp.connection.Connection) -> None:
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
        """Read what is there (blocking); ``EOFError`` once the other end is closed."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise EOFError
        self.buffer += chunk

    def recv(self) -> bytes:
        """Block until a whole message is there and return it."""
        while (message := self.pop()) is None:
            self.fill()
        return message


class Channel:
    """The parent's end of a worker process: starts it, tracks the one request
    in flight, and turns a dead, silent or failing worker into an ``EnvError``.

    Args:
      target: the worker's main function, ``target(conn, payload, parent_pid)``.
      payload: bytes handed to the child (the pickled constructors).
      label: name used in error messages.
      timeout: seconds to wait for any answer before ``EnvTimeoutError``
        (``None``: as long as the worker lives); a late answer is dropped, a
        timed-out construction (the child's first message) waited for again.
      construct_timeout: the limit for the construction instead (``None``: ``timeout``).
    """

    def __init__(self, target: Callable, payload: bytes, label: str,
                 timeout: float | None = None, construct_timeout: float | None = None):
        self.label = label
        self.timeout = timeout
        self.construct_timeout = construct_timeout
        self.pending: str | None = "construct"
        self._stale = 0  # answers still due to requests that timed out
        self.closed = False
        check_main_guard()
        ctx = context()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child_conn, payload, os.getpid()),
                                   name=f"batchrl-env:{label}", daemon=True)
        try:
            with main_not_reimported():
                self.process.start()
        except BaseException as exc:
            self.conn.close()
            child_conn.close()
            # EOF: the fork server could not fork, and died. (Other errors, such as too many
            # open files, go on as they are: train.py says what to free for them.)
            if not isinstance(exc, (BlockingIOError, EOFError)):
                raise
            why = "its fork server died" if isinstance(exc, EOFError) else f"{exc}"
            raise EnvError(label, "construct", f"cannot start a worker process ({why}): is "
                                               f"the limit on processes and threads reached "
                                               f"(ulimit -u, a container's pids.max)?") from None
        self.pid: int | None = self.process.pid  # kept: the process object gets closed
        child_conn.close()
        # Connection.poll() builds a selector per call: dearer than the rest of a step.
        self._frames = Frames(self.conn)
        self._poller = select.poll()
        self._poller.register(self._frames.fd, select.POLLIN | select.POLLHUP)
        # Run when this object is collected, or at exit before multiprocessing's own exit hook
        # joins its children (the worker ignores that hook's SIGTERM: a join would wait for
        # ever); a weakref.finalize may run after that hook.
        self._finalizer = mp.util.Finalize(
            self, _shutdown, (self.process, self.conn, 2.0), exitpriority=10)

    def close(self, wait: bool = True) -> None:
        """Stop the worker process; idempotent. ``wait=False`` kills it at
        once instead of asking it to close (a failed worker may hang), as does
        closing a worker that let a request time out: it would read the close
        request only after the request it is stuck in."""
        if self.closed:
            return
        self.closed = True
        if wait and not self._stale:
            self._finalizer()
        elif self._finalizer.still_active():
            self._finalizer.cancel()
            _shutdown(self.process, self.conn, 0.0)

    def send(self, command: str, message: bytes) -> None:
        """Send a request (already pickled, or raw bytes the worker understands)."""
        if self.closed:
            raise EnvError(self.label, command, "the env was closed")
        if self.pending is not None:
            raise self.busy(command)
        try:
            self._frames.send(message)
        except OSError:
            raise self.crashed(command) from None
        self.pending = command

    def busy(self, command: str) -> RuntimeError:
        """The error for sending ``command`` while an answer is still due."""
        return RuntimeError(f"{self.label}: {command}() called while the result of "
                            f"{self.pending}() was not received yet; call {self.pending}_wait() "
                            f"first")

    def crashed(self, operation: str) -> EnvCrashedError:
        """The error for a worker that died while doing ``operation``."""
        self.process.join(1.0)
        self.pending = None
        return EnvCrashedError(self.label, operation, self.process.exitcode, self.process.pid)

    def receive(self, operation: str) -> tuple[str, Any]:
        """Wait for the answer to ``operation``: ``(kind, value)``, or the worker's error."""
        if self.closed:  # (its connection is closed: its descriptor may be another's now)
            raise EnvError(self.label, operation, "the env was closed")
        if self.pending != operation:
            raise RuntimeError(f"{self.label}: no {operation}() result is pending")
        try:
            message = self._wait(operation)
        except BaseException:
            if self.pending == operation and operation != "construct":
                # Interrupted (Ctrl-C): the answer comes late; the next request must not get it.
                self.pending = None
                self._stale += 1
            raise
        self.pending = None
        kind, value = pickle.loads(message)
        if kind == "error":
            raise error_from_answer(self.label, operation, value)
        return kind, value

    def _wait(self, operation: str) -> bytes:
        """``receive``'s wait for the answer's frame."""
        # The time waited, counting at most two poll intervals per interval: a wait this
        # process spent suspended (Ctrl-Z then fg, a scheduler's SIGSTOP then SIGCONT of the
        # job) is no delay of the worker's, which resumes with it (or, idle in its own process
        # group, never stopped) and must not be declared hung.
        waited = 0.0
        last = time.monotonic()
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
                now = time.monotonic()
                waited += min(now - last, 2 * _POLL_SECONDS)
                last = now
                limit = (self.construct_timeout if operation == "construct"
                         and self.construct_timeout is not None else self.timeout)
                if limit is not None and waited > limit:
                    if operation != "construct":  # construct stays pending: wait again later
                        # Drop the late answer when it comes, not hand it to the next request.
                        self.pending = None
                        self._stale += 1
                    raise EnvTimeoutError(self.label, operation, f"no answer from the env "
                                          f"worker (pid {self.pid}) within {limit} s")
            try:
                frames.fill()
            except (EOFError, OSError):
                raise self.crashed(operation) from None
        return message


class WorkerHandle(Closeable):
    """The user's side of ``self._channel``: pid, timeout, ``close()``, ``with``."""

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
        """``close()`` was called."""
        return self._channel.closed

    def close(self, wait: bool = True) -> None:
        """Stop the worker process (``wait=False``: kill it at once). Safe to call more
        than once."""
        self._channel.close(wait)

