"""Which observations batchrl treats as pixels: one rule for the env layer (which leaves them
as they are) and the algorithms (whose networks take them as they are: BatchPPO's, IMPALA's,
SAC's and DQN's scale them to ``[0, 1]``)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


def is_pixel_space(space: gym.Space) -> bool:
    """Whether ``space`` holds ``uint8`` observations (images, frame stacks): batchrl keeps them
    ``uint8`` through every transport and into the algorithm (the shipped algorithms but the
    ``Reinforce`` example scale them to ``[0, 1]`` inside their networks); the env layer never
    range-normalises them or converts them to float."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8
