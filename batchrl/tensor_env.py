"""A batch env whose state lives in torch tensors on a device.

This is the PyTorch counterpart of TF Agents' ``InGraphBatchEnv``: the current
batch of observations, last actions, rewards and done flags is kept in
preallocated tensors that algorithms read directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
import torch

from batchrl.envs.batch import BatchEnv
from batchrl.parts import numpy_views


@dataclass
class Episodes:
    """The running episodes of a ``TensorBatchEnv``'s agents, as
    ``batchrl.simulation.simulate`` tracks them between its calls (all tensors
    on the env's device; ``N`` agents).

    Attributes:
      score: ``(N,)`` float32, the return of each agent's current episode so
        far (its full return right after it finished).
      length: ``(N,)`` int64, the steps of each agent's current episode.
      agents: ``(N,)`` int64, ``arange(N)``: every step acts for all agents.
      starting: ``(K,)`` int64, the agents to reset before the next step
        (done on the previous one; all of them before the first), or ``None``.
      finished_score, finished_length, finished_count: scalar sums over the
        episodes finished since ``simulate`` last logged them.
      late: with ``simulate(..., overlap=True)``, the step whose
        ``experience()`` is still due, as ``(algorithm, observ, action)``;
        its reward, done flags and next observation are still the env's.
      fast: on the CPU, ``(done, reward)`` of the env and numpy views of
        them and of ``score`` and ``length`` (see ``batchrl.parts.numpy_views``).
    """

    score: torch.Tensor
    length: torch.Tensor
    agents: torch.Tensor
    starting: torch.Tensor | None
    finished_score: torch.Tensor
    finished_length: torch.Tensor
    finished_count: torch.Tensor
    late: tuple[Any, torch.Tensor, torch.Tensor] | None = None
    fast: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, np.ndarray,
                np.ndarray] | None = None

    @classmethod
    def start(cls, done: torch.Tensor, reward: torch.Tensor) -> "Episodes":
        """No episode begun yet, for an env with these ``done`` and ``reward`` buffers."""
        n, device = len(done), done.device
        zero = torch.zeros((), device=device)
        episodes = cls(score=torch.zeros(n, device=device),
                       length=torch.zeros(n, dtype=torch.int64, device=device),
                       agents=torch.arange(n, device=device),
                       starting=torch.arange(n, device=device),
                       finished_score=zero.clone(), finished_length=zero.clone(),
                       finished_count=zero.clone())
        views = tuple(numpy_views.view(tensor) for tensor in
                      (done, reward, episodes.score, episodes.length))
        if all(view is not None for view in views):
            episodes.fast = (done, reward, *views)
        return episodes


class TensorBatchEnv:
    """Wraps a ``BatchEnv`` and exposes its state as tensors on ``device``.

    Attributes (all on ``device``, first dimension ``N = len(batch_env)``):
      observ: ``(N, *obs_shape)`` float32, the latest observation of each env.
      action: ``(N, *act_shape)``, the last action: float32 for Box action
        spaces, int64 for discrete ones.
      reward: ``(N,)`` float32, the last reward (0 after a reset).
      done: ``(N,)`` float32, 1.0 where the last step ended the episode,
        by termination or by truncation (time limit).
      terminated: ``(N,)`` float32, 1.0 where the episode reached a true
        terminal state; ``done - terminated`` marks truncations.
      infos: the info dicts of the last ``step`` (a sequence, on the host;
        ``reset`` leaves it alone).
      episodes: the running episodes, as ``simulate`` tracks them (``Episodes``).
      restarted: ``None``, or the ``(K,)`` int64 indices of the envs whose
        worker the last ``step`` or ``reset`` restarted after a failure (see
        ``BatchEnv``'s ``max_restarts``): they are in new episodes, their
        ``observ`` rows hold the first observations, and what an algorithm
        collected of their old episodes should be discarded.

    ``step`` and ``reset`` update these buffers in place and return them (or
    the reset rows); a caller that needs a value after the next step must
    clone it. On CUDA, staging buffers are pinned and copies are
    ``non_blocking``. Envs are not reset automatically: ``simulate()`` resets
    the ones that are done before it steps them again.
    """

    def __init__(self, batch_env: BatchEnv, device: str | torch.device = "cpu"):
        self.batch_env = batch_env
        self.device = torch.device(device)
        obs_space, act_space = batch_env.observation_space, batch_env.action_space
        n = len(batch_env)
        self._discrete = not isinstance(act_space, gym.spaces.Box)
        action_dtype = torch.int64 if self._discrete else torch.float32
        cuda = self.device.type == "cuda"

        def buffers(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            device_buffer = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
            staging = (torch.zeros(tuple(shape), dtype=dtype, pin_memory=True) if cuda
                       else device_buffer)
            return device_buffer, staging

        self.observ, self._staging_observ = buffers((n, *obs_space.shape), torch.float32)
        self.action, self._staging_action = buffers((n, *act_space.shape), action_dtype)
        self.reward, self._staging_reward = buffers((n,), torch.float32)
        self.done, self._staging_done = buffers((n,), torch.float32)
        self.terminated, self._staging_terminated = buffers((n,), torch.float32)
        # numpy views of the staging buffers: numpy copies small arrays in about
        # a microsecond, a third of a torch copy_ with from_numpy.
        self._np = {name: getattr(self, f"_staging_{name}").numpy()
                    for name in ("observ", "action", "reward", "done", "terminated")}
        self.infos: Sequence[dict] = [{} for _ in range(n)]
        self.restarted: torch.Tensor | None = None
        self.episodes = Episodes.start(self.done, self.reward)
        # The staging buffers may only be rewritten once the last upload finished.
        self._uploaded = torch.cuda.Event() if cuda else None

    @property
    def observation_space(self) -> gym.Space:
        return self.batch_env.observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.batch_env.action_space

    def __len__(self) -> int:
        return len(self.batch_env)

    def _upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._uploaded is None:
            return  # on the CPU the staging buffers are the device buffers
        for device_buffer, staging in pairs:
            device_buffer.copy_(staging, non_blocking=True)
        self._uploaded.record()

    def _staging_ready(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step all envs.

        Args:
          action: ``(N, *act_shape)`` tensor on any device.
        Returns:
          ``(observ, reward, done)``, the updated buffers on ``device``.
        """
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: torch.Tensor) -> None:
        """Start a step: ``action`` is copied into ``self.action`` and sent to
        the worker processes, which step while the caller goes on. Until
        ``step_wait`` the other buffers keep the previous step's values.

        Args:
          action: ``(N, *act_shape)`` tensor on any device.
        """
        action = action.detach()
        if action.shape != self.action.shape:
            raise ValueError(f"action must have shape {tuple(self.action.shape)} "
                             f"(num_envs, *action_space.shape), got {tuple(action.shape)}")
        if self._discrete and (action.is_floating_point() or action.is_complex()):
            raise TypeError(f"actions for {self.action_space} must be integers, got "
                            f"{action.dtype}")
        self.action.copy_(action)
        self._staging_ready()
        if self._uploaded is not None:
            self._staging_action.copy_(self.action, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        self.batch_env.step_async(self._np["action"])

    def step_wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finish the step begun by ``step_async``; returns what ``step`` returns."""
        staging = self._np
        obs, reward, terminated, truncated, infos = self.batch_env.step_wait()
        np.copyto(staging["observ"], obs, casting="unsafe")
        np.copyto(staging["reward"], reward, casting="unsafe")
        np.copyto(staging["terminated"], terminated)
        np.logical_or(terminated, truncated, out=staging["done"])
        self.infos = infos
        self._note_restarts()
        self._upload([(self.observ, self._staging_observ), (self.reward, self._staging_reward),
                      (self.done, self._staging_done),
                      (self.terminated, self._staging_terminated)])
        return self.observ, self.reward, self.done

    def reset(self, indices: torch.Tensor | Sequence[int] | None = None,
              seed: int | Sequence[int] | None = None) -> torch.Tensor:
        """Reset the envs at ``indices`` (all when ``None``).

        Their observation rows are replaced, reward, done and terminated set
        to zero. ``seed`` is passed to ``BatchEnv.reset``.

        Returns:
          ``(len(indices), *obs_shape)`` float32 tensor on ``device``.
        """
        if indices is None:
            rows = np.arange(len(self))
        elif isinstance(indices, torch.Tensor):
            rows = indices.detach().cpu().numpy()
        else:
            rows = np.asarray(indices)
        # Not cast to int first: BatchEnv rejects float or bool "indices" (such
        # as a done mask) that a cast would silently turn into other env indices.
        obs = self.batch_env.reset(rows, seed=seed)
        rows = rows.astype(np.int64)
        if rows.size == 0:
            return self.observ[:0]
        self._staging_ready()
        cpu_rows = torch.from_numpy(rows)
        self._set_rows(cpu_rows, obs)
        self._note_restarts()
        self._upload([(self.observ, self._staging_observ), (self.reward, self._staging_reward),
                      (self.done, self._staging_done),
                      (self.terminated, self._staging_terminated)])
        return self.observ[cpu_rows.to(self.device)]

    def _set_rows(self, cpu_rows: torch.Tensor, obs: np.ndarray) -> None:
        """Fresh episodes in these rows: observations set, the rest zeroed."""
        self._staging_observ[cpu_rows] = torch.from_numpy(np.asarray(obs)).to(torch.float32)
        for staging in (self._staging_reward, self._staging_done, self._staging_terminated):
            staging[cpu_rows] = 0.0

    def _note_restarts(self) -> None:
        """Take over the envs that the batch env restarted in its last call
        (before the upload of the staging buffers)."""
        rows, obs = self.batch_env.restarted
        if not len(rows):
            self.restarted = None
            return
        cpu_rows = torch.from_numpy(rows)
        self._set_rows(cpu_rows, obs)  # after reset(): also rows not asked for
        self.restarted = cpu_rows.to(self.device)

    def close(self) -> None:
        """Close the underlying batch env."""
        self.batch_env.close()

    def __enter__(self) -> "TensorBatchEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
