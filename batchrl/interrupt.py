"""Stop a long computation cleanly on Ctrl-C (SIGINT) or SIGTERM: ``StopSignals``' handlers
only record the signal; the computation calls ``check()`` where stopping is safe."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Raised where a computation stops because signal ``signum`` (``signal_name``)
    asked it to; ``exit_code`` is ``128 + signum``, as a shell reports for that signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.signal_name}")


class StopSignals:
    """Context manager: while active, SIGINT and SIGTERM set ``signum`` instead of raising
    ``KeyboardInterrupt`` or killing the process; a second signal kills it at once, by that
    signal (a shell sees the usual status, 130 or 143). Exit restores the previous handlers.
    Outside the main thread (where Python cannot install handlers) it does nothing. ``notice``
    is printed to stderr at the first signal (e.g. that a second one quits at once)."""

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
        if self.signum is not None:  # the user insists: die now, by the signal itself
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.notice:
            print(f"\n{signal.Signals(signum).name}: {self.notice}", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
