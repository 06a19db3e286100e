"""What the machine offers to this process."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
