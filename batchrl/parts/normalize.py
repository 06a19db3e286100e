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
        # Derived, not saved, and kept in a plain object: nn.Module's
        # __setattr__ costs microseconds, and these change at every env step.
        self._cache = _Derived()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "StreamingNormalizer":
        self._cache.stale()  # .to(device) and friends
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._cache.count = float(self.count)
        self._cache.stale()

    def update(self, values: torch.Tensor) -> None:
        """Add a batch ``(B, *shape)`` to the statistics."""
        values = values.detach()  # instead of no_grad(), which costs more than the update
        if values.shape[1:] != self.shape:
            values = values.reshape((-1,) + self.shape)
        n = values.shape[0]
        if n == 0:
            return
        batch_var, batch_mean = torch.var_mean(values.to(torch.float64), 0, correction=0)
        cache = self._cache
        count = cache.count
        total = count + n
        delta = batch_mean.sub_(self.mean)
        self.mean.add_(delta, alpha=n / total)
        self.sum_sq.add_(batch_var, alpha=n).add_(delta.square_(), alpha=count * n / total)
        self.count.fill_(total)
        cache.count = total
        cache.stale()

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased variance (ones until two values were seen), float64."""
        count = self._cache.count
        if count < 2:
            return torch.ones_like(self.sum_sq)
        return self.sum_sq / (count - 1)

    def transform(self, values: torch.Tensor) -> torch.Tensor:
        """Normalise ``(..., *shape)`` values; returns the input's dtype."""
        cache = self._cache
        if cache.offset is None:
            cache.offset = self.mean.to(torch.float32)
            # 1 / (std + eps), in float64 and then rounded once, as before.
            cache.inverse_std = (self.variance.sqrt_().add_(self.eps).reciprocal_()
                                 .to(torch.float32))
        result = values if values.dtype == torch.float32 else values.to(torch.float32)
        # The first operation allocates the result, the others work in place.
        if self.center:
            result = result - cache.offset
        if self.scale:
            result = result * cache.inverse_std if result is values else result.mul_(
                cache.inverse_std)
        if self.clip is not None:
            result = (result.clamp(-self.clip, self.clip) if result is values
                      else result.clamp_(-self.clip, self.clip))
        return result if result.dtype == values.dtype else result.to(values.dtype)


class _Derived:
    """What ``StreamingNormalizer`` derives from its buffers: the count as a
    Python number and float32 copies of the mean and of the inverse standard
    deviation (``None`` when stale)."""

    def __init__(self) -> None:
        self.count = 0.0
        self.offset: torch.Tensor | None = None
        self.inverse_std: torch.Tensor | None = None

    def stale(self) -> None:
        self.offset = self.inverse_std = None
