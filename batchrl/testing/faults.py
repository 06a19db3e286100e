"""A deliberately faulty env, to test how a run survives env failures: on a chosen step or at random
it raises, aborts, segfaults, exits, hangs, or returns a NaN observation or an infinite reward. A
config can use it to check a set-up (``env.id = "batchrl.testing.faults:make"``, see ``make``)."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

FAULTS = ("raise", "abort", "segfault", "exit", "hang", "nan_observ", "inf_reward")


class FaultyEnv(gym.Wrapper):
    """Wraps ``env`` and injects one of ``FAULTS`` into ``step`` (or ``reset``).

    Args:
      fault: what to do, one of ``FAULTS``; with ``every`` a sequence of them,
        one drawn at random each time.
      at_step: inject in this ``step`` call, counted from 1 over the wrapper's
        lifetime (resets do not restart the count).
      every: instead of ``at_step``, inject with probability ``1 / every`` per
        step (drawn from ``seed``; ``None``: a restarted worker draws anew).
      in_reset: inject in the ``at_step``-th ``reset`` call instead.
      once_file: inject only if this file can be created: a fault that fires
        once among all envs sharing the path, not repeated after a restart.
      hang_seconds: how long ``"hang"`` sleeps.
      log_dir: each injection first creates an empty file ``<pid>-<count>-<fault>``
        there, so that a test can count even the faults that killed a process.
    """

    def __init__(self, env: gym.Env, fault: str | Sequence[str] = "raise",
                 at_step: int | None = None, every: int | None = None, in_reset: bool = False,
                 once_file: str | None = None, seed: int | None = None,
                 hang_seconds: float = 3600.0, log_dir: str | None = None):
        super().__init__(env)
        faults = [fault] if isinstance(fault, str) else list(fault)
        unknown = [name for name in faults if name not in FAULTS]
        if unknown or not faults:
            raise ValueError(f"unknown fault {unknown or fault!r}; valid: {', '.join(FAULTS)}")
        if (at_step is None) == (every is None):
            raise ValueError("give exactly one of at_step (a step number) and every "
                             "(a mean interval in steps)")
        self.faults, self.at_step, self.every = faults, at_step, every
        self.in_reset, self.hang_seconds = in_reset, hang_seconds
        self.once_file = Path(once_file) if once_file else None
        self.log_dir = Path(log_dir) if log_dir else None
        self.rng = np.random.default_rng([os.getpid(), time.time_ns()] if seed is None else seed)
        self.steps = self.resets = 0

    def _fire(self, count: int, where: str) -> str | None:
        """The fault due at the ``count``-th call (``None``: none), after injecting it."""
        due = (self.rng.random() < 1.0 / self.every if self.every is not None
               else count == self.at_step)
        if not due:
            return None
        if self.once_file is not None:
            try:  # atomic (O_EXCL): of several envs due at once, only one fires
                self.once_file.touch(exist_ok=False)
            except FileExistsError:
                return None
        fault = self.faults[int(self.rng.integers(len(self.faults)))]
        if self.log_dir is not None:
            (self.log_dir / f"{os.getpid()}-{count}-{fault}").touch()
        if fault == "raise":
            raise RuntimeError(f"injected fault in {where} {count}")
        if fault == "abort":
            os.abort()
        if fault == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV, as a bug in native code would
        if fault == "exit":
            os._exit(3)
        if fault == "hang":
            time.sleep(self.hang_seconds)
        return fault

    def step(self, action: Any) -> tuple:
        self.steps += 1
        fault = None if self.in_reset else self._fire(self.steps, "step")
        obs, reward, terminated, truncated, info = self.env.step(action)
        if fault == "nan_observ":
            obs = np.full_like(obs, np.nan)
        elif fault == "inf_reward":
            reward = float("inf")
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs: Any) -> tuple:
        self.resets += 1
        fault = self._fire(self.resets, "reset") if self.in_reset else None
        obs, info = self.env.reset(**kwargs)
        if fault == "nan_observ":
            obs = np.full_like(obs, np.nan)
        return obs, info


def make(env_id: str = "CartPole-v1", fault: str | Sequence[str] = "raise",
         at_step: int | None = None, every: int | None = None, in_reset: bool = False,
         once_file: str | None = None, seed: int | None = None, hang_seconds: float = 3600.0,
         log_dir: str | None = None, **kwargs: Any) -> FaultyEnv:
    """``gymnasium.make(env_id, **kwargs)`` wrapped in ``FaultyEnv``; usable as
    a config's env: ``env.id = "batchrl.testing.faults:make"`` with
    ``env.kwargs = {env_id = "Pendulum-v1", fault = "abort", at_step = 500}``."""
    return FaultyEnv(gym.make(env_id, **kwargs), fault, at_step, every, in_reset,
                     once_file, seed, hang_seconds, log_dir)
