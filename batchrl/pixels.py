"""Which observations batchrl treats as pixels: one rule for the env layer (which leaves them
as they are) and the algorithms (which scale them inside their networks)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


def is_pixel_space(space: gym.Space) -> bool:
    """Whether ``space`` holds ``uint8`` observations (images, frame stacks): batchrl keeps them
    ``uint8`` through every transport and into the algorithm, which scales them to ``[0, 1]``
    inside its network; they are never range-normalised or converted to float."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8
