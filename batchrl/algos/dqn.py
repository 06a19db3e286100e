"""Double DQN (van Hasselt et al., 2016) on batched envs: an epsilon-greedy Q-network learning
from a replay buffer (``batchrl.parts.replay``) against a periodically copied target network,
whose value of the online network's best next action is the bootstrap.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import gymnasium as gym
import torch
from torch import nn
from torch.nn import functional as F

from batchrl.algos.base import Summary
from batchrl.algos.networks import build_torso, mlp
from batchrl.algos.replay import (ReplayAlgorithm, check_buffer_size, check_hyperparameters,
                                  observation_field)
from batchrl.errors import UnsupportedSpaceError
from batchrl.parts.replay import ReplayBuffer

__all__ = ["DQN"]


class DQN(ReplayAlgorithm):
    """Double DQN for ``Box`` observations and ``Discrete`` actions.

    Epsilon-greedy acting, epsilon falling linearly from 1 to ``final_epsilon`` over the first
    ``exploration_steps`` env steps (all agents'); from ``learning_starts`` env steps on,
    ``updates_per_step`` gradient steps per env step after every batch step, each a Huber
    loss on ``batch_size`` transitions from the replay buffer against ``r + discount *
    Q_target(s', argmax_a Q(s', a))``; the target network copies the Q-network every
    ``target_update_every`` gradient steps. Evaluation acts greedily (``eval_actions =
    "sample"``: epsilon-greedy with ``final_epsilon``). Observations are not normalised;
    ``uint8`` images are stored as such and scaled to ``[0, 1]`` where the Q-networks read
    them (flattened, through the MLP).

    Args:
      observation_space, action_space: a ``Box`` and a ``Discrete`` space.
      num_agents: ``N``, the envs of the batch.
      device: where the networks and the replay buffer live.
      buffer_size, batch_size, learning_starts, updates_per_step, discount, n_step: as SAC's.
      learning_rate: Adam's.
      hidden: hidden layer sizes of the Q-network (after its torso).
      torso: what reads the observations first, as BatchPPO's ``torso``: ``"mlp"`` (the flat
        observation), ``"nature_cnn"`` or ``"impala_cnn"`` (for images).
      target_update_every: gradient steps between copies into the target network.
      exploration_steps, final_epsilon: the epsilon schedule.
      max_grad_norm: the gradient's norm is clipped to it.
      save_buffer: keep the replay buffer in checkpoints (exact resume; see SAC).
      eval_actions: ``"mean"`` (greedy) or ``"sample"``.
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 device: str | torch.device = "cpu", buffer_size: int = 100_000,
                 batch_size: int = 64, learning_starts: int = 1_000,
                 updates_per_step: float = 0.25, discount: float = 0.99, n_step: int = 1,
                 learning_rate: float = 5e-4, hidden: Sequence[int] = (64, 64),
                 target_update_every: int = 500, exploration_steps: int = 10_000,
                 final_epsilon: float = 0.05, max_grad_norm: float = 10.0,
                 save_buffer: bool = True, eval_actions: str = "mean", torso: str = "mlp"):
        if not isinstance(observation_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"DQN needs a Box observation space, got "
                                        f"{observation_space}")
        if not isinstance(action_space, gym.spaces.Discrete):
            raise UnsupportedSpaceError(f"DQN needs a Discrete action space, got {action_space} "
                                        f"(SAC takes Box actions)")
        for name, value, low in (("batch_size", batch_size, 1), ("buffer_size", buffer_size, 1),
                                 ("target_update_every", target_update_every, 1),
                                 ("exploration_steps", exploration_steps, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not 0 <= final_epsilon <= 1:
            raise ValueError(f"final_epsilon must be in [0, 1], got {final_epsilon}")
        check_hyperparameters({"learning_rate": learning_rate, "max_grad_norm": max_grad_norm},
                              hidden)
        check_buffer_size(buffer_size, num_agents)
        obs_size = math.prod(observation_space.shape)
        flat = observation_field(observation_space)
        super().__init__(device, eval_actions, num_agents, ReplayBuffer(
            num_agents, buffer_size, {"observ": flat, "next_observ": flat,
                                      "action": ((), torch.int64)},
            discount, n_step, device), learning_starts, updates_per_step, save_buffer)
        self.actions, self._start = int(action_space.n), int(action_space.start)
        self.batch_size, self.target_update_every = batch_size, target_update_every
        self.exploration_steps, self.final_epsilon = exploration_steps, final_epsilon
        self.max_grad_norm = max_grad_norm
        first = build_torso(torso, observation_space)  # (None: the float observation itself)
        features = obs_size if first is None else first.out_size
        self.q = nn.Sequential(*([] if first is None else [first]), *mlp(features, hidden),
                               nn.Linear(hidden[-1] if hidden else features,
                                         self.actions)).to(self.device)
        self.target_q = copy.deepcopy(self.q).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=learning_rate)

    @property
    def epsilon(self) -> float:
        """The exploration rate of training actions now."""
        if self.exploration_steps == 0:
            return self.final_epsilon
        done = min(1.0, self.env_steps / self.exploration_steps)
        return 1.0 + done * (self.final_epsilon - 1.0)

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        count = len(agent_indices)
        greedy = self.q(observ.reshape(count, -1)).argmax(-1)
        if self.acting_deterministically:
            return greedy + self._start, {}
        epsilon = self.epsilon if self.training else self.final_epsilon
        explore = torch.rand(count, device=self.device) < epsilon
        random = torch.randint(self.actions, (count,), device=self.device)
        return torch.where(explore, random, greedy) + self._start, {}

    def stored_action(self, action: torch.Tensor) -> torch.Tensor:
        return action.long() - self._start  # (the Q-network's output index)

    def gradient_step(self) -> dict[str, float | torch.Tensor]:
        """One Huber-loss step of the Q-network (and the target's copy when due)."""
        batch = self.buffer.sample(self.batch_size)
        with torch.no_grad():
            best = self.q(batch["next_observ"]).argmax(-1, keepdim=True)
            bootstrap = self.target_q(batch["next_observ"]).gather(-1, best).squeeze(-1)
            target = batch["reward"] + batch["discount"] * bootstrap
        q = self.q(batch["observ"]).gather(-1, batch["action"][:, None]).squeeze(-1)
        loss = F.smooth_l1_loss(q, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.q.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.target_update_every == 0:
            self.target_q.load_state_dict(self.q.state_dict())
        return {"dqn/loss": loss.detach(), "dqn/epsilon": self.epsilon}

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.state_dict(), "target_q": self.target_q.state_dict(),
                "optimizer": self.optimizer.state_dict(), **self.replay_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target_q.load_state_dict(state["target_q"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_replay_state(state)
