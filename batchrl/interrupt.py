"""Stop a long computation cleanly on Ctrl-C (SIGINT) or SIGTERM.

``StopSignals`` installs handlers that only record the signal; the training
loop polls ``requested`` at points where stopping is safe and raises
``Interrupted`` there. A second signal means "now": the handler restores the
default action and re-sends the signal, so the process dies at once with the
conventional status (130 or 143 in a shell). Env workers tie their life to
this process, so none outlives it either way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Raised where a computation stops because a signal asked it to.

    ``signum`` is the signal's number; ``exit_code`` is ``128 + signum``,
    what a shell reports for a process ended by that signal.
    """

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(message or f"interrupted by {name}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Context manager: while active, SIGINT and SIGTERM set ``signum``
    instead of raising ``KeyboardInterrupt`` or killing the process; the
    previous handlers are restored on exit. A second signal kills the
    process at once (default action of that signal).

    Args:
      notice: printed to stderr when the first signal arrives (e.g. that a
        second one quits at once), since the stop itself may take a moment.

    Outside the main thread (where Python cannot install handlers) it does
    nothing and ``requested`` stays false.
    """

    def __init__(self, notice: str | None = None) -> None:
        self.notice = notice
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signum is not None

    def check(self) -> None:
        """Raise ``Interrupted`` if a stop was asked for."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            # The user insists: die now, by the signal itself, so that the
            # parent shell sees the usual status.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.notice:
            print(f"\n{signal.Signals(signum).name}: {self.notice}", file=sys.stderr,
                  flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
