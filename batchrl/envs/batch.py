"""Step many environments in lockstep with batched numpy arrays."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.errors import EnvError, EnvNonFiniteError, SpaceMismatchError
from batchrl.envs.infos import InfoList
from batchrl.envs.local import LocalWorker
from batchrl.envs.spaces import check_space
from batchrl.envs.worker import Closeable, RemoteWorker, Worker, WorkerFront, close_all
from batchrl.nested import (build, concatenate, first_leaf, leaf_spaces, leaves_of, map_nested,
                            put, take)

# Requests sent to the members that step in parallel, whose answers are due: the positions
# asked, ``send(position, member)`` (the request's async half), the positions it was sent to
# and those that failed to send, with the error.
Pending = tuple[Sequence[int], Callable[[int, Worker], None], list[int],
                list[tuple[int, int, EnvError]]]


@dataclasses.dataclass(frozen=True)
class RestartEvent:
    """One worker restart: its envs' batch indices, the error, and the restart count after it."""

    env_indices: range
    error: str
    number: int

    def __str__(self) -> str:
        envs = (f"env {self.env_indices.start}" if len(self.env_indices) == 1 else
                f"envs {self.env_indices.start}-{self.env_indices.stop - 1}")
        reason = self.error.splitlines()[0] if self.error else "?"
        return f"restarted {envs} (restart {self.number}) after: {reason}"


