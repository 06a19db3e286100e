"""Policy and value networks of BatchPPO, written to compile with TorchScript.

A policy is a body (MLP, or MLP then GRU; state ``(B, H)``, ``H = 0`` for feed-forward) and a head:
``policy(observ (B, T, *obs), state) -> (mean_or_logits, log_std, state)`` gives the mean and log
std ``(B, T, A)`` (Gaussian) or the logits ``(B, T, n)`` and an empty ``log_std`` (categorical).
"""

from __future__ import annotations

import math
from typing import Sequence

import gymnasium as gym
import torch
from torch import nn


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def mlp(in_size: int, layers: Sequence[int], activation: str = "relu") -> nn.Sequential:
    """MLP with ``activation`` (a name of ``ACTIVATIONS``) after every layer; empty for none."""
    modules: list[nn.Module] = []
    for size in layers:
        modules += [nn.Linear(in_size, size), ACTIVATIONS[activation]()]
        in_size = size
    return nn.Sequential(*modules)


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights scaled by ``gain`` and zero biases for every ``nn.Linear``
    in ``module`` (Saxe et al., 2014): each layer keeps the scale of its input."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)


class FeedForwardBody(nn.Module):
    """MLP over the last dimension; carries an empty ``(B, 0)`` state."""

    def __init__(self, obs_size: int, layers: Sequence[int], activation: str = "relu"):
        super().__init__()
        self.net = mlp(obs_size, layers, activation)
        self.out_size = layers[-1] if layers else obs_size
        self.state_size = 0

    def forward(self, observ: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(observ), state


class RecurrentBody(FeedForwardBody):
    """``FeedForwardBody`` followed by a single-layer GRU over the time dimension."""

    def __init__(self, obs_size: int, layers: Sequence[int], gru_size: int,
                 activation: str = "relu"):
        super().__init__(obs_size, layers, activation)
        self.gru = nn.GRU(self.out_size, gru_size, batch_first=True)
        self.out_size = self.state_size = gru_size

    def forward(self, observ: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features, final = self.gru(self.net(observ), state.unsqueeze(0).contiguous())
        return features, final.squeeze(0)


class GaussianHead(nn.Module):
    """``tanh``-squashed mean and a learned state-independent log std, starting at
    ``log(init_std)``; ``init_output_factor`` scales the mean layer's initial weights."""

    def __init__(self, in_size: int, action_size: int, init_std: float,
                 init_output_factor: float):
        super().__init__()
        self.mean = nn.Linear(in_size, action_size)
        with torch.no_grad():
            self.mean.weight.mul_(init_output_factor)
            self.mean.bias.zero_()
        self.log_std = nn.Parameter(torch.full((action_size,), float(torch.tensor(init_std).log())))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tanh(self.mean(features))
        return mean, self.log_std.expand_as(mean)


class CategoricalHead(nn.Module):
    """Logits over ``num_actions`` actions; ``init_output_factor`` scales the initial weights."""

    def __init__(self, in_size: int, num_actions: int, init_output_factor: float):
        super().__init__()
        self.logits = nn.Linear(in_size, num_actions)
        with torch.no_grad():
            self.logits.weight.mul_(init_output_factor)
            self.logits.bias.zero_()

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(features)
        return logits, logits.new_zeros(0)


class Policy(nn.Module):
    """Body + head, with the calling convention of this module's docstring."""

    def __init__(self, body: nn.Module, head: nn.Module, discrete: bool):
        super().__init__()
        self.body, self.head, self.discrete = body, head, discrete
        self.state_size: int = body.state_size

    def forward(self, observ: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, state = self.body(observ, state)
        mean_or_logits, log_std = self.head(features)
        return mean_or_logits, log_std, state


class Actor(nn.Module):
    """One inference step of a ``Policy``: ``forward(observ (B, *obs), state (B, H),
    deterministic)`` returns ``(action, mean_or_logits, log_std, state)``, parameters
    ``(B, ...)``. A deterministic action is the mean (Gaussian) or the most likely one
    (categorical); others are sampled with torch's global RNG, so a seed gives the
    same actions in eager and TorchScript modes."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy
        self.discrete: bool = policy.discrete
        self.recurrent: bool = policy.state_size > 0

    def forward(self, observ: torch.Tensor, state: torch.Tensor,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.recurrent:
            mean_or_logits, log_std, state = self.policy(observ.unsqueeze(1), state)
            mean_or_logits = mean_or_logits.squeeze(1)
            if not self.discrete:
                log_std = log_std.squeeze(1)
        else:  # no time axis: three fewer operations and 2-D matrix products
            mean_or_logits, log_std, state = self.policy(observ, state)
        if deterministic:
            action = mean_or_logits.argmax(-1) if self.discrete else mean_or_logits
        elif self.discrete:
            action = torch.multinomial(torch.softmax(mean_or_logits, -1), 1).squeeze(-1)
        else:
            action = mean_or_logits + log_std.exp() * torch.randn_like(mean_or_logits)
        return action, mean_or_logits, log_std, state


class ValueNet(nn.Module):
    """State value: MLP then a linear output, ``(..., obs) -> (...)``."""

    def __init__(self, obs_size: int, layers: Sequence[int], activation: str = "relu"):
        super().__init__()
        self.net = mlp(obs_size, layers, activation)
        self.out = nn.Linear(layers[-1] if layers else obs_size, 1)

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(observ)).squeeze(-1)


def actor_critic(body: nn.Module, obs_size: int, action_space: gym.Space,
                 value_layers: Sequence[int],
                 activation: str, init: str, init_std: float,
                 init_output_factor: float) -> tuple[Policy, ValueNet]:
    """A policy on ``body`` (a ``FeedForwardBody`` or ``RecurrentBody``) with a categorical
    head for a ``Discrete`` ``action_space`` or else a Gaussian one for a 1-D Box
    (``init_std``), and a separate value network of ``value_layers``. ``init="orthogonal"``:
    hidden layers keep their input's scale, the policy's output starts near zero
    (``init_output_factor``), the value's output at gain 1; else PyTorch's initialisation."""
    discrete = isinstance(action_space, gym.spaces.Discrete)
    if discrete:
        head: nn.Module = CategoricalHead(body.out_size, int(action_space.n), init_output_factor)
        output = head.logits
    else:
        head = GaussianHead(body.out_size, action_space.shape[0], init_std, init_output_factor)
        output = head.mean
    policy = Policy(body, head, discrete)
    value = ValueNet(obs_size, value_layers, activation)
    if init == "orthogonal":
        for module in (body.net, value.net):
            orthogonal_init(module, math.sqrt(2.0))
        orthogonal_init(output, init_output_factor)
        orthogonal_init(value.out, 1.0)
    return policy, value
