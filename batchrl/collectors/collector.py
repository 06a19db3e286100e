"""What a collector does, wherever it runs: step its own batch env with a copy of the
algorithm that only acts, and send fixed-length rollouts to the learner.

The loop is written once against a ``Link`` (how rollouts, weights and the stop request travel):
``batchrl.collectors.local`` links a collector process through shared memory,
``batchrl.collectors.ray`` a Ray actor through the object store.
"""

from __future__ import annotations

import abc
import dataclasses
import faulthandler
import random
import time
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from batchrl.algos.base import Algorithm, Summary
from batchrl.parts.packing import packing_for, stored_observations
from batchrl.envs.batch import BatchEnv
from batchrl.envs.factory import split_evenly
from batchrl.parts.rollout import Fields, RolloutBuffer, rollout_tensors
from batchrl.simulation import Simulation
from batchrl.tensor_env import TensorBatchEnv


class CollectorError(RuntimeError):
    """A collector failed before its first rollout, or more often than ``max_restarts``
    allows, or the cluster cannot place the collectors."""


class Replacements:
    """What every transport does with a collector that failed: replace it, up to
    ``max_restarts`` times in this object's life (a session of the run: the count starts
    anew when the run resumes), unless it is a first one that never delivered a rollout
    (it would fail again: a bad env id, a bug). Transports set ``delivered[i]`` when collector
    ``i``'s current process delivers."""

    def __init__(self, collectors: int, max_restarts: int, report: Callable[[str], None]):
        self.max_restarts, self.report = max_restarts, report
        self.count = 0
        self.incarnations = [0] * collectors
        self.delivered = [False] * collectors

    def failed(self, index: int, why: str) -> int:
        """Collector ``index`` failed for ``why`` (one line): reports it and returns its
        successor's incarnation, or raises ``CollectorError``."""
        if not self.incarnations[index] and not self.delivered[index]:
            raise CollectorError(f"collector {index} failed before its first rollout: {why}")
        if self.count >= self.max_restarts:
            raise CollectorError(f"collector {index} failed ({why}) after {self.count} "
                                 f"replacements (at most {self.max_restarts}: env.max_restarts)")
        self.count += 1
        self.incarnations[index] += 1
        self.delivered[index] = False
        self.report(f"collector {index} failed ({why}); replaced [{self.count} of at most "
                    f"{self.max_restarts}]")
        return self.incarnations[index]


