"""Envs stepped in the calling process, as a ``Worker``."""

from __future__ import annotations

import traceback
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvRaisedError
from batchrl.envs.worker import KeptRequest, StepResult, Worker, close_all, reset_arguments
from batchrl.nested import stack_as


class LocalWorker(KeptRequest, Worker):
    """Gymnasium envs stepped one after the other in this process (cannot be restarted). The
    ``*_async`` halves keep the request, the ``*_wait`` halves do the work. An env's exception is
    raised as the ``EnvRaisedError`` a worker process would send."""

    in_process = True

    def __init__(self, envs: Sequence[gym.Env]):
        self.envs = list(envs)
        self.num_envs = len(self.envs)
        # The request step_async() or reset_async() keeps for its wait: (kind, *arguments).
        self._pending: tuple | None = None

    @property
    def label(self) -> str:  # noqa: D102 - the first env's
        return self.env_label(0)

    @property
    def observation_space(self) -> gym.Space:
        return self.envs[0].observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.envs[0].action_space

    def spaces(self) -> list[tuple[gym.Space, gym.Space]]:
        """Each env's ``(observation, action)`` spaces (``BatchEnv`` names any that differ)."""
        return [(env.observation_space, env.action_space) for env in self.envs]

    def step_async(self, actions: np.ndarray, autoreset: np.ndarray | None = None) -> None:
        """Keep ``actions`` (and ``autoreset``) for ``step_wait``, which steps the envs."""
        self._expect(None, "step_async")
        self._pending = ("step", actions, autoreset)

    def step_wait(self, copy: bool = True) -> StepResult:
        """Step env ``i`` with ``actions[i]`` (reset it if ``autoreset[i]``) here; arrays
        of first dimension ``num_envs``, new on every call."""
        _, actions, autoreset = self._expect("step", "step_wait")
        results = []
        try:
            for index, (env, action) in enumerate(zip(self.envs, actions)):
                if autoreset is not None and autoreset[index]:
                    observ, info = env.reset()
                    results.append((observ, 0.0, False, False, info))
                else:
                    results.append(env.step(action))
        except Exception as exc:
            raise self._error(exc, "step", len(results)) from exc
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (self._stack("step", range(self.num_envs), obs), np.array(rewards, np.float64),
                np.array(terminated, bool), np.array(truncated, bool), list(infos))

    def reset_async(self, indices: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None,
                    options: dict | None = None) -> None:
        """Keep the reset's arguments for ``reset_wait``, which resets the envs."""
        self._expect(None, "reset_async")
        self._pending = ("reset", *reset_arguments(self.num_envs, indices, seeds), options)

    def reset_wait(self) -> tuple[np.ndarray, list[dict]]:
        """Reset the envs at the indices ``reset_async`` was given, here."""
        _, indices, seeds, options = self._expect("reset", "reset_wait")
        results = []
        try:
            for index, seed in zip(indices, seeds):
                results.append(self.envs[index].reset(seed=seed, options=options))
        except Exception as exc:
            raise self._error(exc, "reset", index) from exc
        return (self._stack("reset", indices, [obs for obs, _ in results]),
                [info for _, info in results])

    def _stack(self, operation: str, indices: Sequence[int], observations: Sequence) -> Any:
        """The envs' observations as one batch of the space's dtypes and shapes, as a worker
        process's shared memory holds them (a dict in any key order); an observation that
        does not fit is that env's ``EnvRaisedError``."""
        return stack_as(self.observation_space, observations,
                        lambda row, exc: self._error(exc, operation, indices[row]))

    def env_label(self, index: int) -> str:
        env = self.envs[index]
        return env.spec.id if getattr(env, "spec", None) else type(env.unwrapped).__name__

    def _error(self, exc: Exception, operation: str, index: int) -> EnvRaisedError:
        error = EnvRaisedError(self.env_label(index), operation, type(exc).__name__, str(exc),
                               "".join(traceback.format_exception(exc)), "this process")
        error.worker_env_index = index
        return error

    def restart(self) -> "LocalWorker":
        raise RuntimeError("envs stepped in this process cannot be restarted")

    def env(self, index: int) -> gym.Env:
        return self.envs[index]

    def close(self) -> None:
        """Close every env, even if one raises (its error is raised after)."""
        close_all(self.envs)