class BatchEnv(Closeable):
    """N environments with equal observation and action spaces as one batched env.

    Args:
      envs: the members, in batch order: Gymnasium envs stepped in this process, a ``WorkerFront``
        (``ExternalProcess``: one env in a child process), or any ``Worker`` (``EnvWorker``,
        ``RayEnvWorker``), counting as its ``num_envs`` envs.
      blocking: step the members one after the other (each one's ``step_async`` followed at once
        by its ``step_wait``) instead of in parallel (every request sent before any is waited for;
        in-process envs step while the others do).
      max_restarts: how many times in this env's life a failed worker process (an env that raised, a
        crash, a timeout, or a NaN/inf observation or reward) is replaced by a fresh one instead of
        raising. In-process envs are never restarted.

    ``step(actions)`` returns Gymnasium's 5-tuple batched: observations ``(N, *obs_shape)`` (for a
    ``Dict`` or ``Tuple`` observation space, a dict or tuple of such arrays, one per part, as
    Gymnasium's vector envs give them; see ``batchrl.nested``), rewards ``(N,)`` float64, terminated
    and truncated ``(N,)`` bool, and the info dicts as an ``InfoList``.
    Finished envs are not reset automatically. All modes give the same trajectories for the same
    seeds and actions. Real-valued actions for an integer ``Box`` (a Gaussian policy's) reach
    the envs as the nearest integers within its bounds, in its dtype.

    Failures raise an ``EnvError`` naming the env's batch index (or the index range of a dead worker
    process); NaN or infinite observations and rewards raise ``EnvNonFiniteError``. With
    ``max_restarts``, the failed env's worker is replaced instead and all its envs start new
    (unseeded) episodes: ``step`` returns their first observations with zero rewards and false
    flags, ``restarted`` lists them and ``restart_events`` records every restart.
    """

    def __init__(self, envs: Sequence[gym.Env | WorkerFront | Worker],
                 blocking: bool = False, max_restarts: int = 0):
        members: list[Worker] = []
        given: list[Worker | WorkerFront] = []  # per member, what the user passed
        # Each run of consecutive in-process envs forms one LocalWorker.
        for remote, group in itertools.groupby(
                envs, lambda env: isinstance(env, (Worker, WorkerFront))):
            if remote:
                for env in group:
                    given.append(env)
                    members.append(_worker_of(env))
                continue
            local = list(group)
            for env in local:
                if isinstance(env, type) or (callable(env) and not hasattr(env, "step")):
                    raise TypeError(
                        f"BatchEnv takes envs, got the constructor {env!r}: pass make() to "
                        f"step the env in this process, or ExternalProcess(make) / "
                        f"EnvWorker([make, ...]) to build it in a worker process")
            members.append(LocalWorker(local))
            given.append(members[-1])
        if not members:
            raise ValueError("BatchEnv needs at least one env")
        self._members = members
        self._given = given
        self._parallel = [not (member.in_process or blocking) for member in members]
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
        self.observation_space, self.action_space = spaces[0]
        check_space("observation", self.observation_space)
        check_space("action", self.action_space)
        for index, pair in enumerate(spaces[1:], 1):
            for kind, expected, got in zip(("observation", "action"), spaces[0], pair):
                if got != expected:
                    raise SpaceMismatchError(
                        f"all envs of a BatchEnv need equal {kind} spaces, but env "
                        f"{index} has {got} while env 0 has {expected}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        self.restart_events: list[RestartEvent] = []
        # The float parts of the observations, checked for NaN and inf.
        self._float_parts = [np.dtype(leaf.dtype).kind == "f"
                             for _, leaf in leaf_spaces(self.observation_space)]
        # Steps of each env's running episode, to say where a NaN appeared.
        self._episode_steps = np.zeros(self._num_envs, np.int64)
        self._all = np.arange(self._num_envs)
        self._no_restarts = (np.zeros(0, np.int64), self._empty_observ(0))
        self._restarted = self._no_restarts
        self._pending: Pending | None = None  # a step_async() awaiting its step_wait()
        self._closed = False

    def __len__(self) -> int:
        return self._num_envs

    def __getitem__(self, index: int) -> Any:
        return self.envs[index]

    @property
    def envs(self) -> list[Any]:
        """The envs in batch order (a ``WorkerEnv`` handle for a remote one; a
        ``WorkerFront`` such as ``ExternalProcess`` as given)."""
        envs: list[Any] = []
        for given, member in zip(self._given, self._members):
            if isinstance(given, WorkerFront):
                envs.append(given)
            else:
                envs.extend(member.env(i) for i in range(member.num_envs))
        return envs

    @property
    def workers(self) -> list[Worker | WorkerFront]:
        """The members stepped in parallel with the caller, as they were given: worker
        processes, Ray actors, and vector envs with ``send``/``recv`` (their own threads)."""
        return [given for given, member in zip(self._given, self._members)
                if not member.in_process]

    @property
    def steps_here(self) -> bool:
        """Whether some envs step in this process (in its code or its threads), not in worker
        processes or Ray actors: no worker timeout covers them, so a hang in their step hangs
        the caller."""
        return any(not isinstance(member, RemoteWorker) for member in self._members)

    @property
    def restarts(self) -> int:
        """Worker restarts so far (at most ``max_restarts``)."""
        return len(self.restart_events)

    @property
    def restarted(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, observations)`` of the envs restarted by the last
        ``step`` or ``reset``: int64 ``(K,)`` and ``(K, *obs_shape)``; after
        ``reset`` they may include envs not asked for (a worker restarts whole)."""
        return self._restarted

    def _locate(self, exc: EnvError, position: int) -> None:
        """Set the batch index (or range) of the env(s) behind ``exc``."""
        start, count = self._starts[position], self._members[position].num_envs
        local = getattr(exc, "worker_env_index", None)
        if local is not None or count == 1:
            exc.env_index = start + (local or 0)
        else:
            exc.env_indices = range(start, start + count)
            if self._members[position].in_process:  # (a vector env here, not a process)
                exc.together = "one vector env in this process"

    def _send(self, positions: Sequence[int], send: Callable[[int, Worker], None],
              wait: Callable[[Worker], Any]) -> Pending:
        """Call ``send(position, member)``, a request's async half, for the members at
        ``positions`` that step in parallel; what ``_receive`` needs to finish. An error other
        than an env's (bad input a member rejects, an interrupt) is raised once the members
        already sent the request have answered it (``wait``): none is left with a request in
        flight."""
        sent: list[int] = []
        failures: list[tuple[int, int, EnvError]] = []
        for slot, position in enumerate(positions):
            if self._parallel[position]:
                try:
                    send(position, self._members[position])
                    sent.append(slot)
                except EnvError as exc:
                    failures.append((slot, position, exc))
                except BaseException as exc:
                    self._note_member(exc, position)
                    self._drain(positions, sent, wait)
                    raise
        return positions, send, sent, failures

    def _note_member(self, exc: BaseException, position: int) -> None:
        """Say which envs of the batch the member at ``position`` holds, on an error it raised
        that is not an env's (those carry their batch index): its own indices count from 0."""
        count = self._members[position].num_envs
        if isinstance(exc, Exception) and count < self._num_envs:
            start = int(self._starts[position])
            exc.add_note(f"(from the member holding envs {start}-{start + count - 1} of the "
                         f"batch: env indices in the message count from {start})")

    def _drain(self, positions: Sequence[int], slots: Sequence[int],
               wait: Callable[[Worker], Any]) -> None:
        """Wait for the answers of the members at ``slots`` (a request was sent to them),
        ignoring their errors: after a failure elsewhere has ended the request."""
        for slot in slots:
            with contextlib.suppress(Exception):
                wait(self._members[positions[slot]])

    def _receive(self, pending: Pending, wait: Callable[[Worker], Any],
                 recover: Callable[[int, np.ndarray], Any]) -> list[Any]:
        """Finish the request ``_send`` began: send it to and ``wait(member)`` for the others
        (in-process, or all when ``blocking``) one after the other, then wait for every member
        it was sent to (even after a failure: no stale reply may stay in a pipe). A failed
        member is restarted if allowed, its result then ``recover(position, first observ)``;
        otherwise the first failure is raised with its env index."""
        positions, send, sent, failures = pending
        results: list[Any] = [None] * len(positions)
        unanswered = list(reversed(sent))
        try:
            for slot, position in enumerate(positions):
                if not self._parallel[position]:
                    member = self._members[position]
                    try:
                        send(position, member)
                        results[slot] = wait(member)
                    except EnvError as exc:
                        failures.append((slot, position, exc))
                    except BaseException as exc:
                        self._note_member(exc, position)
                        raise
            while unanswered:
                slot = unanswered.pop(0)
                try:
                    results[slot] = wait(self._members[positions[slot]])
                except EnvError as exc:
                    failures.append((slot, positions[slot], exc))
        except BaseException:  # (not an env's error: see _send)
            self._drain(positions, unanswered, wait)
            raise
        # In batch order, not the order the answers came in: as in blocking mode, the first
        # failed member is restarted first, and the one that finds no restart left is raised.
        for slot, position, exc in sorted(failures, key=lambda failure: failure[0]):
            self._locate(exc, position)
            results[slot] = recover(position, self._restart(position, exc))
        return results

    def _restart(self, position: int, exc: EnvError) -> np.ndarray:
        """Replace the failed member at ``position`` and reset all its envs;
        returns their observations. Raises ``exc`` when that is not allowed."""
        member = self._members[position]
        if member.in_process:
            raise exc
        self._check_restarts_left(exc)
        start, count = self._starts[position], member.num_envs
        indices, rows = range(start, start + count), np.arange(start, start + count)
        while True:
            given = self._given[position] = self._given[position].restart()
            member = self._members[position] = _worker_of(given)
            self.restart_events.append(RestartEvent(indices, str(exc), self.restarts + 1))
            try:
                observ, _ = member.reset(list(range(count)), [None] * count)
                self._episode_steps[start:start + count] = 0
                self._check_observ(observ, rows, "reset")
                old_rows, old = self._restarted
                self._restarted = (np.concatenate([old_rows, rows]), concatenate([old, observ]))
                return observ
            except EnvError as again:  # the fresh worker failed too: counts as another
                self._locate(again, position)
                self._check_restarts_left(again)
                exc = again

    def _check_restarts_left(self, exc: EnvError) -> None:
        """Raise ``exc`` if no restart is left (saying so when restarts were on)."""
        if self.restarts >= self.max_restarts:
            if self.max_restarts:
                exc.detail += (f"\n(not restarted: this run used all its "
                               f"max_restarts={self.max_restarts} restarts)")
            raise exc

    def _check_observ(self, observ: np.ndarray, indices: np.ndarray, operation: str,
                      rewards: np.ndarray | None = None) -> None:
        """Raise ``EnvNonFiniteError`` for the first env (row ``i`` is batch
        env ``indices[i]``) with a NaN or infinite observation or reward."""
        parts = [part for part, check in zip(leaves_of(self.observation_space, observ),
                                             self._float_parts) if check]
        if not all(np.isfinite(part).all() for part in parts):
            what, row = "observation", int(np.flatnonzero(~np.all(
                [np.isfinite(part.reshape(len(part), -1)).all(axis=1) for part in parts],
                axis=0))[0])
        elif rewards is not None and not np.isfinite(rewards).all():
            what, row = "reward", int(np.flatnonzero(~np.isfinite(rewards))[0])
        else:
            return
        index = int(indices[row])
        label = self._members[self._member_of[index]].env_label(int(self._local_of[index]))
        error = EnvNonFiniteError(label, operation, what, int(self._episode_steps[index]))
        error.env_index = index
        raise error

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
            if not np.isfinite(actions).all():
                bad = ~np.isfinite(actions.reshape(len(self), -1)).all(axis=1)
                raise ValueError(f"actions must be finite, got NaN or inf for envs "
                                 f"{np.flatnonzero(bad).tolist()}")
            if np.dtype(space.dtype).kind in "iu" and actions.dtype.kind == "f":
                # (a cast alone would truncate toward zero, and could leave the bounds)
                actions = np.clip(np.rint(actions), space.low, space.high).astype(space.dtype)
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

    def step(self, actions: Any, autoreset: np.ndarray | None = None
             ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        """Step env ``i`` with ``actions[i]`` (shape ``(N, *action_space.shape)``);
        returns ``(observations, rewards, terminated, truncated, infos)``.

        ``autoreset``: optional bool ``(N,)``; envs where it is true are reset (no seed or
        options) instead of stepped, in the same round trip: their rows are the first
        observations, zero rewards, false flags and the reset infos.
        """
        self.step_async(actions, autoreset)
        return self.step_wait()

    def step_async(self, actions: Any, autoreset: np.ndarray | None = None) -> None:
        """Send the worker processes their ``actions`` (as for ``step``) and return;
        ``step_wait`` finishes the step. Meanwhile leave this env and ``actions`` alone."""
        self._check_open("step")
        if self._pending is not None:
            raise RuntimeError("step_async() was called twice: call step_wait() first")
        actions = self._check_actions(actions)
        if autoreset is not None:
            autoreset = np.array(autoreset)  # a copy: in-process envs read it in step_wait
            if autoreset.shape != (len(self),) or autoreset.dtype != np.bool_:
                raise ValueError(f"autoreset must be a bool array of shape ({len(self)},), "
                                 f"got {autoreset.dtype} {autoreset.shape}")
            autoreset = autoreset if autoreset.any() else None
        starts = self._starts
        self._restarted = self._no_restarts
        self._pending = self._send(
            range(len(self._members)),
            lambda position, member: member.step_async(
                actions[starts[position]:starts[position] + member.num_envs],
                None if autoreset is None else
                autoreset[starts[position]:starts[position] + member.num_envs]), _wait_step)
        # Before the step's end: a restart sets its envs' counts to 0.
        self._episode_steps += 1
        if autoreset is not None:
            self._episode_steps[autoreset] = 0

    def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict]]:
        """Finish the step begun by ``step_async``; returns what ``step`` returns."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("step_wait() needs a step_async() first")
        one = len(self._members) == 1  # (then its own arrays are the batch's: no join copies)
        results = self._receive(pending, _wait_owned if one else _wait_step, self._fresh_step)
        batch = self._join(results)
        try:
            self._check_observ(batch[0], self._all, "step", batch[1])
        except EnvNonFiniteError:  # rare: restart (or raise for) every member with bad values
            for position, (observ, rewards, *_) in enumerate(results):
                start = self._starts[position]
                try:
                    self._check_observ(observ, np.arange(start, start + len(rewards)), "step",
                                       rewards)
                except EnvNonFiniteError as exc:
                    results[position] = self._fresh_step(position, self._restart(position, exc))
            batch = self._join(results)
        return batch

    @staticmethod
    def _join(results: Sequence[tuple]) -> tuple:
        if len(results) == 1:  # (arrays the member gave up: step_wait(copy=True))
            obs, rewards, terminated, truncated, infos = results[0]
            return obs, rewards, terminated, truncated, InfoList.join([infos])
        obs, rewards, terminated, truncated, infos = zip(*results)
        return (concatenate(obs), np.concatenate(rewards), np.concatenate(terminated),
                np.concatenate(truncated), InfoList.join(infos))

    @staticmethod
    def _fresh_step(position: int, observ: Any) -> tuple:
        """The step result of envs that were restarted instead of stepped."""
        count = len(first_leaf(observ))
        return (observ, np.zeros(count), np.zeros(count, bool), np.zeros(count, bool),
                [{} for _ in range(count)])

    def reset(self, indices: Sequence[int] | np.ndarray | None = None,
              seed: int | Sequence[int] | None = None,
              options: dict | None = None, return_infos: bool = False) -> Any:
        """Reset the envs at ``indices`` (unique, in ``[0, N)``; all when ``None``).

        ``seed`` is ``None``, one seed per index, or an int: env ``i`` then gets ``seed + i`` (as in
        Gymnasium's vector envs). ``options`` go to every env's ``reset``. Returns the new
        observations, ``(len(indices), *obs_shape)``, in the order of ``indices``; with
        ``return_infos``, ``(observations, infos)``, the reset info dicts in the same order (empty
        for envs whose worker was restarted).
        """
        self._check_open("reset")
        if self._pending is not None:
            raise RuntimeError("reset() during a step: call step_wait() after step_async() first")
        self._restarted = self._no_restarts
        indices = self._check_indices(indices)
        if seed is None or isinstance(seed, (int, np.integer)):
            seeds = [None if seed is None else int(seed) + i for i in indices]
        else:
            seeds = [None if s is None else int(s) for s in seed]
            if len(seeds) != len(indices):
                raise ValueError(f"got {len(seeds)} seeds for {len(indices)} envs to reset")
        if not indices:
            observ = self._empty_observ(0)
            return (observ, []) if return_infos else observ
        # Group the requests by member: one round trip per worker process.
        groups: dict[int, tuple[list[int], list[int], list]] = {}
        for slot, index in enumerate(indices):
            rows, local, local_seeds = groups.setdefault(int(self._member_of[index]), ([], [], []))
            rows.append(slot)
            local.append(int(self._local_of[index]))
            local_seeds.append(seeds[slot])
        positions = list(groups)
        # A restarted member's envs were all reset: keep the rows asked for.
        results = self._receive(self._send(
            positions, lambda position, member: member.reset_async(
                groups[position][1], groups[position][2], options), _wait_reset),
            _wait_reset, lambda position, observ: (take(observ, groups[position][1]), None))
        # (each part in the dtype the envs gave, as a step returns it)
        observ = map_nested(lambda part: np.empty((len(indices), *part.shape[1:]), part.dtype),
                            results[0][0])
        infos: list[dict] = [{} for _ in indices]
        for position, (obs, member_infos) in zip(positions, results):
            put(observ, groups[position][0], obs)
            if member_infos is not None:
                for slot, info in zip(groups[position][0], member_infos):
                    infos[slot] = info
        self._episode_steps[indices] = 0
        rows = np.asarray(indices)
        while True:
            try:
                self._check_observ(observ, rows, "reset")
                return (observ, infos) if return_infos else observ
            except EnvNonFiniteError as exc:
                position = int(self._member_of[exc.env_index])
                put(observ, groups[position][0],
                    take(self._restart(position, exc), groups[position][1]))
                for slot in groups[position][0]:
                    infos[slot] = {}

    def _empty_observ(self, count: int) -> Any:
        """Observations of ``count`` envs to fill in (a nested value for Dict and Tuple
        spaces)."""
        return build(self.observation_space,
                     lambda space: np.zeros((count, *space.shape), space.dtype))

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

    def _check_open(self, operation: str) -> None:
        if self._closed:  # (else a failed worker's restart would bring the envs back)
            raise RuntimeError(f"{operation} on a closed BatchEnv")

    def close(self) -> None:
        """Close every env (stops the worker processes). Idempotent; the envs then neither
        step nor reset. Every member is closed even if one raises (its error is raised
        after)."""
        self._pending = None
        self._closed = True
        close_all(self._members)


def _worker_of(member: Worker | WorkerFront) -> Worker:
    """The ``Worker`` that steps a member as given."""
    return member if isinstance(member, Worker) else member.worker


def _wait_step(member: Worker) -> tuple:
    # Views of the workers' buffers: step_wait's concatenation copies them.
    return member.step_wait(copy=False)


def _wait_owned(member: Worker) -> tuple:
    return member.step_wait(copy=True)


def _wait_reset(member: Worker) -> tuple[np.ndarray, list[dict]]:
    return member.reset_wait()
