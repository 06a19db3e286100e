"""Discounted returns and generalised advantages over padded episode batches.

Both are computed with one matrix product against a ``(T, T)`` matrix of
discount powers instead of a Python loop over time steps.
"""

from __future__ import annotations

import torch


def _discount_matrix(length: int, factor: float, device: torch.device) -> torch.Tensor:
    """``M[k, t] = factor ** (k - t)`` for ``k >= t`` else 0, so ``x @ M`` is the
    discounted sum of ``x`` from each step ``t`` onwards."""
    steps = torch.arange(length, device=device)
    offset = steps[:, None] - steps[None, :]
    powers = torch.tensor(factor, dtype=torch.float64, device=device) ** offset.clamp(min=0)
    return torch.where(offset >= 0, powers, torch.zeros((), dtype=torch.float64,
                                                         device=device))


def _valid_mask(length: torch.Tensor, steps: int) -> torch.Tensor:
    return torch.arange(steps, device=length.device)[None, :] < length[:, None]


def _add_at_last_step(values: torch.Tensor, length: torch.Tensor,
                      extra: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(values.shape[0], device=values.device)
    last = (length - 1).clamp(min=0)
    values = values.clone()
    values[rows, last] += extra * (length > 0)
    return values


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
      zero at padded steps. Same dtype and device as ``reward``.
    """
    mask = _valid_mask(length, reward.shape[1])
    values = torch.where(mask, reward, torch.zeros_like(reward)).to(torch.float64)
    if bootstrap is not None:
        values = _add_at_last_step(values, length, discount * bootstrap.to(torch.float64))
    result = values @ _discount_matrix(reward.shape[1], discount, reward.device)
    return torch.where(mask, result, torch.zeros_like(result)).to(reward.dtype)


def generalized_advantage(reward: torch.Tensor, value: torch.Tensor, length: torch.Tensor,
                          discount: float, lambda_: float,
                          bootstrap: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised advantage estimates (Schulman et al., 2016) of padded episodes.

    Args:
      reward: ``(E, T)`` rewards.
      value: ``(E, T)`` value estimates of the states the rewards came from.
      length: ``(E,)`` int64 episode lengths.
      discount: gamma. lambda_: the GAE lambda.
      bootstrap: ``(E,)`` value after the last step (zero when terminal).
    Returns:
      ``(E, T)`` advantages, zero at padded steps.
    """
    steps = reward.shape[1]
    mask = _valid_mask(length, steps)
    next_value = torch.cat([value[:, 1:], torch.zeros_like(value[:, :1])], dim=1)
    # Inside an episode the next value is value[t + 1]; at its last step it is
    # the bootstrap value, never the padding after it.
    next_value = torch.where(_valid_mask(length - 1, steps), next_value, torch.zeros_like(value))
    if bootstrap is not None:
        next_value = _add_at_last_step(next_value, length, bootstrap)
    delta = (reward + discount * next_value - value).to(torch.float64)
    delta = torch.where(mask, delta, torch.zeros_like(delta))
    result = delta @ _discount_matrix(steps, discount * lambda_, reward.device)
    return torch.where(mask, result, torch.zeros_like(result)).to(reward.dtype)
