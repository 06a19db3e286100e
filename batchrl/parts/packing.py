"""Structured observations (Gymnasium ``Dict`` and ``Tuple`` spaces) packed into one ``uint8`` row
each, so that an algorithm stores, indexes and batches them as it does flat observations.

A packed row holds the float parts first, as the bytes of their float32 values (flattened and
concatenated in the space's order), then every ``uint8`` (pixel) part as it is. Pixels stay
bytes in memory; the float region is read back without a copy (``PackedObservations.unpack``),
which is why it comes first and rows are padded to a multiple of four bytes.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import torch

from batchrl.errors import UnsupportedSpaceError
from batchrl.nested import is_nested_space, leaf_spaces, leaves_of
from batchrl.pixels import is_pixel_space

_FLOAT_BYTES = 4


class PackedObservations:
    """The packing of ``space``'s observations (see the module's docstring).

    Attributes:
      size: bytes per packed row (a multiple of 4).
      float_size: float32 values at the front of a row: every non-pixel part, flattened.
      pixel_parts: ``(path, offset, size, space)`` of each ``uint8`` part: bytes
        ``[offset, offset + size)`` of a row hold it, flattened from ``space.shape``.
    """

    def __init__(self, space: gym.Space):
        self.space = space
        parts = leaf_spaces(space)
        self._pixel = [is_pixel_space(leaf) for _, leaf in parts]
        self._sizes = [math.prod(getattr(leaf, "shape", ()) or (1,)) for _, leaf in parts]
        self.float_size = sum(size for size, pixel in zip(self._sizes, self._pixel) if not pixel)
        offset = self.float_size * _FLOAT_BYTES
        self.pixel_parts: list[tuple[str, int, int, gym.Space]] = []
        for (path, leaf), size, pixel in zip(parts, self._sizes, self._pixel):
            if pixel:
                self.pixel_parts.append((path, offset, size, leaf))
                offset += size
        self.size = -(-offset // _FLOAT_BYTES) * _FLOAT_BYTES

    def floats(self, observ: Any, device: torch.device) -> torch.Tensor:
        """The float parts of a batch of ``K`` observations (a nested value of tensors or arrays
        with ``K`` rows), flattened and concatenated: ``(K, float_size)`` float32 on
        ``device``."""
        parts = [part for part, pixel in zip(leaves_of(self.space, observ), self._pixel)
                 if not pixel]
        count = len(parts[0]) if parts else len(leaves_of(self.space, observ)[0])
        if not parts:
            return torch.zeros(count, 0, device=device)
        return torch.cat([torch.as_tensor(part).reshape(count, -1).to(device, torch.float32)
                          for part in parts], 1)

    def pack(self, observ: Any, floats: torch.Tensor) -> torch.Tensor:
        """Rows ``(K, size)`` uint8 of a batch of ``K`` observations, with ``floats``
        ``(K, float_size)`` (the float parts, as ``floats`` gives them or normalised) in front."""
        count = floats.shape[0]
        packed = torch.zeros(count, self.size, dtype=torch.uint8, device=floats.device)
        packed[:, :self.float_size * _FLOAT_BYTES] = floats.float().contiguous().view(torch.uint8)
        parts = leaves_of(self.space, observ)
        pixels = [part for part, pixel in zip(parts, self._pixel) if pixel]
        for (_, offset, size, _), part in zip(self.pixel_parts, pixels):
            packed[:, offset:offset + size] = torch.as_tensor(part).reshape(count, size).to(
                floats.device)
        return packed

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The float region of packed rows ``(..., size)``: ``(..., float_size)`` float32, a
        view of ``packed`` where its layout allows."""
        return packed[..., :self.float_size * _FLOAT_BYTES].view(torch.float32)

    def with_floats(self, packed: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
        """``packed`` rows ``(..., size)`` with their float region replaced by ``floats``
        ``(..., float_size)``."""
        packed = packed.clone()
        packed[..., :self.float_size * _FLOAT_BYTES] = floats.float().contiguous().view(
            torch.uint8)
        return packed

    def pack_all(self, observ: Any) -> torch.Tensor:
        """Rows ``(K, size)`` of a batch of observations as they are (floats not normalised),
        on the device of their first part (a tensor's; else the CPU)."""
        first = leaves_of(self.space, observ)[0]
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        return self.pack(observ, self.floats(observ, device))


def check_observation_space(space: gym.Space, algorithm: str) -> None:
    """Raise ``UnsupportedSpaceError`` unless ``algorithm`` (its name, for the message) can
    take ``space``: a Box, or a Dict or Tuple of Box and Discrete spaces (packed)."""
    if isinstance(space, gym.spaces.Box) or (is_nested_space(space) and all(
            isinstance(leaf, (gym.spaces.Box, gym.spaces.Discrete))
            for _, leaf in leaf_spaces(space))):
        return
    raise UnsupportedSpaceError(f"{algorithm} needs a Box observation space, or a Dict or "
                                f"Tuple of Box and Discrete spaces, got {space}")


def packing_for(space: gym.Space) -> PackedObservations | None:
    """The packing of ``space``'s observations, or ``None`` for an array space (stored as it
    is)."""
    return PackedObservations(space) if is_nested_space(space) else None


def stored_observations(space: gym.Space, dtype: torch.dtype
                        ) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of one observation of ``space`` in a buffer: packed rows for Dict and
    Tuple spaces (``PackedObservations``), else ``space.shape`` in ``dtype``."""
    packing = packing_for(space)
    return ((packing.size,), torch.uint8) if packing else (tuple(space.shape), dtype)
