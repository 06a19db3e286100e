"""Soft actor-critic (Haarnoja et al., 2018) on batched envs: twin Q-functions with Polyak-averaged
targets, a tanh-squashed Gaussian policy and an automatically tuned entropy temperature, learning
from a replay buffer (``batchrl.parts.replay``) at a set number of gradient steps per env step.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import gymnasium as gym
import torch
from torch import nn
from torch.nn import functional as F

from batchrl.algos.base import Summary
from batchrl.algos.networks import build_torso
from batchrl.algos.ppo_config import PRECISIONS
from batchrl.algos.replay import (ReplayAlgorithm, check_buffer_size, check_hyperparameters,
                                  observation_field)
from batchrl.errors import UnsupportedSpaceError
from batchrl.parts.replay import ReplayBuffer

__all__ = ["SAC"]

LOG_STD_RANGE = (-5.0, 2.0)  # the policy's log std is squashed into it


class EnsembleMLP(nn.Module):
    """``members`` ReLU MLPs ``inputs -> *hidden -> outputs`` of the same shape, computed in one
    batched matrix product per layer: ``(B, inputs)`` -> ``(members, B, outputs)``, float32.
    Each member is initialised as ``nn.Linear`` initialises its layers. ``compute_dtype``
    (``torch.bfloat16``: cheaper matrix products on CPUs and GPUs that have them) is the
    dtype the hidden layers compute in; the output layer computes in float32 (bfloat16 keeps
    about 3 significant digits: a Q-value near 1,000 would move in steps of 8, the size of a
    reward), and the parameters stay float32."""

    compute_dtype = torch.float32

    def __init__(self, members: int, inputs: int, hidden: Sequence[int], outputs: int):
        super().__init__()
        sizes = [inputs, *hidden, outputs]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)  # (nn.Linear's kaiming_uniform(a=sqrt(5)) bound)
            self.weights.append(nn.Parameter(
                torch.empty(members, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(
                torch.empty(members, 1, fan_out).uniform_(-bound, bound)))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        x = inputs.to(dtype).unsqueeze(0).expand(len(self.weights[0]), *inputs.shape)
        last = len(self.weights) - 1
        for index, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            if index < last:
                x = F.relu(torch.baddbmm(bias.to(dtype), x, weight.to(dtype)))
            else:
                x = torch.baddbmm(bias, x.float(), weight)
        return x


class SquashedGaussian(nn.Module):
    """The policy: a ReLU MLP giving a Gaussian's mean and log std per action dimension, whose
    samples are squashed by ``tanh`` into [-1, 1]."""

    def __init__(self, inputs: int, hidden: Sequence[int], actions: int):
        super().__init__()
        self.body = EnsembleMLP(1, inputs, hidden, 2 * actions)

    def forward(self, observ: torch.Tensor, deterministic: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions ``(B, A)`` in [-1, 1] and their log-probabilities ``(B,)``."""
        mean, log_std = self.body(observ)[0].chunk(2, dim=-1)
        low, high = LOG_STD_RANGE
        log_std = low + 0.5 * (high - low) * (torch.tanh(log_std) + 1.0)
        noise = torch.zeros_like(mean) if deterministic else torch.randn_like(mean)
        raw = mean + noise * log_std.exp()
        # log N(raw) - log |d tanh(raw) / d raw|, the latter in a stable form
        log_prob = (-0.5 * noise.square() - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_prob = log_prob - (2.0 * (math.log(2.0) - raw - F.softplus(-2.0 * raw))).sum(-1)
        return torch.tanh(raw), log_prob


class SAC(ReplayAlgorithm):
    """Soft actor-critic for ``Box`` observations and actions.

    Until ``learning_starts`` env steps (all agents') it acts uniformly at random; then it
    samples its policy, and after every batch step takes ``updates_per_step`` gradient steps
    per env step (the update-to-data ratio; fractions accumulate), each on ``batch_size``
    transitions drawn from the replay buffer: both critics on the soft Bellman target, the
    policy on ``alpha * log pi - min Q``, the temperature towards ``target_entropy``, and the
    target critics ``tau`` of the way to the critics. Evaluation acts with ``tanh`` of the
    mean (``eval_actions = "sample"``: sampled). Observations are not normalised; ``uint8``
    images are stored as such and scaled to ``[0, 1]`` where the networks read them (flattened,
    through the MLPs).

    Args:
      observation_space, action_space: ``Box`` spaces (1-D actions). Actions are squashed
        into the action space's bounds, which must be finite: [-1, 1] with batchrl's
        wrappers' default ``env.normalize_ranges``, else the env's own.
      num_agents: ``N``, the envs of the batch.
      device: where the networks and the replay buffer live.
      buffer_size: transitions the replay buffer keeps (all agents').
      batch_size: transitions per gradient step.
      learning_starts: env steps of random actions before learning starts.
      updates_per_step: gradient steps per env step.
      discount: ``gamma``.
      n_step: steps summed into each target before it bootstraps.
      tau: the Polyak step of the target critics.
      learning_rate: Adam's for the policy, the critics and the temperature.
      hidden: hidden layer sizes of the policy and of each critic.
      init_alpha: the initial temperature.
      target_entropy: the entropy the temperature aims at (``None``: minus the action size).
      save_buffer: keep the replay buffer in ``state_dict()`` (checkpoints), so that a resumed
        run continues exactly; ``False`` makes checkpoints small, and a resumed run acts with
        its policy but takes no gradient step until the buffer holds ``learning_starts``
        transitions again (not exact).
      eval_actions: ``"mean"`` or ``"sample"`` (``train.eval_actions``).
      precision: ``"float32"``, or ``"bfloat16"``: the networks' hidden layers compute in
        bfloat16 (``EnsembleMLP.compute_dtype``), in acting and in updates; output layers,
        parameters, optimiser states and losses stay float32 (``train.precision``).
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 device: str | torch.device = "cpu", buffer_size: int = 1_000_000,
                 batch_size: int = 256, learning_starts: int = 5_000,
                 updates_per_step: float = 1.0, discount: float = 0.99, n_step: int = 1,
                 tau: float = 0.005, learning_rate: float = 3e-4,
                 hidden: Sequence[int] = (256, 256), init_alpha: float = 1.0,
                 target_entropy: float | None = None, save_buffer: bool = True,
                 eval_actions: str = "mean", precision: str = "float32"):
        if not isinstance(observation_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"SAC needs a Box observation space, got "
                                        f"{observation_space}")
        if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
            raise UnsupportedSpaceError(f"SAC needs a 1-D Box action space, got {action_space} "
                                        f"(DQN takes Discrete actions)")
        for name, value in (("batch_size", batch_size), ("buffer_size", buffer_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 < tau <= 1:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        check_hyperparameters({"init_alpha": init_alpha, "learning_rate": learning_rate},
                              hidden)
        check_buffer_size(buffer_size, num_agents)
        if target_entropy is not None and not math.isfinite(target_entropy):
            raise ValueError(f"target_entropy must be finite, got {target_entropy}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{precision!r}")
        actions, self.obs_size = action_space.shape[0], math.prod(observation_space.shape)
        flat = observation_field(observation_space)
        super().__init__(device, eval_actions, num_agents, ReplayBuffer(
            num_agents, buffer_size, {"observ": flat, "next_observ": flat,
                                      "action": ((actions,), torch.float32)},
            discount, n_step, device), learning_starts, updates_per_step, save_buffer)
        self.batch_size, self.discount, self.tau = batch_size, discount, tau
        self.target_entropy = -float(actions) if target_entropy is None else target_entropy
        if not action_space.is_bounded():
            raise UnsupportedSpaceError(f"SAC squashes its actions into the action space's "
                                        f"range, which must be bounded; got {action_space}")
        low, high = action_space.low, action_space.high
        self._low = torch.as_tensor(low, dtype=torch.float32, device=self.device)
        self._scale = torch.as_tensor(high - low, dtype=torch.float32, device=self.device) / 2
        # (the MLP torso: pixels scaled to [0, 1], other observations as they are)
        self.observation_input = build_torso("mlp", observation_space) or nn.Identity()
        self.policy = SquashedGaussian(self.obs_size, hidden, actions).to(self.device)
        self.critics = EnsembleMLP(2, self.obs_size + actions, hidden, 1).to(self.device)
        self.target_critics = EnsembleMLP(2, self.obs_size + actions, hidden, 1).to(self.device)
        self.target_critics.load_state_dict(self.critics.state_dict())
        self.target_critics.requires_grad_(False)
        for network in (self.policy.body, self.critics, self.target_critics):
            network.compute_dtype = getattr(torch, precision)
        self.log_alpha = torch.tensor(math.log(init_alpha), device=self.device,
                                      requires_grad=True)
        # (fused: one kernel per step instead of several per parameter)
        adam = functools.partial(torch.optim.Adam, lr=learning_rate, fused=True)
        self.policy_optimizer = adam(self.policy.parameters())
        self.critic_optimizer = adam(self.critics.parameters())
        self.alpha_optimizer = adam([self.log_alpha])
        self._last_action: torch.Tensor | None = None

    @property
    def alpha(self) -> torch.Tensor:
        """The entropy temperature, a scalar tensor without gradient."""
        return self.log_alpha.detach().exp()

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        observ = self.observation_input(observ.reshape(len(agent_indices), -1))
        if self.training and self.env_steps < self.learning_starts:
            squashed = torch.rand(len(agent_indices), len(self._low), device=self.device) * 2 - 1
        else:
            squashed, _ = self.policy(observ, self.acting_deterministically)
        if self.training:
            self._last_action = squashed
        return self._low + (squashed + 1.0) * self._scale, {}

    def stored_action(self, action: torch.Tensor) -> torch.Tensor:
        """The squashed action in [-1, 1] that ``perform`` chose for this step (exactly), or
        for transitions it did not choose (a caller's own), ``action`` mapped back to it."""
        squashed, self._last_action = self._last_action, None
        if squashed is None or squashed.shape != action.shape:
            scale = torch.where(self._scale > 0, self._scale, 1.0)  # (low == high: any value)
            squashed = ((action.float() - self._low) / scale - 1.0).clamp(-1.0, 1.0)
        return squashed

    def gradient_step(self) -> dict[str, torch.Tensor]:
        """One step of the critics, the policy and the temperature, and the targets' Polyak
        step; returns their losses and the temperature (0-dim tensors on ``device``)."""
        batch = self.buffer.sample(self.batch_size)
        observ = self.observation_input(batch["observ"])
        next_observ = self.observation_input(batch["next_observ"])
        alpha = self.alpha
        with torch.no_grad():
            next_action, next_log_prob = self.policy(next_observ)
            next_q = self.target_critics(torch.cat([next_observ, next_action], -1))
            soft = next_q.min(0).values.squeeze(-1) - alpha * next_log_prob
            target = batch["reward"] + batch["discount"] * soft
        q = self.critics(torch.cat([observ, batch["action"]], -1)).squeeze(-1)
        critic_loss = 0.5 * (q - target).square().mean(1).sum()
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()

        action, log_prob = self.policy(observ)
        self.critics.requires_grad_(False)  # (the policy's loss moves the policy only)
        q_new = self.critics(torch.cat([observ, action], -1)).min(0).values.squeeze(-1)
        self.critics.requires_grad_(True)
        policy_loss = (alpha * log_prob - q_new).mean()
        self.policy_optimizer.zero_grad(set_to_none=True)
        policy_loss.backward()
        self.policy_optimizer.step()

        alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
        self.alpha_optimizer.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_optimizer.step()

        with torch.no_grad():
            for target, online in zip(self.target_critics.parameters(),
                                      self.critics.parameters()):
                target.lerp_(online, self.tau)
        self.updates += 1
        return {"sac/critic_loss": critic_loss.detach(), "sac/policy_loss": policy_loss.detach(),
                "sac/alpha": alpha.detach(), "sac/entropy": -log_prob.detach().mean()}

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "critics": self.critics.state_dict(),
                "target_critics": self.target_critics.state_dict(),
                "log_alpha": self.log_alpha.detach().clone(),
                "policy_optimizer": self.policy_optimizer.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "alpha_optimizer": self.alpha_optimizer.state_dict(),
                **self.replay_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.critics.load_state_dict(state["critics"])
        self.target_critics.load_state_dict(state["target_critics"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.load_replay_state(state)
