"""Errors shared by the env layer, the algorithms and the process families (collectors,
learners), which import nothing of each other, and how they report one in a line."""

from __future__ import annotations

import sys

LINE_CHARS = 2000  # of an error reported in one line


def error_line(exc: BaseException, limit: int = LINE_CHARS) -> str:
    """``exc`` in one line to report (``TypeName: the first line of its message``), cut to
    ``limit`` characters: such lines travel through pipes that hold 64 KiB, to a reader that
    may wait for the writer to exit first."""
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return line if len(line) <= limit else line[:limit] + " [...]"


class UnsupportedSpaceError(TypeError):
    """An observation or action space that cannot be batched or learned from."""


def tolerant_console() -> None:
    """Make this process's stdout and stderr write what their encoding cannot hold (a "±"
    for ``PYTHONIOENCODING=ascii``, a path's undecodable bytes) as escapes instead of raising
    in the middle of a run or after its end."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
