"""BatchPPO: proximal policy optimisation with an adaptive KL penalty.

As in Hafner et al. (2017), section 3 and 6: collect ``update_every`` whole
episodes, then take ``update_epochs`` full-batch gradient steps on

    policy loss = -E[ratio * advantage] + beta * KL(old || new)
                  + kl_cutoff_coef * max(0, KL - kl_cutoff_factor * kl_target)^2
    value loss  = 1/2 E[(return - V)^2]

and adapt ``beta`` from the KL measured after the update. The losses are parts
(``batchrl.parts.losses``); this class builds the networks, keeps the memory and the
statistics, estimates advantages and runs the update loop.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import gymnasium as gym
import torch
from torch import nn
from torch.distributions import Distribution

from batchrl.algos.base import Algorithm, Summary, load_modules_state, modules_state
from batchrl.algos.networks import (Actor, CastWeights, ConvTorso, FeedForwardBody, Policy,
                                    RecurrentBody, actor_critic, build_torsos, torso_shared_by)
from batchrl.algos.ppo_config import PRECISIONS, PPOConfig
from batchrl.errors import UnsupportedSpaceError
from batchrl.hardware import usable_cores
from batchrl.nested import first_leaf, take
from batchrl.parts import numpy_views
from batchrl.parts.losses import (ClippedObjective, KLPenalizedObjective, KLPenalty,
                                  action_distribution, entropy_bonus, masked_mean, value_loss)
from batchrl.parts.memory import EpisodeMemory, RolloutMemory
from batchrl.parts.distributed import PREEMPT_FEWEST, LearnerGroup, preemption_count
from batchrl.parts.normalize import Statistics, StreamingNormalizer
from batchrl.parts.packing import check_observation_space, packing_for
from batchrl.parts.returns import discounted_cumsum, gae, generalized_advantage
from batchrl.parts.rollout import Fields, Rollout
from batchrl.parts.vtrace import vtrace
from batchrl.pixels import is_pixel_space

__all__ = ["BatchPPO", "KLPenalty", "compile_actor"]


def compile_actor(actor: Actor, mode: str) -> nn.Module:
    """Return ``actor`` compiled for inference: ``"script"`` (TorchScript),
    ``"compile"`` (``torch.compile``) or ``"eager"`` (unchanged). The compiled
    module shares the actor's parameters, so updates are seen at once."""
    if mode == "eager":
        return actor
    if mode == "compile":
        return torch.compile(actor, dynamic=False)
    with warnings.catch_warnings():
        # torch >= 2.10 deprecates TorchScript, still the fastest small-batch CPU path here.
        warnings.filterwarnings("ignore", r".*torch\.jit\.script.*", DeprecationWarning)
        warnings.filterwarnings("ignore", r".*torch\.jit.*", FutureWarning)
        return torch.jit.script(actor)


