"""Streaming mean and variance, for normalising observations and rewards."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchrl.parts import numpy_views


class Statistics(NamedTuple):
    """Count, mean and sum of squared deviations of a set of values, float64 tensors: the
    mean and ``sum_sq`` of one value's shape."""

    count: torch.Tensor
    mean: torch.Tensor
    sum_sq: torch.Tensor

    def __add__(self, other: "Statistics") -> "Statistics":  # type: ignore[override]
        """The statistics of both sets together (Chan et al.'s parallel formula)."""
        total = self.count + other.count
        if float(total) == 0:
            return self
        delta = other.mean - self.mean
        weight = other.count / total
        return Statistics(total, self.mean + delta * weight,
                          self.sum_sq + other.sum_sq + delta * delta * self.count * weight)

    def __sub__(self, other: "Statistics") -> "Statistics":  # type: ignore[override]
        """The statistics of the values in ``self`` that are not in ``other``, a subset of
        them: the inverse of ``+`` (``(a + b) - a == b`` up to float64 rounding)."""
        count = self.count - other.count
        if float(count) == 0:
            return Statistics(count, torch.zeros_like(self.mean), torch.zeros_like(self.sum_sq))
        mean = (self.mean * self.count - other.mean * other.count) / count
        delta = mean - other.mean
        sum_sq = self.sum_sq - other.sum_sq - delta * delta * other.count * count / self.count
        return Statistics(count, mean, sum_sq)

    def flat(self) -> torch.Tensor:
        """One float64 vector ``[count, *mean, *sum_sq]`` (for collectives)."""
        return torch.cat([self.count.reshape(1), self.mean.reshape(-1), self.sum_sq.reshape(-1)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, shape: tuple[int, ...]) -> "Statistics":
        """The inverse of ``flat()`` for values of ``shape``."""
        size = flat.numel() // 2
        return cls(flat[0].clone(), flat[1:1 + size].reshape(shape).clone(),
                   flat[1 + size:].reshape(shape).clone())


class StreamingNormalizer(nn.Module):
    """Normalises values with running statistics of everything it was updated with.

    Statistics are merged batch by batch (Chan et al.'s parallel formula) in
    float64 buffers, part of ``state_dict``; ``transform`` uses float32 copies
    of the mean and of ``1 / (std + eps)``, remade after each update. On the CPU
    the work is done in numpy on views of the buffers (``batchrl.parts.numpy_views``).

    With ``defer``, ``update`` holds values back and merges them when the buffer is
    full or anything reads the statistics (``transform``, ``variance``, the buffers,
    ``state_dict``, a copy or a move): for statistics read far less often than
    updated, such as rewards. Only the float rounding of the merges differs.

    Args:
      shape: shape of one value (``()`` for rewards).
      center: subtract the running mean.
      scale: divide by the running standard deviation (1 until two values were seen).
      clip: clip transformed values to ``[-clip, clip]``; ``None`` for no clip.
      eps: added to the standard deviation.
      defer: values ``update`` may hold back (0: merge every batch at once).
    """

    def __init__(self, shape: tuple[int, ...] = (), center: bool = True, scale: bool = True,
                 clip: float | None = None, eps: float = 1e-8, defer: int = 0):
        super().__init__()
        if not isinstance(defer, int) or defer < 0:
            raise ValueError(f"defer must be a whole number of values >= 0, got {defer!r}")
        # A plain object (nn.Module's __setattr__ is slow), made first: __getattr__ reads it.
        self._cache = _Derived()
        self.shape, self.defer = tuple(shape), defer
        self.center, self.scale, self.clip, self.eps = center, scale, clip, eps
        for name, shape in (("count", ()), ("mean", self.shape), ("sum_sq", self.shape)):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.float64))

    def __getattr__(self, name: str) -> Any:
        # nn.Module looks buffers up here: a reader gets the held values merged first.
        if name in ("mean", "sum_sq", "count"):
            self.flush()
        return super().__getattr__(name)

    def __getstate__(self) -> dict[str, Any]:
        self.flush()  # a copy holds nothing back (see _Derived.__getstate__)
        return super().__getstate__()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "StreamingNormalizer":
        self.flush()
        self._cache.moved()  # .to(device) and friends replace the buffers
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.flush()
        super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._cache.held = 0  # the loaded statistics replace everything seen
        super()._load_from_state_dict(*args, **kwargs)
        self._cache.count = float(self.count)
        self._cache.moved()  # loading with assign=True replaces the buffers

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """numpy views of ``(mean, sum_sq, count)``; empty where numpy cannot use them."""
        arrays = self._cache.arrays
        if arrays is None:
            views = tuple(numpy_views.view(b) for b in (self.mean, self.sum_sq, self.count))
            arrays = self._cache.arrays = () if any(v is None for v in views) else views
        return arrays

    def update(self, values: torch.Tensor) -> None:
        """Add a batch ``(B, *shape)`` to the statistics."""
        if values.shape[1:] != self.shape:
            values = values.reshape((-1,) + self.shape)
        n = values.shape[0]
        if n == 0:
            return
        if self.defer:
            if self._cache.held + n > self.defer:
                self.flush()
            if n <= self.defer:
                self._hold(values, n)
                return
        self._merge(values, n)

    def flush(self) -> None:
        """Merge the values that ``update`` held back (see ``defer``)."""
        cache = self._cache
        if cache.held:
            held, cache.held = cache.held, 0
            self._merge(cache.pending[:held], held)

    def _hold(self, values: torch.Tensor, n: int) -> None:
        """Copy ``n`` values to the end of the held ones (room is checked)."""
        cache = self._cache
        if cache.pending is None:  # float64, as the statistics: held values lose nothing
            cache.pending = torch.empty((self.defer, *self.shape), dtype=torch.float64,
                                        device=self._buffers["mean"].device)
            cache.pending_view = numpy_views.view(cache.pending)
        rows = slice(cache.held, cache.held + n)
        batch = numpy_views.view(values) if cache.pending_view is not None else None
        if batch is not None:
            cache.pending_view[rows] = batch
        else:
            cache.pending[rows] = values.detach()
        cache.held += n

    def _merge(self, values: torch.Tensor, n: int) -> None:
        """Merge a batch of ``n`` values ``(n, *shape)`` into the statistics."""
        cache = self._cache
        count = cache.count
        total = count + n
        arrays = self._arrays()
        batch = numpy_views.view(values) if arrays else None
        if batch is not None:
            mean, sum_sq, count_array = arrays
            centered = batch.astype(np.float64)
            batch_mean = np.add.reduce(centered, 0) / n
            centered -= batch_mean
            batch_m2 = np.add.reduce(np.multiply(centered, centered, out=centered), 0)
            delta = batch_mean - mean
            mean += delta * (n / total)
            sum_sq += batch_m2 + delta * delta * (count * n / total)
            count_array[()] = total
        else:
            values = values.detach()  # instead of no_grad(), which costs more than the update
            batch_var, batch_mean = torch.var_mean(values.to(torch.float64), 0, correction=0)
            delta = batch_mean.sub_(self.mean)
            self.mean.add_(delta, alpha=n / total)
            self.sum_sq.add_(batch_var, alpha=n).add_(delta.square_(), alpha=count * n / total)
            self.count.fill_(total)
        cache.count = total
        cache.fresh = False

    def statistics(self) -> "Statistics":
        """``(count, mean, sum_sq)`` of everything seen, float64 copies."""
        self.flush()
        return Statistics(self.count.clone(), self.mean.clone(), self.sum_sq.clone())

    def load_statistics(self, statistics: "Statistics") -> None:
        """Replace the statistics by ``statistics`` (as ``statistics()`` returns them)."""
        self.flush()
        for name, value in zip(("count", "mean", "sum_sq"), statistics):
            getattr(self, name).copy_(value)
        self._cache.count = float(statistics.count)
        self._cache.fresh = False

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased variance (ones until two values were seen), float64."""
        self.flush()
        count = self._cache.count
        return torch.ones_like(self.sum_sq) if count < 2 else self.sum_sq / (count - 1)

    def _derived(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 mean and ``1 / (std + eps)`` (computed in float64, rounded
        once), remade after each update; on the CPU in place, in numpy."""
        self.flush()
        cache = self._cache
        if not cache.fresh:
            if self._arrays():
                if cache.copies is None:
                    cache.copies = (np.empty(self.shape, np.float32),
                                    np.empty(self.shape, np.float32),
                                    np.empty(self.shape, np.float64))
                    cache.offset = torch.from_numpy(cache.copies[0])
                    cache.inverse_std = torch.from_numpy(cache.copies[1])
                offset, inverse_std, scratch = cache.copies
                mean, sum_sq, _ = cache.arrays
                np.copyto(offset, mean, casting="same_kind")
                if cache.count >= 2:
                    np.sqrt(np.divide(sum_sq, cache.count - 1, out=scratch), out=scratch)
                else:
                    scratch.fill(1.0)
                np.add(scratch, self.eps, out=scratch)
                np.divide(1.0, scratch, out=inverse_std, casting="same_kind")
            else:
                cache.offset = self.mean.to(torch.float32)
                cache.inverse_std = (self.variance.sqrt_().add_(self.eps).reciprocal_()
                                     .to(torch.float32))
            cache.fresh = True
        return cache.offset, cache.inverse_std

    def transform(self, values: torch.Tensor) -> torch.Tensor:
        """Normalise ``(..., *shape)`` values; returns the input's dtype."""
        offset, inverse_std = self._derived()
        result = values if values.dtype == torch.float32 else values.to(torch.float32)
        # The first operation allocates the result, the others work in place.
        if self.center:
            result = result - offset
        if self.scale:
            result = result * inverse_std if result is values else result.mul_(inverse_std)
        if self.clip is not None:
            result = (result.clamp(-self.clip, self.clip) if result is values
                      else result.clamp_(-self.clip, self.clip))
        return result if result.dtype == values.dtype else result.to(values.dtype)


class _Derived:
    """What ``StreamingNormalizer`` derives from its buffers (float32 copies valid
    while ``fresh``; numpy views: ``()`` off the CPU, ``None`` until made) and the
    values ``update`` held back: the first ``held`` rows of ``pending``."""

    def __init__(self, count: float = 0.0) -> None:
        self.count = count
        self.fresh = False
        self.offset: torch.Tensor | None = None
        self.inverse_std: torch.Tensor | None = None
        self.arrays: tuple[np.ndarray, ...] | None = None
        self.copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.held = 0
        self.pending: torch.Tensor | None = None
        self.pending_view: np.ndarray | None = None

    def moved(self) -> None:
        self.__init__(self.count)

    # A copy (deepcopy, pickle) derives everything again from its own buffers.
    def __getstate__(self) -> dict[str, float]:
        return {"count": self.count}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__(state["count"])
