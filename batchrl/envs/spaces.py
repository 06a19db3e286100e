"""Which Gymnasium spaces the env layer can batch."""

from __future__ import annotations

import gymnasium as gym

from batchrl.envs.errors import UnsupportedSpaceError

SUPPORTED_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                    gym.spaces.MultiBinary)


def check_space(kind: str, space: gym.Space) -> None:
    """Raise ``UnsupportedSpaceError`` naming ``space`` (the ``kind``:
    ``"observation"`` or ``"action"``) unless it is an array space that fits
    in one batched array."""
    if not isinstance(space, SUPPORTED_SPACES):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_SPACES)
        hint = (" (flatten it, e.g. with gymnasium.wrappers.FlattenObservation)"
                if kind == "observation" else "")
        raise UnsupportedSpaceError(f"unsupported {kind} space {space}: a batch env needs "
                                    f"one of {names}{hint}")
