"""IMPALA: an actor-critic that learns from fixed-length rollouts with V-trace targets.

Espeholt et al. (2018): actors step their envs with a copy of the policy and send rollouts of
``T`` steps; the learner takes a gradient step on each batch of them. The policy that acted may
lag behind the learner's by several updates, and V-trace (``batchrl.parts.vtrace``) corrects for
that from the log-probabilities the actors recorded. As a ``RolloutAlgorithm`` this runs in the
synchronous loop (then the lag is zero unless ``update_steps > 1``) and with collector processes
alike. A learning step on a rollout:

1. merge the rollout's discounted returns into the reward scale;
2. the values ``V(x_0 .. x_T)``, and of the final observation where a time limit ended an
   episode (zero after a terminal state);
3. V-trace targets ``vs`` and advantages from the learner's log-probabilities of the actions;
4. one gradient step on ``actor_critic_loss`` (``update_steps`` of them), the gradient of the
   policy and of the value network clipped each to ``max_grad_norm`` (together when they
   share a torso);
5. merge the rollout's observations into the normaliser. The steps before used the statistics
   the rollout was acted with (in the synchronous loop; a collector's may be older), so that
   on the learner's own rollout the first step is exactly on-policy.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict
from typing import Any

import gymnasium as gym
import torch
from torch import nn

from batchrl.algos.base import Summary, load_modules_state, modules_state
from batchrl.algos.impala_config import IMPALAConfig
from batchrl.algos.networks import (FeedForwardBody, Policy, actor_critic, build_torsos,
                                    torso_shared_by)
from batchrl.algos.rollout import RolloutAlgorithm
from batchrl.errors import UnsupportedSpaceError
from batchrl.parts.losses import action_distribution, actor_critic_loss, masked_mean
from batchrl.parts.normalize import StreamingNormalizer
from batchrl.parts.packing import check_observation_space, packing_for
from batchrl.parts.returns import discounted_cumsum
from batchrl.parts.rollout import Fields, Rollout
from batchrl.parts.vtrace import vtrace
from batchrl.pixels import is_pixel_space

__all__ = ["IMPALA", "IMPALAConfig"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class IMPALA(RolloutAlgorithm):
    """IMPALA with policy and value networks (on one torso with ``shared_torso``), for a batch
    of ``num_agents`` envs.

    Args:
      observation_space: a Box space (observations are flattened): float32, normalised with
        running statistics if ``normalize_observ``; or ``uint8`` pixels, kept as bytes and
        scaled to ``[0, 1]`` by the networks' torso (``torso``). Dict and Tuple observations
        are packed as BatchPPO packs them (``PackedObservations``, ``PackedTorso``).
      action_space: Box (Gaussian policy, 1-D) or Discrete (categorical policy).
      num_agents: the batch size N of the env.
      config: hyperparameters (``IMPALAConfig``); or give them as keyword arguments (any
        ``IMPALAConfig`` field), as ``train.py`` does with a config's ``[algorithm]`` section.
      device: where networks, statistics and the rollout live.
      max_length: the episode time limit; not needed (rollouts have a fixed length, whatever
        the episodes'), taken because the trainer passes it to a constructor with ``**options``.
      total_steps: the run's training env steps, over which ``lr_schedule="linear"`` decays
        the learning rate (``train.py`` passes ``train.steps``).
      eval_actions: ``"mean"`` (evaluation takes the most likely or mean action) or
        ``"sample"`` (``train.eval_actions``).
    """

    config_class = IMPALAConfig
    # state_dict() entries sized by num_agents: the running rollout and returns.
    per_agent_state = ("rollout", "running_return")

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 config: IMPALAConfig | None = None, device: str | torch.device = "cpu",
                 max_length: int | None = None, total_steps: int | None = None,
                 eval_actions: str = "mean", **options: Any):
        if config is not None and options:
            raise TypeError(f"IMPALA takes an IMPALAConfig or keyword arguments, not both "
                            f"(got config and {sorted(options)})")
        config = config or IMPALAConfig(**options)
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps must be >= 1 or None, got {total_steps}")
        if config.lr_schedule == "linear" and total_steps is None:
            raise ValueError("lr_schedule='linear' needs total_steps, the env steps over which "
                             "the learning rate decays to zero (train.py sets it to train.steps)")
        check_observation_space(observation_space, "IMPALA")
        discrete = isinstance(action_space, gym.spaces.Discrete)
        if not discrete and not (isinstance(action_space, gym.spaces.Box)
                                 and len(action_space.shape) == 1):
            raise UnsupportedSpaceError(f"IMPALA supports Discrete and 1-D Box action spaces, "
                                        f"got {action_space}")
        super().__init__(observation_space, action_space, num_agents, config.rollout_length,
                         device, eval_actions)
        self.config, self.total_steps, self.discrete = config, total_steps, discrete
        self.pixels = is_pixel_space(observation_space)
        # Dict and Tuple observations: packed uint8 rows (as the rollouts hold them).
        self.packing = packing_for(observation_space)
        self.obs_size = (self.packing.size if self.packing
                         else math.prod(observation_space.shape))
        policy, value = self.build_networks(self.obs_size, action_space)
        self.policy, self.value = policy.to(self.device), value.to(self.device)
        # (a shared torso's parameters once)
        parameters = list({id(p): p for p in [*self.policy.parameters(),
                                              *self.value.parameters()]}.values())
        self.shared_torso = len(parameters) < (len(list(self.policy.parameters()))
                                               + len(list(self.value.parameters())))
        self._parameters = parameters
        self._torso = torso_shared_by(self.policy, self.value)  # computed once per step
        if config.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.Adam(
                parameters, lr=config.learning_rate, eps=config.epsilon)
        else:
            self.optimizer = torch.optim.RMSprop(parameters, lr=config.learning_rate,
                                                 alpha=0.99, eps=config.epsilon)
        self.observ_normalizer = StreamingNormalizer(
            (self.packing.float_size if self.packing else self.obs_size,), center=True,
            scale=True, clip=5.0).to(self.device)
        # Rewards are divided by the std of the discounted returns (unit-scale value targets).
        self.return_normalizer = StreamingNormalizer(
            (), center=False, scale=True, clip=10.0).to(self.device)
        self.running_return = torch.zeros(num_agents, device=self.device)
        self.learned_steps = 0  # env steps learned from: the clock of the lr schedule
        self._no_state = torch.zeros(0, device=self.device)  # feed-forward policies carry none

    def build_networks(self, obs_size: int, action_space: gym.Space
                       ) -> tuple[Policy, nn.Module]:
        """The policy (``Policy``: ``(observ (..., obs_size), state)`` ->
        ``(mean_or_logits, log_std, state)``) and the value network (``(..., obs_size)`` ->
        ``(...)``), from the config. Override to build others (feed-forward ones)."""
        config = self.config
        torso, value_torso = build_torsos(config.torso, self.observation_space,
                                          config.shared_torso)
        body = FeedForwardBody(obs_size, config.policy_layers, config.activation, torso)
        return actor_critic(body, obs_size, action_space, config.value_layers, config.activation,
                            config.init, config.init_std, config.init_output_factor,
                            value_torso)

    # -- acting ---------------------------------------------------------------------------

    def _features(self, observ: torch.Tensor, batch_dims: int) -> torch.Tensor:
        """``(*batch, *obs_shape)`` observations of any dtype -> ``(*batch, obs_size)`` on
        ``device``: ``uint8`` pixels as they are (the torso scales them), else float32,
        normalised when the config says so."""
        if self.packing is not None:
            if not isinstance(observ, torch.Tensor):  # (act: a dict or tuple of parts)
                observ = self.packing.pack_all(observ)
            observ = observ.to(self.device, torch.uint8).reshape(*observ.shape[:batch_dims],
                                                                 self.obs_size)
            if self.config.normalize_observ:
                observ = self.packing.with_floats(observ, self.observ_normalizer.transform(
                    self.packing.unpack(observ)))
            return observ
        if self.pixels:
            return observ.to(self.device, torch.uint8).reshape(*observ.shape[:batch_dims],
                                                               self.obs_size)
        observ = observ.to(self.device, torch.float32).reshape(
            *observ.shape[:batch_dims], self.obs_size)
        if self.config.normalize_observ:
            observ = self.observ_normalizer.transform(observ)
        return observ

    def behaviour_fields(self) -> Fields:
        return {"log_prob": ((), torch.float32)}

    @torch.no_grad()
    def act(self, observ: torch.Tensor, deterministic: bool = False
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Actions ``(K,)`` int64 (Discrete) or ``(K, A)`` float32 (Box) for ``observ``
        ``(K, *obs_shape)``, and ``{"log_prob": (K,) float32}``, their log-probability under
        the policy. Sampled with torch's global RNG; ``deterministic``: the most likely action
        (the mean)."""
        mean_or_logits, log_std, _ = self.policy(self._features(observ, 1), self._no_state)
        if self.discrete:
            log_probs = torch.log_softmax(mean_or_logits, -1)
            action = (log_probs.argmax(-1) if deterministic
                      else torch.multinomial(log_probs.exp(), 1).squeeze(-1))
            log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        else:
            noise = (torch.zeros_like(mean_or_logits) if deterministic
                     else torch.randn_like(mean_or_logits))
            action = mean_or_logits + log_std.exp() * noise
            log_prob = (-0.5 * noise.square() - log_std - _LOG_SQRT_2PI).sum(-1)
        return action, {"log_prob": log_prob}

    def acting_state(self) -> dict[str, torch.Tensor]:
        """Copies of the policy's weights (``policy.*``) and of the observation statistics
        (``observ_normalizer.*``)."""
        return modules_state(self._acting_modules())

    def load_acting_state(self, state: dict[str, torch.Tensor]) -> None:
        load_modules_state(state, self._acting_modules())

    def _acting_modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy, "observ_normalizer": self.observ_normalizer}

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        # A reset between rollouts leaves no step to mark the cut on: the running return of
        # the agents' old episodes must not carry into their new ones. (Inside a rollout the
        # cut marks the last step, where _scale_reward restarts the return.)
        if self.training and not self.buffer.step:
            self.running_return[agent_indices] = 0.0
        return super().begin_episodes(agent_indices)

    # -- learning -------------------------------------------------------------------------

    def _scale_reward(self, rollout: Rollout) -> torch.Tensor:
        """The rollout's rewards ``(B, T)`` divided by the running std of the agents' discounted
        returns, which this first updates with the returns of the rollout's valid steps."""
        gamma = self.config.discount
        reward, done = rollout.reward, rollout.done
        # G_t = r_t + gamma (1 - done_{t-1}) G_{t-1}, continued from the agent's previous
        # rollout: the backward recursion of discounted_cumsum on the time-reversed rollout.
        carried = self.running_return[rollout.agents]
        first = reward[:, :1] + gamma * carried[:, None]
        values = torch.cat([first, reward[:, 1:]], 1)
        factors = torch.cat([torch.zeros_like(done[:, :1]), gamma * (1.0 - done[:, :-1])], 1)
        returns = discounted_cumsum(values.flip(1), factors.flip(1)).flip(1)
        self.running_return[rollout.agents] = returns[:, -1] * (1.0 - done[:, -1])
        self.return_normalizer.update(returns[rollout.valid])
        return self.return_normalizer.transform(reward)

    def _anneal(self) -> float:
        """Set the learning rate for the coming step (``linear``: decayed by the env steps
        learned from so far) and return it."""
        config = self.config
        rate = config.learning_rate
        if config.lr_schedule == "linear":
            rate *= max(0.0, 1.0 - self.learned_steps / self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        return rate

    def learn(self, rollout: Rollout) -> Summary:
        """Gradient steps (``update_steps``) on the V-trace actor-critic loss of ``rollout``
        (see the module docstring); returns the ``impala/`` summary."""
        config = self.config
        rollout = rollout.to(self.device)
        steps = rollout.length
        valid, ends = rollout.valid, rollout.done.bool()
        raw = rollout.observ.reshape(rollout.size, steps + 1, self.obs_size)
        reward = self._scale_reward(rollout) if config.normalize_reward else rollout.reward
        observ = self._features(raw, 2)
        # Episodes that a time limit (or a cut) ended bootstrap from their final observation.
        bootstrap = ends & (rollout.terminated == 0)
        final_observ = self._features(rollout.final_observ[bootstrap], 1)
        rate = self._anneal()
        self.learned_steps += rollout.size * steps
        totals: dict[str, float] = {}
        with torch.enable_grad():
            for _ in range(config.update_steps):
                # May raise (Ctrl-C): the trainer discards the half-updated state.
                self.check_interrupt()
                for name, value in self._step(rollout, observ, final_observ, bootstrap,
                                              reward).items():
                    totals[name] = totals.get(name, 0.0) + value
        if config.normalize_observ and not self.pixels:  # (the policy that acted saw the
            # statistics before)
            seen = raw[:, :steps][valid]
            self.observ_normalizer.update(self.packing.unpack(seen) if self.packing is not None
                                          else seen.to(torch.float32))
        summary = {f"impala/{name}": total / config.update_steps
                   for name, total in totals.items()}
        summary["impala/lr"] = rate
        return summary

    def _step(self, rollout: Rollout, observ: torch.Tensor, final_observ: torch.Tensor,
              bootstrap: torch.Tensor, reward: torch.Tensor) -> dict[str, float]:
        """One gradient step on the loss of ``rollout``, with its normalised observations
        ``(B, T + 1, obs_size)``, the final ones ``(K, obs_size)`` of the ``bootstrap``
        ``(B, T)`` steps and the (scaled) rewards ``(B, T)``; returns the terms to log."""
        config, steps = self.config, rollout.length
        if self._torso is not None:  # the shared torso once for both networks
            features = self._torso(observ)
            mean_or_logits, log_std, _ = self.policy.from_features(features[:, :steps],
                                                                   self._no_state)
            values = self.value.from_features(features)
        else:
            mean_or_logits, log_std, _ = self.policy(observ[:, :steps], self._no_state)
            values = self.value(observ)
        distribution = action_distribution(mean_or_logits, log_std, self.discrete)
        log_prob = distribution.log_prob(rollout.action)
        valid, ends = rollout.valid, rollout.done.bool()
        with torch.no_grad():
            next_value = torch.where(ends, 0.0, values[:, 1:])
            next_value[bootstrap] = self.value(final_observ)
            log_rho = log_prob - rollout.behaviour["log_prob"]
            if config.vtrace:
                targets = vtrace(log_rho, reward, values[:, :steps], next_value, ends,
                                 config.discount, config.rho_bar, config.c_bar, valid=valid)
            else:  # on-policy n-step targets: every ratio taken as 1
                targets = vtrace(torch.zeros_like(log_rho), reward, values[:, :steps],
                                 next_value, ends, config.discount, valid=valid)
        loss, terms = actor_critic_loss(log_prob, distribution.entropy(), values[:, :steps],
                                        targets.vs, targets.pg_advantage, valid,
                                        config.baseline_cost, config.entropy_cost)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        limit = config.max_grad_norm or float("inf")
        if self.shared_torso:  # one gradient through the torso: clipped as one
            grad_norm = value_grad_norm = nn.utils.clip_grad_norm_(self._parameters, limit)
        else:
            grad_norm = nn.utils.clip_grad_norm_(list(self.policy.parameters()), limit)
            value_grad_norm = nn.utils.clip_grad_norm_(list(self.value.parameters()), limit)
        self.optimizer.step()
        with torch.no_grad():
            mask = valid.float()
            ratio = log_rho.exp()
            # The acting and the learning forward pass round differently: a ratio within
            # 1e-4 of rho_bar is not counted as truncated. Without V-trace none is truncated.
            clipped = config.rho_bar * (1.0 + 1e-4) if config.vtrace else float("inf")
            result = {name: float(term.detach()) for name, term in terms.items()}
            result.update(loss=float(loss.detach()), grad_norm=float(grad_norm),
                          value_grad_norm=float(value_grad_norm),
                          rho_mean=float(masked_mean(ratio, mask)),
                          rho_clipped=float(masked_mean((ratio > clipped).float(), mask)))
        return result

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config),
                "policy": self.policy.state_dict(), "value": self.value.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "observ_normalizer": self.observ_normalizer.state_dict(),
                "return_normalizer": self.return_normalizer.state_dict(),
                "running_return": self.running_return, "learned_steps": self.learned_steps,
                "rollout": self.rollout_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.value.load_state_dict(state["value"])
        # The optimiser keeps the moment tensors it is given: copy, so two loaded algorithms
        # never share them.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.observ_normalizer.load_state_dict(state["observ_normalizer"])
        self.return_normalizer.load_state_dict(state["return_normalizer"])
        self.running_return.copy_(state["running_return"])
        self.learned_steps = int(state["learned_steps"])
        self.load_rollout_state(state["rollout"])
