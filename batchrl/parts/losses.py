"""Policy-gradient losses as parts, beside the return estimators of ``batchrl.parts.returns``.

Every policy objective here is called the same way, so an algorithm's update loop can take any of
them (and a new one, such as the clipped objective or an entropy bonus, goes beside them):

    loss, terms = objective(new, old, action, advantage, mask)   # during the update
    summary = objective.end_update(new, old, action, advantage, mask)  # once, after it

``new`` and ``old`` are ``torch.distributions`` over actions for the same ``(B, T)`` steps (from
``action_distribution``), ``action`` the actions taken, ``advantage`` ``(B, T)`` float32 and
``mask`` ``(B, T)`` float32, 1.0 on real steps and 0.0 on padding; means are over the real steps.
``terms`` are detached-able tensors to log. All tensors on one device.

``actor_critic_loss`` is a whole loss instead (policy gradient, baseline and entropy terms), for
algorithms that learn from V-trace targets (``batchrl.parts.vtrace``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributions import Categorical, Distribution, Independent, Normal, kl_divergence


def action_distribution(mean_or_logits: torch.Tensor, log_std: torch.Tensor,
                        discrete: bool) -> Distribution:
    """The policy's action distribution: categorical over ``mean_or_logits`` ``(..., n)``
    logits, or a diagonal Gaussian with mean ``(..., A)`` and ``log_std`` ``(..., A)``."""
    if discrete:
        return Categorical(logits=mean_or_logits)
    return Independent(Normal(mean_or_logits, log_std.exp()), 1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the steps where ``mask`` is 1.0 (0 when there are none).
    Padded steps' values are left out, not multiplied by 0: they may be inf (inf * 0 is nan)."""
    return (torch.where(mask > 0, values, 0.0) * mask).sum() / mask.sum().clamp(min=1)


