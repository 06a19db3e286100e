"""The interface every algorithm implements to run under ``simulate()``."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

import torch

from batchrl.algos.ppo_config import EVAL_ACTIONS

if TYPE_CHECKING:  # (parts sit below algorithms; only the annotations name them)
    from batchrl.parts.rollout import Fields, Rollout

Summary = dict[str, float]
"""Scalars to log, by name. Empty when there is nothing to report."""


class Algorithm(abc.ABC):
    """A batch of agents, one per env of a ``TensorBatchEnv``.

    ``simulate()`` calls the four methods below once per env step, in this order, and merges the
    summaries they return:

    1. ``begin_episodes(agent_indices)`` for the agents whose episode starts now (their env was just
       reset): every agent on the first step and when ``simulate(..., reset=True)``, afterwards the
       ones done on the previous step.
    2. ``perform(agent_indices, observ)`` for all agents; returns the actions.
    3. ``experience(...)`` with the transition of all agents after the envs stepped.
    4. ``end_episodes(agent_indices)`` for the agents whose episode just ended.

    Conventions: ``agent_indices`` is a 1-D int64 tensor of indices into the batch dimension; every
    other tensor has it first and is float32 unless stated; all are on the algorithm's ``device``.
    Observations are the env's (already wrapped) ones as float32, or uint8 for a uint8 space
    (images): an algorithm normalises them itself if it wants to. Under ``simulate`` every call
    covers all ``N`` agents (``agent_indices`` is ``arange(N)``), so per-agent state can be
    indexed by it directly.

    ``done`` is 1.0 when the episode is over for any reason (Gymnasium's
    ``terminated or truncated``); ``terminated`` is 1.0 only for a true terminal state (the value
    after it is zero). Where ``done`` is 1.0 and ``terminated`` 0.0 a time limit cut the episode,
    and ``next_observ`` is the real observation there, so an algorithm can bootstrap from its value.

    Overlap: with ``simulate(..., overlap=True)`` and ``experience_may_lag`` true, the
    ``experience`` of a step in which no episode ended may be called one step late, after the next
    ``perform``, while the worker processes step the envs: learning bookkeeping then costs no env
    time. Set it only when ``perform`` does not depend on the previous ``experience`` (update the
    statistics ``perform`` uses in ``perform``). The order of ``perform``/``experience`` pairs is
    kept, every ``experience`` comes before ``end_episodes`` and ``begin_episodes`` of its agents,
    and ``Simulation.flush()`` delivers a late one before a checkpoint. Envs restarted after a
    failure give their agents ``steps_lost`` before that step's ``experience`` (optional).

    ``train()`` / ``eval()`` switch ``self.training``; in evaluation an algorithm learns nothing and
    acts with its mean (mode) action, or with sampled ones when ``eval_actions`` is ``"sample"``
    (``acting_deterministically`` says which applies now). ``state_dict()`` /
    ``load_state_dict()`` must cover everything needed to resume training exactly (weights,
    optimisers, statistics). Gradient steps may happen in any method (typically ``end_episodes``
    or ``experience``): only ``perform`` should run under ``torch.no_grad()``. An algorithm
    given an env that something else stepped before must start with
    ``simulate(..., reset=True)``.

    Built by ``train.py``: a config's ``[algorithm]`` section names the class
    (``class = "package.module:Class"``; BatchPPO without it) and its other keys are keyword
    arguments: ``Class(observation_space, action_space, num_agents, **run facts, **keys)``. The
    run facts are passed by name to a constructor that takes them: ``max_length`` (the episode
    time limit, ``env.max_length``), ``total_steps`` (the training budget, ``train.steps``),
    ``device`` (``train.device``), ``precision`` (``train.precision``) and ``eval_actions``
    (``train.eval_actions``, which a class passes on to ``Algorithm.__init__``). A class may name
    a dataclass of its hyperparameters in ``config_class`` (as BatchPPO does with
    ``PPOConfig``); otherwise its constructor's signature and annotations check the keys. The
    trainer then offers everything it has (evaluation phases, TensorBoard, checkpoints of
    ``state_dict()``, exact resume, Ctrl-C, ``python -m batchrl.evaluate``). Optional attributes tell it more:

    - ``episodes_per_phase``: an update's worth of whole episodes. A training phase then ends once
      that many episodes finished, and an evaluation follows every ``train.eval_every`` phases.
    - ``steps_per_update``: an update's worth of batch steps (fixed-length rollouts). A training
      phase is then ``train.eval_every`` updates, and an evaluation follows every phase.
    - Neither (the default): a training phase is ``train.phase_steps`` env steps (by default
      sized so that evaluations cost at most about a tenth of the run), and an evaluation follows
      every ``train.eval_every`` phases. Every phase starts new episodes (seeded resets), and the
      last one stops at ``train.steps``.
    - ``per_agent_state``: the ``state_dict()`` entries whose first dimension is the agent, which
      ``batchrl.evaluate`` takes fresh when it runs another number of agents than the training run
      (without them it runs the training run's number).
    - ``interrupt_check``: set by the trainer; a long computation (an update) calls
      ``self.check_interrupt()`` between its steps, so that Ctrl-C stops the run within a step.

    Decoupled collection (``train.collectors = N``): collector processes step their own envs with
    a copy of the algorithm that only acts, and the learner learns from the fixed-length rollouts
    they send (``batchrl.parts.rollout.Rollout``). An algorithm takes part by implementing five
    more methods (BatchPPO and IMPALA do; ``RolloutAlgorithm`` builds the four paper methods on
    them, so a new algorithm may implement only these):

    - ``behaviour_fields()``: name -> ``(shape, dtype)`` of what ``act`` records per agent and
      step (log-probabilities, distribution parameters), stored in the rollout.
    - ``act(observ, deterministic=False)``: sampled training actions for ``observ``
      ``(K, *obs_shape)`` float32 and that record, ``(K, ...)`` each; changes no learning state.
    - ``acting_state()`` / ``load_acting_state(state)``: the tensors a copy needs to act as this
      algorithm does now (policy weights, observation statistics). The learner publishes them,
      versioned; collectors load the newest between rollouts.
    - ``learn(rollout)``: one learning step (an update) from a batch of rollouts whose rows
      together are the ``num_agents`` agents (``rollout.agents``), on the algorithm's device.
      The rows were acted by older weights (``rollout.version``): correct for it (importance
      ratios, V-trace) from the recorded behaviour.

    Several learners (``train.learners = M``): each learner process holds a copy of the
    algorithm and steps its share of the envs. An algorithm takes part with three methods
    (BatchPPO has them): ``learner_support(M)`` says why it cannot (or ``None``; where the
    hyperparameter class has a ``learner_support(M)`` too, the run is refused from the config
    before any learner starts);
    ``join_learners(group)`` hands it the ``batchrl.parts.distributed.LearnerGroup`` whose
    collectives it calls in the same order on every learner (BatchPPO averages its gradients
    after every backward pass and merges its statistics before every update); and
    ``synchronize()``, a collective the trainer calls on every learner before a checkpoint,
    after which the state all learners share is identical. With DD-PPO's preemption
    (``train.preemption_threshold``) the trainer calls ``join_learners(group,
    preemption=f)`` and reads ``updates`` and ``env_steps`` (all learners' steps, the same on
    each after every update): its training phases are whole updates.

    ``rollout_length`` is the steps per rollout (``steps_per_update`` unless an algorithm says
    otherwise); ``collector_support()`` says why an instance cannot run with collectors, if it
    cannot (the trainer reports it before it starts any).
    """

    experience_may_lag: bool = False
    config_class: type | None = None
    episodes_per_phase: int | None = None
    steps_per_update: int | None = None
    per_agent_state: tuple[str, ...] = ()
    interrupt_check: Callable[[], None] | None = None

    def __init__(self, device: str | torch.device = "cpu", eval_actions: str = "mean"):
        if eval_actions not in EVAL_ACTIONS:
            raise ValueError(f"eval_actions must be one of {EVAL_ACTIONS}, got {eval_actions!r}")
        self.device = torch.device(device)
        self.eval_actions = eval_actions
        self.training = True

    def train(self, mode: bool = True) -> "Algorithm":
        """Switch to training (sampled actions, learning) or, with ``False``, evaluation."""
        self.training = mode
        return self

    def eval(self) -> "Algorithm":
        """Switch to evaluation: mean (or, with ``eval_actions="sample"``, sampled) actions,
        nothing learned."""
        return self.train(False)

    @property
    def acting_deterministically(self) -> bool:
        """Whether actions now are the mean (mode) ones: in evaluation, unless ``eval_actions``
        is ``"sample"``."""
        return not self.training and self.eval_actions == "mean"

    def check_interrupt(self) -> None:
        """Call ``interrupt_check`` if the trainer set one: it raises when asked to stop."""
        if self.interrupt_check is not None:
            self.interrupt_check()

    @abc.abstractmethod
    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        """The agents at ``agent_indices`` (shape ``(K,)``) start new episodes."""

    @abc.abstractmethod
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        """Choose actions for the ``K`` agents at ``agent_indices`` from ``observ``
        ``(K, *obs_shape)`` (``TensorBatchEnv.observ``'s rows: for a Dict or Tuple observation
        space a dict or tuple of such tensors, see ``batchrl.nested``); returns ``(action,
        summary)`` with ``action`` ``(K, *act_shape)``, float32 for Box action spaces and int64
        for discrete ones."""

    @abc.abstractmethod
    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        """Receive the transition of the ``K`` agents at ``agent_indices`` after the envs stepped:
        ``observ`` ``(K, *obs_shape)`` the observations ``perform`` saw, ``action``
        ``(K, *act_shape)`` the actions taken, ``next_observ`` the observations after the step;
        ``reward``, ``done`` (1.0 where the episode ended, terminated or truncated) and
        ``terminated`` (1.0 where it reached a terminal state) are ``(K,)`` float32."""

    def steps_lost(self, agent_indices: torch.Tensor) -> None:
        """The step that the next ``experience`` gives the agents at ``agent_indices``
        (``(K,)``) is no transition: their env was restarted after a failure instead of
        stepping (zero reward, the new episode's first observation as ``next_observ``), and
        ``begin_episodes`` for them follows. By default nothing: an algorithm that drops the
        running episodes in ``begin_episodes`` loses the step with them, unless that step's
        ``experience`` learns at once (a completed rollout); one that learns from single steps
        (a replay buffer) must not learn from it."""

    @abc.abstractmethod
    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        """The agents at ``agent_indices`` (shape ``(K,)``) finished an episode:
        learning algorithms typically move those episodes into their update
        memory here and update once enough were collected."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimisers, statistics, counters."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` returned."""

    # -- decoupled collection (optional; see the class docstring) -----------------------

    @property
    def rollout_length(self) -> int | None:
        """Steps per agent of a collector's rollout (``None``: it cannot say)."""
        return self.steps_per_update

    def behaviour_fields(self) -> "Fields":
        """name -> ``(shape, dtype)`` of what ``act`` records per agent and step."""
        raise NotImplementedError(self._cannot_collect())

    def act(self, observ: torch.Tensor, deterministic: bool = False
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sampled actions ``(K, *act_shape)`` for ``observ`` ``(K, *obs_shape)`` float32 (with
        ``deterministic``, the mean or most likely ones), and the behaviour record
        (``behaviour_fields``), ``(K, ...)`` each. Learns nothing."""
        raise NotImplementedError(self._cannot_collect())

    def acting_state(self) -> dict[str, torch.Tensor]:
        """The tensors a copy of this algorithm needs to act as it does now."""
        raise NotImplementedError(self._cannot_collect())

    def load_acting_state(self, state: dict[str, torch.Tensor]) -> None:
        """Act from now on as the algorithm whose ``acting_state()`` gave ``state``."""
        raise NotImplementedError(self._cannot_collect())

    def learn(self, rollout: "Rollout") -> Summary:
        """One learning step from ``rollout`` (all ``num_agents`` agents, rows in any order,
        acted by the weights ``rollout.version``); returns the summary to log."""
        raise NotImplementedError(self._cannot_collect())

    def collector_support(self) -> str | None:
        """``None`` when this algorithm can run with collectors, else why it cannot."""
        methods = ("behaviour_fields", "act", "acting_state", "load_acting_state", "learn")
        missing = [name for name in methods
                   if getattr(type(self), name) is getattr(Algorithm, name)]
        if missing:
            return (f"{type(self).__name__} does not implement {', '.join(missing)}, which an "
                    f"algorithm needs to act in collector processes (see Algorithm's docstring)")
        if self.rollout_length is None:
            return (f"{type(self).__name__} names no rollout_length: collectors send "
                    f"fixed-length rollouts")
        return None

    def _cannot_collect(self) -> str:
        return (f"{type(self).__name__} cannot run with collectors: it does not implement the "
                f"decoupled interface (behaviour_fields, act, acting_state, load_acting_state, "
                f"learn)")


def modules_state(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """An ``acting_state`` made of whole modules: a detached copy of each tensor of each
    module's ``state_dict()``, named ``"<key>.<name>"`` (on the modules' devices)."""
    return {f"{key}.{name}": tensor.detach().clone()
            for key, module in modules.items() for name, tensor in module.state_dict().items()}


def load_modules_state(state: dict[str, torch.Tensor],
                       modules: dict[str, torch.nn.Module]) -> None:
    """Load a ``modules_state(modules)`` (of modules of the same shapes) into ``modules``."""
    for key, module in modules.items():
        prefix = f"{key}."
        module.load_state_dict({name[len(prefix):]: tensor for name, tensor in state.items()
                                if name.startswith(prefix)})
