"""Crash-safe checkpoint files: write to a temporary file, fsync, rename.

A checkpoint is never seen half-written: ``os.replace`` is atomic, so after a
crash at any moment the directory holds only complete checkpoint files (and
maybe a stray ``*.tmp`` that is ignored and cleaned up).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")


def checkpoint_path(logdir: Path, step: int) -> Path:
    return Path(logdir) / f"ckpt-{step:012d}.pt"


def list_checkpoints(logdir: Path) -> list[Path]:
    """Complete checkpoints in ``logdir``, oldest first."""
    logdir = Path(logdir)
    if not logdir.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in logdir.iterdir()
             if (m := _NAME.match(path.name))]
    return [path for _, path in sorted(found)]


def latest_checkpoint(logdir: Path) -> Path | None:
    """The newest complete checkpoint in ``logdir``, or ``None``."""
    checkpoints = list_checkpoints(logdir)
    return checkpoints[-1] if checkpoints else None


def save_checkpoint(logdir: Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``; keep the newest ``keep``."""
    path = checkpoint_path(logdir, step)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)
    for old in list_checkpoints(logdir)[:-keep]:
        old.unlink(missing_ok=True)
    for stray in Path(logdir).glob("ckpt-*.pt.tmp"):
        stray.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` onto ``device``."""
    return torch.load(path, map_location=device, weights_only=False)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
