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

from batchrl.algos.base import Algorithm, Summary
from batchrl.errors import UnsupportedSpaceError
from batchrl.parts.replay import ReplayBuffer

__all__ = ["DQN"]


def _mlp(inputs: int, hidden: Sequence[int], outputs: int) -> nn.Sequential:
    """A ReLU MLP ``inputs -> *hidden -> outputs`` with a linear output layer."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(inputs, size), nn.ReLU()]
        inputs = size
    return nn.Sequential(*layers, nn.Linear(inputs, outputs))


class DQN(Algorithm):
    """Double DQN for ``Box`` observations and ``Discrete`` actions.

    Epsilon-greedy acting, epsilon falling linearly from 1 to ``final_epsilon`` over the first
    ``exploration_steps`` env steps (all agents'); from ``learning_starts`` env steps on,
    ``updates_per_step`` gradient steps per env step after every batch step, each a Huber
    loss on ``batch_size`` transitions from the replay buffer against ``r + discount *
    Q_target(s', argmax_a Q(s', a))``; the target network copies the Q-network every
    ``target_update_every`` gradient steps. Evaluation acts greedily (``eval_actions =
    "sample"``: epsilon-greedy with ``final_epsilon``). Observations are not normalised.

    Args:
      observation_space, action_space: a ``Box`` and a ``Discrete`` space.
      num_agents: ``N``, the envs of the batch.
      device: where the networks and the replay buffer live.
      buffer_size, batch_size, learning_starts, updates_per_step, discount, n_step: as SAC's.
      learning_rate: Adam's.
      hidden: hidden layer sizes of the Q-network.
      target_update_every: gradient steps between copies into the target network.
      exploration_steps, final_epsilon: the epsilon schedule.
      max_grad_norm: the gradient's norm is clipped to it.
      save_buffer: keep the replay buffer in checkpoints (exact resume; see SAC).
      eval_actions: ``"mean"`` (greedy) or ``"sample"``.
    """

    per_agent_state = ("buffer",)

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 device: str | torch.device = "cpu", buffer_size: int = 100_000,
                 batch_size: int = 64, learning_starts: int = 1_000,
                 updates_per_step: float = 0.25, discount: float = 0.99, n_step: int = 1,
                 learning_rate: float = 5e-4, hidden: Sequence[int] = (64, 64),
                 target_update_every: int = 500, exploration_steps: int = 10_000,
                 final_epsilon: float = 0.05, max_grad_norm: float = 10.0,
                 save_buffer: bool = True, eval_actions: str = "mean"):
        super().__init__(device, eval_actions)
        if not isinstance(observation_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"DQN needs a Box observation space, got "
                                        f"{observation_space}")
        if not isinstance(action_space, gym.spaces.Discrete):
            raise UnsupportedSpaceError(f"DQN needs a Discrete action space, got {action_space} "
                                        f"(SAC takes Box actions)")
        for name, value, low in (("batch_size", batch_size, 1), ("buffer_size", buffer_size, 1),
                                 ("learning_starts", learning_starts, 0),
                                 ("target_update_every", target_update_every, 1),
                                 ("exploration_steps", exploration_steps, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if updates_per_step <= 0:
            raise ValueError(f"updates_per_step must be > 0, got {updates_per_step}")
        if not 0 <= final_epsilon <= 1:
            raise ValueError(f"final_epsilon must be in [0, 1], got {final_epsilon}")
        self.num_agents, self.actions = num_agents, int(action_space.n)
        self._start = int(action_space.start)
        self.batch_size, self.learning_starts = batch_size, learning_starts
        self.updates_per_step, self.target_update_every = updates_per_step, target_update_every
        self.exploration_steps, self.final_epsilon = exploration_steps, final_epsilon
        self.max_grad_norm, self.save_buffer = max_grad_norm, save_buffer
        obs_size = math.prod(observation_space.shape)
        self.q = _mlp(obs_size, hidden, self.actions).to(self.device)
        self.target_q = copy.deepcopy(self.q).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=learning_rate)
        flat = ((obs_size,), torch.float32)
        self.buffer = ReplayBuffer(num_agents, buffer_size, {
            "observ": flat, "next_observ": flat, "action": ((), torch.int64)},
            discount, n_step, self.device)
        self.env_steps = self.updates = 0
        self._owed = 0.0  # gradient steps due (fractions of one accumulate)

    @property
    def epsilon(self) -> float:
        """The exploration rate of training actions now."""
        if self.exploration_steps == 0:
            return self.final_epsilon
        done = min(1.0, self.env_steps / self.exploration_steps)
        return 1.0 + done * (self.final_epsilon - 1.0)

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        if self.training:  # (a reset may cut an episode: its n-step returns stop there)
            self.buffer.cut(agent_indices)
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        return {}

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

    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        count = len(agent_indices)
        if count != self.num_agents:
            raise ValueError(f"DQN stores every agent's step at once: experience() for "
                             f"{count} of {self.num_agents} agents")
        self.buffer.add(reward=reward, terminated=terminated.bool(), done=done.bool(),
                        observ=observ.reshape(count, -1),
                        next_observ=next_observ.reshape(count, -1),
                        action=action.long() - self._start)
        self.env_steps += count
        # Gradient steps are owed for the env steps past learning_starts.
        learned = self.env_steps - max(self.env_steps - count, self.learning_starts)
        if learned <= 0:
            return {}
        self._owed += self.updates_per_step * learned
        steps = int(self._owed)
        self._owed -= steps
        losses = []
        for _ in range(steps):
            self.check_interrupt()
            losses.append(self._gradient_step())
        if not steps:
            return {}
        return {"dqn/loss": sum(losses) / steps, "dqn/epsilon": self.epsilon}

    def _gradient_step(self) -> float:
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
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.state_dict(), "target_q": self.target_q.state_dict(),
                "optimizer": self.optimizer.state_dict(), "env_steps": self.env_steps,
                "updates": self.updates, "owed": self._owed,
                "buffer": self.buffer.state_dict() if self.save_buffer else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target_q.load_state_dict(state["target_q"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.env_steps, self.updates = int(state["env_steps"]), int(state["updates"])
        self._owed = float(state["owed"])
        if state["buffer"] is not None:
            self.buffer.load_state_dict(state["buffer"])
