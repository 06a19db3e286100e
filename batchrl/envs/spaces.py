"""Which Gymnasium spaces the env layer can batch."""

from __future__ import annotations

import gymnasium as gym

from collections.abc import Sequence

from batchrl.envs.errors import EnvError, UnsupportedSpaceError

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


def worker_spaces(label: str, spaces: Sequence[tuple[gym.Space, gym.Space]]
                  ) -> tuple[gym.Space, gym.Space]:
    """The ``(observation, action)`` spaces shared by the envs of one worker
    (``spaces`` has a pair per env); an ``EnvError`` naming the first env
    that differs from env 0."""
    obs_space, act_space = spaces[0]
    for index, (obs, act) in enumerate(spaces[1:], 1):
        if obs != obs_space or act != act_space:
            raise EnvError(label, "construct",
                           f"all envs of a worker need equal spaces, but env {index} has "
                           f"{obs} and {act} while env 0 has {obs_space} and {act_space}")
    return obs_space, act_space
