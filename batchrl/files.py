"""Files of a run written all or nothing: a crash, a full disk or a second Ctrl-C leaves the
old file or the new one, never a part of one; and the lock that keeps a second run out of a
run's log directory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode``: ``"w"`` or ``"wb"``) for the caller
    to write; on a clean exit flush it to disk and rename it over ``path`` (then make the
    rename durable); on an error remove it and leave ``path`` as it was. The temporary
    file's name (``NAME.PID.tmp``) is this process's: processes that write the same file at
    once each rename a whole one."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, mode) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform can fsync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


LOCK_FILE = "run.lock"  # in a run's log directory: held by the process that trains it

_held: dict[Path, list[int]] = {}  # this process's locks: directory -> [fd, holds]


class LogdirInUse(RuntimeError):
    """Another process holds the log directory: a run is training there."""


def hold_logdir(logdir: Path) -> None:
    """Claim ``logdir`` (which exists) for this process's run until ``release_logdir`` or
    the process's end; ``LogdirInUse`` naming the holder's pid when another process holds
    it. Two runs in one directory would write each other's records, events and checkpoints.

    A POSIX record lock (``fcntl.lockf``) on ``LOCK_FILE``: the system drops it when the
    process ends however it ends (no stale lock after a crash or SIGKILL), processes the
    run starts do not inherit it, and the same process may hold it again (``train.py``
    first, then its ``Trainer``): each hold needs its release. On a file system without
    record locks (some network ones) the run goes on unguarded."""
    key = Path(logdir).resolve()
    if key in _held:
        _held[key][1] += 1
        return
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):  # (held: one of those two)
            _held[key] = [fd, 1]  # a file system without record locks: the run goes on
            return
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise LogdirInUse(
            f"{logdir} is in use by another training run"
            f"{f' (pid {holder})' if holder.isdigit() else ''}: wait for it to end or stop "
            f"it, or choose another --logdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # (for the message above)
    _held[key] = [fd, 1]


def release_logdir(logdir: Path) -> None:
    """Undo one ``hold_logdir(logdir)`` of this process; the last one lets go of the lock."""
    key = Path(logdir).resolve()
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])  # (closing any descriptor of the file drops the process's lock)
