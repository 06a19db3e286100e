"""BatchPPO's hyperparameters, without torch: ``train.py`` checks a config before it imports
torch, so that a wrong value is reported at once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ACTIVATIONS = ("relu", "tanh")  # the keys of ``batchrl.algos.networks.ACTIVATIONS``
INFERENCE_MODES = ("script", "eager", "compile")
NETWORKS = ("feed_forward", "recurrent")
INITS = ("default", "orthogonal")
REWARD_SCALES = ("reward", "return")
LR_SCHEDULES = ("constant", "linear")
VALUE_TARGETS = ("gae", "vtrace")
TORSOS = ("mlp", "nature_cnn", "impala_cnn")  # built by ``batchrl.algos.networks.build_torso``
OBJECTIVES = ("kl_penalty", "clip")
ADVANTAGE_NORMALIZATIONS = ("update", "minibatch", "none")
PRECISIONS = ("float32", "bfloat16")  # of updates: train.precision, BatchPPO's precision
# What evaluation acts with (train.eval_actions, every Algorithm's eval_actions): the policy's
# mean or most likely action, or a sample of it.
EVAL_ACTIONS = ("mean", "sample")


def check_finite(config: object) -> None:
    """Raise ``ValueError`` naming the first float field of the dataclass ``config`` that
    is inf or nan (an update would turn the weights into NaNs)."""
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{item.name} must be a finite number, got {value}")


SHARED_MLP = ("shared_torso needs a torso with layers to share: set torso to 'nature_cnn' or "
              "'impala_cnn' (an MLP policy and value network share nothing)")


def check_torso(config: object) -> None:
    """Raise ``ValueError`` where ``config`` (PPO's or IMPALA's) shares the ``"mlp"`` torso,
    which has no layers to share."""
    if config.shared_torso and config.torso == "mlp":  # type: ignore[attr-defined]
        raise ValueError(SHARED_MLP)


@dataclass
class PPOConfig:
    """Hyperparameters of BatchPPO. The defaults follow the paper's update scheme (whole
    episodes, 25 full-batch epochs, the adaptive KL penalty); ``configs/paper/`` sets the
    released code's values where they differ (discount, value learning rate, initial std)."""

    network: str = "feed_forward"            # or "recurrent" (MLP then GRU)
    policy_layers: tuple[int, ...] = (200, 100)
    value_layers: tuple[int, ...] = (200, 100)
    torso: str = "mlp"                        # or "nature_cnn", "impala_cnn" (images)
    shared_torso: bool = False                # policy and value on one torso (one joint step)
    activation: str = "relu"                  # or "tanh", after every hidden layer
    init: str = "default"                     # or "orthogonal" weights (zero biases)
    gru_size: int = 100                       # recurrent policies only
    chunk_length: int | None = None           # recurrent: train on chunks of episodes
    init_std: float = 0.35
    init_output_factor: float = 0.1           # scale (orthogonal: gain) of the policy output
    update_every: int = 30                    # episodes per update (whole-episode updates)
    rollout_length: int | None = None         # steps per agent per update; None: whole episodes
    update_epochs: int = 25
    batch_size: int | None = None             # sequences per gradient step; None = all
    minibatch_size: int | None = None         # time steps per gradient step (feed-forward only)
    policy_lr: float = 1e-4
    value_lr: float = 1e-3
    lr_schedule: str = "constant"             # or "linear": decay to 0 over the run's steps
    epsilon: float = 1e-8                     # Adam's epsilon (torch's default)
    discount: float = 0.99
    gae_lambda: float | None = None           # None: plain discounted returns
    value_targets: str = "gae"                # or "vtrace": V-trace targets and advantages
    objective: str = "kl_penalty"             # or "clip": PPO's clipped surrogate
    clip_range: float = 0.2                   # objective="clip": ratios outside 1 +- this
    value_clip: float | None = None           # clip value predictions this far from the old
    entropy_coef: float = 0.0                 # entropy bonus of the policy loss
    value_coef: float = 1.0                   # weight of the value loss (1/2 MSE)
    advantage_normalization: str = "update"   # or "minibatch", "none"
    kl_target: float = 1e-2
    kl_cutoff_factor: float = 2.0
    kl_cutoff_coef: float = 1000.0
    kl_init_penalty: float = 1.0
    max_grad_norm: float | None = None
    normalize_observ: bool = True
    normalize_reward: bool = True
    reward_scale: str = "reward"              # or "return": whose std normalize_reward divides by
    inference: str = "script"                 # "script", "eager" or "compile"
    update_threads: int | None = None         # None: policy and value steps side by side
    fused_adam: bool = False                  # Adam's step in one kernel for all parameters

    def __post_init__(self) -> None:
        check_finite(self)
        for name, choices in (("network", NETWORKS), ("activation", ACTIVATIONS),
                              ("init", INITS), ("reward_scale", REWARD_SCALES),
                              ("lr_schedule", LR_SCHEDULES), ("inference", INFERENCE_MODES),
                              ("value_targets", VALUE_TARGETS), ("torso", TORSOS),
                              ("objective", OBJECTIVES),
                              ("advantage_normalization", ADVANTAGE_NORMALIZATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        check_torso(self)
        for name in ("policy_layers", "value_layers"):
            if any(size < 1 for size in getattr(self, name)):
                raise ValueError(f"{name} must be layer sizes >= 1, got {getattr(self, name)}")
        for name in ("update_every", "update_epochs", "gru_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if self.gae_lambda is not None and not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"gae_lambda must be in [0, 1] or None, got {self.gae_lambda}")
        for name in ("init_std", "policy_lr", "value_lr", "epsilon", "kl_target", "clip_range",
                     "value_coef", "kl_init_penalty"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 or None (no clipping), got "
                             f"{self.value_clip}")
        for name in ("entropy_coef", "kl_cutoff_factor", "kl_cutoff_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got "
                             f"{self.max_grad_norm}")
        for name in ("batch_size", "minibatch_size", "rollout_length", "chunk_length",
                     "update_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.batch_size is not None and self.minibatch_size is not None:
            raise ValueError(f"batch_size ({self.batch_size} sequences) and minibatch_size "
                             f"({self.minibatch_size} time steps) both set the size of a "
                             f"gradient step's batch: set one of them")
        if self.advantage_normalization == "minibatch" and self.minibatch_size == 1:
            raise ValueError("advantage_normalization='minibatch' centres each gradient "
                             "step's advantages: with minibatch_size 1 all would be 0; set "
                             "minibatch_size >= 2 or advantage_normalization 'update'")
        if self.value_targets == "vtrace" and self.rollout_length is None:
            raise ValueError("value_targets='vtrace' needs fixed-length rollouts: set "
                             "rollout_length")
        if self.value_targets == "vtrace" and self.gae_lambda not in (None, 1.0):
            raise ValueError(f"gae_lambda ({self.gae_lambda}) is GAE's: V-trace's targets "
                             f"(value_targets='vtrace') trace as lambda 1 does; leave "
                             f"gae_lambda unset (or 1)")
        if self.chunk_length is not None and self.network != "recurrent":
            raise ValueError(f"chunk_length ({self.chunk_length}) cuts a recurrent policy's "
                             f"episodes: it needs network='recurrent'")
        if self.network == "recurrent":
            for name in ("rollout_length", "minibatch_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs network='feed_forward': a recurrent "
                                     f"policy trains on whole episodes (or chunk_length "
                                     f"chunks) of them, batch_size at a time")

    def learner_support(self, learners: int) -> str | None:
        """Why BatchPPO with these settings cannot be one of ``learners`` learners, or
        ``None``: each learner must take the same number of gradient steps per update."""
        if self.rollout_length is None:
            return ("several learners need fixed-length rollouts (every learner must take "
                    "the same gradient steps per update): set algorithm.rollout_length")
        for name in ("minibatch_size", "batch_size"):
            value = getattr(self, name)
            if value is not None and value % learners:
                return (f"algorithm.{name} ({value}) is the batch of a gradient step over all "
                        f"learners and must be divisible by train.learners ({learners})")
        return None
