"""Step many environments in lockstep with batched numpy arrays."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError
from batchrl.envs.external import ExternalProcess

SUPPORTED_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                    gym.spaces.MultiBinary)


def _check_space(kind: str, space: gym.Space) -> None:
    if not isinstance(space, SUPPORTED_SPACES):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_SPACES)
        hint = (" (flatten it, e.g. with gymnasium.wrappers.FlattenObservation)"
                if kind == "observation" else "")
        raise TypeError(f"unsupported {kind} space {space}: a batch env needs one of "
                        f"{names}{hint}")


class BatchEnv:
    """Combines N environments with equal spaces into one batched env.

    Args:
      envs: Gymnasium envs, in-process or ``ExternalProcess``; all must have
        equal observation and action spaces.
      blocking: with ``False`` (the default) external envs are stepped in
        parallel: every request is sent before any result is received. With
        ``True`` they are stepped one after the other.

    ``step(actions)`` returns Gymnasium's 5-tuple batched: observations of
    shape ``(N, *obs_shape)`` in the observation space's dtype, rewards
    ``(N,)`` float64, terminated and truncated ``(N,)`` bool, and a list of N
    info dicts. Envs are not reset automatically: reset the finished ones with
    ``reset(indices)`` before stepping them again.
    """

    def __init__(self, envs: Sequence[gym.Env], blocking: bool = False):
        envs = list(envs)
        if not envs:
            raise ValueError("BatchEnv needs at least one env")
        first = envs[0]
        spaces = []
        for index, env in enumerate(envs):
            try:  # waits for an ExternalProcess to be built; name the env that failed
                spaces.append({"observation": env.observation_space, "action": env.action_space})
            except EnvError as exc:
                exc.env_index = index
                raise
        _check_space("observation", first.observation_space)
        _check_space("action", first.action_space)
        for index in range(1, len(envs)):
            for kind in ("observation", "action"):
                expected = spaces[0][kind]
                got = spaces[index][kind]
                if got != expected:
                    raise ValueError(
                        f"all envs of a BatchEnv need equal {kind} spaces, but env {index} "
                        f"has {got} while env 0 has {expected}")
        self._envs = envs
        self._parallel = [isinstance(env, ExternalProcess) and not blocking for env in envs]
        self.observation_space: gym.Space = first.observation_space
        self.action_space: gym.Space = first.action_space

    def __len__(self) -> int:
        return len(self._envs)

    def __getitem__(self, index: int) -> gym.Env:
        return self._envs[index]

    def __enter__(self) -> "BatchEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def envs(self) -> list[gym.Env]:
        """The individual envs, in batch order."""
        return list(self._envs)

    def _gather(self, indices: Sequence[int],
                call: Callable[[int, gym.Env, bool], Any]) -> list[Any]:
        """Run ``call(slot, env, blocking)`` on the envs at ``indices``; parallel envs first send all
        requests, then receive all answers. Every answer is received even when
        one env fails, so no stale reply is left in a pipe; the first failure is
        raised with its env index."""
        results: list[Any] = [None] * len(indices)
        promises: list[tuple[int, int, Callable[[], Any]]] = []
        error: EnvError | None = None
        for slot, index in enumerate(indices):
            env = self._envs[index]
            try:
                if self._parallel[index]:
                    promises.append((slot, index, call(slot, env, False)))
                else:
                    results[slot] = call(slot, env, True)
            except EnvError as exc:
                exc.env_index = index
                error = error or exc
        for slot, index, promise in promises:
            try:
                results[slot] = promise()
            except EnvError as exc:
                exc.env_index = index
                error = error or exc
        if error is not None:
            raise error
        return results

    def _check_actions(self, actions: Any) -> np.ndarray:
        space = self.action_space
        actions = np.asarray(actions)
        expected_shape = (len(self),) + tuple(space.shape)
        if actions.shape != expected_shape:
            raise ValueError(f"actions must have shape {expected_shape} (num_envs, "
                             f"*action_space.shape) for {space}, got {actions.shape}")
        if isinstance(space, gym.spaces.Box):
            if actions.dtype.kind not in "fiub":
                raise TypeError(f"actions for {space} must be real numbers, got dtype "
                                f"{actions.dtype}")
            bad = ~np.isfinite(actions.reshape(len(self), -1)).all(axis=1)
            if bad.any():
                raise ValueError(f"actions must be finite, got NaN or inf for envs "
                                 f"{np.flatnonzero(bad).tolist()}")
        else:
            if actions.dtype.kind not in "iub":
                raise TypeError(f"actions for {space} must be integers, got dtype "
                                f"{actions.dtype}")
            low = getattr(space, "start", 0)
            high = (low + space.n if isinstance(space, gym.spaces.Discrete)
                    else low + space.nvec if isinstance(space, gym.spaces.MultiDiscrete)
                    else 2)
            bad = ((actions < low) | (actions >= high)).reshape(len(self), -1).any(axis=1)
            if bad.any():
                raise ValueError(f"actions out of range for {space} in envs "
                                 f"{np.flatnonzero(bad).tolist()}: "
                                 f"{actions[bad].tolist()}")
        return actions

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          list[dict]]:
        """Step every env with its action.

        Args:
          actions: array-like of shape ``(N, *action_space.shape)``.
        Returns:
          ``(observations, rewards, terminated, truncated, infos)`` as described
          in the class docstring.
        """
        actions = self._check_actions(actions)
        results = self._gather(range(len(self)),
                               lambda slot, env, blocking: _step(env, actions[slot], blocking))
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (np.stack(obs), np.asarray(rewards, dtype=np.float64),
                np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool),
                list(infos))

    def reset(self, indices: Sequence[int] | np.ndarray | None = None,
              seed: int | Sequence[int] | None = None) -> np.ndarray:
        """Reset the envs at ``indices`` (all when ``None``).

        Args:
          indices: env indices, unique, each in ``[0, N)``.
          seed: ``None``; an int, in which case env ``i`` is seeded with
            ``seed + i`` (its index in the batch, as Gymnasium's vector envs
            do); or one seed per index.
        Returns:
          the new observations, shape ``(len(indices), *obs_shape)``.
        """
        indices = self._check_indices(indices)
        if seed is None:
            seeds = [None] * len(indices)
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + int(i) for i in indices]
        else:
            seeds = [None if s is None else int(s) for s in seed]
            if len(seeds) != len(indices):
                raise ValueError(f"got {len(seeds)} seeds for {len(indices)} envs to reset")
        results = self._gather(indices,
                               lambda slot, env, blocking: _reset(env, seeds[slot], blocking))
        if not results:
            return np.zeros((0,) + tuple(self.observation_space.shape),
                            self.observation_space.dtype)
        return np.stack([obs for obs, _ in results])

    def _check_indices(self, indices: Any) -> list[int]:
        if indices is None:
            return list(range(len(self)))
        array = np.asarray(indices)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise TypeError(f"indices must be a 1-D sequence of ints, got {indices!r}")
        result = [int(i) for i in array]
        bad = [i for i in result if not 0 <= i < len(self)]
        if bad:
            raise IndexError(f"env indices {bad} out of range for a batch of {len(self)} envs")
        if len(set(result)) != len(result):
            raise ValueError(f"env indices must be unique, got {result}")
        return result

    def close(self) -> None:
        """Close every env (stops external worker processes). Idempotent."""
        for env in self._envs:
            env.close()


def _step(env: gym.Env, action: Any, blocking: bool) -> Any:
    if isinstance(env, ExternalProcess):
        return env.step(action, blocking=blocking)
    return env.step(action)


def _reset(env: gym.Env, seed: int | None, blocking: bool) -> Any:
    if isinstance(env, ExternalProcess):
        return env.reset(seed=seed, blocking=blocking)
    return env.reset(seed=seed)
