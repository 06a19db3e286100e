"""Envs that step a whole batch at once (native vector envs such as ale-py's ``AtariVectorEnv``)
as one ``BatchEnv`` member."""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from batchrl.envs.errors import EnvRaisedError, EnvSpecError
from batchrl.envs.infos import InfoColumns, InfoList, info_row
from batchrl.envs.worker import (KeptRequest, StepResult, Worker, constructor_label,
                                  reset_arguments)
from batchrl.nested import build, take


class VectorWorker(KeptRequest, Worker):
    """``make()``'s Gymnasium ``VectorEnv`` (its ``num_envs`` envs stepped together by the env's
    own code, often in native threads) as a ``Worker``: a ``BatchEnv`` member like any other.

    The vector env must use next-step autoreset (Gymnasium's default) and accept
    ``options={"reset_mask": mask}`` with one seed per env reset (an int array; ale-py's and
    EnvPool's convention). Its next-step autoreset is the ``Worker`` protocol's ``autoreset``: an
    env whose episode ended is reset, not stepped, by the next step; one that ``reset`` started
    again steps. So a step must reset (``autoreset``) exactly the envs whose episode ended at the
    last step and were not reset since (a ``ValueError`` otherwise). When the vector env has
    ``send``/``recv`` (ale-py's does), ``step_async`` sends and the envs step while the caller
    goes on; else they step in ``step_wait`` (``in_process``).

    Args:
      make: builds the vector env (called again by ``restart``).
      label: names the envs in error messages (default: ``make``'s name).
      infos: pass on the vector env's infos (else empty dicts).
    """

    def __init__(self, make: Callable[[], gym.vector.VectorEnv], label: str | None = None,
                 infos: bool = True):
        self._make = make
        self.label = label or constructor_label(make)
        self.infos = infos
        try:
            env = make()
        except Exception as exc:
            raise self._error(exc, "construct", None) from exc
        if not isinstance(env, gym.vector.VectorEnv):
            raise EnvSpecError(f"{self.label} returned {type(env).__name__}, not a "
                               f"gymnasium.vector.VectorEnv (a vector env member needs one)")
        mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        if mode is not AutoresetMode.NEXT_STEP:
            env.close()
            raise EnvSpecError(f"{self.label}: a vector env member needs next-step autoreset "
                               f"(Gymnasium's default), got {mode}")
        self.vector_env = env
        self.num_envs = int(env.num_envs)
        self.observation_space = env.single_observation_space
        self.action_space = env.single_action_space
        self._async = hasattr(env, "send") and hasattr(env, "recv")
        self.in_process = not self._async
        self._ended = np.zeros(self.num_envs, bool)  # episodes that ended at the last step
        self._any_ended = False
        self._pending: tuple | None = None  # (kind, *arguments) of the request in flight

    def _error(self, exc: Exception, operation: str, index: int | None) -> EnvRaisedError:
        error = EnvRaisedError(self.label, operation, type(exc).__name__, str(exc),
                               "".join(traceback.format_exception(exc)), "this process")
        if index is not None:
            error.worker_env_index = index
        return error

    def step_async(self, actions: np.ndarray, autoreset: np.ndarray | None = None) -> None:
        """Send the actions; envs whose episode ended at the last step are reset instead (by
        the vector env's autoreset), and ``autoreset`` may name only those."""
        self._expect(None, "step_async")
        if autoreset is not None or self._any_ended:  # (else nothing to check)
            self._check_resets(np.zeros(self.num_envs, bool) if autoreset is None
                               else autoreset)
        if self._async:
            try:
                self.vector_env.send(actions)
            except Exception as exc:
                raise self._error(exc, "step", None) from exc
        self._pending = ("step", actions)

    def _check_resets(self, resets: np.ndarray) -> None:
        """A ``ValueError`` unless ``resets`` names exactly the envs whose episode ended."""
        if (resets != self._ended).any():
            early, late = resets & ~self._ended, self._ended & ~resets
            raise ValueError(
                f"{self.label}: a vector env resets an env instead of stepping it only after its "
                f"episode ended, and then always; envs {np.flatnonzero(early).tolist()} did not "
                f"end" if early.any() else
                f"{self.label}: envs {np.flatnonzero(late).tolist()} ended their episodes: reset "
                f"them (or step with autoreset) first; a vector env would reset them itself")

    def step_wait(self, copy: bool = True) -> StepResult:
        """The step's arrays (new ones on every call), the infos from the vector env's dict of
        arrays."""
        _, actions = self._expect("step", "step_wait")
        try:
            result = self.vector_env.recv() if self._async else self.vector_env.step(actions)
        except Exception as exc:
            raise self._error(exc, "step", None) from exc
        observ, reward, terminated, truncated, info = result
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        self._ended = terminated | truncated
        self._any_ended = bool(self._ended.any())
        if not (self.infos and info):
            return (observ, np.asarray(reward, np.float64), terminated, truncated,
                    InfoList([(self.num_envs, None)]))
        return (observ, np.asarray(reward, np.float64), terminated, truncated,
                InfoList([(self.num_envs, InfoColumns(info))]))

    def reset_async(self, indices: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None,
                    options: dict | None = None) -> None:
        """Keep the reset for ``reset_wait``, which resets the envs at ``indices`` with the
        vector env's ``reset_mask``."""
        self._expect(None, "reset_async")
        self._pending = ("reset", *reset_arguments(self.num_envs, indices, seeds), options)

    def reset_wait(self) -> tuple[Any, list[dict]]:
        _, indices, seeds, options = self._expect("reset", "reset_wait")
        if not indices:
            return build(self.observation_space, lambda space: np.zeros(
                (0, *space.shape), space.dtype)), []
        if len(set(indices)) != len(indices):
            raise ValueError(f"{self.label}: reset indices must be unique, got {indices}")
        mask = np.zeros(self.num_envs, bool)
        mask[indices] = True
        order = np.flatnonzero(mask)  # the vector env's order: its seeds follow it
        by_index = dict(zip(indices, seeds))
        ordered = [by_index[int(i)] for i in order]
        seed = (None if all(s is None for s in ordered)
                else np.array([-1 if s is None else int(s) for s in ordered], np.int64))
        try:
            observ, info = self.vector_env.reset(
                seed=seed, options={**(options or {}), "reset_mask": mask})
        except Exception as exc:
            raise self._error(exc, "reset", None) from exc
        self._ended[indices] = False
        self._any_ended = bool(self._ended.any())
        return (take(observ, np.asarray(indices, np.int64)),
                [info_row(info, index) if self.infos else {} for index in indices])

    def restart(self) -> "VectorWorker":
        """Close this vector env; a fresh one from ``make`` (the same label and ``infos``)."""
        self.close()
        return VectorWorker(self._make, self.label, self.infos)

    def env(self, index: int) -> gym.vector.VectorEnv:
        """The vector env that steps env ``index`` (one object for all of them)."""
        return self.vector_env

    def close(self) -> None:
        self._pending = None
        env = getattr(self, "vector_env", None)
        if env is not None and not getattr(env, "closed", False):
            env.close()
