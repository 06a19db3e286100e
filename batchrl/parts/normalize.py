"""Streaming mean and variance, for normalising observations and rewards."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StreamingNormalizer(nn.Module):
    """Normalises values with running statistics of everything it was updated with.

    Statistics are merged batch by batch with Chan et al.'s parallel formula,
    kept in float64 buffers (so they are part of ``state_dict``).
    ``transform`` computes in float32 with copies of the mean and of the
    inverse standard deviation made after each update: it runs at every env
    step, where each saved tensor operation counts.

    Args:
      shape: shape of one value (``()`` for rewards).
      center: subtract the running mean.
      scale: divide by the running standard deviation (1 until two values
        were seen).
      clip: clip transformed values to ``[-clip, clip]``; ``None`` for no clip.
    """

    def __init__(self, shape: tuple[int, ...] = (), center: bool = True, scale: bool = True,
                 clip: float | None = None, eps: float = 1e-8):
        super().__init__()
        self.shape = tuple(shape)
        self.center, self.scale, self.clip, self.eps = center, scale, clip, eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("sum_sq", torch.zeros(self.shape, dtype=torch.float64))
        # Derived, not saved: the count as a Python number, and float32 copies
        # of the statistics for transform(), rebuilt when they are stale.
        self._count = 0.0
        self._derived: tuple[torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "StreamingNormalizer":
        self._derived = None  # .to(device) and friends
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._count = float(self.count)
        self._derived = None

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        """Add a batch ``(B, *shape)`` to the statistics."""
        values = values.detach().reshape((-1,) + self.shape).to(torch.float64)
        n = values.shape[0]
        if n == 0:
            return
        batch_var, batch_mean = torch.var_mean(values, 0, correction=0)
        count = self._count
        total = count + n
        delta = batch_mean - self.mean
        self.mean.add_(delta, alpha=n / total)
        self.sum_sq.add_(batch_var, alpha=n).add_(delta * delta, alpha=count * n / total)
        self.count.fill_(total)
        self._count = total
        self._derived = None

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased variance (ones until two values were seen), float64."""
        if self._count < 2:
            return torch.ones_like(self.sum_sq)
        return self.sum_sq / (self._count - 1)

    def transform(self, values: torch.Tensor) -> torch.Tensor:
        """Normalise ``(..., *shape)`` values; returns the input's dtype."""
        if self._derived is None:
            self._derived = (self.mean.to(torch.float32),
                             (1.0 / (self.variance.sqrt() + self.eps)).to(torch.float32))
        offset, inverse_std = self._derived
        result = values.to(torch.float32)
        if self.center:
            result = result - offset
        if self.scale:
            result = result * inverse_std
        if self.clip is not None:
            result = result.clamp(-self.clip, self.clip)
        return result.to(values.dtype)
