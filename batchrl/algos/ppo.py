"""BatchPPO: proximal policy optimisation with an adaptive KL penalty.

As in Hafner et al. (2017), section 3 and 6: collect ``update_every`` whole
episodes, then take ``update_epochs`` full-batch gradient steps on

    policy loss = -E[ratio * advantage] + beta * KL(old || new)
                  + kl_cutoff_coef * max(0, KL - kl_cutoff_factor * kl_target)^2
    value loss  = 1/2 E[(return - V)^2]

and adapt ``beta`` from the KL measured after the update.
"""

from __future__ import annotations

import collections
import copy
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import gymnasium as gym
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal, kl_divergence

from batchrl.algos.base import Algorithm, Summary
from batchrl.algos.networks import (Actor, CategoricalHead, FeedForwardBody, GaussianHead,
                                    Policy, RecurrentBody, ValueNet)
from batchrl.envs.errors import UnsupportedSpaceError
from batchrl.hardware import usable_cores
from batchrl.parts import host
from batchrl.parts.memory import EpisodeMemory
from batchrl.parts.normalize import StreamingNormalizer
from batchrl.parts.returns import discounted_return, generalized_advantage

INFERENCE_MODES = ("script", "eager", "compile")
NETWORKS = ("feed_forward", "recurrent")