@dataclasses.dataclass
class CollectorSpec:
    """How to build a collector, picklable (it travels to another process or node).

    Attributes:
      make_env: ``make_env(index, num_envs, seed)`` -> the collector's ``BatchEnv``.
      make_algorithm: ``make_algorithm(observation_space, action_space, num_agents)`` -> the
        acting copy (on the CPU); it loads the learner's ``acting_state`` before each rollout.
      num_agents: envs of the whole run (``env.num_agents``), split over the collectors
        (``agents``).
      collectors: how many.
      rollout_length: ``T``, steps per agent of a rollout.
      seed: the run's seed; collector ``i`` seeds its env and torch from it, ``session``,
        ``i`` and its restarts (``collector_seed``).
      session: where the run stands when the collectors start (the trainer's phase count), so
        that a resumed run's collectors do not replay the first session's seeds.
      step_timeout: seconds a step of envs that step in the collector's own process (inline,
        native or vector envs: ``BatchEnv.steps_here``) may take (``None``: no limit); see
        ``StepWatchdog``. Envs in worker processes and Ray actors have their own timeouts.
    """

    make_env: Callable[[int, int, int], BatchEnv]
    make_algorithm: Callable[[gym.Space, gym.Space, int], Algorithm]
    num_agents: int
    collectors: int
    rollout_length: int
    seed: int = 0
    session: int = 0
    step_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.collectors <= self.num_agents:
            raise ValueError(f"collectors must be between 1 and num_agents "
                             f"({self.num_agents}), got {self.collectors}")

    def agents(self, index: int) -> torch.Tensor:
        """``(n,)`` int64: the learner's agent indices of collector ``index``'s envs (a
        contiguous share; shares differ by one at most)."""
        sizes = split_evenly(self.num_agents, self.collectors)
        start = sum(sizes[:index])
        return torch.arange(start, start + sizes[index])

    def rollout_tensors(self, index: int, observation_space: gym.Space,
                        action_space: gym.Space, behaviour: Fields,
                        device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Zeroed tensors of one rollout of collector ``index`` (``rollout_tensors``):
        observations in the space's dtype (Dict and Tuple ones packed), int64 actions of a
        ``Discrete`` space, else float32 (``device="meta"``: only the layout)."""
        discrete = isinstance(action_space, gym.spaces.Discrete)
        observ_shape, observ_dtype = stored_observations(
            observation_space, torch.from_numpy(np.zeros(0, observation_space.dtype)).dtype)
        return rollout_tensors(len(self.agents(index)), self.rollout_length, observ_shape,
                               observ_dtype, () if discrete else action_space.shape,
                               torch.int64 if discrete else torch.float32, behaviour,
                               device=device)


def collector_seed(spec: CollectorSpec, index: int, incarnation: int) -> int:
    """The seed of collector ``index``'s ``incarnation``-th start: its global generators'
    (torch, NumPy, ``random``), and its env ``j``'s first reset's plus ``j``. Every
    collector and restart of a session gets seeds of its own, at least as far apart as a
    collector has envs, and every session (the phases done before it) another range of
    them."""
    stride = max(7919, -(-spec.num_agents // spec.collectors))
    return (spec.seed * 1_000_003 + spec.session * 1_000_000_007
            + (incarnation * spec.collectors + index) * stride)


class Link(abc.ABC):
    """A collector's end of the way to the learner."""

    @abc.abstractmethod
    def begin(self) -> tuple[dict[str, torch.Tensor], Any] | None:
        """Storage for the next rollout (``rollout_tensors``' layout) and a token for ``send``;
        waits while the queue is full or the lag limit says so; ``None`` when asked to stop."""

    @abc.abstractmethod
    def weights(self, known: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest published ``(version, acting_state)`` if newer than ``known``, else
        ``None``; never waits for the learner."""

    @abc.abstractmethod
    def send(self, token: Any, meta: dict[str, Any]) -> None:
        """The rollout ``begin`` gave storage for is complete; ``meta`` describes it."""


class StepWatchdog:
    """Ends this process, every thread's traceback on stderr and exit code 1, when a step (or
    the envs' close) does not return: envs that step in a collector's own process have no
    worker timeout, and a hang there would leave the learner waiting for ever (it replaces a
    collector that exits).

    ``faulthandler``'s timer runs in a native thread, so it fires even while a hung step holds
    the GIL. Arming it starts a thread, so it is re-armed only once ``seconds`` have passed since
    it was: a step longer than ``2 * seconds`` always ends the process, one shorter than
    ``seconds`` never does. ``seconds=None`` watches nothing.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._armed: float | None = None  # when the timer was set, or None

    def step(self) -> None:
        """A step begins."""
        if self.seconds is None:
            return
        now = time.monotonic()
        if self._armed is None or now - self._armed > self.seconds:
            faulthandler.dump_traceback_later(2 * self.seconds, exit=True)
            self._armed = now

    def pause(self) -> None:
        """Until the next ``step``, nothing is watched (waiting for the learner is no hang)."""
        if self._armed is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed = None


class Recorder(Algorithm):
    """Runs ``Simulation`` with an acting algorithm's ``act`` and records every step in
    ``buffer`` (which ``collect`` replaces before each rollout)."""

    def __init__(self, actor: Algorithm):
        super().__init__(actor.device)
        self.actor = actor
        self.buffer: RolloutBuffer | None = None

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        self.buffer.begin_episodes(agent_indices)
        return {}

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        action, behaviour = self.actor.act(observ)
        self.buffer.act(observ, action, behaviour)
        return action, {}

    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        self.buffer.outcome(reward, done, terminated, next_observ)
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def collect(spec: CollectorSpec, index: int, link: Link, incarnation: int = 0) -> None:
    """Collector ``index``'s life: build its env and acting algorithm, then send rollouts
    until ``link.begin()`` says stop. ``incarnation`` counts its restarts (new seeds)."""
    seed = collector_seed(spec, index, incarnation)
    # (its envs and algorithm may draw from any global generator: each collector its own)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    torch.set_num_threads(1)
    agents = spec.agents(index)
    batch_env = spec.make_env(index, len(agents), seed)
    watchdog = StepWatchdog(spec.step_timeout if batch_env.steps_here else None)
    try:
        env = TensorBatchEnv(batch_env, "cpu")
        actor = spec.make_algorithm(env.observation_space, env.action_space, len(env))
        actor.train()
        recorder = Recorder(actor)
        simulation = Simulation(env)
        version, first, restarts_seen = -1, True, 0
        while (job := link.begin()) is not None:
            tensors, token = job
            newest = link.weights(version)
            if newest is not None:
                version, state = newest
                actor.load_acting_state(state)
            recorder.buffer = buffer = RolloutBuffer(tensors, packing_for(env.observation_space))
            buffer.start(agents, version)
            fresh = first  # (its envs are reset: new episodes, none carried on from before)
            started = time.perf_counter()
            episodes = scores = squares = lengths = 0.0
            for _ in range(spec.rollout_length):
                watchdog.step()
                done, score, _ = simulation.step(recorder, reset=first,
                                                 seed=seed if first else None)
                first = False
                if bool(done.any()):
                    ended = score[done].double()
                    episodes += len(ended)
                    scores += float(ended.sum())
                    squares += float((ended * ended).sum())
                    lengths += float(simulation.episode_length[done].sum())
            watchdog.pause()
            restarts = batch_env.restarts
            # A few numbers, whatever the rollout: the message stays small.
            link.send(token, {"collector": index, "version": version, "fresh": fresh,
                              "steps": len(env) * spec.rollout_length,
                              "seconds": time.perf_counter() - started,
                              "episodes": episodes, "score_sum": scores,
                              "score_squares": squares, "length_sum": lengths,
                              "env_restarts": restarts - restarts_seen})
            restarts_seen = restarts
    finally:
        watchdog.pause()
        watchdog.step()  # (envs a failed step left broken may hang in close: watched too)
        try:
            batch_env.close()
        finally:
            watchdog.pause()
