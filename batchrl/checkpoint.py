"""Crash-safe checkpoint files: write to a temporary file, fsync, rename (atomic), so after
a crash the directory holds only complete checkpoints (and maybe a stray ``*.tmp``, ignored
and cleaned up). A file that cannot be read anyway raises ``CheckpointError`` naming it
rather than being skipped: training on from an older one would quietly hide the damage."""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from batchrl.files import atomic_write

_NAME = re.compile(r"^ckpt-(\d{12,})\.pt$")  # (12 digits, more from step 10**12 on)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read or is not a batchrl checkpoint."""


def list_checkpoints(logdir: Path) -> list[Path]:
    """Complete checkpoints in ``logdir``, oldest first."""
    found = [(int(m.group(1)), path) for path in Path(logdir).glob("ckpt-*.pt")
             if (m := _NAME.match(path.name))]
    return [path for _, path in sorted(found)]


def latest_checkpoint(logdir: Path) -> Path | None:
    """The newest complete checkpoint in ``logdir``, or ``None``."""
    checkpoints = list_checkpoints(logdir)
    return checkpoints[-1] if checkpoints else None


def serialize(state: dict[str, Any]) -> bytes:
    """``state`` as the bytes of a checkpoint file (a snapshot kept in memory)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def save_checkpoint(logdir: Path, step: int, state: dict[str, Any] | bytes,
                    keep: int = 3) -> Path:
    """Atomically write ``state`` (a dict, streamed to the file without a copy in memory, or
    ``serialize``'s bytes) as the checkpoint of ``step``; keep the newest ``keep``."""
    path = Path(logdir) / f"ckpt-{step:012d}.pt"
    with atomic_write(path, "wb") as file:
        if isinstance(state, bytes):
            file.write(state)
        else:
            torch.save(state, file)
    for old in list_checkpoints(logdir)[:-keep]:
        old.unlink(missing_ok=True)
    for stray in Path(logdir).glob("ckpt-*.pt.*tmp"):  # (NAME.PID.tmp; older: NAME.tmp)
        stray.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint`` onto ``device``; raises
    ``CheckpointError`` naming the file when it cannot be read or is not a checkpoint.

    On the CPU the tensors are mapped from the file (``mmap``, copy-on-write) rather than
    read into memory of the process's own: while a resume copies a replay buffer of
    gigabytes into the algorithm's, the checkpoint's copy is file pages the system can drop
    and read again, not a second copy that must stay resident. Every record's checksum is
    checked first, which reads the file once (through the same file pages)."""
    on_cpu = torch.device(device).type == "cpu"
    try:
        # (torch.load checks no checksums of a mapped file: a changed byte would load)
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise CheckpointError(f"cannot read checkpoint {path}: its record {damaged} fails "
                                  f"its checksum; {_DAMAGED}")
        state = torch.load(path, map_location=device, weights_only=False, mmap=on_cpu)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:  # (the file system's error, not the file's content)
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    except (ImportError, AttributeError) as exc:
        # (pickle finds an object's class by its module and name: code that moved or was
        # renamed since the checkpoint was written, not a damaged file)
        missing = isinstance(exc, ImportError) or str(exc).startswith("Can't get attribute")
        if not (missing and _NAME.match(Path(path).name)):
            raise _unreadable(path, exc) from None
        raise CheckpointError(
            f"cannot read checkpoint {path}: it holds an object whose class cannot be found "
            f"here ({type(exc).__name__}: {exc}); load it with the code that wrote it (its "
            f"modules importable, e.g. on PYTHONPATH)") from None
    except Exception as exc:  # unpickling a damaged file fails with many types
        raise _unreadable(path, exc) from None
    if not isinstance(state, dict) or "algorithm" not in state:
        raise CheckpointError(f"{path} is not a batchrl checkpoint (no 'algorithm' state)")
    return state


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    """The error for a file ``torch.load`` failed to read with ``exc``: not a checkpoint, or a
    damaged one."""
    if not _NAME.match(Path(path).name):
        return CheckpointError(f"{path} is not a batchrl checkpoint (those are the ckpt-*.pt "
                               f"files of a run's log directory): {type(exc).__name__}: {exc}")
    return CheckpointError(f"cannot read checkpoint {path} ({type(exc).__name__}: {exc}); "
                           f"{_DAMAGED}")


_DAMAGED = ("the file is damaged (checkpoints are written atomically, so something else "
            "changed it). Delete it to continue from the previous checkpoint")