class BatchPPO(Algorithm):
    """PPO with the adaptive KL penalty, for a batch of ``num_agents`` envs.

    Args:
      observation_space: a Box space, or a Dict or Tuple of Box and Discrete spaces.
        Observations are flattened to ``(obs_size,)``: float32 (normalised with running
        statistics if ``normalize_observ``), or ``uint8`` pixels, kept as bytes in memory and
        scaled to ``[0, 1]`` by the networks' torso (``torso``: an MLP's input, or a
        convolutional network for images). Dict and Tuple observations are packed into one
        ``uint8`` row each (``PackedObservations``: the float parts, normalised, then the
        images); the torso gives every image part a ``torso`` network of its own and
        concatenates their features with the float parts (``PackedTorso``). They run
        ``inference="script"`` eager.
      action_space: Box (Gaussian policy) or Discrete (categorical policy).
      num_agents: the batch size N of the env.
      config: hyperparameters (``PPOConfig``); or give them as keyword
        arguments (any ``PPOConfig`` field), as ``train.py`` does with a config's
        ``[algorithm]`` section.
      device: where networks, memory and statistics live.
      max_length: the longest episode (the env's time limit); sizes the episode memory.
      total_steps: the run's training env steps, over which ``lr_schedule="linear"``
        decays the learning rates (``train.py`` passes ``train.steps``).
      precision: ``"float32"``, or ``"bfloat16"``: the networks' forward passes, in acting
        and in the update, run under ``torch.autocast`` in bfloat16 (weights, optimiser state,
        recorded distributions and losses stay float32); ``train.py`` passes
        ``train.precision``.
      eval_actions: ``"mean"`` (evaluation acts with the mean or most likely action) or
        ``"sample"``; ``train.py`` passes ``train.eval_actions``.

    ``build_networks`` makes the policy and the value network; a subclass may return
    networks that share layers (a torso), which the update then trains with one joint step.
    """

    config_class = PPOConfig
    # state_dict() entries sized by num_agents: unfinished episodes, not what was learned.
    per_agent_state = ("recurrent_state", "running_return", "memory")

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 config: PPOConfig | None = None, device: str | torch.device = "cpu",
                 max_length: int = 1000, total_steps: int | None = None,
                 precision: str = "float32", eval_actions: str = "mean", **options: Any):
        super().__init__(device, eval_actions)
        if config is not None and options:
            raise TypeError(f"BatchPPO takes a PPOConfig or keyword arguments, not both "
                            f"(got config and {sorted(options)})")
        self.config = config = config or PPOConfig(**options)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 or None, got {total_steps}")
        self.max_length, self.total_steps = max_length, total_steps
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        if config.rollout_length is None:  # (else an update every rollout_length batch steps)
            self.episodes_per_phase = config.update_every
        self.steps_per_update = config.rollout_length
        if config.lr_schedule == "linear" and total_steps is None:
            raise ValueError("lr_schedule='linear' needs total_steps, the env steps over which "
                             "the learning rates decay to zero (train.py sets it to train.steps)")
        check_observation_space(observation_space, "BatchPPO")
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if not self.discrete and not isinstance(action_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"BatchPPO supports Box and Discrete action spaces, got "
                                        f"{action_space}")
        if not self.discrete and len(action_space.shape) != 1:
            raise UnsupportedSpaceError(f"BatchPPO needs a 1-D Box action space, got "
                                        f"{action_space}")
        self.num_agents = num_agents
        self.observation_space = observation_space
        # uint8 observations stay bytes up to the network, without running statistics.
        self.pixels = is_pixel_space(observation_space)
        # Whether observations are normalised with running statistics, kept and merged.
        self.normalizes_observ = config.normalize_observ and not self.pixels
        # Dict and Tuple observations: one uint8 row each, whose float part is normalised.
        self.packing = packing_for(observation_space)
        observ_dtype = torch.uint8 if self.pixels or self.packing else torch.float32
        obs_size = (self.packing.size if self.packing
                    else math.prod(observation_space.shape))
        # The observation values with running statistics.
        normalized_size = self.packing.float_size if self.packing else obs_size
        if self.discrete:
            action_shape, action_dtype = (), torch.int64
            param_shape, log_std_shape = (int(action_space.n),), (0,)
        else:
            action_shape, action_dtype = tuple(action_space.shape), torch.float32
            param_shape = log_std_shape = action_shape
        policy, value = self.build_networks(obs_size, action_space)
        self.policy, self.value = policy.to(self.device), value.to(self.device)
        if precision == "bfloat16":  # images straight to bfloat16 (see ConvTorso)
            for module in (*self.policy.modules(), *self.value.modules()):
                if isinstance(module, ConvTorso):
                    module.input_dtype = torch.bfloat16
        # Parameters of both networks (a shared torso) take the policy's optimiser, and
        # both losses' gradients in one joint step (see update()).
        policy_params = list(self.policy.parameters())
        shared = {id(p) for p in policy_params}
        value_params = [p for p in self.value.parameters() if id(p) not in shared]
        self.shared_torso = len(value_params) < len(list(self.value.parameters()))
        # The torso both networks take their features from, run once per gradient step.
        self._torso = torso_shared_by(self.policy, self.value)
        if not value_params:
            raise ValueError("the value network has no parameters of its own: give it at "
                             "least an output layer besides the shared torso")
        # TorchScript cannot view the bytes of packed Dict and Tuple observations as floats:
        # those run eager.
        inference = ("eager" if self.packing is not None and config.inference == "script"
                     else config.inference)
        # In bfloat16, acting runs (under autocast) a copy of the policy whose weights are
        # cast when they change, not at every call (see CastWeights): the same actions.
        self._cast_policy = (CastWeights(self.policy, torch.bfloat16)
                             if precision == "bfloat16" else None)
        self.actor = compile_actor(Actor(self.policy if self._cast_policy is None
                                         else self._cast_policy.module), inference)
        # A TorchScript module's forward, called directly, skips nn.Module's hook handling.
        self._act = self.actor.forward if inference == "script" else self.actor
        # fused: one kernel per step over all parameters instead of several per parameter
        # (cheaper for small networks; it rounds differently, so it is a setting of its own).
        adam = functools.partial(torch.optim.Adam, eps=config.epsilon,
                                 fused=True if config.fused_adam else None)
        self.policy_optimizer = adam(policy_params, lr=config.policy_lr)
        self.value_optimizer = adam(value_params, lr=config.value_lr)
        if self._cast_policy is not None:  # (a shared torso is in both)
            for optimizer in (self.policy_optimizer, self.value_optimizer):
                self._cast_policy.watch(optimizer)
        self.observ_normalizer = StreamingNormalizer(
            (normalized_size,), center=True, scale=True, clip=5.0).to(self.device)
        # Read only by update(): the rewards of 64 steps are merged at once.
        self.reward_normalizer = StreamingNormalizer(
            (), center=False, scale=True, clip=10.0, defer=64 * num_agents).to(self.device)
        # reward_scale "return": each agent's discounted return so far (unit-scale value targets).
        self.running_return = torch.zeros(num_agents, device=self.device)
        self.objective: KLPenalizedObjective | ClippedObjective
        if config.objective == "clip":
            self.objective = ClippedObjective(config.clip_range)
        else:
            self.objective = KLPenalizedObjective(config.kl_target, config.kl_cutoff_factor,
                                                  config.kl_cutoff_coef, config.kl_init_penalty)
        self.state_size = self.policy.state_size
        self._behaviour = {"mean_or_logits": (param_shape, torch.float32),
                           "log_std": (log_std_shape, torch.float32)}
        self.recurrent_state = torch.zeros(num_agents, self.state_size, device=self.device)
        self._no_state = torch.zeros(num_agents, 0, device=self.device)
        step_fields = {"observ": ((obs_size,), observ_dtype),
                       "action": (action_shape, action_dtype),
                       "mean_or_logits": (param_shape, torch.float32),
                       "log_std": (log_std_shape, torch.float32),
                       "reward": ((), torch.float32), "state": ((self.state_size,), torch.float32)}
        # The state after an episode's (or a rollout's) last step, to bootstrap from.
        end_fields = {"bootstrap_observ": ((obs_size,), observ_dtype),
                      "terminated": ((), torch.float32)}
        self.memory: EpisodeMemory | RolloutMemory
        if config.rollout_length is None:
            self.memory = EpisodeMemory(num_agents, config.update_every, max_length,
                                        step_fields, end_fields, self.device)
        else:
            self.memory = RolloutMemory(num_agents, config.rollout_length, step_fields,
                                        end_fields, self.device)
        self.updates = 0
        # Env steps in training, and those before the last update (the lr schedule's clock).
        self.env_steps = self.updated_steps = 0
        # Several learners (join_learners): the group and the merged normaliser statistics.
        self.learners: LearnerGroup | None = None
        # With preemption: the finished learners that end the others' rollouts, and the
        # fewest steps a rollout is cut at.
        self._preempt_count: int | None = None
        self._preempt_steps = 0
        self._merged: dict[str, Statistics | None] = {"observ": None, "reward": None}
        # What perform() saw, for experience(), which may come after the next perform().
        self._performed: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=2)
        self._lost: torch.Tensor | None = None  # agents whose next experience() is no step

    def build_networks(self, obs_size: int, action_space: gym.Space
                       ) -> tuple[Policy, nn.Module]:
        """The policy (``Policy``: ``(observ (B, T, obs_size), state (B, H))`` ->
        ``(mean_or_logits, log_std, state)``) and the value network (``(..., obs_size)`` ->
        ``(...)``), from the config. Override to build others; they may share modules.

        The torso (``config.torso``, for ``self.observation_space``) is the policy's first
        module; the value network gets it too with ``shared_torso``, else one of its own."""
        config = self.config
        torso, value_torso = build_torsos(config.torso, self.observation_space,
                                          config.shared_torso)
        if config.network == "recurrent":
            body: FeedForwardBody = RecurrentBody(obs_size, config.policy_layers,
                                                  config.gru_size, config.activation, torso)
        else:
            body = FeedForwardBody(obs_size, config.policy_layers, config.activation, torso)
        return actor_critic(body, obs_size, action_space, config.value_layers, config.activation,
                            config.init, config.init_std, config.init_output_factor,
                            value_torso)

    @property
    def penalty(self) -> KLPenalty:
        """The adaptive KL coefficient (beta) of the objective (``objective="kl_penalty"``)."""
        if not isinstance(self.objective, KLPenalizedObjective):
            raise AttributeError(f"objective={self.config.objective!r} has no KL penalty")
        return self.objective.penalty

    # -- helpers ---------------------------------------------------------------

    def _flatten(self, observ: Any) -> torch.Tensor:
        """``(K, *obs_shape)`` -> ``(K, obs_size)`` on ``device``: float32, ``uint8`` for
        pixels, packed ``uint8`` rows for Dict and Tuple observations (``PackedObservations``)."""
        if self.packing is not None:
            return self.packing.pack(observ, self.packing.floats(observ, self.device))
        if observ.dim() != 2:
            observ = observ.reshape(observ.shape[0], -1)
        dtype = torch.uint8 if self.pixels else torch.float32
        if observ.dtype != dtype or observ.device != self.device:
            observ = observ.to(self.device, dtype)
        return observ

    def _normalize(self, observ: Any) -> torch.Tensor:
        """``_flatten``'s rows with the observation statistics applied (``normalize_observ``):
        to the float parts of packed rows, to none of pixels."""
        if self.packing is None or not isinstance(observ, torch.Tensor):  # (else packed)
            observ = self._flatten(observ)
        if not self.normalizes_observ:
            return observ
        if self.packing is not None:
            return self.packing.with_floats(
                observ, self.observ_normalizer.transform(self.packing.unpack(observ)))
        return self.observ_normalizer.transform(observ)

    def _statistics_input(self, flat: torch.Tensor) -> torch.Tensor:
        """The values of ``_flatten``'s rows ``(..., obs_size)`` that the observation
        statistics take in."""
        return self.packing.unpack(flat) if self.packing is not None else flat

    def distribution(self, mean_or_logits: torch.Tensor, log_std: torch.Tensor) -> Distribution:
        """The action distribution for parameters from the policy (any batch shape)."""
        return action_distribution(mean_or_logits, log_std, self.discrete)

    # -- Algorithm interface -------------------------------------------------------

    @property
    def experience_may_lag(self) -> bool:
        """True except for the experience() that completes a rollout: it updates
        the policy, which the next perform() must use."""
        memory = self.memory
        if self.config.rollout_length is None or not self.training:
            return True
        # Steps stored, plus one performed but not yet experienced, plus this one.
        pending = len(self._performed) + 1
        # (with preemption any step past the fewest may end the rollout)
        last = (memory.num_agents * memory.length if self._preempt_count is None
                else self._preempt_steps)
        return memory.stored + pending * self.num_agents < last

    def train(self, mode: bool = True) -> "BatchPPO":
        self._performed.clear()  # a perform() of the other mode gets no experience()
        return super().train(mode)

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        self.recurrent_state[agent_indices] = 0.0
        self.running_return[agent_indices] = 0.0
        # Episodes cut short by a reset must not reach the update memory.
        self.memory.discard(agent_indices)
        return {}

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        flat = self._flatten(observ)
        norm_observ = self._normalize(flat)
        if self.state_size:
            state = self.recurrent_state[agent_indices]
        else:  # feed-forward: skip two indexing operations per step
            count = agent_indices.shape[0]
            state = self._no_state if count == self.num_agents else self._no_state[:count]
        action, mean_or_logits, log_std, new_state = self._infer(
            norm_observ, state, self.acting_deterministically)
        if self.state_size:
            self.recurrent_state[agent_indices] = new_state
        if self.training:
            self._performed.append({"agents": agent_indices, "observ": norm_observ,
                                    "mean_or_logits": mean_or_logits, "log_std": log_std,
                                    "state": state})
            # Only now: this step's data and action used the statistics before it.
            if self.normalizes_observ:
                self.observ_normalizer.update(self._statistics_input(flat))
        return action, {}

    def steps_lost(self, agent_indices: torch.Tensor) -> None:
        # begin_episodes drops these agents' running segments after experience(), which is too
        # late where that step completes a rollout: experience() drops them before the update.
        if self.training and self.config.rollout_length is not None:
            self._lost = agent_indices

    @torch.no_grad()
    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        lost, self._lost = self._lost, None
        last = self._performed.popleft() if self._performed else None
        # simulate() passes the same index tensor to both: skip the comparison.
        if last is None or (last["agents"] is not agent_indices
                            and not torch.equal(last["agents"], agent_indices)):
            raise RuntimeError("experience() must follow perform() for the same agents")
        self.memory.append(agent_indices, observ=last["observ"], action=action,
                           mean_or_logits=last["mean_or_logits"], log_std=last["log_std"],
                           reward=reward, state=last["state"])
        if lost is not None:  # (agent indices: simulate() gives every agent, in order)
            self.memory.discard(lost)
        # (all learners step alike: the run's env steps are this learner's times their number)
        self.env_steps += agent_indices.shape[0] * (self.learners.size if self.learners else 1)
        if self.config.reward_scale == "return":
            running = self.running_return[agent_indices] * self.config.discount + reward
            self.running_return[agent_indices] = running
            self.reward_normalizer.update(running)
        else:
            self.reward_normalizer.update(reward)
        episodes = self.config.rollout_length is None
        if not episodes and self._rollout_ends():  # cut here: every agent bootstraps
            self.memory.end_segments(agent_indices,
                                     bootstrap_observ=self._normalize(next_observ),
                                     terminated=terminated)
            summary = self.update()
            self.memory.clear()
            return summary
        done_array = numpy_views.view(done)
        any_done = done_array.any() if done_array is not None else bool(done.any())
        if any_done:
            ended = done.bool()
            end = self.memory.set_episode if episodes else self.memory.end_segments
            end(agent_indices[ended], bootstrap_observ=self._normalize(take(next_observ, ended)),
                terminated=terminated[ended])
        return {}

    def _rollout_ends(self) -> bool:
        """Whether the rollout ends at this step: the memory is full, or (DD-PPO's preemption)
        enough other learners collected theirs and this one has at least its fewest steps.
        A learner whose rollout is full tells the others."""
        if self.memory.full:
            if self._preempt_count is not None:
                self.learners.report_finished(self.updates)
            return True
        return (self._preempt_count is not None and self.memory.stored >= self._preempt_steps
                and self.learners.finished(self.updates) >= self._preempt_count)

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        # (fixed-length rollouts saw the end of the episodes in experience())
        if not self.training or self.config.rollout_length is not None:
            return {}
        self.memory.finish(agent_indices)
        if not self.memory.full:
            return {}
        summary = self.update()
        self.memory.clear()
        return summary

    # -- learning ------------------------------------------------------------------

    def _advantages(self, rollout_data: dict[str, torch.Tensor] | None = None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The memory's step fields ``(B, T, ...)`` (or those of ``rollout_data``, in
        ``RolloutMemory.data()``'s layout) with ``advantage`` (normalised over the valid steps)
        and ``returns`` added, and the ``(B, T)`` bool mask of valid steps. ``B`` counts
        episodes, or agents for rollouts."""
        config = self.config
        lambda_ = 1.0 if config.gae_lambda is None else config.gae_lambda  # 1: R - V
        rollout = rollout_data is not None or isinstance(self.memory, RolloutMemory)
        if rollout:
            data = self.memory.data() if rollout_data is None else rollout_data
            mask = data["valid"]
        else:
            data, length = self.memory.data()
            mask = torch.arange(data["reward"].shape[1], device=self.device)[None] < length[:, None]
        with self._autocast():
            value = self.value(data["observ"]).float()
            if rollout:  # bootstrap values only where a segment ends (end fields: a row each)
                after = torch.zeros_like(value)
                after[data["ends"]] = (self.value(data["bootstrap_observ"]).float()
                                       * (1.0 - data["terminated"]))
            else:
                after = self.value(data["bootstrap_observ"]).float() * (1.0 - data["terminated"])
        reward = data["reward"]
        if config.normalize_reward:
            reward = self.reward_normalizer.transform(reward)
        targets = None
        if rollout:
            # Next state: the next stored one, or at a segment's end the one stored with it.
            next_value = torch.where(data["ends"], after,
                                     torch.cat([value[:, 1:], after[:, -1:]], 1))
            if config.value_targets == "vtrace":  # (log_rho 0 without lag: n-step returns)
                log_rho = data.get("log_rho", torch.zeros_like(reward))
                targets, advantage = vtrace(log_rho, reward, value, next_value, data["ends"],
                                            config.discount, valid=mask)
            else:  # (the memory's invalid steps end their segments: nothing to mask there)
                advantage = gae(reward, value, next_value, data["ends"], config.discount,
                                lambda_, valid=None if rollout_data is None else mask)
        else:
            advantage = generalized_advantage(reward, value, length, config.discount, lambda_,
                                              after)
        weight = data.get("behaviour_weight")
        data = {name: data[name] for name in self.memory.step_fields}
        data["returns"] = advantage + value if targets is None else targets
        if config.value_clip is not None:
            data["old_value"] = value
        if config.advantage_normalization == "update":
            mean, std = self._advantage_moments(advantage[mask])
            data["advantage"] = (advantage - mean) / (std + 1e-8) * mask
        else:  # ("minibatch": in each gradient step)
            data["advantage"] = advantage * mask
        if weight is not None and targets is None:  # (older weights: see learn; V-trace's
            # advantages carry the truncated weight already)
            if config.advantage_normalization == "minibatch":
                data["advantage_weight"] = weight  # (after the minibatch's normalisation)
            else:
                data["advantage"] = data["advantage"] * weight
        return data, mask

    def _advantage_moments(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and (unbiased) std of the update's advantages ``valid`` ``(K,)``; with several
        learners, of all learners' advantages."""
        if self.learners is None:
            if valid.numel() < 2:  # (no spread to divide by: centred, not scaled)
                return (valid.mean() if valid.numel() else valid.new_zeros(()),
                        valid.new_ones(()))
            return valid.mean(), valid.std()
        # (in float64: far from zero, float32's sum of squares cancels)
        dtype, valid = valid.dtype, valid.double()
        sums = self.learners.sum(torch.stack([valid.new_tensor(valid.numel()), valid.sum(),
                                              valid.square().sum()]))
        count, total, squares = sums
        mean = total / count
        variance = (squares - count * mean * mean) / (count - 1).clamp(min=1)
        return mean.to(dtype), variance.clamp(min=0).sqrt().to(dtype)

    def _merge_statistics(self) -> None:
        """Give this learner's normalisers the statistics of every learner's data."""
        if self.normalizes_observ:
            self._merged["observ"] = self.learners.merge(self.observ_normalizer,
                                                         self._merged["observ"])
        self._merged["reward"] = self.learners.merge(self.reward_normalizer,
                                                     self._merged["reward"])

    # -- several learners ------------------------------------------------------------

    def learner_support(self, learners: int) -> str | None:
        """Why this instance cannot be one of ``learners`` learners, or ``None`` (its
        config's ``learner_support``)."""
        return self.config.learner_support(learners)

    def synchronize(self) -> None:
        """Merge every learner's normaliser statistics (a collective: all learners call it);
        the trainer does before each checkpoint, which then holds them all."""
        self._merge_statistics()

    def join_learners(self, learners: LearnerGroup, preemption: float | None = None) -> None:
        """Learn as one of ``learners``: gradients averaged over them after every backward
        pass, normaliser statistics merged before every update, advantages normalised
        (``advantage_normalization = "update"``; ``"minibatch"`` normalises each learner's
        share of a minibatch) and the KL penalty adapted over all learners' data, and
        ``minibatch_size`` (or
        ``batch_size``) split among them. Call on every learner before training.

        ``preemption`` (DD-PPO's threshold, in (0, 1)): once ``ceil(preemption * M)``
        learners collected their whole rollout, the others end theirs at their next step
        (if they hold ``PREEMPT_FEWEST`` of it). Every learner still takes
        the same gradient steps: a shorter rollout fills fewer of its minibatches' rows."""
        reason = self.learner_support(learners.size)
        if reason is not None:
            raise ValueError(reason)
        self.learners = learners
        if preemption is not None:
            self._preempt_count = preemption_count(preemption, learners.size)
            self._preempt_steps = math.ceil(
                self.memory.num_agents * self.memory.length * PREEMPT_FEWEST)

    def _layout(self, data: dict[str, torch.Tensor], mask: torch.Tensor
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The rows that minibatches are drawn from, ``(R, C, ...)``, and their mask:
        every valid step with ``minibatch_size`` (``C = 1``); chunks of
        ``chunk_length`` steps for recurrent policies (each starting from the state
        stored at its first step); else whole sequences (episodes or rollouts).
        """
        chunk = self.config.chunk_length
        if self.config.minibatch_size is not None:
            if self.learners is not None:  # every step, the invalid ones masked: all learners
                # take the same gradient steps however many steps a reset dropped
                return ({name: value.flatten(0, 1).unsqueeze(1)
                         for name, value in data.items()}, mask.reshape(-1, 1))
            return ({name: value[mask].unsqueeze(1) for name, value in data.items()},
                    mask.new_ones(int(mask.sum()), 1))
        if self.state_size == 0 or chunk is None:
            return data, mask
        steps = mask.shape[1]
        padded = -(-steps // chunk) * chunk
        result = {}
        for name, value in data.items():
            pad = value.new_zeros((value.shape[0], padded - steps, *value.shape[2:]))
            value = torch.cat([value, pad], 1)
            result[name] = value.reshape(value.shape[0] * padded // chunk, chunk, *value.shape[2:])
        chunk_mask = torch.cat([mask, mask.new_zeros(mask.shape[0], padded - steps)], 1)
        chunk_mask = chunk_mask.reshape(-1, chunk)
        keep = chunk_mask.any(1)
        return {name: value[keep] for name, value in result.items()}, chunk_mask[keep]

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The precision of the networks' forward passes in updates (``precision``)."""
        if self.precision == "bfloat16":
            return torch.autocast(self.device.type, torch.bfloat16)
        return contextlib.nullcontext()

    def _infer(self, observ: torch.Tensor, state: torch.Tensor, deterministic: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The actor at ``precision``: ``(action, mean_or_logits, log_std, state)``, the
        floating ones float32 whatever the precision."""
        if self._cast_policy is None:
            return self._act(observ, state, deterministic)
        self._cast_policy.current()  # (the policy's weights, cast when they changed)
        with self._autocast():
            action, mean_or_logits, log_std, state = self._act(observ, state, deterministic)
        if action.is_floating_point():
            action = action.float()
        return action, mean_or_logits.float(), log_std.float(), state.float()

    def _distributions(self, batch: dict[str, torch.Tensor],
                       features: torch.Tensor | None = None
                       ) -> tuple[Distribution, Distribution]:
        """The current policy's and the acting policy's action distributions at ``batch``'s
        steps ``(R, C)``, the current one's from the state stored at each row's first step
        (from the shared torso's ``features`` of ``batch["observ"]`` when given)."""
        state = batch["state"][:, 0]
        with self._autocast():
            if features is None:
                mean_or_logits, log_std, _ = self.policy(batch["observ"], state)
            else:
                mean_or_logits, log_std, _ = self.policy.from_features(features, state)
        return (self.distribution(mean_or_logits.float(), log_std.float()),
                self.distribution(batch["mean_or_logits"], batch["log_std"]))

    def _policy_loss(self, batch: dict[str, torch.Tensor], mask: torch.Tensor,
                     features: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective's loss at ``batch`` (with the entropy bonus) and its terms to log."""
        config = self.config
        new, old = self._distributions(batch, features)
        advantage = batch["advantage"]
        if config.advantage_normalization == "minibatch":
            count = mask.sum()
            mean = masked_mean(advantage, mask)
            variance = ((advantage - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1)
            advantage = (advantage - mean) / (variance.sqrt() + 1e-8) * mask
            if "advantage_weight" in batch:
                advantage = advantage * batch["advantage_weight"]
        loss, terms = self.objective(new, old, batch["action"], advantage, mask)
        if config.entropy_coef:
            bonus, _ = entropy_bonus(new, mask, config.entropy_coef)
            loss = loss + bonus
            terms = {**terms, "entropy_bonus": bonus}
        return loss, terms

    def _value_loss(self, batch: dict[str, torch.Tensor], mask: torch.Tensor,
                    features: torch.Tensor | None = None) -> torch.Tensor:
        """The value network's loss against the returns at ``batch``, times ``value_coef``
        (clipped around the values before the update with ``value_clip``)."""
        config = self.config
        with self._autocast():
            value = (self.value(batch["observ"]) if features is None
                     else self.value.from_features(features))
        loss = value_loss(value.float(), batch["returns"], mask, batch.get("old_value"),
                          config.value_clip)
        return loss if config.value_coef == 1.0 else config.value_coef * loss

    def _gradient_step(self, loss: torch.Tensor, modules: tuple[nn.Module, ...],
                       optimizers: tuple[torch.optim.Optimizer | None, ...],
                       norm: bool = False) -> torch.Tensor | None:
        """One Adam step on ``loss``, the gradient of ``modules`` clipped to
        ``max_grad_norm``; returns the norm before clipping (a scalar tensor on the device)
        when measured (``norm`` or clipping)."""
        for optimizer in optimizers:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.learners is not None:
            self.learners.average_gradients(
                p for module in modules for p in module.parameters())
        grad_norm = None
        if norm or self.config.max_grad_norm:
            parameters = {id(p): p for module in modules for p in module.parameters()}
            grad_norm = nn.utils.clip_grad_norm_(
                list(parameters.values()), self.config.max_grad_norm or float("inf"))
        for optimizer in optimizers:
            if optimizer is not None:
                optimizer.step()
        return grad_norm

    def _policy_step(self, batch: dict[str, torch.Tensor], mask: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """One gradient step of the policy: its loss, terms and gradient norm."""
        loss, terms = self._policy_loss(batch, mask)
        grad_norm = self._gradient_step(loss, (self.policy,), (self.policy_optimizer,),
                                        norm=True)
        return loss, terms, grad_norm

    def _value_step(self, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """One gradient step of the value network; returns its loss."""
        with torch.enable_grad():  # (grad mode is per thread)
            loss = self._value_loss(batch, mask)
            self._gradient_step(loss, (self.value,), (self.value_optimizer,))
        return loss

    def _joint_step(self, batch: dict[str, torch.Tensor], mask: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """One gradient step of networks that share a torso, on the sum of both losses:
        the policy's loss, terms and gradient norm (of both networks), and the value loss."""
        features = None
        if self._torso is not None:  # once for both networks
            with self._autocast():
                features = self._torso(batch["observ"])
        loss, terms = self._policy_loss(batch, mask, features)
        values = self._value_loss(batch, mask, features)
        grad_norm = self._gradient_step(loss + values, (self.policy, self.value),
                                        (self.policy_optimizer, self.value_optimizer),
                                        norm=True)
        return loss, terms, grad_norm, values

    def _both_steps(self, batch: dict[str, torch.Tensor], mask: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The policy's and the value network's gradient steps with one all-reduce of both
        gradients (several learners; the networks share nothing, so each step is what
        ``_policy_step`` and ``_value_step`` take): as ``_joint_step`` returns."""
        loss, terms = self._policy_loss(batch, mask)
        values = self._value_loss(batch, mask)
        for optimizer in (self.policy_optimizer, self.value_optimizer):
            optimizer.zero_grad(set_to_none=True)
        (loss + values).backward()  # (each network's gradient is its own loss's)
        self.learners.average_gradients(
            p for network in (self.policy, self.value) for p in network.parameters())
        limit = self.config.max_grad_norm or float("inf")
        grad_norm = nn.utils.clip_grad_norm_(list(self.policy.parameters()), limit)
        if self.config.max_grad_norm:
            nn.utils.clip_grad_norm_(list(self.value.parameters()), limit)
        self.policy_optimizer.step()
        self.value_optimizer.step()
        return loss, terms, grad_norm, values

    def update(self, rollout_data: dict[str, torch.Tensor] | None = None) -> Summary:
        """Learn from the episodes (or the rollout) in memory, or from ``rollout_data`` (see
        ``learn``); returns the summary. Runs with gradients on, even when called under
        ``no_grad``.

        Threads: with ``update_threads=None`` (the default), on the CPU with two or more
        usable cores, each minibatch's policy step and value step run side by side in two
        threads of one torch thread each. The two networks share nothing, so the result is
        bit-identical to ``update_threads=1`` on any number of cores, and no thread
        busy-waits for a core that another run or program holds (as split operations do).
        ``update_threads=N`` runs the steps one after the other with N torch threads each,
        for networks large enough that splitting every operation pays. Networks that share a
        torso (such as a convolutional one) take one joint step on the sum of both losses
        instead, with ``update_threads`` torch threads (``None``: one per usable core, so that
        their results depend on the number of cores; set it to compare runs across machines).
        """
        threads = torch.get_num_threads()
        # (not with several learners: two threads' all-reduces could interleave)
        side_by_side = (self.config.update_threads is None and self.device.type == "cpu"
                        and usable_cores() > 1 and not self.shared_torso
                        and self.learners is None)
        default = usable_cores() if self.shared_torso and self.device.type == "cpu" else 1
        torch.set_num_threads(self.config.update_threads or default)
        try:
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                # Leaving the pool waits for its step, also when the policy step raised.
                pool = stack.enter_context(ThreadPoolExecutor(
                    1, "batchrl-value", torch.set_num_threads, (1,))) if side_by_side else None
                return self._update(pool, rollout_data)
        finally:
            torch.set_num_threads(threads)

    def _anneal(self) -> float:
        """Set both learning rates for the coming update to a fraction of the configured
        ones, and return it: ``1 - steps / total_steps`` with the ``linear`` schedule,
        ``steps`` counting the env steps before this update's data."""
        config = self.config
        if config.lr_schedule == "constant":
            return 1.0
        fraction = max(0.0, 1.0 - self.updated_steps / self.total_steps)
        for optimizer, rate in ((self.policy_optimizer, config.policy_lr),
                                (self.value_optimizer, config.value_lr)):
            for group in optimizer.param_groups:
                group["lr"] = rate * fraction
        return fraction

    def _update(self, pool: ThreadPoolExecutor | None,
                rollout_data: dict[str, torch.Tensor] | None) -> Summary:
        config = self.config
        lr_fraction = self._anneal()
        summary = {}
        if self.learners is not None:  # every learner normalises with everyone's statistics
            self._merge_statistics()
            # The run's steps in this rollout: the learners' own (which preemption can make
            # differ) summed, the same on each.
            collected = float(self.learners.sum(torch.tensor(float(self.memory.stored),
                                                             device=self.device)))
            self.env_steps = self.updated_steps + int(collected)
            summary["learners/collected"] = collected / (self.memory.num_agents
                                                         * self.memory.length
                                                         * self.learners.size)
        with torch.no_grad():
            data, valid = self._advantages(rollout_data)
        batches, mask = self._layout(data, valid)
        mask = mask.float()
        rows = mask.shape[0]
        if rows == 0:  # restarts lost every step of the rollout: nothing to learn from
            return self._updated(summary, lr_fraction)
        size = config.minibatch_size or config.batch_size or rows
        if self.learners is not None and (config.minibatch_size or config.batch_size):
            size //= self.learners.size  # a gradient step's batch is over all learners
        # Each gradient step's loss, value loss, gradient norm and terms, read once after the
        # loop: a read per step would make the host wait for a GPU at every step instead of
        # queueing the next one.
        names: list[str] = []
        read: list[torch.Tensor] = []
        for _ in range(config.update_epochs):
            order = torch.randperm(rows, device=self.device)
            for start in range(0, rows, size):  # every row once per epoch
                # May raise (Ctrl-C): the trainer discards the half-updated state.
                self.check_interrupt()
                picked = order[start:start + size]
                batch = {name: value[picked] for name, value in batches.items()}
                batch_mask = mask[picked]
                if self.shared_torso:
                    policy_loss, terms, grad_norm, values = self._joint_step(batch, batch_mask)
                elif self.learners is not None:
                    policy_loss, terms, grad_norm, values = self._both_steps(batch, batch_mask)
                elif pool is None:
                    policy_loss, terms, grad_norm = self._policy_step(batch, batch_mask)
                    values = self._value_step(batch, batch_mask)
                else:  # the networks share nothing: the same result as one after the other
                    value_step = pool.submit(self._value_step, batch, batch_mask)
                    policy_loss, terms, grad_norm = self._policy_step(batch, batch_mask)
                    values = value_step.result()
                step = {"policy_loss": policy_loss, "value_loss": values,
                        "grad_norm": grad_norm, **terms}
                names = list(step)
                read.append(torch.stack([term.detach() for term in step.values()]))

        steps = torch.stack(read)
        if self.learners is not None:  # (the losses of every learner's share, not this one's)
            steps = self.learners.mean(steps)
        totals = [0.0] * len(names)
        for row in steps.tolist():  # (summed in this order, as floats)
            totals = [total + value for total, value in zip(totals, row)]
        summary.update({f"ppo/{name}": total / len(read) for name, total in zip(names, totals)})
        summary["ppo/total_loss"] = summary["ppo/policy_loss"] + summary["ppo/value_loss"]
        with torch.no_grad():  # the updated networks on every row (a shared torso runs once)
            features = None
            if self._torso is not None:
                with self._autocast():
                    features = self._torso(batches["observ"])
            new, old = self._distributions(batches, features)
            summary.update({f"ppo/{name}": value for name, value in self.objective.end_update(
                new, old, batches["action"], batches["advantage"], mask,
                None if self.learners is None else self.learners.mean).items()})
            with self._autocast():
                value = (self.value(batches["observ"]) if features is None
                         else self.value.from_features(features))
            valid_rows = mask.bool()
            returns = batches["returns"][valid_rows]
            residual = returns - value.float()[valid_rows]
            if self.learners is not None:
                explained = self._explained_variance_of_all(returns, residual)
                if explained is not None:
                    summary["ppo/explained_variance"] = explained
            elif len(returns) > 1:  # (a variance needs two)
                summary["ppo/explained_variance"] = 1.0 - float(residual.var()
                                                                / (returns.var() + 1e-8))
        return self._updated(summary, lr_fraction)

    def _explained_variance_of_all(self, returns: torch.Tensor, residual: torch.Tensor
                                   ) -> float | None:
        """The explained variance over every learner's valid steps (``returns`` and the value's
        ``residual``, ``(K,)`` each on this one; a collective), from their pooled moments;
        ``None`` for fewer than two steps in all."""
        returns, residual = returns.double(), residual.double()  # (sums of squares cancel)
        moments = torch.stack([returns.new_tensor(float(len(returns))), returns.sum(),
                               returns.square().sum(), residual.sum(), residual.square().sum()])
        count, total, squares, errors, error_squares = self.learners.sum(moments).tolist()
        if count < 2:
            return None
        returns_var = (squares - total * total / count) / (count - 1)
        residual_var = (error_squares - errors * errors / count) / (count - 1)
        return 1.0 - residual_var / (returns_var + 1e-8)

    def _updated(self, summary: Summary, lr_fraction: float) -> Summary:
        """Count the update (its rollout is used up) in ``summary``."""
        self.updates += 1
        self.updated_steps = self.env_steps
        summary["ppo/updates"] = float(self.updates)
        if self.config.lr_schedule != "constant":
            summary["ppo/lr_fraction"] = lr_fraction
        return summary

    # -- decoupled collection ----------------------------------------------------------

    @property
    def rollout_length(self) -> int:
        """Steps per collector rollout: ``rollout_length``, or with whole-episode updates
        ``max_length`` (episodes cut at a rollout's end bootstrap from the value)."""
        return self.config.rollout_length or self.max_length

    def collector_support(self) -> str | None:
        if self.state_size:
            return ("BatchPPO with network='recurrent' cannot run with collectors: rollouts "
                    "carry no recurrent state; use network='feed_forward'")
        return super().collector_support()

    def behaviour_fields(self) -> Fields:
        """The acting policy's distribution parameters, per step."""
        return dict(self._behaviour)

    @torch.no_grad()
    def act(self, observ: torch.Tensor, deterministic: bool = False
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Actions for ``observ`` ``(K, *obs_shape)`` with the current observation statistics,
        and the policy's ``mean_or_logits`` and ``log_std`` that chose them."""
        self._check_decoupled()
        count = first_leaf(observ).shape[0]
        state = self._no_state if count == self.num_agents else self._no_state[:count]
        if count > self.num_agents:
            state = self._no_state.new_zeros(count, 0)
        action, mean_or_logits, log_std, _ = self._infer(self._normalize(observ), state,
                                                         deterministic)
        return action, {"mean_or_logits": mean_or_logits, "log_std": log_std}

    def acting_state(self) -> dict[str, torch.Tensor]:
        """Copies of the policy's weights (``policy.*``) and of the observation statistics
        (``observ_normalizer.*``)."""
        return modules_state(self._acting_modules())

    def load_acting_state(self, state: dict[str, torch.Tensor]) -> None:
        load_modules_state(state, self._acting_modules())

    def _acting_modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy, "observ_normalizer": self.observ_normalizer}

    def _check_decoupled(self) -> None:
        if self.state_size:  # (act and learn would hand the GRU no state)
            raise NotImplementedError(self.collector_support())

    def learn(self, rollout: Rollout) -> Summary:
        """One update (``update_epochs`` epochs of minibatches) on ``rollout``, whose rows are
        the ``num_agents`` agents. The reward statistics take in the rollout first, the
        observation statistics after its data is normalised (as ``perform`` does).

        The rollout may come from older weights (the behaviour policy ``mu``, recorded per
        step). The objective's ratio and KL penalty are taken against the policy as it is at
        the start of this update (the proximal policy ``pi_0``), so that the penalty bounds the
        update's own step whatever the lag; each step's advantage is weighted by
        ``min(1, pi_0(a|s) / mu(a|s))``, IMPALA's truncated importance weight, to correct for
        the data coming from ``mu``. Without lag the weight is 1 and this is the synchronous
        update. With ``value_targets="vtrace"`` the value targets and advantages are V-trace's
        (``rho = pi_0 / mu``), which carry that weight themselves (NAPPO's IMPALA-PPO)."""
        self._check_decoupled()
        with torch.no_grad():
            rollout = rollout.to(self.device)
            batch, steps = rollout.size, rollout.length
            observ = rollout.observ.reshape(batch, steps + 1, -1)
            if not (self.pixels or self.packing):  # (packed rows stay bytes)
                observ = observ.to(torch.float32)
            valid = rollout.valid
            self._learn_rewards(rollout)
            self.env_steps += batch * steps
            last = torch.zeros_like(valid)
            last[:, -1] = True
            ends = rollout.done.bool() | last
            bootstrap = rollout.next_observ(ends)
            bootstrap = bootstrap.reshape(bootstrap.shape[0], -1)
            if not (self.pixels or self.packing):
                bootstrap = bootstrap.to(torch.float32)
            normalized = self._normalize(observ[:, :steps].reshape(batch * steps, -1)
                                         ).reshape(batch, steps, -1)
            state = observ.new_zeros(batch, steps, 0, dtype=torch.float32)
            with self._autocast():
                mean_or_logits, log_std, _ = self.policy(normalized, state[:, 0])
            mean_or_logits, log_std = mean_or_logits.float(), log_std.float()
            # Copies in the memory's layout ((B, T, ...), an empty log_std for a categorical):
            # a state-independent log_std is a view of the parameter the update changes.
            log_std = log_std.expand(batch, steps, *rollout.behaviour["log_std"].shape[2:])
            mean_or_logits, log_std = mean_or_logits.detach().clone(), log_std.detach().clone()
            proximal = self.distribution(mean_or_logits, log_std)
            behaviour = self.distribution(rollout.behaviour["mean_or_logits"],
                                          rollout.behaviour["log_std"])
            log_ratio = proximal.log_prob(rollout.action) - behaviour.log_prob(rollout.action)
            data = {"observ": normalized, "action": rollout.action, "reward": rollout.reward,
                    "mean_or_logits": mean_or_logits, "log_std": log_std,
                    "behaviour_weight": log_ratio.exp().clamp(max=1.0), "log_rho": log_ratio,
                    "state": state, "valid": valid,
                    "ends": ends, "bootstrap_observ": self._normalize(bootstrap),
                    "terminated": rollout.terminated[ends]}
            # Only now, as perform() does: the data was normalised as the weights that acted
            # on it (without lag) normalised it.
            if self.normalizes_observ:
                self.observ_normalizer.update(self._statistics_input(observ[:, :steps][valid]))
        summary = self.update(data)
        if valid.any():
            summary["ppo/importance_weight"] = float(data["behaviour_weight"][valid].mean())
        return summary

    def _learn_rewards(self, rollout: Rollout) -> None:
        """Update the reward statistics with the rollout's rewards, or with each agent's
        running discounted return (``reward_scale="return"``), carried across rollouts."""
        reward = rollout.reward
        if self.config.reward_scale != "return":
            self.reward_normalizer.update(reward[rollout.valid])
            return
        # running_t = reward_t + discount * running_{t-1}, restarted after an episode's end:
        # the reversed sequence is a discounted sum (the agent's carried return in front).
        discount = self.config.discount
        agents = rollout.agents
        carried = torch.cat([self.running_return[agents][:, None], reward], 1)
        first = torch.zeros_like(reward[:, :1])
        # links[i]: the factor of entry i - 1 in entry i (none for the carried return)
        links = torch.cat([first, first + discount,
                           discount * (1.0 - rollout.done[:, :-1])], 1)
        running = discounted_cumsum(carried.flip(1), links.flip(1)).flip(1)[:, 1:]
        self.reward_normalizer.update(running[rollout.valid])
        # (an agent twice in one batch keeps its later row's return)
        self.running_return[agents] = running[:, -1] * (1.0 - rollout.done[:, -1])

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config),
                "policy": self.policy.state_dict(), "value": self.value.state_dict(),
                "policy_optimizer": self.policy_optimizer.state_dict(),
                "value_optimizer": self.value_optimizer.state_dict(),
                "observ_normalizer": self.observ_normalizer.state_dict(),
                "reward_normalizer": self.reward_normalizer.state_dict(),
                "objective": self.objective.state_dict(), "updates": self.updates,
                "env_steps": self.env_steps, "updated_steps": self.updated_steps,
                "recurrent_state": self.recurrent_state, "running_return": self.running_return,
                "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.value.load_state_dict(state["value"])
        # Adam keeps the moment tensors it is given: copy, so two loaded algorithms never share.
        self.policy_optimizer.load_state_dict(copy.deepcopy(state["policy_optimizer"]))
        self.value_optimizer.load_state_dict(copy.deepcopy(state["value_optimizer"]))
        self.observ_normalizer.load_state_dict(state["observ_normalizer"])
        self.reward_normalizer.load_state_dict(state["reward_normalizer"])
        if "objective" in state:
            self.objective.load_state_dict(state["objective"])
        else:  # (checkpoints of earlier versions hold the KL penalty's beta alone)
            self.objective.load_state_dict({"beta": state["kl_penalty"]})
        self.updates = int(state["updates"])
        # (checkpoints of earlier versions lack the schedule's counters)
        self.env_steps = int(state.get("env_steps", 0))
        self.updated_steps = int(state.get("updated_steps", 0))
        self.recurrent_state.copy_(state["recurrent_state"])
        if "running_return" in state:  # (checkpoints of earlier versions lack it)
            self.running_return.copy_(state["running_return"])
        self.memory.load_state_dict(state["memory"])
        # Every learner loads the same merged statistics: its own additions start from them.
        self._merged = {"observ": self.observ_normalizer.statistics(),
                        "reward": self.reward_normalizer.statistics()}
