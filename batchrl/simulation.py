"""The simulation loop: one fused step of a batch of envs and an algorithm (TF Agents'
``simulate`` op), and the state that loop keeps between steps.

A ``Simulation`` owns the loop state of one ``TensorBatchEnv`` (each agent's running episode, the
experience ``overlap=True`` still owes the algorithm), so two loops over two envs, in one process or
in several, never touch each other. ``simulate(env, algo)`` is the paper's one-call interface on
top: it keeps one such state per env for the caller.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchrl.algos.base import Algorithm, Summary
from batchrl.nested import map_nested
from batchrl.parts import numpy_views
from batchrl.tensor_env import TensorBatchEnv


@dataclass
class Episodes:
    """The ``N`` agents' running episodes, as a ``Simulation`` tracks them (env's device).

    Attributes:
      score: ``(N,)`` float32, each agent's return so far (in full right after the end).
      length: ``(N,)`` int64, the steps of each agent's current episode.
      agents: ``(N,)`` int64, ``arange(N)``: every step acts for all agents.
      starting: ``(K,)`` int64, the agents to reset before the next step, or ``None``.
      finished_score, finished_length, finished_count: scalar sums over the
        episodes finished since the loop last logged them.
      late: ``(algorithm, observ, action)`` of the step whose ``experience()`` is
        still due (``overlap=True``); its reward, done and next observation are the env's.
      fast: on the CPU, the env's ``(done, reward)`` and numpy views of them and of
        ``score`` and ``length`` (see ``batchrl.parts.numpy_views``).
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
    def start(cls, env: TensorBatchEnv) -> "Episodes":
        """No episode begun yet in ``env`` (every agent starts on the next step)."""
        done, reward = env.done, env.reward
        n, device = len(done), done.device
        zero = torch.zeros((), device=device)
        episodes = cls(score=torch.zeros(n, device=device),
                       length=torch.zeros(n, dtype=torch.int64, device=device),
                       agents=torch.arange(n, device=device),
                       starting=torch.arange(n, device=device),
                       finished_score=zero.clone(), finished_length=zero.clone(),
                       finished_count=zero.clone())
        views = [numpy_views.view(t) for t in (done, reward, episodes.score, episodes.length)]
        if all(view is not None for view in views):
            episodes.fast = (done, reward, *views)
        return episodes


def _merge(summary: Summary, returned: Any, algo: Algorithm, method: str) -> None:
    """Add what ``algo.method()`` returned to ``summary``; it must be a dict."""
    if type(returned) is not dict and not isinstance(returned, Mapping):
        raise TypeError(f"{type(algo).__name__}.{method}() returned {_short(returned)}; it "
                        f"must return a dict of scalars to log ({{}} when there is nothing)")
    summary.update(returned)


def _performed(returned: Any, algo: Algorithm, summary: Summary,
               shape: torch.Size) -> torch.Tensor:
    """The action of what ``perform`` returned, checked (against the env's action ``shape``);
    its summary goes into ``summary``."""
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise TypeError(f"{type(algo).__name__}.perform() returned {_short(returned)}; it must "
                        f"return (action, summary): a tensor of actions and a dict")
    if not isinstance(returned[0], torch.Tensor):
        raise TypeError(f"{type(algo).__name__}.perform() returned an action of type "
                        f"{type(returned[0]).__name__}; it must be a "
                        f"torch.Tensor of shape (N, *action_shape) on the algorithm's device")
    if returned[0].shape != shape:
        raise ValueError(f"{type(algo).__name__}.perform() returned actions of shape "
                         f"{tuple(returned[0].shape)}; the env takes {tuple(shape)} "
                         f"(num_agents, *action_space.shape)")
    _merge(summary, returned[1], algo, "perform")
    return returned[0]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _begin(tracker: Episodes, algo: Algorithm, agents: torch.Tensor, summary: Summary) -> None:
    """Start new episodes for ``agents`` (``(K,)`` int64, on the env's device)."""
    tracker.score[agents] = 0.0
    tracker.length[agents] = 0
    _merge(summary, algo.begin_episodes(agents), algo, "begin_episodes")


