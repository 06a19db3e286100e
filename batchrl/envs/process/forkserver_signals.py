"""Imported only by multiprocessing's fork server, as a preload module. A ``kill -TERM`` to
the process group (a job scheduler, ``timeout``) also reaches the fork server, whose death
would kill every env worker (their parent-death signal): the trainer would see crashed envs
instead of stopping cleanly. So it ignores SIGTERM, as the workers do (it starts with both
signals blocked, until this module ignores them: ``channel.context``). It ignores Ctrl-C too,
and so do the processes it starts from their first instruction: the fork server gives them
the signal handlers it had after this module, and a Ctrl-C while one still imports (before
``interrupt.start_worker`` ignores it) would kill it, a crash where the trainer stops.

It exits when the process that started it (the trainer) dies, even if that process was
killed. multiprocessing alone does not ensure that: every child holds the fork server's
"alive" pipe open, so a worker stuck in a call that holds the GIL (where its own watchdog
thread cannot run) would keep the fork server alive, and the fork server would keep the
worker alive, since the worker's parent-death signal fires only when the fork server ends.
So the fork server asks the kernel for ``SIGUSR1`` when its parent dies
(``PR_SET_PDEATHSIG``, Linux), gives idle workers a moment to exit on their pipes' EOF,
kills the workers that are still busy, with the process groups they lead (what their envs
started), and exits."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import time
import types

from batchrl.interrupt import ignore_stop_signals, kill_group

# How long the fork server waits for its workers to exit by themselves once the trainer is
# gone (an idle worker reads EOF at once and closes its envs).
GRACE_SECONDS = 1.0
_SERVER = os.getpid()
_TRAINER = os.getppid()


def _parent_died(signum: int, frame: types.FrameType | None) -> None:
    # The workers inherit this handler: in them it does nothing. The fork server's parent
    # "dies" for the kernel also when the thread that started it ends while the trainer
    # lives on (the parent-death signal follows threads): then its parent is unchanged.
    if os.getpid() != _SERVER or os.getppid() == _TRAINER:
        return
    # The workers are not reaped here: a zombie keeps its pid, so the groups they lead cannot
    # be mistaken for another's when they are killed below.
    workers = _children()
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(map(_running, workers)):
        time.sleep(0.02)
    for worker in workers:  # (and what their envs started, in the groups they lead)
        kill_group(worker)
    os._exit(0)


def _children() -> list[int]:
    """The fork server's child processes (the workers), from ``/proc`` (Linux)."""
    pids = []
    for path in glob.glob(f"/proc/{_SERVER}/task/*/children"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as file:
                pids += [int(pid) for pid in file.read().split()]
    return pids


def _running(pid: int) -> bool:
    """Whether child ``pid`` still runs (it is neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# (started with both blocked, ``channel.context``: one that came while Python started is dropped)
ignore_stop_signals()
if sys.platform.startswith("linux"):
    signal.signal(signal.SIGUSR1, _parent_died)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != _TRAINER:  # the trainer died before the signal was armed
        os._exit(0)
