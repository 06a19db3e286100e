"""numpy views of CPU tensors, for the per-step bookkeeping of tiny arrays: numpy operations
on a few dozen numbers cost less than torch's (no dispatch or autograd bookkeeping), so on the
CPU the normaliser and the episode memory work on arrays sharing the tensors' memory."""

from __future__ import annotations

import numpy as np
import torch

# False: torch operations on the CPU as well (the tests run both paths).
enabled = True


def view(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy array sharing ``tensor``'s memory, or ``None`` where numpy
    cannot use it: another device, a dtype numpy lacks, or ``enabled`` off.
    A tensor that requires grad is read through ``detach()``."""
    if not (enabled and tensor.is_cpu):
        return None
    try:
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    except (TypeError, RuntimeError):  # e.g. bfloat16, or a lazily conjugated tensor
        return None
