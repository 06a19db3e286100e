"""One fused step of a batch of envs and an algorithm (TF Agents' ``simulate`` op)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from batchrl.algos.base import Algorithm, Summary
from batchrl.tensor_env import Episodes, TensorBatchEnv


def _merge(summary: Summary, returned: Any, algo: Algorithm, method: str) -> None:
    """Add what ``algo.method()`` returned to ``summary``; it must be a dict."""
    if type(returned) is not dict and not isinstance(returned, Mapping):
        raise TypeError(f"{type(algo).__name__}.{method}() returned {_short(returned)}; it "
                        f"must return a dict of scalars to log ({{}} when there is nothing)")
    summary.update(returned)


def _performed(returned: Any, algo: Algorithm, summary: Summary) -> torch.Tensor:
    """The action of what ``perform`` returned, checked; its summary goes into ``summary``."""
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise TypeError(f"{type(algo).__name__}.perform() returned {_short(returned)}; it must "
                        f"return (action, summary): a tensor of actions and a dict")
    if not isinstance(returned[0], torch.Tensor):
        raise TypeError(f"{type(algo).__name__}.perform() returned a "
                        f"{type(returned[0]).__name__} as the action; it must be a "
                        f"torch.Tensor of shape (N, *action_shape) on the algorithm's device")
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


def flush(env: TensorBatchEnv, summary: Summary | None = None) -> Summary:
    """Deliver the ``experience()`` that ``simulate(..., overlap=True)`` held back, if
    any; returns its summary (merged into ``summary``). Call it before saving the
    algorithm mid-episode; ``simulate`` flushes whenever an episode ends or starts."""
    summary = {} if summary is None else summary
    tracker = env.episodes
    if tracker.late is not None:
        (algo, observ, action), tracker.late = tracker.late, None
        _merge(summary, algo.experience(tracker.agents, observ, action, env.reward, env.done,
                                        env.observ, env.terminated), algo, "experience")
    return summary


def episode_length(env: TensorBatchEnv) -> torch.Tensor:
    """``(N,)`` int64: steps of each agent's current (or just finished) episode."""
    return env.episodes.length


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


def simulate(env: TensorBatchEnv, algo: Algorithm, log: bool = False,
             reset: bool = False, overlap: bool = False, seed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, Summary]:
    """Advance every env of ``env`` by one step with actions from ``algo``.

    Agents done on the previous step (all on the first call or with ``reset``, which discontinues
    running episodes) are reset first; ``algo`` is called as ``Algorithm`` says. Agents whose env
    restarted after a failure (``env.restarted``) get ``begin_episodes`` again, without
    ``end_episodes``.

    Args:
      env, algo: the batch env (on the algorithm's device) and the algorithm for its N agents.
      log: add the mean ``score`` and ``length`` and the number ``episodes`` of the
        episodes finished since the last call with ``log`` (if any finished).
      reset: start new episodes for all agents first.
      overlap: when ``algo.experience_may_lag``, deliver the experience of a step that
        ended no episode in the next call, while the env steps (see ``flush``).
      seed: with ``reset``, env ``i``'s reset gets ``seed + i`` (reproducible phases).
    Returns:
      ``done`` ``(N,)`` bool: the episodes that ended at this step; ``score`` ``(N,)`` float32:
      each agent's return so far (in full where done); ``summary``: all summaries and the log.
    """
    if not isinstance(env, TensorBatchEnv):
        raise TypeError(f"simulate() needs a TensorBatchEnv (the batch as torch tensors), got "
                        f"a {type(env).__name__}: wrap it as TensorBatchEnv(batch_env, device)")
    if seed is not None and not reset:
        raise ValueError("simulate(seed=...) seeds the resets of all agents: it needs reset=True")
    tracker = env.episodes
    summary: Summary = {}
    lag = overlap and algo.experience_may_lag
    if tracker.late is not None and (reset or not lag or tracker.late[0] is not algo):
        flush(env, summary)  # before begin_episodes discards the running episodes
    starting = tracker.agents if reset else tracker.starting
    if starting is not None:
        tracker.starting = None
        env.reset(starting, seed=seed)
        _begin(tracker, algo, starting, summary)
        if env.restarted is not None:  # a failed worker restarted other envs as well
            _begin(tracker, algo, env.restarted, summary)

    agents = tracker.agents
    observ = env.observ.clone()  # the env overwrites its buffer when it steps
    action = _performed(algo.perform(agents, observ), algo, summary)
    env.step_async(action)
    if lag:
        flush(env, summary)  # the previous step's, while the workers step this one
    next_observ, reward, done = env.step_wait()
    finished, ended, score = _count_step(tracker, reward, done)
    if not lag or env.restarted is not None or ended is not None:
        _merge(summary, algo.experience(agents, observ, env.action, reward, done, next_observ,
                                        env.terminated), algo, "experience")
    else:  # nothing ends or starts before the next call: deliver it then
        tracker.late = (algo, observ, env.action.clone())

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
        for total in (tracker.finished_score, tracker.finished_length, tracker.finished_count):
            total.zero_()
    return finished, score, summary


def evaluate_episodes(env: TensorBatchEnv, algo: Algorithm, episodes: int,
                      seed: int = 0) -> tuple[list[float], list[int]]:
    """Returns and lengths of exactly ``episodes`` whole mean-action episodes (eval mode,
    resets seeded ``seed + i`` for env ``i``). Each agent counts its first episodes, an
    equal share, so short ones bias nothing; the lists hold all first episodes first."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    num_agents = len(env)
    quota = [episodes // num_agents + (i < episodes % num_agents) for i in range(num_agents)]
    results: list[list[tuple[float, int]]] = [[] for _ in range(num_agents)]
    training = algo.training
    algo.eval()
    try:
        reset = True
        while any(len(results[i]) < quota[i] for i in range(num_agents)):
            done, score, _ = simulate(env, algo, reset=reset, seed=seed if reset else None)
            reset = False
            if bool(done.any()):
                lengths = episode_length(env)
                for i in done.nonzero().squeeze(1).tolist():
                    if len(results[i]) < quota[i]:
                        results[i].append((float(score[i]), int(lengths[i])))
    finally:
        algo.train(training)
    ordered = [results[i][k] for k in range(max(quota)) for i in range(num_agents)
               if k < len(results[i])]
    return [s for s, _ in ordered], [n for _, n in ordered]
