"""The training loop: alternate training and mean-action evaluation phases.

For any ``Algorithm`` (the config's ``[algorithm]``): with whole-episode updates
(``episodes_per_phase``) a training phase collects one update's episodes, and every
``train.eval_every`` training phases an evaluation phase runs ``train.eval_episodes``
mean-action episodes. With fixed-length rollouts (``steps_per_update``) a training phase
is ``train.eval_every`` updates long and an evaluation follows every phase. An algorithm
that names neither trains in phases of ``train.phase_steps`` env steps (by default sized so
that evaluations cost at most about a tenth of the run), with an evaluation every
``train.eval_every`` of them. The last training phase stops at the budget, ``train.steps``.
Each phase starts with seeded resets (``Simulation.step(..., reset=True)``), so a run resumed
from a checkpoint (written at phase boundaries) continues exactly as it would have.

With ``handle_signals``, SIGINT, SIGTERM or SIGHUP stops the run within a step or gradient step:
the state at the last phase boundary, kept in memory, is written as the final checkpoint
(a state from mid-phase could not be resumed exactly) and ``run()`` raises
``TrainingInterrupted``. Any other error (an env's, the algorithm's, a collector's) writes
that snapshot too before it propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchrl.algos.base import Algorithm
from batchrl.collectors import CollectorError, CollectorSpec, LocalCollectors
from batchrl.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint,
                                save_checkpoint, serialize)
from batchrl.config import CONFIG_FILE, Config, ConfigError, config_class, save_config
from batchrl.envs.errors import EnvError
from batchrl.envs.factory import make_batch_env
from batchrl.errors import error_line
from batchrl.files import hold_logdir, release_logdir
from batchrl.hardware import BFLOAT16_HARDWARE, core_share, native_bfloat16, usable_cores
from batchrl.tensor_env import TensorBatchEnv
from batchrl.interrupt import Interrupted, StopSignals
from batchrl.metrics import RunLog, episodes_words
from batchrl.parts.distributed import LearnerGroup, launched_by_torchrun
from batchrl.simulation import Simulation


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """``"auto"`` is CUDA when available, else the CPU; others are checked
    (errors name the setting as ``key``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's own error for a malformed device string
        raise ConfigError(f"{key} must be 'auto', 'cpu', 'cuda' or 'cuda:N', got "
                          f"{name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} but CUDA is not available here; "
                          f"use 'auto' or 'cpu'")
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{key}={name!r} but this machine has "
                          f"{torch.cuda.device_count()} CUDA devices (cuda:0 to "
                          f"cuda:{torch.cuda.device_count() - 1})")
    return device


def _rng_state() -> dict[str, Any]:
    # (The GPUs' generators only where this process uses CUDA: reading them would start
    # CUDA, and take GPU memory, in a CPU run on a GPU machine.)
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    # (A checkpoint loaded onto a GPU holds its RNG states there; torch takes CPU bytes.)
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_initialized():
        # One state per GPU the saving machine had; this one may have fewer or more.
        for index, generator in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(generator.cpu(), index)


def _unfit_hint(saved: dict[str, Any] | None, config: Config, algo: Algorithm,
                exc: Exception) -> str:
    """What to do about a checkpoint whose algorithm state ``algo`` could not load
    (``exc``): restore the run's config, if it no longer shapes the algorithm as the
    checkpoint's ``saved`` one did (the algorithm's keys and the env's, less where the envs
    step), else look at the algorithm's code."""
    shaping = [{"algorithm": values["algorithm"],
                "env": {key: value for key, value in values["env"].items()
                        if key not in ("workers", "timeout")}}
               for values in (saved or config.to_dict(), config.to_dict())]
    if shaping[0] != shaping[1]:
        return "restore that file (each checkpoint holds its run's config, under 'config')"
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return (f"the config is the one the checkpoint was saved with, so did "
            f"{type(algo).__name__}'s state_dict() or load_state_dict() change since? "
            f"(raised at {frame.filename}:{frame.lineno})")


