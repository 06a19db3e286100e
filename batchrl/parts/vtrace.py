"""V-trace targets (Espeholt et al., 2018, section 4.1) for batches of fixed-length rollouts.

A rollout row holds ``T`` consecutive steps of one agent, across episode boundaries; the
recursion of the paper,

    v_s - V(x_s) = delta_s + gamma * c_s * (v_{s+1} - V(x_{s+1})),
    delta_s = rho_s * (r_s + gamma * V(x_{s+1}) - V(x_s)),

stops at the steps that end an episode and at the rollout's last step, where
``v_{s+1} - V(x_{s+1})`` is zero. It is evaluated with ``discounted_cumsum``, without a loop
over time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchrl.parts.returns import discounted_cumsum


class VTrace(NamedTuple):
    """What ``vtrace`` returns: ``vs`` the value targets and ``pg_advantage`` the advantages of
    the policy gradient, ``(B, T)`` each."""

    vs: torch.Tensor
    pg_advantage: torch.Tensor


@torch.no_grad()
def vtrace(log_rho: torch.Tensor, reward: torch.Tensor, value: torch.Tensor,
           next_value: torch.Tensor, ends: torch.Tensor, discount: float,
           rho_bar: float = 1.0, c_bar: float = 1.0,
           valid: torch.Tensor | None = None) -> VTrace:
    """V-trace value targets and policy-gradient advantages of ``B`` rollouts of ``T`` steps.

    Args:
      log_rho: ``(B, T)`` ``log pi(a_t | x_t) - log mu(a_t | x_t)``, the log importance ratio
        of the learner's policy ``pi`` to the behaviour policy ``mu`` that acted.
      reward: ``(B, T)`` rewards ``r_t``.
      value: ``(B, T)`` ``V(x_t)``, the learner's value of the state acted on at step ``t``.
      next_value: ``(B, T)`` the value of the state after step ``t``: 0 after a terminal
        state, the value of the final observation where a time limit (or a cut) ended the
        episode, ``V(x_{t+1})`` otherwise (at the last step: of the observation after it).
      ends: ``(B, T)`` bool or 0/1: step ``t`` ended its episode (terminated or truncated);
        traces never reach across it.
      discount: gamma, in ``[0, 1]``.
      rho_bar: the truncation of the importance ratio in ``delta`` and in the advantages
        (the paper's rho-bar; larger values aim at the value of ``pi``, smaller at ``mu``'s).
      c_bar: the truncation of the trace coefficients ``c_t`` (how far back corrections
        reach).
      valid: ``(B, T)`` bool, optional: steps to learn from. An invalid step (an episode cut
        without its next state, which ends there) adds nothing to the targets before it: they
        bootstrap from its value.

    Returns:
      ``VTrace(vs, pg_advantage)``, ``(B, T)`` each in ``value``'s dtype, without gradient:
      ``vs`` the targets of ``V(x_t)``, and
      ``pg_advantage_t = min(rho_bar, rho_t) * (r_t + gamma * v'_{t+1} - V(x_t))`` with
      ``v'_{t+1} = vs_{t+1}`` inside an episode and ``next_value_t`` where step ``t`` ended it
      or ends the rollout.
    """
    shape = log_rho.shape
    if log_rho.dim() != 2 or any(t.shape != shape for t in (reward, value, next_value, ends)):
        raise ValueError(f"vtrace takes (B, T) tensors of one shape, got log_rho {tuple(shape)}, "
                         f"reward {tuple(reward.shape)}, value {tuple(value.shape)}, next_value "
                         f"{tuple(next_value.shape)}, ends {tuple(ends.shape)}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    if not (rho_bar > 0 and c_bar > 0):
        raise ValueError(f"rho_bar and c_bar must be > 0, got {rho_bar} and {c_bar}")
    # float64 throughout: the targets are sums of up to T terms of unbounded ratio products.
    ratio = log_rho.to(torch.float64).exp()
    rho = ratio.clamp(max=rho_bar)
    c = ratio.clamp(max=c_bar)
    value64, next_value64 = value.to(torch.float64), next_value.to(torch.float64)
    reward64 = reward.to(torch.float64)
    going_on = 1.0 - ends.to(torch.float64)
    delta = rho * (reward64 + discount * next_value64 - value64)
    if valid is not None:
        delta = delta * valid
    vs = value64 + discounted_cumsum(delta, discount * c * going_on)
    # The value after each step for the advantage: vs_{t+1} inside an episode.
    later = torch.cat([vs[:, 1:], next_value64[:, -1:]], dim=1)
    next_vs = torch.where(going_on > 0, later, next_value64)
    pg_advantage = rho * (reward64 + discount * next_vs - value64)
    return VTrace(vs.to(value.dtype), pg_advantage.to(value.dtype))
