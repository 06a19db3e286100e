"""A batch env whose state (observations, last actions, rewards, done flags) lives in
preallocated torch tensors on a device: the PyTorch ``InGraphBatchEnv`` of TF Agents. It is a
tensor view of the batch and nothing more: the loop's own state (episodes, returns) belongs to
``batchrl.simulation.Simulation``."""

from __future__ import annotations

from typing import Any, Sequence

import gymnasium as gym
import numpy as np
import torch

from batchrl.envs.batch import BatchEnv
from batchrl.envs.worker import Closeable
from batchrl.nested import build, leaf_spaces, leaves, map_nested, put, take
from batchrl.pixels import is_pixel_space


class TensorBatchEnv(Closeable):
    """Wraps a ``BatchEnv`` and exposes its state as tensors on ``device``.

    Attributes (on ``device``, first dimension ``N = len(batch_env)``):
      observ: ``(N, *obs_shape)``, the latest observation of each env: ``uint8`` for a
        ``uint8`` observation space (pixels stay bytes until the network), else float32. For a
        ``Dict`` or ``Tuple`` space, a dict or tuple of such tensors, one per part
        (``batchrl.nested``): ``{"image": (N, 84, 84, 4) uint8, "state": (N, 7) float32}``.
      action: ``(N, *act_shape)``, the last action: float32 (Box) or int64 (discrete).
      reward: ``(N,)`` float32, the last reward (0 after a reset).
      done: ``(N,)`` float32, 1.0 where the last step ended the episode (terminated or truncated).
      terminated: ``(N,)`` float32, 1.0 where it terminated (``done - terminated``: truncated).
      infos: the info dicts of the last ``step`` (on the host; ``reset`` keeps them).
      restarted: ``None``, or the ``(K,)`` int64 envs whose worker the last ``step``
        or ``reset`` restarted after a failure (``BatchEnv``'s ``max_restarts``):
        their ``observ`` rows hold the first observations of new episodes.

    ``step`` and ``reset`` update these buffers in place and return them (or the
    reset rows): clone what must outlive the next step. On CUDA, staging buffers
    are pinned and copies ``non_blocking``. Envs are not reset automatically.
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
            device_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            staging = torch.zeros(shape, dtype=dtype, pin_memory=True) if cuda else device_buffer
            return device_buffer, staging

        pairs = [buffers((n, *space.shape), torch.uint8 if is_pixel_space(space)
                         else torch.float32) for _, space in leaf_spaces(obs_space)]
        device_parts, staging_parts = iter([p[0] for p in pairs]), iter([p[1] for p in pairs])
        self.observ = build(obs_space, lambda _: next(device_parts))
        self._staging_observ = build(obs_space, lambda _: next(staging_parts))
        self.action, self._staging_action = buffers((n, *act_space.shape), action_dtype)
        self.reward, self._staging_reward = buffers((n,), torch.float32)
        self.done, self._staging_done = buffers((n,), torch.float32)
        self.terminated, self._staging_terminated = buffers((n,), torch.float32)
        names = ("observ", "action", "reward", "done", "terminated")
        # numpy views of the staging buffers: cheaper to fill than torch copies
        self._np = {name: map_nested(torch.Tensor.numpy, getattr(self, f"_staging_{name}"))
                    for name in names}
        self._uploads = [pair for name in names if name != "action"  # (device, staging) pairs
                         for pair in zip(leaves(getattr(self, name)),
                                         leaves(getattr(self, f"_staging_{name}")))]
        self.infos: Sequence[dict] = [{} for _ in range(n)]
        self.restarted: torch.Tensor | None = None
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

    def _upload(self) -> None:
        """Copy the staging buffers (but the action) to the device buffers."""
        if self._uploaded is None:
            return  # on the CPU the staging buffers are the device buffers
        for device_buffer, staging in self._uploads:
            device_buffer.copy_(staging, non_blocking=True)
        self._uploaded.record()

    def step(self, action: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Step all envs with ``action`` ``(N, *act_shape)`` (on any device); returns the
        updated buffers ``(observ, reward, done)``."""
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action: torch.Tensor) -> None:
        """Start a step: ``action`` ``(N, *act_shape)`` (on any device) is copied into
        ``self.action`` and sent to the workers, which step while the caller goes on;
        until ``step_wait`` the other buffers keep the previous step's values."""
        action = action.detach()
        if action.shape != self.action.shape:
            raise ValueError(f"action must have shape {tuple(self.action.shape)} "
                             f"(num_envs, *action_space.shape), got {tuple(action.shape)}")
        if self._discrete and (action.is_floating_point() or action.is_complex()):
            raise TypeError(f"actions for {self.action_space} must be integers, got {action.dtype}")
        self.action.copy_(action)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the staging buffers' last upload is done
            self._staging_action.copy_(self.action, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        self.batch_env.step_async(self._np["action"])

    def step_wait(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Finish the step begun by ``step_async``; returns what ``step`` returns."""
        staging = self._np
        obs, reward, terminated, truncated, infos = self.batch_env.step_wait()
        map_nested(_copy_to, staging["observ"], obs)
        np.copyto(staging["reward"], reward, casting="unsafe")
        np.copyto(staging["terminated"], terminated)
        np.logical_or(terminated, truncated, out=staging["done"])
        self.infos = infos
        self._note_restarts()
        self._upload()
        return self.observ, self.reward, self.done

    def reset(self, indices: torch.Tensor | Sequence[int] | None = None,
              seed: int | Sequence[int] | None = None) -> Any:
        """Reset the envs at ``indices`` (all when ``None``), seeded as ``BatchEnv.reset``
        does: their observation rows are replaced, reward, done and terminated zeroed.
        Returns their observations ``(len(indices), *obs_shape)`` on ``device``."""
        if indices is None:
            rows = np.arange(len(self))
        elif isinstance(indices, torch.Tensor):
            rows = indices.detach().cpu().numpy()
        else:
            rows = np.asarray(indices)
        # Not cast to int first: BatchEnv rejects float or bool "indices" (a done mask).
        obs = self.batch_env.reset(rows, seed=seed)
        rows = rows.astype(np.int64)
        if rows.size == 0:
            return take(self.observ, slice(0, 0))
        if self._uploaded is not None:
            self._uploaded.synchronize()
        cpu_rows = torch.from_numpy(rows)
        self._set_rows(cpu_rows, obs)
        self._note_restarts()
        self._upload()
        return take(self.observ, cpu_rows.to(self.device))

    def _set_rows(self, cpu_rows: torch.Tensor, obs: Any) -> None:
        """Fresh episodes in these rows: observations set, the rest zeroed."""
        put(self._staging_observ, cpu_rows,
            map_nested(lambda staging, part: torch.from_numpy(np.asarray(part)).to(staging.dtype),
                       self._staging_observ, obs))
        for staging in (self._staging_reward, self._staging_done, self._staging_terminated):
            staging[cpu_rows] = 0.0

    def _note_restarts(self) -> None:
        """Take over the envs the batch env restarted in its last call (before the upload)."""
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


def _copy_to(staging: np.ndarray, observ: np.ndarray) -> None:
    np.copyto(staging, observ, casting="unsafe")

