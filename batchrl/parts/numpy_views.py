"""numpy views of CPU tensors, for the per-step bookkeeping of tiny arrays.

An operation on a few dozen numbers costs about a microsecond in numpy and
two to five in torch (dispatch, autograd and allocation bookkeeping). The
normaliser and the episode memory run a dozen such operations at every env
step, so on the CPU they work in numpy on arrays that share the tensors'
memory; on other devices (CUDA) torch does the work.
"""

from __future__ import annotations

import numpy as np
import torch

# False: torch operations on the CPU as well (the tests run both paths).
enabled = True


def view(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy array sharing ``tensor``'s memory, or ``None`` where numpy
    cannot use it: another device, a dtype numpy lacks, or ``enabled`` is
    off. A tensor that requires grad (such as a view of a parameter made
    under ``no_grad``) is read through ``detach()``: the array holds data,
    never a part of a graph."""
    if not (enabled and tensor.is_cpu):
        return None
    try:
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    except (TypeError, RuntimeError):  # e.g. bfloat16, or a lazily conjugated tensor
        return None