def _count_step(tracker: Episodes, reward: torch.Tensor, done: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Count one step of ``reward`` ``(N,)`` into every running episode; returns
    ``done`` as bool, the ``(K,)`` int64 done agents (or ``None``) and a copy of the scores."""
    fast = tracker.fast
    if fast is not None and done is fast[0] and reward is fast[1]:
        _, _, done_array, reward_array, score, length = fast
        finished = done_array != 0
        score += reward_array
        length += 1
        # (most steps end no episode: any() costs a fraction of flatnonzero)
        ended = torch.from_numpy(np.flatnonzero(finished)) if finished.any() else None
        return torch.from_numpy(finished), ended, torch.from_numpy(score.copy())
    finished = done.bool()
    ended = finished.nonzero().squeeze(1)
    tracker.score += reward
    tracker.length += 1
    return finished, ended if ended.numel() else None, tracker.score.clone()


class Simulation:
    """The simulation loop of one batch env: the env and the state kept between its steps.

    Args:
      env: the batch env, on the device of the algorithms that act in it.

    ``step(algo)`` advances every env by one step with actions from ``algo``; ``evaluate(algo, n)``
    runs ``n`` whole mean-action episodes; ``flush()`` delivers an experience held back by
    ``overlap``. Every new ``Simulation`` starts new episodes on its first step. Two simulations of
    one env would disagree about its episodes: step an env through one of them at a time (a new one
    takes over cleanly, since its first step resets every env).
    """

    def __init__(self, env: TensorBatchEnv, episodes: Episodes | None = None):
        if not isinstance(env, TensorBatchEnv):
            raise TypeError(f"a simulation needs a TensorBatchEnv (the batch as torch tensors), "
                            f"got a {type(env).__name__}: wrap it as TensorBatchEnv(batch_env, "
                            f"device)")
        self.env = env
        self.episodes = Episodes.start(env) if episodes is None else episodes

    @property
    def episode_length(self) -> torch.Tensor:
        """``(N,)`` int64: steps of each agent's current (or just finished) episode."""
        return self.episodes.length

    def flush(self, summary: Summary | None = None) -> Summary:
        """Deliver the ``experience()`` that ``step(..., overlap=True)`` held back, if any;
        returns its summary (merged into ``summary``). Call it before saving the algorithm
        mid-episode; ``step`` flushes whenever an episode ends or starts."""
        summary = {} if summary is None else summary
        tracker, env = self.episodes, self.env
        if tracker.late is not None:
            (algo, observ, action), tracker.late = tracker.late, None
            _merge(summary, algo.experience(tracker.agents, observ, action, env.reward, env.done,
                                            env.observ, env.terminated), algo, "experience")
        return summary

    def step(self, algo: Algorithm, log: bool = False, reset: bool = False,
             overlap: bool = False, seed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, Summary]:
        """Advance every env by one step with actions from ``algo``.

        Agents done on the previous step (all on the first call or with ``reset``, which
        discontinues running episodes) are reset first; ``algo`` is called as ``Algorithm`` says.
        Agents whose env restarted after a failure (``env.restarted``) get ``steps_lost``
        before the step's ``experience``, then ``begin_episodes`` again, without
        ``end_episodes``.

        Args:
          algo: the algorithm for the env's N agents.
          log: add the mean ``score`` and ``length`` and the number ``episodes`` of the
            episodes finished since the last call with ``log`` (if any finished).
          reset: start new episodes for all agents first.
          overlap: when ``algo.experience_may_lag``, deliver the experience of a step that
            ended no episode in the next call, while the env steps (see ``flush``).
          seed: with ``reset``, env ``i``'s reset gets ``seed + i`` (reproducible phases).
        Returns:
          ``done`` ``(N,)`` bool: the episodes that ended at this step; ``score`` ``(N,)``
          float32: each agent's return so far (in full where done); ``summary``: all summaries
          and the log.
        """
        if seed is not None and not reset:
            raise ValueError("simulate(seed=...) seeds the resets of all agents: it needs "
                             "reset=True")
        env, tracker = self.env, self.episodes
        summary: Summary = {}
        lag = overlap and algo.experience_may_lag
        if tracker.late is not None and (reset or not lag or tracker.late[0] is not algo):
            self.flush(summary)  # before begin_episodes discards the running episodes
        starting = tracker.agents if reset else tracker.starting
        if starting is not None:
            tracker.starting = None
            env.reset(starting, seed=seed)
            if env.restarted is not None:  # a failed worker restarted other envs as well
                starting = torch.unique(torch.cat([starting, env.restarted]))
            _begin(tracker, algo, starting, summary)

        agents = tracker.agents
        observ = map_nested(torch.clone, env.observ)  # the env overwrites it when it steps
        action = _performed(algo.perform(agents, observ), algo, summary, env.action.shape)
        env.step_async(action)
        if lag:
            self.flush(summary)  # the previous step's, while the workers step this one
        next_observ, reward, done = env.step_wait()
        finished, ended, score = _count_step(tracker, reward, done)
        if env.restarted is not None:
            algo.steps_lost(env.restarted)
        if not lag or env.restarted is not None or ended is not None:
            _merge(summary, algo.experience(agents, observ, action, reward, done, next_observ,
                                            env.terminated), algo, "experience")
        else:  # nothing ends or starts before the next call: deliver it then
            tracker.late = (algo, observ, action.detach())

        if env.restarted is not None:  # their old episodes, this step included, are dropped
            _begin(tracker, algo, env.restarted, summary)
            score = tracker.score.clone()
        if ended is not None:
            tracker.starting = ended
            _merge(summary, algo.end_episodes(ended), algo, "end_episodes")
            tracker.finished_score += tracker.score[ended].sum()
            tracker.finished_length += tracker.length[ended].sum()
            tracker.finished_count += ended.numel()

        if log:
            count = int(tracker.finished_count.item())
            if count:
                summary["score"] = float(tracker.finished_score.item()) / count
                summary["length"] = float(tracker.finished_length.item()) / count
                summary["episodes"] = float(count)
            for total in (tracker.finished_score, tracker.finished_length,
                          tracker.finished_count):
                total.zero_()
        return finished, score, summary

    def evaluate(self, algo: Algorithm, episodes: int, seed: int = 0,
                 after_step: Callable[[], None] | None = None
                 ) -> tuple[list[float], list[int]]:
        """Returns and lengths of exactly ``episodes`` whole mean-action episodes (eval mode,
        resets seeded ``seed + i`` for env ``i``). Each agent counts its first episodes, an
        equal share, so short ones bias nothing; the lists hold all first episodes first.
        ``after_step()``, if given, runs after every step (a trainer checks for stop signals and
        reports env restarts there; what it raises ends the evaluation).

        An algorithm that samples in evaluation (``eval_actions="sample"``) draws from torch's
        global generators seeded with ``seed`` inside a fork of them: the same seed gives the
        same episodes, and the training run's random stream goes on as if no evaluation ran.

        An algorithm keeps its per-agent state (a recurrent state, running returns) by agent
        index, whatever env the agent is in: evaluating it in another env's simulation begins
        episodes for those indices there, so the training simulation should begin new ones
        afterwards (``step(reset=True)``, as every training phase of the trainer does)."""
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        quota = episode_quota(episodes, len(self.env))
        # A loop shared with training is left as training had it: the experience held back
        # delivered before the algorithm stops training, the episodes finished since the
        # last log kept apart from the evaluation's, and new episodes on the next step (the
        # evaluation reset the envs).
        self.flush()
        tracker = self.episodes
        totals = (tracker.finished_score, tracker.finished_length, tracker.finished_count)
        kept = [total.clone() for total in totals]
        training = algo.training
        algo.eval()
        with evaluation_rng(seed, algo.device):
            try:
                return self._evaluate(algo, quota, seed, after_step)
            finally:
                algo.train(training)
                for total, value in zip(totals, kept):
                    total.copy_(value)
                tracker.starting = tracker.agents

    def _evaluate(self, algo: Algorithm, quota: list[int], seed: int,
                  after_step: Callable[[], None] | None) -> tuple[list[float], list[int]]:
        """``evaluate``'s loop: the first ``quota[i]`` episodes of agent ``i``."""
        num_agents = len(self.env)
        results: list[list[tuple[float, int]]] = [[] for _ in range(num_agents)]
        reset = True
        while any(len(results[i]) < quota[i] for i in range(num_agents)):
            done, score, _ = self.step(algo, reset=reset, seed=seed if reset else None)
            reset = False
            if after_step is not None:
                after_step()
            if bool(done.any()):
                lengths = self.episode_length
                for i in done.nonzero().squeeze(1).tolist():
                    if len(results[i]) < quota[i]:
                        results[i].append((float(score[i]), int(lengths[i])))
        ordered = [results[i][k] for k in range(max(quota)) for i in range(num_agents)
                   if k < len(results[i])]
        return [s for s, _ in ordered], [n for _, n in ordered]


def episode_quota(episodes: int, num_agents: int) -> list[int]:
    """How many of ``episodes`` evaluation episodes each of ``num_agents`` agents plays: its
    first ones, an equal share (the first ``episodes % num_agents`` agents one more). The first
    episodes to end anywhere would favour short ones (a fall, a lost game)."""
    return [episodes // num_agents + (i < episodes % num_agents) for i in range(num_agents)]


@contextlib.contextmanager
def evaluation_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: torch's global generators (the CPU's, and ``device``'s if it is a GPU) seeded
    with ``seed``; after: as they were. Evaluations with sampled actions run inside it, so they
    are reproducible by their seed and leave the training run's random stream untouched."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


# The state simulate() keeps for each env it was called with. Only the env is weakly held (the
# state references its tensors, never the env object), so a dropped env frees its entry.
_STATES: "weakref.WeakKeyDictionary[TensorBatchEnv, Episodes]" = weakref.WeakKeyDictionary()


def _simulation(env: TensorBatchEnv) -> Simulation:
    """The ``Simulation`` that ``simulate`` keeps for ``env``."""
    if not isinstance(env, TensorBatchEnv):
        raise TypeError(f"simulate() needs a TensorBatchEnv (the batch as torch tensors), got "
                        f"a {type(env).__name__}: wrap it as TensorBatchEnv(batch_env, device)")
    episodes = _STATES.get(env)
    if episodes is None:
        episodes = _STATES[env] = Episodes.start(env)
    return Simulation(env, episodes)


def simulate(env: TensorBatchEnv, algo: Algorithm, log: bool = False,
             reset: bool = False, overlap: bool = False, seed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, Summary]:
    """Advance every env of ``env`` by one step with actions from ``algo``: the paper's one-call
    interface, ``Simulation.step`` on a loop state kept for ``env``. Arguments and results are
    ``Simulation.step``'s."""
    return _simulation(env).step(algo, log=log, reset=reset, overlap=overlap, seed=seed)


def flush(env: TensorBatchEnv, summary: Summary | None = None) -> Summary:
    """``Simulation.flush`` of the loop ``simulate`` keeps for ``env``."""
    return _simulation(env).flush(summary)


def evaluate_episodes(env: TensorBatchEnv, algo: Algorithm, episodes: int,
                      seed: int = 0) -> tuple[list[float], list[int]]:
    """``Simulation.evaluate`` on the loop ``simulate`` keeps for ``env``: returns and lengths of
    exactly ``episodes`` whole mean-action episodes, resets seeded ``seed + i`` for env ``i``."""
    return _simulation(env).evaluate(algo, episodes, seed)
