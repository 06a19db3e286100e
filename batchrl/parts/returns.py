"""Discounted returns and generalised advantages, without a Python loop over time: all evaluate
``y_t = x_t + f_t * y_{t+1}`` with ``discounted_cumsum``. ``gae`` takes sequences with per-step end
flags (fixed-length rollouts); ``discounted_return`` and ``generalized_advantage`` take padded whole
episodes: ``(E, T)`` rows of which the first ``length[e]`` steps are real."""

from __future__ import annotations

import torch


def discounted_cumsum(values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``y_t = x_t + f_t * y_{t+1}`` along the last axis, with ``y_T = 0``: ``values``
    ``(..., T)`` are the ``x_t``, ``factors`` ``(..., T)`` the ``f_t`` (a discount, zero where a
    sequence ends). Returns the ``(..., T)`` ``y_t``, computed in float64, in ``values``' dtype."""
    # After the doubling step with shift s, y_t holds the terms t .. t + 2s - 1
    # and gain_t the product of their factors: ceil(log2(T)) steps in all.
    result = values.to(torch.float64)
    gain = factors.to(torch.float64)
    steps = values.shape[-1]
    shift = 1
    while shift < steps:
        later = gain[..., :-shift] * result[..., shift:]
        result = torch.cat([result[..., :-shift] + later, result[..., -shift:]], dim=-1)
        gain = torch.cat([gain[..., :-shift] * gain[..., shift:], gain[..., -shift:]], dim=-1)
        shift *= 2
    return result.to(values.dtype)


def gae(reward: torch.Tensor, value: torch.Tensor, next_value: torch.Tensor,
        ends: torch.Tensor, discount: float, lambda_: float,
        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised advantage estimates (Schulman et al., 2016); episodes may end at any step.

    Args:
      reward: ``(B, T)`` rewards.
      value: ``(B, T)`` value estimates of the states the rewards came from.
      next_value: ``(B, T)`` value of the state after each step: zero after a terminal state, the
        value of the real next observation after a time limit or at the end of a rollout.
      ends: ``(B, T)`` bool or 0/1: step ``t`` ends its sequence (episode end or rollout cut);
        advantages never reach across it.
      discount: gamma. lambda_: the GAE lambda (1 gives ``return - value``).
      valid: ``(B, T)`` bool, optional: steps to learn from. An invalid step (an episode cut
        without its next state, which ends there) adds nothing to the steps before it: they
        bootstrap from its value.
    Returns:
      ``(B, T)`` advantages in the dtype of ``reward``.
    """
    delta = reward.to(torch.float64) + discount * next_value.to(torch.float64) - value
    if valid is not None:
        delta = delta * valid
    factors = (discount * lambda_) * (1.0 - ends.to(torch.float64))
    return discounted_cumsum(delta, factors).to(reward.dtype)


def _episode_flags(length: torch.Tensor, steps: int, bootstrap: torch.Tensor | None,
                   value: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid mask, last-step flags and value after every step of padded episodes
    (``value[t + 1]``, ``bootstrap`` after the last step, zero in the padding)."""
    time = torch.arange(steps, device=length.device)[None, :]
    mask = time < length[:, None]
    last = time == (length[:, None] - 1)
    if value is None:
        next_value = torch.zeros(length.shape[0], steps, dtype=torch.float64,
                                 device=length.device)
    else:
        next_value = torch.cat([value[:, 1:], torch.zeros_like(value[:, :1])], dim=1)
        next_value = torch.where(mask & ~last, next_value, torch.zeros_like(next_value))
    if bootstrap is not None:
        next_value = torch.where(last, bootstrap[:, None].to(next_value.dtype), next_value)
    return mask, last, next_value


def discounted_return(reward: torch.Tensor, length: torch.Tensor, discount: float,
                      bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """Discounted return of every step of padded episodes.

    Args:
      reward: ``(E, T)`` rewards; entries at ``t >= length`` are ignored.
      length: ``(E,)`` int64 episode lengths.
      discount: the discount factor gamma.
      bootstrap: ``(E,)`` value of the state after each episode's last step
        (zero for terminal states); ``None`` means zero.
    Returns:
      ``(E, T)`` returns ``R_t = sum_k gamma^(k-t) r_k + gamma^(L-t) bootstrap``,
      zero at padded steps, in the dtype of ``reward``.
    """
    mask, last, next_value = _episode_flags(length, reward.shape[1], bootstrap, None)
    values = torch.where(mask, reward.to(torch.float64), 0.0) + discount * next_value
    result = discounted_cumsum(values, discount * (~last).to(torch.float64))
    return torch.where(mask, result, 0.0).to(reward.dtype)


def generalized_advantage(reward: torch.Tensor, value: torch.Tensor, length: torch.Tensor,
                          discount: float, lambda_: float,
                          bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """``gae`` of padded episodes, their ends taken from ``length`` ``(E,)`` int64: ``reward``,
    ``value`` ``(E, T)`` and ``discount``, ``lambda_`` as for ``gae``, ``bootstrap`` ``(E,)`` as for
    ``discounted_return``. Returns ``(E, T)`` advantages, zero at padded steps."""
    mask, last, next_value = _episode_flags(length, reward.shape[1], bootstrap, value)
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    result = gae(torch.where(mask, reward, zero.to(reward.dtype)), torch.where(mask, value, zero),
                 next_value, ~mask | last, discount, lambda_)
    return torch.where(mask, result, torch.zeros_like(result))
