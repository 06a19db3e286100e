"""Structured observations: Gymnasium's ``Dict`` and ``Tuple`` spaces, handled leaf by leaf.

A *nested* value mirrors its space: a leaf (a numpy array or a torch tensor), a ``dict`` of nested
values (a ``Dict`` space, in the space's key order) or a ``tuple`` of them (a ``Tuple`` space). A
batch keeps the env (or agent) dimension first in every leaf, as Gymnasium's vector envs return
them: ``{"image": (N, 84, 84, 4) uint8, "state": (N, 7) float32}``. Plain arrays are nested values
with one leaf, so code written with these functions handles both.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import gymnasium as gym
import numpy as np

__all__ = ["is_nested_space", "leaf_spaces", "map_nested", "leaves", "leaves_of", "build", "put",
           "take", "concatenate", "stack", "stack_as", "first_leaf", "copy_nested", "unstack"]


def is_nested_space(space: gym.Space) -> bool:
    """Whether ``space`` is a ``Dict`` or ``Tuple`` of other spaces."""
    return isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple))


def leaf_spaces(space: gym.Space, prefix: str = "") -> list[tuple[str, gym.Space]]:
    """``(path, space)`` of every leaf of ``space`` in order: paths are dotted keys and tuple
    positions (``"image"``, ``"sensors.0"``); a space that is not nested is one leaf ``""``."""
    if isinstance(space, gym.spaces.Dict):
        items: Iterator[tuple[Any, gym.Space]] = iter(space.spaces.items())
    elif isinstance(space, gym.spaces.Tuple):
        items = enumerate(space.spaces)
    else:
        return [(prefix, space)]
    found = []
    for key, child in items:
        found += leaf_spaces(child, f"{prefix}.{key}" if prefix else str(key))
    return found


def build(space: gym.Space, make: Callable[[gym.Space], Any]) -> Any:
    """The nested value of ``space`` whose leaves are ``make(leaf_space)``."""
    if isinstance(space, gym.spaces.Dict):
        return {key: build(child, make) for key, child in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(build(child, make) for child in space.spaces)
    return make(space)


def map_nested(fn: Callable[..., Any], value: Any, *others: Any) -> Any:
    """``fn`` applied leaf by leaf to ``value`` and the ``others`` of the same structure (dicts
    matched by key, in ``value``'s key order); the result has ``value``'s structure."""
    if isinstance(value, dict):
        return {key: map_nested(fn, child, *(other[key] for other in others))
                for key, child in value.items()}
    if isinstance(value, tuple):
        return tuple(map_nested(fn, child, *(other[i] for other in others))
                     for i, child in enumerate(value))
    return fn(value, *others)


def leaves(value: Any) -> list[Any]:
    """The leaves of ``value`` in order."""
    if isinstance(value, dict):
        return [leaf for child in value.values() for leaf in leaves(child)]
    if isinstance(value, tuple):
        return [leaf for child in value for leaf in leaves(child)]
    return [value]


def leaves_of(space: gym.Space, value: Any) -> list[Any]:
    """The leaves of ``value`` in ``space``'s order (a dict in any key order)."""
    if isinstance(space, gym.spaces.Dict):
        return [leaf for key, child in space.spaces.items()
                for leaf in leaves_of(child, value[key])]
    if isinstance(space, gym.spaces.Tuple):
        return [leaf for child, part in zip(space.spaces, value) for leaf in leaves_of(child, part)]
    return [value]


def first_leaf(value: Any) -> Any:
    """The first leaf of ``value`` (its batch size is every leaf's; an empty part has none)."""
    return leaves(value)[0]


def put(target: Any, index: Any, value: Any) -> None:
    """``target[index] = value`` in every leaf of ``target`` (``value`` has its structure)."""
    if isinstance(target, dict):
        for key, child in target.items():
            put(child, index, value[key])
    elif isinstance(target, tuple):
        for child, part in zip(target, value):
            put(child, index, part)
    else:
        target[index] = value


def take(value: Any, index: Any) -> Any:
    """``value[index]`` in every leaf."""
    return map_nested(lambda leaf: leaf[index], value)


def concatenate(values: list[Any]) -> Any:
    """Batches of one structure joined along the first dimension (numpy leaves)."""
    return map_nested(lambda *parts: np.concatenate(parts), values[0], *values[1:])


def stack_as(space: gym.Space, values: Sequence[Any],
             row_error: Callable[[int, Exception], Exception] | None = None) -> Any:
    """Single observations of ``space`` (dicts in any key order) stacked into one batch of
    the space's structure, leaf dtypes and shapes. A row that does not fit raises
    ``row_error(row, exc)`` where given (from the fitting error ``exc``), else that error."""
    batch = build(space, lambda leaf: np.empty((len(values), *leaf.shape), leaf.dtype))
    for row, value in enumerate(values):
        try:
            put(batch, row, value)
        except Exception as exc:
            if row_error is None:
                raise
            raise row_error(row, exc) from exc
    return batch


def copy_nested(value: Any) -> Any:
    """A copy of every leaf (numpy scalars stay scalars)."""
    return map_nested(lambda leaf: leaf.copy(), value)


def unstack(value: Any) -> list[Any]:
    """A batch split into its rows (the inverse of ``stack_as``)."""
    return [take(value, row) for row in range(len(first_leaf(value)))]