@dataclass
class PPOConfig:
    """Hyperparameters of BatchPPO; defaults follow the paper and BatchPPO's code."""

    network: str = "feed_forward"            # or "recurrent" (MLP then GRU)
    policy_layers: tuple[int, ...] = (200, 100)
    value_layers: tuple[int, ...] = (200, 100)
    gru_size: int = 100                       # recurrent policies only
    chunk_length: int | None = None           # recurrent: train on chunks of episodes
    init_std: float = 0.35
    init_output_factor: float = 0.1
    update_every: int = 30                    # episodes per update
    update_epochs: int = 25
    batch_size: int | None = None             # sequences per gradient step; None = all
    policy_lr: float = 1e-4
    value_lr: float = 1e-3
    discount: float = 0.99
    gae_lambda: float | None = None           # None: plain discounted returns
    kl_target: float = 1e-2
    kl_cutoff_factor: float = 2.0
    kl_cutoff_coef: float = 1000.0
    kl_init_penalty: float = 1.0
    max_grad_norm: float | None = None
    normalize_observ: bool = True
    normalize_reward: bool = True
    max_length: int = 1000                    # longest episode (the env's time limit)
    inference: str = "script"                 # "script", "eager" or "compile"
    update_threads: int | None = None         # torch threads in update(); None = all cores

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, got {self.network!r}")
        if self.inference not in INFERENCE_MODES:
            raise ValueError(f"inference must be one of {INFERENCE_MODES}, got {self.inference!r}")
        for name in ("update_every", "update_epochs", "max_length", "gru_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if self.gae_lambda is not None and not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"gae_lambda must be in [0, 1] or None, got {self.gae_lambda}")
        for name in ("init_std", "policy_lr", "value_lr", "kl_target"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("batch_size", "chunk_length", "update_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


class KLPenalty:
    """The adaptive KL coefficient beta of the PPO penalty objective.

    After each update: ``beta *= 1.5`` if ``kl > 1.3 * target``; ``beta /= 1.5``
    if ``kl < 0.7 * target``; unchanged in between (the dead band).
    """

    def __init__(self, target: float, initial: float = 1.0):
        self.target = target
        self.value = initial

    def adapt(self, kl: float) -> float:
        if kl > 1.3 * self.target:
            self.value *= 1.5
        elif kl < 0.7 * self.target:
            self.value /= 1.5
        return self.value


def compile_actor(actor: Actor, mode: str) -> nn.Module:
    """Return ``actor`` compiled for inference: ``"script"`` (TorchScript),
    ``"compile"`` (``torch.compile``) or ``"eager"`` (unchanged). The compiled
    module shares the actor's parameters, so updates are seen at once."""
    if mode == "eager":
        return actor
    if mode == "compile":
        return torch.compile(actor, dynamic=False)
    with warnings.catch_warnings():
        # torch >= 2.10 deprecates TorchScript; it is still the fastest small-batch
        # CPU inference path here, and the warning says nothing actionable to users.
        warnings.filterwarnings("ignore", category=DeprecationWarning,
                                message=r".*torch\.jit\.script.*")
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r".*torch\.jit.*")
        return torch.jit.script(actor)


class BatchPPO(Algorithm):
    """PPO with the adaptive KL penalty, for a batch of ``num_agents`` envs.

    Args:
      observation_space: a Box space (observations are flattened to float32).
      action_space: Box (Gaussian policy) or Discrete (categorical policy).
      num_agents: the batch size N of the env.
      config: hyperparameters (``PPOConfig``).
      device: where networks, memory and statistics live.
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 config: PPOConfig | None = None, device: str | torch.device = "cpu"):
        super().__init__(device)
        self.config = config = config or PPOConfig()
        if not isinstance(observation_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"BatchPPO needs a Box observation space, got "
                                        f"{observation_space}")
        if isinstance(action_space, gym.spaces.Box):
            self.discrete = False
            action_shape, action_dtype = tuple(action_space.shape), torch.float32
            if len(action_shape) != 1:
                raise UnsupportedSpaceError(f"BatchPPO needs a 1-D Box action space, got "
                                            f"{action_space}")
        elif isinstance(action_space, gym.spaces.Discrete):
            self.discrete = True
            action_shape, action_dtype = (), torch.int64
        else:
            raise UnsupportedSpaceError(f"BatchPPO supports Box and Discrete action spaces, got "
                                        f"{action_space}")
        self.num_agents = num_agents
        obs_shape = tuple(observation_space.shape)
        obs_size = math.prod(obs_shape)
        self._obs_shape = obs_shape

        if config.network == "recurrent":
            body = RecurrentBody(obs_size, config.policy_layers, config.gru_size)
        else:
            body = FeedForwardBody(obs_size, config.policy_layers)
        if self.discrete:
            head = CategoricalHead(body.out_size, int(action_space.n), config.init_output_factor)
            param_shape = (int(action_space.n),)
            param_b_shape = (0,)
        else:
            head = GaussianHead(body.out_size, action_shape[0], config.init_std,
                                config.init_output_factor)
            param_shape = param_b_shape = action_shape
        self.policy = Policy(body, head, self.discrete).to(self.device)
        self.value = ValueNet(obs_size, config.value_layers).to(self.device)
        self.actor = compile_actor(Actor(self.policy), config.inference)
        # A TorchScript module's forward, called directly, skips nn.Module's
        # hook handling: 5 us of every step.
        self._act = self.actor.forward if config.inference == "script" else self.actor
        self.policy_optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.policy_lr)
        self.value_optimizer = torch.optim.Adam(self.value.parameters(), lr=config.value_lr)
        self.observ_normalizer = StreamingNormalizer(
            (obs_size,), center=True, scale=True, clip=5.0).to(self.device)
        # Read only by update(): the rewards of 64 steps are merged at once.
        self.reward_normalizer = StreamingNormalizer(
            (), center=False, scale=True, clip=10.0, defer=64 * num_agents).to(self.device)
        self.penalty = KLPenalty(config.kl_target, config.kl_init_penalty)
        self.state_size = body.state_size
        self.recurrent_state = torch.zeros(num_agents, self.state_size, device=self.device)
        self._no_state = torch.zeros(num_agents, 0, device=self.device)
        self.memory = EpisodeMemory(
            num_agents, config.update_every, config.max_length,
            step_fields={"observ": ((obs_size,), torch.float32),
                         "action": (action_shape, action_dtype),
                         "param_a": (param_shape, torch.float32),
                         "param_b": (param_b_shape, torch.float32),
                         "reward": ((), torch.float32),
                         "state": ((self.state_size,), torch.float32)},
            episode_fields={"bootstrap_observ": ((obs_size,), torch.float32),
                            "terminated": ((), torch.float32)},
            device=self.device)
        self.updates = 0
        # Called before every gradient step of an update; it may raise (the
        # trainer's Ctrl-C check) to abandon the update within a fraction of a
        # second. The algorithm's state is then half-updated: the caller must
        # discard it (the trainer keeps a snapshot from the last phase boundary).
        self.interrupt_check: Callable[[], None] | None = None
        # What perform() saw, kept for experience(): oldest first, as the
        # experience of a step may come after the next perform (overlap).
        self._performed: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=2)

    # -- helpers ---------------------------------------------------------------

    def _flatten(self, observ: torch.Tensor) -> torch.Tensor:
        """``(K, *obs_shape)`` -> ``(K, obs_size)`` float32 on ``device``."""
        if observ.dim() != 2:
            observ = observ.reshape(observ.shape[0], -1)
        if observ.dtype != torch.float32 or observ.device != self.device:
            observ = observ.to(self.device, torch.float32)
        return observ

    def _normalize(self, observ: torch.Tensor) -> torch.Tensor:
        observ = self._flatten(observ)
        if self.config.normalize_observ:
            return self.observ_normalizer.transform(observ)
        return observ

    def distribution(self, param_a: torch.Tensor, param_b: torch.Tensor) -> Distribution:
        """The action distribution for parameters from the policy (any batch shape)."""
        if self.discrete:
            return Categorical(logits=param_a)
        return Independent(Normal(param_a, param_b.exp()), 1)

    # -- Algorithm interface -------------------------------------------------------

    # perform() updates the observation statistics it uses itself: it does
    # not depend on the previous experience().
    experience_may_lag = True

    def train(self, mode: bool = True) -> "BatchPPO":
        self._performed.clear()  # a perform() of the other mode gets no experience()
        return super().train(mode)

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        self.recurrent_state[agent_indices] = 0.0
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
        action, param_a, param_b, new_state = self._act(norm_observ, state, not self.training)
        if self.state_size:
            self.recurrent_state[agent_indices] = new_state
        if self.training:
            self._performed.append({"agents": agent_indices, "observ": norm_observ,
                                    "param_a": param_a, "param_b": param_b, "state": state})
            # The statistics change only after this step's observation was
            # normalised with the ones the stored data and the action used.
            self.observ_normalizer.update(flat)
        return action, {}

    @torch.no_grad()
    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        last = self._performed.popleft() if self._performed else None
        # simulate() passes the same index tensor to both: skip the comparison.
        if last is None or (last["agents"] is not agent_indices
                            and not torch.equal(last["agents"], agent_indices)):
            raise RuntimeError("experience() must follow perform() for the same agents")
        self.memory.append(agent_indices, observ=last["observ"], action=action,
                           param_a=last["param_a"], param_b=last["param_b"],
                           reward=reward, state=last["state"])
        done_array = host.view(done)
        if done_array.any() if done_array is not None else bool(done.any()):
            ended = done.bool()
            self.memory.set_episode(agent_indices[ended],
                                    bootstrap_observ=self._normalize(next_observ[ended]),
                                    terminated=terminated[ended])
        self.reward_normalizer.update(reward)
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        self.memory.finish(agent_indices)
        if not self.memory.full:
            return {}
        summary = self.update()
        self.memory.clear()
        return summary

    # -- learning ------------------------------------------------------------------

    def _chunks(self, data: dict[str, torch.Tensor], length: torch.Tensor
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Split episodes ``(E, T, ...)`` into ``(E * T / C, C, ...)`` chunks for
        recurrent training; each chunk starts from the state stored at its first
        step. Feed-forward policies keep whole episodes."""
        chunk = self.config.chunk_length
        if self.state_size == 0 or chunk is None:
            return data, torch.arange(data["reward"].shape[1], device=self.device)[None] < length[:, None]
        steps = data["reward"].shape[1]
        padded = -(-steps // chunk) * chunk
        mask = torch.arange(padded, device=self.device)[None] < length[:, None]
        result = {}
        for name, value in data.items():
            if name in self.memory.episode_fields:
                continue
            pad = value.new_zeros((value.shape[0], padded - steps, *value.shape[2:]))
            value = torch.cat([value, pad], 1)
            result[name] = value.reshape(value.shape[0] * padded // chunk, chunk, *value.shape[2:])
        chunk_mask = mask.reshape(-1, chunk)
        keep = chunk_mask.any(1)
        return {name: value[keep] for name, value in result.items()}, chunk_mask[keep]

    def _policy_terms(self, batch: dict[str, torch.Tensor], mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Surrogate, KL(old || new), entropy (masked means) and the per-step log-ratio
        (zero at padded steps)."""
        param_a, param_b, _ = self.policy(batch["observ"], batch["state"][:, 0])
        new = self.distribution(param_a, param_b)
        old = self.distribution(batch["param_a"], batch["param_b"])
        # Padded steps hold arbitrary data whose ratio or KL can overflow to inf, and
        # inf * 0 is nan: select them away with where() before masking, not after.
        valid = mask > 0
        log_ratio = torch.where(
            valid, new.log_prob(batch["action"]) - old.log_prob(batch["action"]), 0.0)
        count = mask.sum().clamp(min=1)
        surrogate = -(torch.exp(log_ratio) * batch["advantage"] * mask).sum() / count
        kl = (torch.where(valid, kl_divergence(old, new), 0.0) * mask).sum() / count
        entropy = (new.entropy() * mask).sum() / count
        return surrogate, kl, entropy, log_ratio

    def update(self) -> Summary:
        """Learn from the episodes in memory; returns the update's summary.

        Runs with ``update_threads`` torch threads (all usable cores by
        default): envs step in lockstep with the learner, so they are idle now.
        """
        threads = torch.get_num_threads()
        torch.set_num_threads(self.config.update_threads or usable_cores())
        try:
            return self._update()
        finally:
            torch.set_num_threads(threads)

    def _update(self) -> Summary:
        config = self.config
        data, length = self.memory.data()
        data = dict(data)
        with torch.no_grad():
            value = self.value(data["observ"])
            bootstrap = self.value(data["bootstrap_observ"]) * (1.0 - data["terminated"])
            reward = data["reward"]
            if config.normalize_reward:
                reward = self.reward_normalizer.transform(reward)
            if config.gae_lambda is None:
                returns = discounted_return(reward, length, config.discount, bootstrap)
                advantage = returns - value
            else:
                advantage = generalized_advantage(reward, value, length, config.discount,
                                                  config.gae_lambda, bootstrap)
                returns = advantage + value
            valid = torch.arange(reward.shape[1], device=self.device)[None] < length[:, None]
            adv_valid = advantage[valid]
            advantage = (advantage - adv_valid.mean()) / (adv_valid.std() + 1e-8)
            advantage = advantage * valid
        data["advantage"], data["returns"] = advantage, returns
        batches, mask = self._chunks(data, length)

        totals = {"policy_loss": 0.0, "value_loss": 0.0, "grad_norm": 0.0, "kl_cutoff": 0.0}
        steps = 0
        for _ in range(config.update_epochs):
            order = torch.randperm(mask.shape[0], device=self.device)
            size = config.batch_size or mask.shape[0]
            for start in range(0, mask.shape[0], size):
                if self.interrupt_check is not None:
                    self.interrupt_check()
                rows = order[start:start + size]
                batch = {name: value[rows] for name, value in batches.items()}
                batch_mask = mask[rows].float()
                count = batch_mask.sum().clamp(min=1)

                surrogate, kl, _, _ = self._policy_terms(batch, batch_mask)
                cutoff = config.kl_cutoff_coef * torch.relu(
                    kl - config.kl_cutoff_factor * config.kl_target) ** 2
                policy_loss = surrogate + self.penalty.value * kl + cutoff
                self.policy_optimizer.zero_grad(set_to_none=True)
                policy_loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(
                    self.policy.parameters(), config.max_grad_norm or float("inf"))
                self.policy_optimizer.step()

                value_loss = 0.5 * (((batch["returns"] - self.value(batch["observ"])) ** 2)
                                    * batch_mask).sum() / count
                self.value_optimizer.zero_grad(set_to_none=True)
                value_loss.backward()
                if config.max_grad_norm:
                    nn.utils.clip_grad_norm_(self.value.parameters(), config.max_grad_norm)
                self.value_optimizer.step()

                totals["policy_loss"] += float(policy_loss.detach())
                totals["value_loss"] += float(value_loss.detach())
                totals["grad_norm"] += float(grad_norm)
                totals["kl_cutoff"] += float(cutoff.detach())
                steps += 1

        with torch.no_grad():
            surrogate, kl, entropy, _ = self._policy_terms(batches, mask.float())
            kl = float(kl)
            value = self.value(data["observ"])
            residual = (returns - value)[valid]
            explained = 1.0 - float(residual.var() / (returns[valid].var() + 1e-8))
        beta_used = self.penalty.value
        self.penalty.adapt(kl)
        self.updates += 1
        summary = {f"ppo/{name}": total / steps for name, total in totals.items()}
        summary["ppo/total_loss"] = summary["ppo/policy_loss"] + summary["ppo/value_loss"]
        summary.update({"ppo/kl": kl, "ppo/beta": beta_used, "ppo/beta_next": self.penalty.value,
                        "ppo/entropy": float(entropy), "ppo/explained_variance": explained,
                        "ppo/updates": float(self.updates)})
        return summary

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config),
                "policy": self.policy.state_dict(), "value": self.value.state_dict(),
                "policy_optimizer": self.policy_optimizer.state_dict(),
                "value_optimizer": self.value_optimizer.state_dict(),
                "observ_normalizer": self.observ_normalizer.state_dict(),
                "reward_normalizer": self.reward_normalizer.state_dict(),
                "kl_penalty": self.penalty.value, "updates": self.updates,
                "recurrent_state": self.recurrent_state,
                "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.value.load_state_dict(state["value"])
        # Adam keeps the moment tensors it is given: copy them, so two
        # algorithms loaded from one state never share optimiser state.
        self.policy_optimizer.load_state_dict(copy.deepcopy(state["policy_optimizer"]))
        self.value_optimizer.load_state_dict(copy.deepcopy(state["value_optimizer"]))
        self.observ_normalizer.load_state_dict(state["observ_normalizer"])
        self.reward_normalizer.load_state_dict(state["reward_normalizer"])
        self.penalty.value = float(state["kl_penalty"])
        self.updates = int(state["updates"])
        self.recurrent_state.copy_(state["recurrent_state"])
        self.memory.load_state_dict(state["memory"])
