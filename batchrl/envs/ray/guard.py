"""Stop the Ray processes that batchrl's ``ray.init`` started when the trainer dies (by
SIGKILL or the OOM killer: no ``ray.shutdown()``, and Ray's agents would run on for minutes).
The guard, this file run as a script (``python guard.py PID``), notes the trainer's descendants
every second and SIGKILLs them once its pipe from the trainer closes. Linux only (``/proc``)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

_STOP = b"q"  # sent by stop(): this process lives on, kill nothing
_SCAN_SECONDS = 1.0


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from ``/proc``."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):  # the processes' directories
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def descendants(root: int, table: dict[int, tuple[int, str]]) -> dict[int, str]:
    """pid -> start time of the descendants of ``root`` in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found[pid] = table[pid][1]
        stack.extend(children.get(pid, []))
    return found


def _kill(seen: dict[int, str]) -> None:
    """SIGKILL those of ``seen`` still running (same start time: no recycled pid) and below."""
    table = _processes()
    targets: dict[int, str] = {}
    for pid, started in seen.items():
        if table.get(pid, (0, None))[1] == started:
            targets[pid] = started
            targets.update(descendants(pid, table))
    for pid in targets:
        if pid != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


class RayGuard:
    """Kills this process's descendants (Ray's) if this process dies before
    ``stop()``: start it right before ``ray.init`` starts Ray here, stop it
    after ``ray.shutdown()``. ``start`` returns ``None`` without ``/proc``."""

    def __init__(self, process: subprocess.Popen):
        self._process = process

    @classmethod
    def start(cls) -> "RayGuard | None":
        """A guard watching this process, or ``None`` where ``/proc`` is missing."""
        if not Path("/proc/self/stat").exists():
            return None
        # Isolated (-I): the script needs only the standard library. Its own
        # session: a Ctrl-C to the trainer's process group must not end it.
        return cls(subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE, start_new_session=True))

    def stop(self) -> None:
        """End the guard; it kills nothing."""
        stdin = self._process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):  # the guard is gone already
                stdin.write(_STOP)
                stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _main(watched: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seen: dict[int, str] = {}
    stdin = sys.stdin.buffer.raw
    while True:
        # Noted beforehand: once the trainer is gone, init adopts the orphans.
        seen.update(descendants(watched, _processes()))
        readable, _, _ = select.select([stdin], [], [], _SCAN_SECONDS)
        if readable:
            if stdin.read(1) != _STOP:  # end of file: the watched process died
                _kill(seen)
            return


if __name__ == "__main__":
    _main(int(sys.argv[1]))
