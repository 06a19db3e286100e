"""What the machine offers to this process."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Number of CPU cores this process may run on (its affinity mask where
    the platform has one, else all cores)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
