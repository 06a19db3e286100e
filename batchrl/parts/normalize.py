"""Streaming mean and variance, for normalising observations and rewards."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from batchrl.parts import numpy_views


class StreamingNormalizer(nn.Module):
    """Normalises values with running statistics of everything it was updated with.

    Statistics are merged batch by batch with Chan et al.'s parallel formula,
    kept in float64 buffers (so they are part of ``state_dict``).
    ``transform`` computes in float32 with copies of the mean and of the
    inverse standard deviation made after each update: it runs at every env
    step, where each saved tensor operation counts.

    On the CPU, ``update`` (of CPU tensors) and the derivation of the float32
    copies work in numpy on views of the same memory (``batchrl.parts.numpy_views``);
    results are the same up to float rounding.

    With ``defer``, ``update`` only copies values into a buffer and merges
    them in one go when it is full or when anything reads the statistics
    (``transform``, ``variance``, the ``mean``/``sum_sq``/``count`` buffers,
    ``state_dict``, a copy or a move): for statistics read far less often
    than updated, such as the rewards, which BatchPPO reads once per update.
    Readers see every value given to ``update``; only the grouping of the
    merges, and so the float rounding, differs.

    Args:
      shape: shape of one value (``()`` for rewards).
      center: subtract the running mean.
      scale: divide by the running standard deviation (1 until two values
        were seen).
      clip: clip transformed values to ``[-clip, clip]``; ``None`` for no clip.
      defer: how many values (of ``shape``) ``update`` may hold back before
        merging them; 0 merges every batch at once.
    """

    def __init__(self, shape: tuple[int, ...] = (), center: bool = True, scale: bool = True,
                 clip: float | None = None, eps: float = 1e-8, defer: int = 0):
        super().__init__()
        if not isinstance(defer, int) or defer < 0:
            raise ValueError(f"defer must be a whole number of values >= 0, got {defer!r}")
        # Derived, not saved, and kept in a plain object: nn.Module's
        # __setattr__ costs microseconds, and these change at every env step.
        # (Made first: __getattr__ uses it once buffers are looked up.)
        self._cache = _Derived()
        self.shape = tuple(shape)
        self.defer = defer
        self.center, self.scale, self.clip, self.eps = center, scale, clip, eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("sum_sq", torch.zeros(self.shape, dtype=torch.float64))

    def __getattr__(self, name: str) -> Any:
        # nn.Module looks buffers up here (they are not instance attributes):
        # whoever reads the statistics gets the held values merged first.
        if name in _STATISTICS:
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
        """numpy views of ``(mean, sum_sq, count)``; empty where numpy cannot
        work on the buffers (see ``batchrl.parts.numpy_views``)."""
        arrays = self._cache.arrays
        if arrays is None:
            views = tuple(numpy_views.view(buffer) for buffer in (self.mean, self.sum_sq, self.count))
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
            cache = self._cache
            if cache.held + n > self.defer:
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
        if cache.pending is None:
            device = self._buffers["mean"].device
            # float64, as the statistics: held values lose nothing
            cache.pending = torch.empty((self.defer, *self.shape), dtype=torch.float64,
                                        device=device)
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
        cache.stale()

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased variance (ones until two values were seen), float64."""
        self.flush()
        count = self._cache.count
        if count < 2:
            return torch.ones_like(self.sum_sq)
        return self.sum_sq / (count - 1)

    def _derived(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 mean and ``1 / (std + eps)`` (computed in float64,
        rounded once), made again after each update. On the CPU they are
        rewritten in place: fresh tensors at every env step cost more than
        the arithmetic."""
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
        # (torch beats numpy here: three operations, against five and two
        # conversions.)
        if self.center:
            result = result - offset
        if self.scale:
            result = result * inverse_std if result is values else result.mul_(inverse_std)
        if self.clip is not None:
            result = (result.clamp(-self.clip, self.clip) if result is values
                      else result.clamp_(-self.clip, self.clip))
        return result if result.dtype == values.dtype else result.to(values.dtype)


_STATISTICS = frozenset(("mean", "sum_sq", "count"))


class _Derived:
    """What ``StreamingNormalizer`` derives from its buffers: the count as a
    Python number, float32 copies of the mean and of the inverse standard
    deviation (valid while ``fresh``), numpy views of the buffers (``()``
    when not on the CPU, ``None`` when not yet made) and, on the CPU, the
    arrays behind the float32 copies and a float64 scratch array. Also the
    values ``update`` held back: the first ``held`` rows of ``pending``
    (made at the first one; ``pending_view`` is its numpy view, or ``None``).
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.fresh = False
        self.offset: torch.Tensor | None = None
        self.inverse_std: torch.Tensor | None = None
        self.arrays: tuple[np.ndarray, ...] | None = None
        self.copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.held = 0
        self.pending: torch.Tensor | None = None
        self.pending_view: np.ndarray | None = None

    def stale(self) -> None:
        self.fresh = False

    def moved(self) -> None:
        count = self.count
        self.__init__()
        self.count = count

    # A copy (deepcopy, pickle) must not keep views of the original's
    # buffers: it derives everything again from its own.
    def __getstate__(self) -> dict[str, float]:
        return {"count": self.count}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.__init__()
        self.count = state["count"]
