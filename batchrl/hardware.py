"""What the machine offers to this process: the cores it may use, and whether a device
computes bfloat16 in hardware."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")


def allowed_cores() -> list[int]:
    """The core ids this process may run on (its affinity mask; all cores where
    the platform has none)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _quota(directory: Path) -> float | None:
    """CPUs the cgroup at ``directory`` may use per period (``None``: no quota)."""
    try:
        if (directory / "cpu.max").exists():  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((directory / "cpu.cfs_quota_us").read_text())  # cgroup v1; -1: none
        period = int((directory / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def cgroup_cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs
    (``None`` without one): what a container or a ``systemd-run -p CPUQuota=``
    grants, which the affinity mask does not show."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers and "cpu" not in controllers.split(","):
            continue
        mount = root if not controllers else root / controllers
        if controllers and not mount.is_dir():
            mount = root / "cpu"
        directory = mount / path.lstrip("/")
        if not directory.is_dir():
            directory = mount  # the path is outside this mount namespace's view
        while True:
            limit = _quota(directory)
            if limit is not None:
                limits.append(limit)
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent
    return min(limits) if limits else None


def usable_cores() -> int:
    """Cores this process may keep busy: its affinity mask, capped by its
    cgroup's CPU quota (rounded up), at least 1."""
    cores = len(allowed_cores())
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker, running an actor or a task (without importing
    Ray where it is not loaded); not the driver."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized()
                and ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


def pinnable_cores() -> list[int]:
    """The cores to pin this process's workers to: its affinity mask, or none (``[]``) where
    pinning would not pay: a platform without affinity; a cgroup CPU quota below the
    mask (containers that share a host would all pin to the same first cores); a Ray worker
    (Ray reserves CPUs, not cores: every actor and task of a node sees all its cores, and
    they would all pin to its first ones)."""
    if not hasattr(os, "sched_setaffinity") or in_ray_worker():
        return []
    cores = allowed_cores()
    return cores if usable_cores() >= len(cores) else []


def core_share(cores: Sequence[int], index: int, count: int) -> Sequence[int]:
    """Part ``index`` of ``count`` contiguous parts of ``cores`` (sizes differ by one at
    most); with more parts than cores, the one core it shares with others (``[]`` for no
    cores)."""
    if not cores:
        return []
    start, end = len(cores) * index // count, len(cores) * (index + 1) // count
    return cores[start:end] or [cores[start]]


# What computes bfloat16 in hardware, in words (for messages).
BFLOAT16_HARDWARE = ("CPUs with AVX-512 BF16, AMX or Arm BF16; CUDA GPUs of compute "
                     "capability 8.0+")


def native_bfloat16(device: Any) -> bool | None:
    """Whether ``device`` (a ``torch.device`` or its name) has bfloat16 arithmetic in
    hardware: a CUDA GPU of compute capability 8.0 or later (or ROCm), a CPU with AVX-512
    BF16 or AMX (x86) or BF16 (Arm). ``None`` where torch cannot tell (other device types; a
    torch without ``torch.cpu.get_capabilities``). Elsewhere oneDNN and CUDA emulate
    bfloat16, at several times float32's cost."""
    import torch  # (here: batchrl.config imports this module, and must not load torch)

    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.version.hip) or torch.cuda.get_device_properties(device).major >= 8
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if device.type != "cpu" or capabilities is None:
        return None
    flags = capabilities()
    return any(flags.get(flag, False) for flag in ("avx512_bf16", "amx_bf16", "bf16",
                                                   "sve_bf16"))


def resolve_precision(precision: str, device: Any) -> str:
    """``train.precision`` for ``device``: ``"auto"`` is ``"bfloat16"`` where the device
    computes it in hardware (``native_bfloat16``), else ``"float32"`` (also where torch
    cannot tell); others are kept."""
    if precision != "auto":
        return precision
    return "bfloat16" if native_bfloat16(device) else "float32"
