"""Files of a run written all or nothing: a crash, a full disk or a second Ctrl-C leaves the
old file or the new one, never a part of one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode``: ``"w"`` or ``"wb"``) for the caller
    to write; on a clean exit flush it to disk and rename it over ``path`` (then make the
    rename durable); on an error remove it and leave ``path`` as it was. The temporary
    file's name (``NAME.PID.tmp``) is this process's: processes that write the same file at
    once (torchrun's learners) each rename a whole one."""
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