def masked_log_ratio(new: Distribution, old: Distribution, action: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """``log new(a) - log old(a)`` ``(B, T)``, zero where ``mask`` is 0 (a padded step's ratio
    can be inf, and inf * 0 is nan)."""
    return torch.where(mask > 0, new.log_prob(action) - old.log_prob(action), 0.0)


def policy_terms(new: Distribution, old: Distribution, action: torch.Tensor,
                 advantage: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(surrogate, kl, log_ratio)``: the negated importance-weighted advantage
    ``-E[ratio * advantage]`` and ``KL(old || new)`` (masked means), and the ``(B, T)``
    log-ratio ``log new(a) - log old(a)`` (zero on padding)."""
    log_ratio = masked_log_ratio(new, old, action, mask)
    surrogate = -(torch.exp(log_ratio) * advantage * mask).sum() / mask.sum().clamp(min=1)
    kl = masked_mean(kl_divergence(old, new), mask)
    return surrogate, kl, log_ratio


def value_loss(value: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               old_value: torch.Tensor | None = None, clip: float | None = None) -> torch.Tensor:
    """Half the mean squared error of ``value`` against ``returns`` (both ``(B, T)``). With
    ``clip``, PPO's clipped value loss: per step the larger error of ``value`` and of
    ``old_value + clamp(value - old_value, -clip, clip)`` (the prediction moved at most
    ``clip`` from ``old_value``, the value network's before the update)."""
    error = (returns - value) ** 2
    if clip is not None:
        if old_value is None:
            raise ValueError("a clipped value loss needs old_value, the predictions before "
                             "the update")
        moved = old_value + (value - old_value).clamp(-clip, clip)
        error = torch.maximum(error, (returns - moved) ** 2)
    return 0.5 * (error * mask).sum() / mask.sum().clamp(min=1)


def entropy_bonus(new: Distribution, mask: torch.Tensor, coef: float
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-coef * E[entropy of new]`` over the real steps (added to a policy loss, it rewards
    spread-out action distributions), and the mean entropy to log."""
    entropy = masked_mean(new.entropy(), mask)
    return -coef * entropy, {"entropy": entropy}


def actor_critic_loss(log_prob: torch.Tensor, entropy: torch.Tensor, value: torch.Tensor,
                      targets: torch.Tensor, advantage: torch.Tensor, valid: torch.Tensor,
                      baseline_cost: float = 0.5, entropy_cost: float = 0.01
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor-critic loss of IMPALA (Espeholt et al., 2018, section 4.2), means over the
    valid steps::

        loss = -E[log pi(a|x) * advantage] + baseline_cost * 1/2 E[(targets - V)^2]
               - entropy_cost * E[entropy]

    Args:
      log_prob: ``(B, T)`` ``log pi(a_t | x_t)`` of the actions taken, with gradient.
      entropy: ``(B, T)`` entropy of ``pi(. | x_t)``, with gradient.
      value: ``(B, T)`` ``V(x_t)``, with gradient.
      targets, advantage: ``(B, T)`` value targets and policy-gradient advantages (V-trace's
        ``vs`` and ``pg_advantage``); no gradient flows into them.
      valid: ``(B, T)`` bool or 0/1: the steps the loss uses.

    Returns:
      ``(loss, terms)``: the scalar loss and its unweighted ``policy_loss``, ``value_loss``
      (``1/2 E[(targets - V)^2]``) and ``entropy``, scalars.
    """
    mask = valid.to(value.dtype)
    # A step left out may hold a log-probability of -inf, and -inf * 0 is nan.
    weighted = torch.where(mask > 0, log_prob * advantage.detach(), 0.0)
    policy = -masked_mean(weighted, mask)
    baseline = value_loss(value, targets.detach(), mask)
    mean_entropy = masked_mean(entropy, mask)
    loss = policy + baseline_cost * baseline - entropy_cost * mean_entropy
    return loss, {"policy_loss": policy, "value_loss": baseline, "entropy": mean_entropy}


class KLPenalty:
    """The adaptive KL coefficient beta of the PPO penalty objective.

    After each update: ``beta *= 1.5`` if ``kl > 1.3 * target``; ``beta /= 1.5``
    if ``kl < 0.7 * target``; unchanged in between (the dead band).
    """

    def __init__(self, target: float, initial: float = 1.0):
        self.target = target
        self.value = initial

    def adapt(self, kl: float) -> float:
        """Adapt beta to the ``kl`` an update reached; returns the new beta."""
        if kl > 1.3 * self.target:
            self.value *= 1.5
        elif kl < 0.7 * self.target:
            self.value /= 1.5
        return self.value


class KLPenalizedObjective:
    """BatchPPO's policy objective (Hafner et al., 2017, section 3)::

        loss = -E[ratio * advantage] + beta * KL(old || new)
               + cutoff_coef * max(0, KL - cutoff_factor * target)^2

    with ``beta`` (``penalty``) adapted after every update to keep the KL near ``target``.
    ``KL`` is the mean over the gradient step's valid steps, in the cutoff too: the paper's
    code takes the cutoff of each episode's mean KL, but fixed-length rollouts cut episodes.
    """

    def __init__(self, target: float, cutoff_factor: float = 2.0, cutoff_coef: float = 1000.0,
                 init_penalty: float = 1.0):
        self.penalty = KLPenalty(target, init_penalty)
        self.cutoff_factor = cutoff_factor
        self.cutoff_coef = cutoff_coef

    def __call__(self, new: Distribution, old: Distribution, action: torch.Tensor,
                 advantage: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one gradient step and its ``kl_cutoff`` term (see the module docstring)."""
        surrogate, kl, _ = policy_terms(new, old, action, advantage, mask)
        target = self.penalty.target
        cutoff = self.cutoff_coef * torch.relu(kl - self.cutoff_factor * target) ** 2
        return surrogate + self.penalty.value * kl + cutoff, {"kl_cutoff": cutoff}

    def end_update(self, new: Distribution, old: Distribution, action: torch.Tensor,
                   advantage: torch.Tensor, mask: torch.Tensor,
                   average: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> dict[str, float]:
        """Adapt beta to the KL of the updated policy over the whole update's data; returns
        the KL, beta before and after, and the new policy's entropy. ``average``: the mean of
        a tensor over several learners (each holding an equal share of the data), so that
        all of them adapt beta alike."""
        with torch.no_grad():
            _, kl, _ = policy_terms(new, old, action, advantage, mask)
            entropy = masked_mean(new.entropy(), mask)
            if average is not None:
                kl, entropy = average(torch.stack([kl, entropy]))
        kl, beta = float(kl), self.penalty.value
        return {"kl": kl, "beta": beta, "beta_next": self.penalty.adapt(kl),
                "entropy": float(entropy)}

    def state_dict(self) -> dict[str, float]:
        """The adapted coefficient."""
        return {"beta": self.penalty.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.penalty.value = float(state["beta"])


class ClippedObjective:
    """PPO's clipped surrogate (Schulman et al., 2017, equation 7)::

        loss = -E[min(ratio * advantage, clip(ratio, 1 - eps, 1 + eps) * advantage)]

    A step whose ratio has left ``[1 - eps, 1 + eps]`` in the direction its advantage favours
    gives no gradient, which keeps the update near the policy that acted. Nothing adapts.
    """

    def __init__(self, clip_range: float = 0.2):
        if not clip_range > 0:
            raise ValueError(f"clip_range must be > 0, got {clip_range}")
        self.clip_range = clip_range

    def __call__(self, new: Distribution, old: Distribution, action: torch.Tensor,
                 advantage: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one gradient step and the fraction of steps it clipped
        (``clip_fraction``)."""
        ratio = masked_log_ratio(new, old, action, mask).exp()
        low, high = 1.0 - self.clip_range, 1.0 + self.clip_range
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
        clipped = ((ratio < low) | (ratio > high)).to(mask.dtype)
        return -masked_mean(surrogate, mask), {"clip_fraction": masked_mean(clipped, mask)}

    def end_update(self, new: Distribution, old: Distribution, action: torch.Tensor,
                   advantage: torch.Tensor, mask: torch.Tensor,
                   average: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> dict[str, float]:
        """The KL of the updated policy from the acting one and its entropy, to log
        (``average``: their mean over several learners)."""
        with torch.no_grad():
            _, kl, _ = policy_terms(new, old, action, advantage, mask)
            entropy = masked_mean(new.entropy(), mask)
            if average is not None:
                kl, entropy = average(torch.stack([kl, entropy]))
        return {"kl": float(kl), "entropy": float(entropy)}

    def state_dict(self) -> dict[str, float]:
        """Nothing adapts: empty."""
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Nothing to load (``state_dict`` is empty)."""
