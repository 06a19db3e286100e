"""``RolloutAlgorithm``: an algorithm written as an acting part and a learning step on
fixed-length rollouts, which runs in the synchronous loop and with collectors alike.

A subclass implements the decoupled interface of ``Algorithm`` (``behaviour_fields``, ``act``,
``acting_state``, ``load_acting_state``, ``learn``) and ``state_dict``/``load_state_dict``; this
class turns ``act`` and ``learn`` into the four paper methods: it records each step in a
``RolloutBuffer`` and calls ``learn`` every ``rollout_length`` steps. With collectors the trainer
calls ``act`` in their processes and ``learn`` on what they send, so both modes learn from the
same ``Rollout``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch

from batchrl.algos.base import Algorithm, Summary
from batchrl.parts.packing import packing_for, stored_observations
from batchrl.parts.rollout import RolloutBuffer, rollout_tensors
from batchrl.pixels import is_pixel_space

__all__ = ["RolloutAlgorithm"]


class RolloutAlgorithm(Algorithm):
    """Base of algorithms that learn from fixed-length rollouts (see the module docstring).

    Args:
      observation_space, action_space: the env's spaces (actions: Box or Discrete).
      num_agents: the batch size N of the env.
      rollout_length: steps per agent between learning steps (T).
      device: where the rollout buffer (and the subclass's networks) live.

    ``updates`` counts the learning steps of the synchronous loop (rollouts carry it as their
    version). Recurrent state is not supported: ``act`` sees only the observation.
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, num_agents: int,
                 rollout_length: int, device: str | torch.device = "cpu",
                 eval_actions: str = "mean"):
        super().__init__(device, eval_actions)
        if rollout_length < 1:
            raise ValueError(f"rollout_length must be >= 1, got {rollout_length}")
        self.num_agents = num_agents
        self.steps_per_update = rollout_length
        self.observation_space, self.action_space = observation_space, action_space
        self.updates = 0
        self._buffer: RolloutBuffer | None = None  # made on first use: behaviour_fields()
        self._agents = torch.arange(num_agents, device=self.device)
        self._lost: torch.Tensor | None = None  # agents whose next experience() is no step

    @property
    def buffer(self) -> RolloutBuffer:
        """The rollout the synchronous loop is recording (on ``device``; observations as the
        loop gives them: ``uint8`` pixels, else float32; Dict and Tuple ones packed)."""
        if self._buffer is None:
            discrete = isinstance(self.action_space, gym.spaces.Discrete)
            space = self.observation_space
            shape, dtype = stored_observations(
                space, torch.uint8 if is_pixel_space(space) else torch.float32)
            self._buffer = RolloutBuffer(rollout_tensors(
                self.num_agents, self.steps_per_update, shape, dtype,
                () if discrete else self.action_space.shape,
                torch.int64 if discrete else torch.float32, self.behaviour_fields(),
                self.device), packing_for(space))
            self._buffer.start(self._agents, self.updates)
        return self._buffer

    # -- the four paper methods ---------------------------------------------------------

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        if self.training:
            self.buffer.begin_episodes(agent_indices)
        return {}

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        action, behaviour = self.act(observ, deterministic=self.acting_deterministically)
        if self.training:
            self.buffer.act(observ, action, behaviour)
        return action, {}

    def steps_lost(self, agent_indices: torch.Tensor) -> None:
        if self.training:
            self._lost = agent_indices

    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        lost, self._lost = self._lost, None
        buffer = self.buffer
        buffer.outcome(reward, done, terminated, next_observ)
        if lost is not None:  # cut before a full rollout is learned (begin_episodes is later)
            buffer.cut(lost)
        if not buffer.full:
            return {}
        summary = self.learn(buffer.rollout())
        self.updates += 1
        buffer.start(self._agents, self.updates)
        return summary

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        return {}

    # -- checkpoints ----------------------------------------------------------------------

    def rollout_state(self) -> dict[str, Any]:
        """The running rollout (the buffer's own tensors: serialise or copy them before the
        next step) and the update count, for a subclass's ``state_dict``."""
        buffer = self.buffer
        return {"tensors": dict(buffer.tensors), "step": buffer.step, "updates": self.updates}

    def load_rollout_state(self, state: dict[str, Any]) -> None:
        """Restore what ``rollout_state()`` returned."""
        buffer = self.buffer
        for name, tensor in buffer.tensors.items():
            tensor.copy_(state["tensors"][name])
        buffer.step = int(state["step"])
        self.updates = int(state["updates"])
