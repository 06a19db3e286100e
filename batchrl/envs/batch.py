"""Step many environments in lockstep with batched numpy arrays."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError
from batchrl.envs.external import ExternalProcess
from batchrl.envs.workers import EnvWorker, InfoList

SUPPORTED_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                    gym.spaces.MultiBinary)


def _check_space(kind: str, space: gym.Space) -> None:
    if not isinstance(space, SUPPORTED_SPACES):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_SPACES)
        hint = (" (flatten it, e.g. with gymnasium.wrappers.FlattenObservation)"
                if kind == "observation" else "")
        raise TypeError(f"unsupported {kind} space {space}: a batch env needs one of "
                        f"{names}{hint}")


class _LocalEnvs:
    """A ``BatchEnv`` member: consecutive envs stepped in this process, one
    after the other (while the child processes step theirs)."""

    parallel = False

    def __init__(self, envs: list[gym.Env]):
        self.envs = envs
        self.num_envs = len(envs)

    def spaces(self) -> list[tuple[gym.Space, gym.Space]]:
        return [(env.observation_space, env.action_space) for env in self.envs]

    def step(self, actions: np.ndarray, blocking: bool) -> Any:
        results = [env.step(action) for env, action in zip(self.envs, actions)]
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (np.stack(obs), np.array(rewards, np.float64), np.array(terminated, bool),
                np.array(truncated, bool), list(infos))

    def reset(self, indices: list[int], seeds: list, options: dict | None,
              blocking: bool) -> Any:
        results = [self.envs[index].reset(seed=seed, options=options)
                   for index, seed in zip(indices, seeds)]
        return np.stack([obs for obs, _ in results]), [info for _, info in results]

    def handles(self) -> list:
        return list(self.envs)

    def close(self) -> None:
        for env in self.envs:
            env.close()


class _ProcessEnv:
    """A ``BatchEnv`` member: one ``ExternalProcess``."""

    num_envs = 1
    parallel = True

    def __init__(self, env: ExternalProcess):
        self.env = env

    def spaces(self) -> list[tuple[gym.Space, gym.Space]]:
        return [(self.env.observation_space, self.env.action_space)]

    def step(self, actions: np.ndarray, blocking: bool) -> Any:
        if blocking:
            return _as_batch(self.env.step(actions[0]))
        promise = self.env.step(actions[0], blocking=False)
        return lambda: _as_batch(promise())

    def reset(self, indices: list[int], seeds: list, options: dict | None,
              blocking: bool) -> Any:
        promise = self.env.reset(seed=seeds[0], options=options, blocking=False)

        def result() -> tuple[np.ndarray, list[dict]]:
            obs, info = promise()
            return np.asarray(obs)[None], [info]

        return result() if blocking else result

    def handles(self) -> list:
        return [self.env]

    def close(self) -> None:
        self.env.close()


class _Workers(_ProcessEnv):
    """A ``BatchEnv`` member: an ``EnvWorker`` and its envs."""

    def __init__(self, worker: EnvWorker):
        super().__init__(worker)
        self.num_envs = worker.num_envs

    def spaces(self) -> list[tuple[gym.Space, gym.Space]]:
        # The worker has checked that its envs have equal spaces.
        return [(self.env.observation_space, self.env.action_space)] * self.num_envs

    def step(self, actions: np.ndarray, blocking: bool) -> Any:
        # Views of the shared block: the concatenation below copies them.
        return self.env._step(actions, blocking, copy=False)  # noqa: SLF001

    def reset(self, indices: list[int], seeds: list, options: dict | None,
              blocking: bool) -> Any:
        return self.env.reset(indices, seeds, options, blocking=blocking)

    def handles(self) -> list:
        return [self.env.env(i) for i in range(self.num_envs)]


def _as_batch(result: tuple) -> tuple:
    obs, reward, terminated, truncated, info = result
    return (np.asarray(obs)[None], np.array([reward], np.float64),
            np.array([terminated], bool), np.array([truncated], bool), [info])


class BatchEnv:
    """Combines N environments with equal spaces into one batched env.

    Args:
      envs: the members, in batch order: Gymnasium envs stepped in this
        process, ``ExternalProcess`` (one env in a child process) or
        ``EnvWorker`` (several envs in a child process, arrays in shared
        memory; counts as ``worker.num_envs`` envs). All envs must have equal
        observation and action spaces.
      blocking: with ``False`` (the default) the child processes are stepped
        in parallel: every request is sent before any result is received.
        With ``True`` they are stepped one after the other.

    ``step(actions)`` returns Gymnasium's 5-tuple batched: observations of
    shape ``(N, *obs_shape)``, rewards ``(N,)`` float64, terminated and
    truncated ``(N,)`` bool, and the N info dicts as an ``InfoList`` (a
    read-only sequence that unpickles workers' infos on first access). Envs are not reset
    automatically: reset the finished ones with ``reset(indices)`` before
    stepping them again. All modes give the same trajectories for the same
    seeds and actions.
    """

    def __init__(self, envs: Sequence[gym.Env | ExternalProcess | EnvWorker],
                 blocking: bool = False):
        members: list[Any] = []
        for env in envs:
            if isinstance(env, EnvWorker):
                members.append(_Workers(env))
            elif isinstance(env, ExternalProcess):
                members.append(_ProcessEnv(env))
            elif members and isinstance(members[-1], _LocalEnvs):
                members[-1].envs.append(env)
                members[-1].num_envs += 1
            else:
                members.append(_LocalEnvs([env]))
        if not members:
            raise ValueError("BatchEnv needs at least one env")
        self._members = members
        self._parallel = [member.parallel and not blocking for member in members]
        starts = np.cumsum([0] + [m.num_envs for m in members])
        self._starts = [int(s) for s in starts[:-1]]
        self._num_envs = int(starts[-1])
        # Global env index -> (member, index within the member).
        self._member_of = np.repeat(np.arange(len(members)), [m.num_envs for m in members])
        self._local_of = np.arange(self._num_envs) - starts[self._member_of]
        spaces = []
        for position, member in enumerate(members):
            try:  # waits for a child process to be built; name the env that failed
                spaces.extend(member.spaces())
            except EnvError as exc:
                self._locate(exc, position)
                raise
        observation_space, action_space = spaces[0]
        _check_space("observation", observation_space)
        _check_space("action", action_space)
        for index, pair in enumerate(spaces[1:], 1):
            for kind, expected, got in zip(("observation", "action"), spaces[0], pair):
                if got != expected:
                    raise ValueError(
                        f"all envs of a BatchEnv need equal {kind} spaces, but env "
                        f"{index} has {got} while env 0 has {expected}")
        self.observation_space: gym.Space = observation_space
        self.action_space: gym.Space = action_space

    def __len__(self) -> int:
        return self._num_envs

    def __getitem__(self, index: int) -> Any:
        return self.envs[index]

    def __enter__(self) -> "BatchEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def envs(self) -> list[Any]:
        """The individual envs, in batch order (a ``WorkerEnv`` handle for
        each env of an ``EnvWorker``)."""
        return [handle for member in self._members for handle in member.handles()]

    @property
    def workers(self) -> list[ExternalProcess | EnvWorker]:
        """The child processes: ``ExternalProcess`` and ``EnvWorker`` members."""
        return [member.env for member in self._members if member.parallel]

    def _locate(self, exc: EnvError, position: int) -> None:
        """Set the batch index (or range) of the env(s) behind ``exc``."""
        start, count = self._starts[position], self._members[position].num_envs
        local = getattr(exc, "worker_env_index", None)
        if local is not None or count == 1:
            exc.env_index = start + (local or 0)
        else:
            exc.env_indices = range(start, start + count)

    def _gather(self, positions: Sequence[int],
                call: Callable[[int, Any, bool], Any]) -> list[Any]:
        """Run ``call(position, member, blocking)`` on the members at
        ``positions``; parallel members first get all requests, then all
        answers are received. Every answer is received even when one member
        fails, so no stale reply is left in a pipe; the first failure is
        raised with its env index."""
        results: list[Any] = [None] * len(positions)
        promises: list[tuple[int, int, Callable[[], Any]]] = []
        error: EnvError | None = None
        # Requests to child processes go out first, so that they work while
        # this process steps its own envs (if any) and waits.
        order = sorted(range(len(positions)), key=lambda slot: not self._parallel[positions[slot]])
        for slot in order:
            position = positions[slot]
            member = self._members[position]
            try:
                if self._parallel[position]:
                    promises.append((slot, position, call(position, member, False)))
                else:
                    results[slot] = call(position, member, True)
            except EnvError as exc:
                self._locate(exc, position)
                error = error or exc
        for slot, position, promise in reversed(promises):
            try:
                results[slot] = promise()
            except EnvError as exc:
                self._locate(exc, position)
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
            if np.isfinite(actions).all():
                return actions
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
        starts = self._starts
        results = self._gather(
            range(len(self._members)),
            lambda position, member, blocking: member.step(
                actions[starts[position]:starts[position] + member.num_envs], blocking))
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (np.concatenate(obs), np.concatenate(rewards), np.concatenate(terminated),
                np.concatenate(truncated), InfoList.join(infos))

    def reset(self, indices: Sequence[int] | np.ndarray | None = None,
              seed: int | Sequence[int] | None = None,
              options: dict | None = None) -> np.ndarray:
        """Reset the envs at ``indices`` (all when ``None``).

        Args:
          indices: env indices, unique, each in ``[0, N)``.
          seed: ``None``; an int, in which case env ``i`` is seeded with
            ``seed + i`` (its index in the batch, as Gymnasium's vector envs
            do); or one seed per index.
          options: passed to every env's ``reset``.
        Returns:
          the new observations, shape ``(len(indices), *obs_shape)``, in the
          order of ``indices``.
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
        if not indices:
            return np.zeros((0,) + tuple(self.observation_space.shape),
                            self.observation_space.dtype)
        # Group the requests by member: one round trip per worker process.
        groups: dict[int, tuple[list[int], list[int], list]] = {}
        for slot, index in enumerate(indices):
            rows, local, local_seeds = groups.setdefault(int(self._member_of[index]),
                                                         ([], [], []))
            rows.append(slot)
            local.append(int(self._local_of[index]))
            local_seeds.append(seeds[slot])
        positions = list(groups)
        results = self._gather(
            positions, lambda position, member, blocking: member.reset(
                groups[position][1], groups[position][2], options, blocking))
        first = results[0][0]
        observ = np.empty((len(indices), *first.shape[1:]), first.dtype)
        for position, (obs, _) in zip(positions, results):
            observ[groups[position][0]] = obs
        return observ

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
        """Close every env (stops the worker processes). Idempotent."""
        for member in self._members:
            member.close()

