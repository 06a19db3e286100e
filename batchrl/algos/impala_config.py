"""IMPALA's hyperparameters, without torch: ``train.py`` checks a config before it imports
torch, so that a wrong value is reported at once."""

from __future__ import annotations

from dataclasses import dataclass

from batchrl.algos.ppo_config import (ACTIVATIONS, INITS, LR_SCHEDULES, TORSOS, check_finite,
                                      check_torso)

OPTIMIZERS = ("adam", "rmsprop")


@dataclass
class IMPALAConfig:
    """Hyperparameters of IMPALA (Espeholt et al., 2018): an actor-critic that learns from
    fixed-length rollouts of ``rollout_length`` steps of every agent, correcting for the lag of
    the policy that acted with V-trace. Losses are means over the rollout's valid steps."""

    policy_layers: tuple[int, ...] = (64, 64)
    value_layers: tuple[int, ...] = (64, 64)
    torso: str = "mlp"                        # or "nature_cnn", "impala_cnn" (images)
    shared_torso: bool = False                # policy and value on one torso
    activation: str = "tanh"                  # or "relu", after every hidden layer
    init: str = "orthogonal"                  # or "default" (PyTorch's) weights
    init_output_factor: float = 0.01          # scale (orthogonal: gain) of the policy output
    init_std: float = 0.5                     # Gaussian policies: the initial action std
    rollout_length: int = 20                  # steps per agent in a rollout (T)
    update_steps: int = 1                     # gradient steps on each rollout
    optimizer: str = "adam"                   # or "rmsprop" (alpha 0.99, no momentum)
    learning_rate: float = 5e-4
    epsilon: float = 1e-5                     # the optimiser's epsilon
    lr_schedule: str = "constant"             # or "linear": decay to 0 over the run's steps
    discount: float = 0.99
    vtrace: bool = True                       # False: on-policy n-step targets (rho = 1)
    rho_bar: float = 1.0                      # truncation of the importance ratios
    c_bar: float = 1.0                        # truncation of the trace coefficients
    entropy_cost: float = 0.01
    baseline_cost: float = 0.5                # weight of the value loss
    max_grad_norm: float | None = 0.5         # per network; None: no clipping
    normalize_observ: bool = True             # running mean and std of the observations
    normalize_reward: bool = True             # divide by the std of the discounted returns

    def __post_init__(self) -> None:
        check_finite(self)
        for name, choices in (("activation", ACTIVATIONS), ("init", INITS),
                              ("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES),
                              ("torso", TORSOS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        check_torso(self)
        for name in ("policy_layers", "value_layers"):
            if any(size < 1 for size in getattr(self, name)):
                raise ValueError(f"{name} must be layer sizes >= 1, got {getattr(self, name)}")
        for name in ("rollout_length", "update_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("init_output_factor", "init_std", "learning_rate", "epsilon", "rho_bar",
                     "c_bar", "baseline_cost"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if not self.entropy_cost >= 0:
            raise ValueError(f"entropy_cost must be >= 0, got {self.entropy_cost}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
