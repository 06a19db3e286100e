"""Which Gymnasium spaces the env layer can batch."""

from __future__ import annotations

from collections.abc import Sequence

import gymnasium as gym

from batchrl.envs.errors import EnvError, UnsupportedSpaceError
from batchrl.nested import is_nested_space, leaf_spaces

SUPPORTED_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                    gym.spaces.MultiBinary)


def check_space(kind: str, space: gym.Space) -> None:
    """Raise ``UnsupportedSpaceError`` naming the ``kind`` (``"observation"`` or
    ``"action"``) of ``space`` unless it fits in one batched array or, for observations, is a
    ``Dict`` or ``Tuple`` of such spaces (batched leaf by leaf: ``batchrl.nested``)."""
    names = ", ".join(cls.__name__ for cls in SUPPORTED_SPACES)
    if kind == "observation" and is_nested_space(space):
        if not leaf_spaces(space):
            raise UnsupportedSpaceError(f"unsupported observation space {space}: a Dict or "
                                        f"Tuple observation needs at least one part")
        for path, leaf in leaf_spaces(space):
            if not isinstance(leaf, SUPPORTED_SPACES):
                raise UnsupportedSpaceError(
                    f"unsupported observation space {space}: its part {path!r} is {leaf}, "
                    f"but the parts of a Dict or Tuple observation must be {names}")
        return
    if not isinstance(space, SUPPORTED_SPACES):
        hint = ", or a Dict or Tuple of them" if kind == "observation" else ""
        raise UnsupportedSpaceError(f"unsupported {kind} space {space}: a batch env needs "
                                    f"one of {names}{hint}")


def worker_spaces(label: str, spaces: Sequence[tuple[gym.Space, gym.Space]]
                  ) -> tuple[gym.Space, gym.Space]:
    """The ``(observation, action)`` spaces shared by one worker's envs (a pair
    each in ``spaces``); an ``EnvError`` names the first env that differs."""
    obs_space, act_space = spaces[0]
    for index, (obs, act) in enumerate(spaces[1:], 1):
        if obs != obs_space or act != act_space:
            raise EnvError(label, "construct",
                           f"all envs of a worker need equal spaces, but env {index} has "
                           f"{obs} and {act} while env 0 has {obs_space} and {act_space}")
    return obs_space, act_space
