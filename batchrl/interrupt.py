"""Stop a long computation cleanly on Ctrl-C (SIGINT) or SIGTERM: ``StopSignals``' handlers
only record the signal; the computation calls ``check()`` where stopping is safe. A child
process (an env worker, a collector, a learner) calls ``start_worker`` first: it then dies
with its parent and leaves Ctrl-C to it."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Any, Iterator, NoReturn, Sequence

# The signals that ask a run to stop: Ctrl-C, a scheduler's SIGTERM, and SIGHUP, which a
# closed terminal or SSH session sends (where the platform has it).
SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP")
                                             else ())


class Interrupted(Exception):
    """Raised where a computation stops because signal ``signum`` (``signal_name``)
    asked it to; ``exit_code`` is ``128 + signum``, as a shell reports for that signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.signal_name}")

    def __reduce__(self) -> tuple:
        return type(self), (self.signum,)  # (args holds the message, not the signal)


class StopSignals:
    """Context manager: while active, SIGINT, SIGTERM and SIGHUP (unless ignored, as under
    ``nohup``) set ``signum`` instead of raising ``KeyboardInterrupt`` or killing the process;
    a second signal kills it at once, by that signal (a shell sees the usual status, 130, 143
    or 129). Exit restores the previous handlers. Outside the main thread (where Python
    cannot install handlers) it does nothing. ``notice`` is printed to stderr at the first
    signal (e.g. that a second one quits at once).

    One stop may arrive twice within microseconds (GNU ``timeout`` signals its child, then
    the child's process group): a signal within ``DEBOUNCE_S`` of the one before counts as
    the same request.

    Python runs a handler only when the main thread runs Python, not while it waits in a C
    call that released the GIL (a collective on a learner that stopped answering can wait for
    an hour). A thread therefore watches the signals too (``signal.set_wakeup_fd``): when the
    process still lives ``STUCK_S`` seconds after a second request, it kills the process by
    that signal itself."""

    # Signals closer together than this are one request.
    DEBOUNCE_S = 0.25
    # How long a second request may wait for the main thread's handler.
    STUCK_S = 1.0

    def __init__(self, notice: str | None = None) -> None:
        self.notice = notice
        self.signum: int | None = None
        self._last = -math.inf  # when the handler counted its last request
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup = -1
        self._closed = threading.Event()

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signum is not None

    def check(self) -> None:
        """Raise ``Interrupted`` if a stop was asked for."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if now - self._last < self.DEBOUNCE_S:
            return  # (the same request, delivered twice)
        self._last = now
        if self.signum is not None:  # the user insists: die now, by the signal itself
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.notice:  # (os.write: a print to sys.stderr may be under way in the frame)
            with contextlib.suppress(OSError):
                os.write(2, f"\n{signal.Signals(signum).name}: {self.notice}\n".encode())

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self
        self._closed.clear()
        try:
            reader, writer = socket.socketpair()
        except OSError:  # (no descriptors left: the handlers alone still stop cleanly)
            pass
        else:
            reader.settimeout(None)  # (whatever socket.setdefaulttimeout says)
            writer.setblocking(False)
            self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(),
                                                         warn_on_full_buffer=False)
            self._wakeup = reader, writer
            threading.Thread(target=self._watch, args=(reader,), daemon=True,
                             name="batchrl-stop-signals").start()
        for signum in SIGNALS:
            if (signum == getattr(signal, "SIGHUP", None)
                    and signal.getsignal(signum) is signal.SIG_IGN):
                continue  # (nohup's: this run was meant to outlive its terminal)
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            reader, writer = self._wakeup
            with contextlib.suppress(OSError):
                reader.shutdown(socket.SHUT_RDWR)  # (ends the watching thread's recv)
            writer.close()
            self._wakeup = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _watch(self, reader: socket.socket) -> None:
        """The watching thread: counts the stop requests the C handler saw."""
        requests, last = 0, -math.inf
        with reader:
            while data := reader.recv(64):
                for signum in data:
                    now = time.monotonic()
                    if signum not in SIGNALS or now - last < self.DEBOUNCE_S:
                        continue
                    requests, last = requests + 1, now
                    if requests >= 2:
                        # (the handler kills the process meanwhile if the main thread runs)
                        if not self._closed.wait(self.STUCK_S):
                            _kill_by(signum)


def _kill_by(signum: int) -> None:
    """End this process by ``signum``'s default action, from any thread."""
    with contextlib.suppress(OSError):
        os.write(2, f"\n{signal.Signals(signum).name} again: quitting now (the run waits in "
                    f"a call that Python cannot interrupt)\n".encode())
    try:  # (only the main thread may reset a handler through Python: libc's signal() does)
        import ctypes
        ctypes.CDLL(None).signal(signum, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(0.5)
    except Exception:  # noqa: S110 - no ctypes or libc here: the exit status says it instead
        pass
    os._exit(128 + signum)  # (PID 1 in a container ignores its own default-action signals)


def die_with_parent() -> None:
    """Make this process exit when the process that created the worker dies, even while
    stuck in a ``step()`` that never reads the pipe: by ``prctl(PR_SET_PDEATHSIG)`` (Linux;
    under ``forkserver`` the parent is the fork server, which ends with the worker's creator:
    ``batchrl.envs.process.forkserver_signals``), and elsewhere by a thread waiting on
    ``multiprocessing.parent_process()``."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent is gone
        time.sleep(1.0)  # an idle worker exits cleanly on the pipe's EOF meanwhile
        end_own_group()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="batchrl-parent-watchdog", daemon=True).start()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Around starting a process by exec (a spawned learner, the fork server): SIGINT and
    SIGTERM blocked in this thread, so that the new process starts with them blocked (the
    mask outlives exec): a Ctrl-C while it still imports Python would kill it with a
    traceback; it ignores them, then unblocks them (``start_worker``, the fork server's
    preload). Here a signal that arrives meanwhile waits until the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker (which every start makes sure of) unblocks both
    # signals once it started, instead of restoring the mask: it starts first.
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_worker(parent_pid: int, own_group: bool = False) -> bool:
    """First thing a worker does: tie its life to the parent's and ignore
    Ctrl-C and SIGTERM (sent to the whole process group, but the parent
    decides how to stop). With ``own_group`` it leads a process group of its own, which
    the processes it starts join: ``kill_group`` ends them with it. Returns ``False``
    when the parent is already gone."""
    ignore_stop_signals()
    die_with_parent()
    if own_group and hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
            # (a group apart from the terminal's foreground: its output must not stop it)
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            signal.signal(signal.SIGTTIN, signal.SIG_IGN)
    if parent_pid != os.getppid():
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False  # the parent died before prctl was armed
        except PermissionError:
            pass  # alive, but another user's
    return True


def exit_reporting(line: str, errors: Any, item: Any, sent: Sequence[Any] = ()) -> NoReturn:
    """End a worker process that failed (exit code 1) once ``item`` (its error ``line``) went
    into the ``errors`` queue for its parent, and what it put into the ``sent`` queues before.
    Where the queue cannot send (no thread left for its feeder under the process limit), the
    line goes to stderr instead."""
    try:
        errors.put(item)
        for queue in (errors, *sent):
            queue.close()
            queue.join_thread()
    except Exception:  # noqa: BLE001 - the parent then sees the exit code alone
        with contextlib.suppress(OSError):
            os.write(2, f"{line}\n".encode())
    os._exit(1)


def kill_group(leader: int, reaped: bool = False) -> None:
    """SIGKILL the process group that process ``leader`` leads (``start_worker`` with
    ``own_group``): what the worker started and left running, and the worker if it still
    runs. Nothing if there is no such group (it has ended, or the worker never led one).

    ``reaped``: the worker has exited and was reaped, so its pid is free again. Its group
    keeps the id while members remain (the kernel reuses no pid that names a group), but a
    new process may have the pid once the group is empty: then nothing is killed."""
    if not hasattr(os, "killpg"):
        return
    if reaped:
        try:
            os.getpgid(leader)
            return  # a live process has the pid: not the worker
        except ProcessLookupError:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def end_own_group() -> None:
    """The last act of a worker whose parent is gone, if it leads a process group
    (``start_worker`` with ``own_group``): SIGKILL that group, itself and what its envs
    started and left running, after flushing its output. Nothing otherwise."""
    if not hasattr(os, "killpg") or os.getpgid(0) != os.getpid():
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.killpg(0, signal.SIGKILL)


def ignore_stop_signals() -> None:
    """Ignore SIGINT, SIGTERM and SIGHUP, then unblock them (held by ``signals_held`` if this
    process was started by exec): one that arrived while they were blocked is dropped."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