def phase_plan(config: Config, algo: Algorithm, num_agents: int
               ) -> tuple[int | None, int | None, int]:
    """How a run of ``algo`` is split: ``(episodes, batch_steps, eval_every)``, a training
    phase's whole episodes (``None``: it is ``batch_steps`` steps of the batch instead) and the
    training phases between evaluations (see the module docstring)."""
    eval_every = config.train.eval_every
    if algo.episodes_per_phase is not None:
        return algo.episodes_per_phase, None, eval_every
    if algo.steps_per_update is not None:
        return None, algo.steps_per_update * eval_every, 1
    env_steps = config.train.phase_steps or max(
        50_000, 10 * config.train.eval_episodes * config.env.max_length)
    return None, -(-env_steps // num_agents), eval_every


def collector_plan(config: Config, algo: Algorithm, num_agents: int) -> tuple[int, int]:
    """How a run with collectors is split: ``(updates, eval_every)``, the updates of a training
    phase (each learns one rollout of every agent) and the training phases between evaluations;
    as ``phase_plan``, with phases of whole episodes taken as one update."""
    episodes, batch_steps, eval_every = phase_plan(config, algo, num_agents)
    if batch_steps is None:
        return 1, eval_every
    return max(1, round(batch_steps / algo.rollout_length)), eval_every


def _collector_env(config: Config, machine_cores: int, index: int, num_envs: int,
                   seed: int) -> Any:
    """Collector ``index``'s batch env of ``num_envs`` envs, as ``[env]`` configures; with
    ``env.workers = 0`` the machine's ``machine_cores`` usable cores are shared among its
    collectors (their worker processes, or native threads; ``vector`` builds one vector env;
    each local collector process is pinned to its share, ``LocalCollectors``), and on a Ray
    cluster a collector takes the CPUs it reserves (``env.ray_resources``). There the
    collector is the unit Ray places: backend ``"ray"`` steps its envs in worker processes of
    the collector's node, unpinned (Ray reserves CPUs, not cores)."""
    env = config.env
    on_ray = on_a_cluster(config)
    backend = "workers" if env.backend == "ray" else env.chosen_backend
    cores = (int(env.ray_resources.get("CPU", 1)) if on_ray
             else len(core_share(range(machine_cores), index, config.train.collectors)))
    # One env worker per core, less the core of this process if it steps a share too.
    here = backend == "workers" and env.share_main and not env.restart_crashed_envs
    workers = env.workers or (1 if backend == "vector" else max(1, cores - here))
    return make_batch_env(
        env.id, num_envs, env.max_length, env.kwargs, backend, workers,
        env.normalize_ranges, share_main=env.share_main, infos=False,
        timeout=env.timeout or None,
        max_restarts=env.max_restarts if env.restart_crashed_envs else 0,
        ray_address=env.ray_address, ray_resources=env.ray_resources, vector_id=env.vector_id)


def _check_eval_spaces(training: Any, evaluation: Any) -> None:
    """``ConfigError`` unless the evaluation envs (``env.eval_kwargs``) have the training
    envs' observation and action spaces."""
    for name in ("observation_space", "action_space"):
        ours, theirs = getattr(training, name), getattr(evaluation, name)
        if ours != theirs:
            raise ConfigError(f"env.eval_kwargs builds envs whose {name.replace('_', ' ')} is "
                              f"{theirs}, not the training envs' {ours}: one policy cannot act "
                              f"in both")


def _collector_algorithm(config: Config, observation_space: Any, action_space: Any,
                         num_agents: int) -> Algorithm:
    """A collector's acting copy of the configured algorithm, on the CPU."""
    return config.make_algorithm(observation_space, action_space, num_agents,
                                 torch.device("cpu"))


def on_a_cluster(config: Config) -> bool:
    """Whether the run's collectors are Ray actors (``env.ray_address`` or backend ``"ray"``)."""
    return bool(config.env.ray_address) or config.env.backend == "ray"


def check_collectors(config: Config, algo: Algorithm) -> None:
    """``ConfigError`` when ``train.collectors`` cannot work with this config and algorithm."""
    collectors, agents = config.train.collectors, config.env.num_agents
    reason = algo.collector_support()
    if reason is not None:
        raise ConfigError(f"train.collectors = {collectors}: {reason}; or set "
                          f"train.collectors = 0")
    if collectors > agents:
        raise ConfigError(f"train.collectors ({collectors}) must be at most env.num_agents "
                          f"({agents}): each collector steps a share of the envs")


def check_collector_room(config: Config) -> None:
    """``ConfigError`` when the Ray cluster cannot hold the run's collectors (they would wait
    for room for ever): before anything is written, so the run can be started again with
    other settings."""
    from batchrl.collectors.ray import check_room  # (imports Ray)

    try:
        check_room(config.train.collectors, dict(config.env.ray_resources),
                   config.env.ray_address)
    except CollectorError as exc:
        raise ConfigError(str(exc)) from None


def check_learner_support(config: Config, learners: int, algo: Algorithm | None = None
                          ) -> None:
    """``ConfigError`` when the configured algorithm cannot be one of ``learners`` learners:
    said by ``algo`` itself, or without one (before any learner starts) by its class (whose
    methods these must be) and its hyperparameter class's ``learner_support`` (where it has
    one). Such an algorithm has
    ``join_learners`` and ``synchronize``; with preemption its instances also have
    ``updates`` and ``env_steps``, the counts of its updates and of all learners' env steps
    (exact after each update), which the phases go by."""
    needed = ["join_learners", "synchronize"]
    if algo is None:
        holder = config.algorithm.cls
        schema = config_class(config.algorithm.path)
        judge = (schema(**config.algorithm.keys) if hasattr(schema, "learner_support")
                 else None)
    else:
        holder = judge = algo
        if config.train.preemption_threshold:
            needed += ["updates", "env_steps"]
    support = getattr(judge, "learner_support", None)
    if not all(hasattr(holder, name) for name in needed):
        name = holder.__name__ if algo is None else type(algo).__name__
        reason = f"{name} cannot be one of several learners (no {' and '.join(needed)})"
    else:
        reason = None if support is None else support(learners)
    if reason is not None:
        raise ConfigError(f"train.learners = {learners}: {reason}; or set train.learners = 1")


def _join(algo: Algorithm, config: Config, learners: LearnerGroup) -> None:
    """Make ``algo`` one of ``learners`` (with DD-PPO's preemption threshold unless 0), or say
    why it cannot be (``ConfigError``, see ``check_learner_support``)."""
    check_learner_support(config, learners.size, algo)
    preemption = config.train.preemption_threshold
    if preemption:
        algo.join_learners(learners, preemption=preemption)
    else:
        algo.join_learners(learners)


def _learner_state(state: dict[str, Any], checkpoint: Path, learners: LearnerGroup | None
                   ) -> dict[str, Any]:
    """This learner's own part of a checkpoint (``learners``: ``None`` for one learner): its
    random generators, the per-agent algorithm state that differs between learners and (with
    several) its env restarts."""
    written = len(state.get("learners", ())) or 1
    size = 1 if learners is None else learners.size
    if written != size:
        setting = ("torchrun --nproc-per-node (times its nodes)" if launched_by_torchrun()
                   else "train.learners")
        raise ConfigError(f"{checkpoint} was written by {written} learner(s) and resumes "
                          f"exactly only with as many ({setting} = {written}); this run "
                          f"has {size}")
    if "learners" not in state:  # one learner's checkpoint
        return {"rng": state["rng"], "algorithm": {}}
    return state["learners"][0 if learners is None else learners.rank]


class _NoLog:
    """The run log of a learner other than the writer: it logs nothing."""

    def scalars(self, *args: Any) -> None:
        pass

    phase = plot = truncate = close = update = sync = scalars


class TrainingInterrupted(Interrupted):
    """``Trainer.run()`` stopped on a signal, after writing its final checkpoint:
    ``checkpoint`` is the run's newest (``None``: it has none yet), ``step`` its step."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int):
        super().__init__(signum)
        self.checkpoint = checkpoint
        self.step = step


@dataclasses.dataclass
class Counters:
    """Progress of a run, saved in every checkpoint."""

    steps: int = 0          # training env steps
    eval_steps: int = 0     # evaluation env steps
    phases: int = 0         # phases started (training and evaluation)
    train_phases: int = 0
    wall_time: float = 0.0  # seconds spent in phases, over all sessions of the run
    env_restarts: int = 0   # failed env workers replaced (env.restart_crashed_envs)
    cut_phase: int = 0      # batch steps of a phase of batch steps the budget cut short


class Trainer:
    """Runs one training job in ``logdir``; see the module docstring.

    Args:
      config: the run's configuration.
      logdir: where the config, metrics, events, plot and checkpoints go.
      progress: show a progress bar on a terminal, one line per phase otherwise.
      handle_signals: stop cleanly on SIGINT, SIGTERM or SIGHUP (main thread only).
    """

    def __init__(self, config: Config, logdir: Path, progress: bool = True,
                 handle_signals: bool = False, learners: LearnerGroup | None = None):
        self.config = config
        # Several learners: this one's group; only the writer (learner 0) logs, evaluates
        # and checkpoints.
        self.learners = learners
        self.writer = learners is None or learners.is_writer
        self.logdir = Path(logdir)
        self.progress = progress
        self.handle_signals = handle_signals
        # (step, state) of the last phase boundary, state None once it is on disk; the step of
        # the newest on disk.
        self._snapshot: tuple[int, bytes | None] | None = None
        self._written: int | None = None
        self.device = resolve_device(config.train.device)
        if learners is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", learners.local_rank)  # a GPU per learner
        self.counters = Counters()
        self.last_scores: dict[str, float | None] = {"train": None, "eval": None}
        self._restarts_seen: dict[int, int] = {}  # per batch env (id), its restarts reported
        self._batch_envs: list[Any] = []  # the run's batch envs: training (and evaluation)
        self._collector_restarts = 0
        self._batch_env: Any = None  # the run's BatchEnv, for its restart events
        self._lines = False  # progress as plain lines (not a terminal)

    def _phase_seed(self, num_agents: int) -> int:
        """The seed of the next phase's resets (and of its evaluation's samples): seeded resets
        make phases reproducible across resumes. Learner r's envs are agents r * N/M ... of the
        run's N, seeded as one learner's would be. Counts the phase."""
        size, rank = (1, 0) if self.learners is None else (self.learners.size,
                                                          self.learners.rank)
        seed = (self.config.train.seed * 1_000_003 + self.counters.phases * num_agents * size
                + rank * num_agents)
        self.counters.phases += 1
        return seed

    def _phase(self, simulation: Simulation, algo: Algorithm, episodes: int | None,
               bar: Any, batch_steps: int | None = None,
               updates: int | None = None) -> dict[str, Any]:
        """Run one training phase until ``episodes`` episodes finished, or for ``batch_steps``
        steps of the whole batch when given, or for ``updates`` updates of ``algo`` (with
        preemption, whose learners' rollouts differ in length: the budget is checked between
        updates, and steps are the algorithm's count of all learners'); it also ends at the
        run's budget (``train.steps``). A phase of ``batch_steps`` after one the budget cut
        short (``Counters.cut_phase``) trains only the rest of that one, so that phases of
        fixed-length rollouts end with an update again (from the cut, each would end
        mid-rollout, and the next phase's resets drop that rollout's running episodes).
        Returns its record."""
        config, counters = self.config, self.counters
        before = 0  # batch steps of this phase trained before the budget cut it short
        if batch_steps is not None and updates is None:
            before = counters.cut_phase if counters.cut_phase < batch_steps else 0
        algo.train(True)
        env = simulation.env
        num_agents = len(env)
        size = 1 if self.learners is None else self.learners.size
        seed = self._phase_seed(num_agents)
        scores: list[float] = []
        lengths: list[float] = []
        start, calls, start_steps = time.perf_counter(), 0, counters.steps
        last_update = first_update = algo.updates if updates is not None else 0

        def more() -> bool:
            if updates is not None:
                return algo.updates < first_update + updates
            if batch_steps is None:
                return len(scores) < episodes
            return before + calls < batch_steps

        while more():
            if ((updates is None or calls == 0 or algo.updates != last_update)
                    and counters.steps >= config.train.steps):
                break  # the budget is spent: the last phase stops at it
            if updates is not None:
                last_update, counted = algo.updates, algo.env_steps
            reset = calls == 0
            done, score, summary = simulation.step(algo, reset=reset,
                                                   seed=seed if reset else None,
                                                   overlap=config.train.overlap)
            calls += 1
            self._stop.check()
            # Envs restarted in this step did not step (they were reset); several learners
            # count every env, so that their step counters (and budgets) stay in lockstep.
            # Without preemption the learners step alike.
            if updates is not None:
                stepped = algo.env_steps - counted
            elif env.restarted is None or self.learners is not None:
                stepped = num_agents * size
            else:
                stepped = num_agents - len(env.restarted)
            counters.steps += stepped
            if bar is not None:  # (the last batch step may end past the budget)
                bar.update(max(0, min(stepped, bar.total - bar.n)))
            self._check_restarts(bar, env)
            if bool(done.any()):
                ended = done.nonzero().squeeze(1)
                scores += score[ended].tolist()
                lengths += simulation.episode_length[ended].tolist()
            if summary:
                self.log.scalars(summary, counters.steps)
        if batch_steps is not None and updates is None:
            counters.cut_phase = before + calls if before + calls < batch_steps else 0
        summary = simulation.flush()  # a checkpoint must hold every step's experience
        if summary:
            self.log.scalars(summary, counters.steps)
        elapsed = time.perf_counter() - start
        counters.wall_time += elapsed
        if self.learners is not None:  # the phase's episodes of all learners
            everyone = self.learners.gather_to_writer((scores, lengths))
            if everyone is not None:
                scores = [score for each, _ in everyone for score in each]
                lengths = [length for _, each in everyone for length in each]
        if not before:  # (the rest of a cut phase completes that one)
            counters.train_phases += 1
        if batch_steps is None and updates is None:  # (one step may end several episodes)
            scores, lengths = scores[:episodes], lengths[:episodes]
        return self._record("train", scores, lengths, counters.steps - start_steps, elapsed)

    def _evaluation(self, simulation: Simulation, algo: Algorithm, episodes: int, bar: Any
                    ) -> dict[str, Any]:
        """Run one evaluation phase: ``episodes`` whole episodes, each agent's first ones
        (``Simulation.evaluate``), with ``train.eval_actions``. Returns its record."""
        env = simulation.env
        seed = self._phase_seed(len(env))
        start, steps = time.perf_counter(), 0

        def after_step() -> None:
            nonlocal steps
            self._stop.check()
            # (envs restarted in this step did not step: they were reset)
            steps += len(env) - (0 if env.restarted is None else len(env.restarted))
            self._check_restarts(bar, env)

        scores, lengths = simulation.evaluate(algo, episodes, seed, after_step)
        elapsed = time.perf_counter() - start
        self.counters.wall_time += elapsed
        self.counters.eval_steps += steps
        return self._record("eval", scores, lengths, steps, elapsed)

    def _record(self, phase: str, scores: list[float], lengths: list[float], steps: int,
                elapsed: float) -> dict[str, Any]:
        """A phase's record: its episodes' mean score and length, its speed, the run's time."""
        return {"step": self.counters.steps, "phase": phase,
                "score": float(np.mean(scores)) if scores else None,
                "score_std": float(np.std(scores)) if scores else None,
                "length": float(np.mean(lengths)) if lengths else None,
                "episodes": len(scores),
                "wall_time": round(self.counters.wall_time, 3),
                "steps_per_s": round(steps / elapsed, 1)}

    def _collect_phase(self, pool: Any, algo: Algorithm, updates: int,
                       bar: Any) -> dict[str, Any]:
        """A training phase with collectors: ``updates`` updates, each on one rollout of every
        agent from the queue (ends early at ``train.steps``). Logs, per update, the policy lag
        (learner version minus the version that collected each rollout), the queue's fill and
        the collectors' and the learner's steps/s. Returns the phase's record."""
        config, counters = self.config, self.counters
        algo.train()
        counters.phases += 1
        episodes = scores = squares = lengths = 0.0  # of the episodes finished in the phase
        start = last = time.perf_counter()
        steps = 0
        for _ in range(updates):
            if counters.steps >= config.train.steps:
                break
            waited = time.perf_counter()
            rollout, metas = pool.receive(self._stop.check)
            learning = time.perf_counter()
            version = pool.version  # the learner's, which this update starts from
            fresh = [meta["collector"] for meta in metas if meta["fresh"]]
            if fresh:  # a started or replaced collector's envs were reset: new episodes
                algo.begin_episodes(torch.cat([pool.spec.agents(index) for index in fresh]
                                              ).to(self.device))
            summary = algo.learn(rollout.to(self.device))
            pool.publish(algo.acting_state())
            now = time.perf_counter()
            lag = (version - rollout.version).float()
            stepped = rollout.size * rollout.length
            counters.steps += stepped
            steps += stepped
            ended = sum(meta["episodes"] for meta in metas)
            episodes += ended
            scores += sum(meta["score_sum"] for meta in metas)
            squares += sum(meta["score_squares"] for meta in metas)
            lengths += sum(meta["length_sum"] for meta in metas)
            summary.update({
                "collectors/lag_mean": float(lag.mean()), "collectors/lag_max": float(lag.max()),
                "collectors/queue": float(pool.queued),
                "collectors/steps_per_s": sum(m["steps"] / max(m["seconds"], 1e-9)
                                              for m in metas),
                "learner/steps_per_s": stepped / max(now - last, 1e-9),
                "learner/wait_s": learning - waited, "learner/learn_s": now - learning})
            if ended:  # (the training phase's record averages them over the phase)
                summary["collectors/score"] = sum(m["score_sum"] for m in metas) / ended
                summary["collectors/length"] = sum(m["length_sum"] for m in metas) / ended
                summary["collectors/episodes"] = float(ended)
            restarts = sum(meta["env_restarts"] for meta in metas)
            if restarts or pool.restarts != self._collector_restarts:
                counters.env_restarts += restarts
                self._collector_restarts = pool.restarts
                summary["env/restarts"] = float(counters.env_restarts)
                summary["collectors/restarts"] = float(pool.restarts)
            self.log.scalars(summary, counters.steps)
            self.log.update({"step": counters.steps, **{
                name.replace("/", "_"): round(value, 6) for name, value in summary.items()
                if name.startswith(("collectors/", "learner/"))}})
            last = now
            if bar is not None:
                bar.update(max(0, min(stepped, bar.total - bar.n)))
            self._stop.check()
        elapsed = time.perf_counter() - start
        counters.wall_time += elapsed
        counters.train_phases += 1
        mean = scores / episodes if episodes else None
        return {"step": counters.steps, "phase": "train", "score": mean,
                "score_std": math.sqrt(max(0.0, squares / episodes - mean * mean))
                if episodes else None,
                "length": lengths / episodes if episodes else None,
                "episodes": int(episodes), "wall_time": round(counters.wall_time, 3),
                "steps_per_s": round(steps / elapsed, 1)}

    def _collectors(self, algo: Algorithm, env: TensorBatchEnv, bar: Any) -> Any:
        """Start the run's collectors, acting with ``algo``'s current weights."""
        config = self.config
        spec = CollectorSpec(make_env=functools.partial(_collector_env, config,
                                                        usable_cores()),
                             make_algorithm=functools.partial(_collector_algorithm, config),
                             num_agents=config.env.num_agents,
                             collectors=config.train.collectors,
                             rollout_length=algo.rollout_length, seed=config.train.seed,
                             session=self.counters.phases,
                             step_timeout=config.env.timeout or None)

        def report(line: str) -> None:
            line = f"step {self.counters.steps:,}: {line}"
            if bar is not None:
                bar.write(line)
            else:
                print(line, flush=True)

        options = dict(max_policy_lag=config.train.max_policy_lag,
                       queue_size=config.train.queue_size,
                       max_restarts=config.env.max_restarts, report=report)
        if on_a_cluster(config):
            from batchrl.collectors.ray import RayCollectors  # (imports Ray)
            collectors = RayCollectors(spec, env.observation_space, env.action_space,
                                       algo.behaviour_fields(), algo.acting_state(),
                                       address=config.env.ray_address,
                                       resources=config.env.ray_resources,
                                       check=self._stop.check, **options)
            report(f"{spec.collectors} collectors on Ray nodes "
                   f"{', '.join(node[:8] for node in collectors.nodes)}")
            return collectors
        return LocalCollectors(spec, env.observation_space, env.action_space,
                               algo.behaviour_fields(), algo.acting_state(), **options)

    def _check_restarts(self, bar: Any, env: TensorBatchEnv) -> None:
        """Print the new restarts of ``env``'s batch env (the training or the evaluation envs),
        log the run's count (``env/restarts``) and leave both envs what is left of the run's
        ``env.max_restarts``."""
        batch_env = env.batch_env
        if batch_env.restarts == self._restarts_seen.get(id(batch_env), 0):
            return
        for event in batch_env.restart_events[self._restarts_seen.get(id(batch_env), 0):]:
            self.counters.env_restarts += 1
            message = (f"step {self.counters.steps:,}: {event} [{self.counters.env_restarts} "
                       f"of at most {self.config.env.max_restarts} in this run]")
            if bar is not None:
                bar.write(message)
            else:
                print(message, flush=True)
        self._restarts_seen[id(batch_env)] = batch_env.restarts
        left = max(0, self.config.env.max_restarts - self.counters.env_restarts)
        for other in self._batch_envs:
            other.max_restarts = other.restarts + left if other.max_restarts else 0
        self.log.scalars({"env/restarts": float(self.counters.env_restarts)},
                         self.counters.steps)

    def _boundary_state(self, algo: Algorithm, precision: str | None) -> dict[str, Any]:
        """This process's state at a phase boundary, as a checkpoint holds it."""
        algo_state = algo.state_dict()
        if not isinstance(algo_state, dict):  # (found at the first boundary, not on resume)
            raise TypeError(f"{type(algo).__name__}.state_dict() returned "
                            f"{type(algo_state).__name__}, not a dict: return everything a "
                            f"resume needs (weights, optimisers, counters)")
        missing = [key for key in algo.per_agent_state if key not in algo_state]
        if missing:  # (evaluate would fail on it, with another agent count)
            raise TypeError(f"{type(algo).__name__}.per_agent_state names {missing[0]!r}, "
                            f"which its state_dict() lacks (its keys: "
                            f"{', '.join(map(repr, algo_state)) or 'none'})")
        return {"algorithm": algo_state, "counters": dataclasses.asdict(self.counters),
                "rng": _rng_state(), "config": self.config.to_dict(), "precision": precision}

    def _save_snapshot(self) -> Path | None:
        """Write the last phase boundary's state unless it is on disk already;
        returns the run's newest checkpoint."""
        if self._snapshot is not None and self._snapshot[0] != self._written:
            step, state = self._snapshot
            self._written = step
            return self._checkpoint(step, state)
        return latest_checkpoint(self.logdir)

    def _checkpoint(self, step: int, state: dict[str, Any] | bytes) -> Path:
        """Write the checkpoint of ``step`` (``state`` or its ``serialize``d bytes), after the
        records up to it are on disk; returns its path."""
        self.log.sync()
        return save_checkpoint(self.logdir, step, state, self.config.train.keep_checkpoints)

    def run(self) -> dict[str, Any]:
        """Train until ``train.steps`` env steps; returns the last evaluation record.
        Raises ``TrainingInterrupted`` when ``handle_signals`` and a signal stopped it."""
        # Without handle_signals it is never entered, so check() never raises.
        self._stop = StopSignals("stopping after this step, with a checkpoint of the last "
                                 "finished phase; the same signal again quits at once")
        with self._stop if self.handle_signals else contextlib.nullcontext():
            return self._run()

    def _run(self) -> dict[str, Any]:
        config = self.config
        torch.set_num_threads(config.train.threads)
        random.seed(config.train.seed)
        np.random.seed(config.train.seed)
        torch.manual_seed(config.train.seed)

        # The env first: a bad env id fails here, before anything is written to
        # the log directory (a config.json there would make it a run to resume).
        env_config = config.env
        learners = self.learners
        # On a Ray cluster, a collector or one learner of several is what Ray places: the
        # envs here step in processes of this node (with collectors they only evaluate).
        backend = env_config.backend
        if backend == "ray" and (config.train.collectors or learners is not None):
            backend = "workers"

        # Several learners: env.num_agents is the run's, each learner steps its share.
        num_agents = env_config.num_agents // (1 if learners is None else learners.size)

        def build(kwargs: dict[str, Any]) -> Any:
            return make_batch_env(
                env_config.id, num_agents, env_config.max_length, kwargs,
                backend, env_config.workers, env_config.normalize_ranges,
                share_main=env_config.share_main, infos=False,
                timeout=env_config.timeout or None,
                max_restarts=env_config.max_restarts if env_config.restart_crashed_envs else 0,
                ray_address=env_config.ray_address, ray_resources=env_config.ray_resources,
                vector_id=env_config.vector_id)

        # env.eval_kwargs: evaluations run on envs of their own (here, or in the learner
        # beside the collectors, whose envs are the training ones).
        separate_eval = bool(env_config.eval_kwargs and config.train.eval_episodes
                             and not config.train.collectors and self.writer)
        batch_env = self._batch_env = build(env_config.evaluation_kwargs
                                            if config.train.collectors else env_config.kwargs)
        eval_batch_env = None
        self.log = None
        holding = holds_ray = False
        bar = None
        pool = None
        last_eval: dict[str, Any] = {}
        try:
            if separate_eval:
                eval_batch_env = build(env_config.evaluation_kwargs)
                _check_eval_spaces(batch_env, eval_batch_env)
            elif config.train.collectors and env_config.eval_kwargs:
                # This env is the evaluation one: compare one of the collectors' envs.
                probe = _collector_env(config, usable_cores(), 0, 1, config.train.seed)
                try:
                    _check_eval_spaces(probe, batch_env)
                finally:
                    probe.close()
            self._batch_envs = [batch_env] + ([eval_batch_env] if eval_batch_env else [])
            env = TensorBatchEnv(batch_env, self.device)
            algo = config.make_algorithm(env.observation_space, env.action_space, len(env),
                                         self.device)
            # What "auto" chose for this device (None: the algorithm takes no precision).
            precision = config.algorithm_run_facts(self.device).get("precision")
            if self.writer:
                self._report_precision(precision)
            if config.train.collectors:
                check_collectors(config, algo)
                if on_a_cluster(config):  # (before the log directory holds this run)
                    from batchrl.collectors.ray import join_cluster
                    join_cluster(config.env.ray_address)  # (held to the run's end)
                    holds_ray = True
                    check_collector_room(config)
            if learners is not None:
                _join(algo, config, learners)
                # The writer's initial weights for all; then random streams of their own.
                algo.load_state_dict(learners.broadcast(algo.state_dict(), self.device))
                own_seed = config.train.seed * 1_000_003 + learners.rank
                torch.manual_seed(own_seed)
                np.random.seed(own_seed % 2**32)
                random.seed(own_seed)
            # Only now that env and algorithm fit together (spaces) is this a run.
            if self.writer:
                self.logdir.mkdir(parents=True, exist_ok=True)
                hold_logdir(self.logdir)  # (LogdirInUse: another process trains there)
                holding = True
                save_config(config, self.logdir)
            algo.interrupt_check = self._stop.check  # Ctrl-C within an update
            checkpoint = latest_checkpoint(self.logdir) if self.writer else None
            if learners is not None:
                checkpoint = learners.broadcast(checkpoint)
            if checkpoint is not None:
                state = (load_checkpoint(checkpoint, self.device) if self.writer
                         else None)
                if learners is not None:
                    state = learners.broadcast(state, self.device)
                own = _learner_state(state, checkpoint, learners)
                try:
                    algo.load_state_dict({**state["algorithm"], **own["algorithm"]})
                except torch.OutOfMemoryError:
                    raise
                except (KeyError, RuntimeError, ValueError) as exc:
                    raise CheckpointError(
                        f"{checkpoint} does not fit the algorithm its run's "
                        f"{CONFIG_FILE} builds ({config.algorithm.name}): {error_line(exc)}; "
                        f"{_unfit_hint(state.get('config'), config, algo, exc)}") from None
                _set_rng_state(own["rng"])
                self.counters = Counters(**state["counters"])
                # (each learner's own restarts: env.max_restarts bounds each learner's)
                self.counters.env_restarts = own.get("env_restarts", self.counters.env_restarts)
                self._written = self.counters.steps
                for each in self._batch_envs:  # the bound is per run, over all its sessions
                    if each.max_restarts:
                        each.max_restarts = max(
                            0, env_config.max_restarts - self.counters.env_restarts)
                if self.writer:
                    print(f"Resuming from {checkpoint} at step {self.counters.steps:,}")
                    if state.get("precision", precision) != precision:
                        print(f"note: the run computed in {state['precision']} up to this "
                              f"checkpoint and computes in {precision} on this "
                              f"{self.device.type} (train.precision = "
                              f"{config.train.precision!r}): it goes on, but not exactly as "
                              f"it would have", file=sys.stderr)
                if self.counters.steps >= config.train.steps and self.writer:
                    print(f"The run already reached train.steps={config.train.steps:,}; "
                          f"nothing to train (--steps N extends its budget)")
            # Drop what earlier sessions logged after the checkpoint (metrics.jsonl
            # records; TensorBoard hides their events from purge_step on).
            self.log = (RunLog(self.logdir, purge_step=self.counters.steps + 1,
                               eval_actions=config.train.eval_actions) if self.writer
                        else _NoLog())
            self.log.truncate(self.counters.steps)
            # A bar on a terminal; one plain line per phase in a log file.
            self._lines = self.progress and self.writer and not sys.stderr.isatty()
            if self.progress and self.writer and not self._lines:
                from tqdm import tqdm
                bar = tqdm(total=config.train.steps, initial=self.counters.steps,
                           unit="step", unit_scale=True, dynamic_ncols=True)
            evals = self.counters.phases - self.counters.train_phases  # over all sessions
            episodes, phase_steps, eval_every = phase_plan(config, algo, len(env))
            if config.train.phase_steps and self.writer and (
                    episodes is not None or algo.steps_per_update is not None):
                name = type(algo).__name__
                print("note: train.phase_steps is unused: " + (
                    f"{name} learns from every {episodes} episodes, and a training phase is "
                    f"one such update" if episodes is not None else
                    f"{name} learns every {algo.steps_per_update} batch steps, and a training "
                    f"phase is train.eval_every = {config.train.eval_every} such updates"),
                    file=sys.stderr)
            # Preempted rollouts differ in length between learners: phases of whole updates.
            phase_updates = (phase_steps // algo.steps_per_update if learners is not None
                             and config.train.preemption_threshold else None)
            if config.train.collectors:
                updates, eval_every = collector_plan(config, algo, len(env))
                pool = self._collectors(algo, env, bar)
            simulation = Simulation(env)
            eval_simulation = simulation if eval_batch_env is None else Simulation(
                TensorBatchEnv(eval_batch_env, self.device))
            while self.counters.steps < config.train.steps:
                if pool is not None:
                    record = self._collect_phase(pool, algo, updates, bar)
                else:
                    record = self._phase(simulation, algo, episodes, bar, phase_steps,
                                         phase_updates)
                self._report(record, bar)
                due = self.counters.train_phases % eval_every == 0
                final = self.counters.steps >= config.train.steps
                if config.train.eval_episodes and (due or final):
                    if self.writer:
                        last_eval = self._evaluation(eval_simulation, algo,
                                                     config.train.eval_episodes, bar)
                        self._report(last_eval, bar)
                        self.log.plot()
                    else:  # (the writer evaluates; the phase count seeds the next resets)
                        self.counters.phases += 1
                    evals += 1
                # A phase boundary: the only state a run can resume from exactly.
                if learners is not None:  # (the shared state the last update left unmerged)
                    algo.synchronize()
                state = self._boundary_state(algo, precision)
                algo_state = state["algorithm"]
                if learners is not None:  # what differs between the learners, for each
                    state["learners"] = learners.gather_to_writer(
                        {"rng": state["rng"], "env_restarts": self.counters.env_restarts,
                         "algorithm": {key: algo_state[key] for key in algo.per_agent_state}})
                if not self.writer:
                    continue
                # The last boundary's state, for a stop before the next one: written now if a
                # checkpoint is due (straight from the live tensors, so a large replay buffer
                # is never copied in memory), else a copy in memory (the older one freed first).
                self._snapshot = None
                # (without evaluations, each boundary where one would be due counts as one)
                boundaries = (evals if config.train.eval_episodes
                              else self.counters.train_phases // eval_every)
                if final or (due and boundaries % config.train.checkpoint_every == 0):
                    if not config.train.eval_episodes:
                        self.log.plot()  # else redrawn after every evaluation
                    self._checkpoint(self.counters.steps, state)
                    self._written = self.counters.steps
                    self._snapshot = (self.counters.steps, None)
                else:
                    self._snapshot = (self.counters.steps, serialize(state))
        except Interrupted as exc:
            checkpoint = self._save_snapshot()
            raise TrainingInterrupted(exc.signum, checkpoint, self._written or 0) from None
        except EnvError:
            self._save_snapshot()  # what the run learned until the env failed is kept
            raise
        except Exception:
            if self._stop.requested and self.learners is not None and self.writer:
                # A stop reached the other learners first (torchrun, SLURM signal them all):
                # the collective this one waited in failed. A stop all the same.
                raise TrainingInterrupted(self._stop.signum, self._save_snapshot(),
                                          self._written or 0) from None
            # the algorithm, collectors or another learner failed: keep what was learned
            # (the last boundary's state, from before the failure)
            if self.writer:
                with contextlib.suppress(Exception):  # (the error that stopped it matters more)
                    self._save_snapshot()
            raise
        finally:
            try:
                if pool is not None:
                    pool.close()
            finally:
                try:
                    self._close(bar, batch_env, eval_batch_env)
                finally:
                    if holding:
                        release_logdir(self.logdir)
                    if holds_ray:
                        from batchrl.collectors.ray import leave_cluster
                        leave_cluster()
        return last_eval

    def _close(self, bar: Any, batch_env: Any, eval_batch_env: Any) -> None:
        """Close what ``_run`` opened, whatever failed."""
        try:
            if bar is not None:
                bar.close()
            if self.log is not None:
                self.log.close()
        finally:
            try:
                batch_env.close()
            finally:
                if eval_batch_env is not None:
                    eval_batch_env.close()

    def _report_precision(self, precision: str | None) -> None:
        """Says what ``train.precision = "auto"`` chose for the algorithm (``precision``; None:
        it takes none), or notes a bfloat16 that this device would emulate."""
        device = self.device.type
        if precision is not None and self.config.train.precision == "auto":
            unknown = native_bfloat16(self.device) is None
            print(f"train.precision = 'auto': {precision} on this {device}"
                  + (" (this torch cannot tell whether it computes bfloat16 in hardware)"
                     if unknown else ""))
        elif precision == "bfloat16" and native_bfloat16(self.device) is False:
            print(f"note: train.precision = 'bfloat16', but this {device} has no bfloat16 "
                  f"arithmetic in hardware ({BFLOAT16_HARDWARE}): it is emulated, several "
                  f"times slower than float32; train.precision = 'auto' picks float32 here",
                  file=sys.stderr)

    def _report(self, record: dict[str, Any], bar: Any) -> None:
        self.log.phase(record)
        if record["score"] is not None:
            self.last_scores[record["phase"]] = record["score"]
        if self._lines:
            score = "-" if record["score"] is None else f"{record['score']:.1f}"
            print(f"step {record['step']:,} of {self.config.train.steps:,}: {record['phase']} "
                  f"return {score} over {episodes_words(record['episodes'])}, "
                  f"{record['steps_per_s']:,.0f} steps/s", flush=True)
        if bar is not None:
            bar.set_postfix({name: "-" if value is None else f"{value:.1f}"
                             for name, value in self.last_scores.items()}, refresh=True)
