"""Streaming mean and variance, for normalising observations and rewards."""

from __future__ import annotations

import torch
from torch import nn


class StreamingNormalizer(nn.Module):
    """Normalises values with running statistics of everything it was updated with.

    Statistics are merged batch by batch with Chan et al.'s parallel formula,
    kept in float64 buffers (so they are part of ``state_dict``).

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

    @torch.no_grad()
    def update(self, values: torch.Tensor) -> None:
        """Add a batch ``(B, *shape)`` to the statistics."""
        values = values.detach().reshape((-1,) + self.shape).to(torch.float64)
        n = values.shape[0]
        if n == 0:
            return
        batch_mean = values.mean(0)
        batch_sum_sq = ((values - batch_mean) ** 2).sum(0)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * (n / total)
        self.sum_sq += batch_sum_sq + delta ** 2 * (self.count * n / total)
        self.count.copy_(total)

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased variance (ones until two values were seen), float64."""
        if self.count < 2:
            return torch.ones_like(self.sum_sq)
        return self.sum_sq / (self.count - 1)

    def transform(self, values: torch.Tensor) -> torch.Tensor:
        """Normalise ``(..., *shape)`` values; returns the input's dtype."""
        dtype = values.dtype
        result = values.to(torch.float64)
        if self.center:
            result = result - self.mean
        if self.scale:
            result = result / (self.variance.sqrt() + self.eps)
        if self.clip is not None:
            result = result.clamp(-self.clip, self.clip)
        return result.to(dtype)
