"""``ReplayAlgorithm``: what every off-policy algorithm does around its gradient step (SAC,
DQN): store each batch step in a replay buffer and learn at a set update-to-data ratio."""

from __future__ import annotations

import math
from typing import Any, Sequence

import gymnasium as gym
import torch

from batchrl.algos.base import Algorithm, Summary
from batchrl.parts.replay import ReplayBuffer
from batchrl.pixels import is_pixel_space


def check_hyperparameters(positive: dict[str, float], layers: Sequence[int] = ()) -> None:
    """Raise ``ValueError`` naming the first of ``positive`` that is not a finite number above
    zero, or ``layers`` (hidden sizes) if one of them is below 1."""
    for name, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    if any(size < 1 for size in layers):
        raise ValueError(f"hidden must be layer sizes >= 1, got {list(layers)}")


def check_buffer_size(buffer_size: int, num_agents: int) -> None:
    """Raise ``ValueError`` unless a buffer of ``buffer_size`` transitions holds at least one
    batch step of ``num_agents`` agents."""
    if buffer_size < num_agents:
        raise ValueError(f"buffer_size ({buffer_size}) must hold at least one transition per "
                         f"agent ({num_agents} agents: env.num_agents)")


def observation_field(space: gym.spaces.Box) -> tuple[tuple[int], torch.dtype]:
    """The replay buffer's field of flattened ``space`` observations: ``uint8`` pixels stay
    ``uint8`` (a quarter of the bytes), other observations are ``float32``."""
    return (math.prod(space.shape),), torch.uint8 if is_pixel_space(space) else torch.float32



class ReplayAlgorithm(Algorithm):
    """The four methods of an off-policy algorithm on a ``ReplayBuffer``: a subclass acts
    (``perform``) and learns (``gradient_step``).

    Every batch step, all agents' transitions go to ``buffer`` (the action as
    ``stored_action`` makes it); from ``learning_starts`` env steps (all agents') on, the
    algorithm owes ``updates_per_step`` gradient steps per env step (fractions accumulate) and
    takes them after the batch step. A reset cuts the agents' n-step returns. ``replay_state``
    and ``load_replay_state`` cover the counters, the summary's running sums and (with
    ``save_buffer``) the buffer; resumed without its buffer, the algorithm acts on but takes no
    gradient step until the buffer holds ``learning_starts`` transitions again. The
    gradient steps' scalars are averaged and returned once per ``summary_every`` env steps
    (not every batch step: at one gradient step per env step that would be a log record per
    step).

    Args:
      device, eval_actions: ``Algorithm``'s.
      num_agents: ``N``; every ``experience`` holds all of them.
      buffer: the replay buffer, ``N`` agents wide.
      learning_starts: env steps before the first gradient step.
      updates_per_step: gradient steps per env step.
      save_buffer: keep the buffer in ``replay_state`` (checkpoints: exact resume).
    """

    per_agent_state = ("buffer",)
    summary_every = 1000  # env steps (all agents') between summaries of the gradient steps

    def __init__(self, device: str | torch.device, eval_actions: str, num_agents: int,
                 buffer: ReplayBuffer, learning_starts: int, updates_per_step: float,
                 save_buffer: bool):
        super().__init__(device, eval_actions)
        if learning_starts < 0:
            raise ValueError(f"learning_starts must be >= 0, got {learning_starts}")
        check_hyperparameters({"updates_per_step": updates_per_step})
        self.num_agents, self.buffer = num_agents, buffer
        self.learning_starts, self.updates_per_step = learning_starts, updates_per_step
        self.save_buffer = save_buffer
        self.env_steps = 0  # training env steps, all agents'
        self.updates = 0    # gradient steps taken
        self._owed = 0.0    # gradient steps due (fractions of one accumulate)
        # The gradient steps' scalars since the last summary (tensors stay on the device).
        self._totals: dict[str, float | torch.Tensor] = {}
        self._counted = 0
        self._summarized = 0  # env_steps at the last summary
        self._refill = 0  # transitions the buffer must hold before learning (after a resume)
        self._lost: torch.Tensor | None = None  # agents whose next experience() is no step

    def gradient_step(self) -> dict[str, float | torch.Tensor]:
        """One gradient step from ``buffer``; its scalars, averaged into a summary every
        ``summary_every`` env steps: floats, or 0-dim tensors, which are summed where they are
        and read once per summary (a step on a GPU then never waits to read them)."""
        raise NotImplementedError

    def stored_action(self, action: torch.Tensor) -> torch.Tensor:
        """The action ``experience`` stores for ``action`` (the env's), ``(N, ...)``."""
        return action

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        # A reset, an evaluation's too, may cut a training episode: its n-step returns stop
        # at its newest stored step.
        self.buffer.cut(agent_indices)
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        return {}

    def steps_lost(self, agent_indices: torch.Tensor) -> None:
        if self.training:
            self._lost = agent_indices

    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        if not self.training:
            return {}
        lost, self._lost = self._lost, None
        count = len(agent_indices)
        if count != self.num_agents:
            raise ValueError(f"{type(self).__name__} stores every agent's step at once: "
                             f"experience() for {count} of {self.num_agents} agents")
        self.buffer.add(reward=reward, terminated=terminated.bool(), done=done.bool(), lost=lost,
                        observ=observ.reshape(count, -1),
                        next_observ=next_observ.reshape(count, -1),
                        action=self.stored_action(action))
        taken = count if lost is None else count - len(lost)  # (as the trainer counts them)
        self.env_steps += taken
        if len(self.buffer) < self._refill:  # resumed without the buffer: not from a few
            return {}
        self._refill = 0
        # Gradient steps are owed for the env steps past learning_starts.
        learned = self.env_steps - max(self.env_steps - taken, self.learning_starts)
        if learned <= 0:
            return {}
        self._owed += self.updates_per_step * learned
        steps = int(self._owed)
        self._owed -= steps
        for _ in range(steps):
            self.check_interrupt()
            for name, value in self.gradient_step().items():
                if isinstance(value, torch.Tensor):
                    value = value.detach()
                self._totals[name] = self._totals.get(name, 0.0) + value
            self._counted += 1
        if not self._counted or self.env_steps - self._summarized < self.summary_every:
            return {}
        summary = {name: float(total) / self._counted for name, total in self._totals.items()}
        self._totals, self._counted, self._summarized = {}, 0, self.env_steps
        return summary

    def replay_state(self) -> dict[str, Any]:
        """The counters, the summary's running sums and (with ``save_buffer``) the buffer, for
        ``state_dict``."""
        return {"env_steps": self.env_steps, "updates": self.updates, "owed": self._owed,
                "refill": self._refill,
                "summary": {"totals": dict(self._totals), "counted": self._counted,
                            "summarized": self._summarized},
                "buffer": self.buffer.state_dict() if self.save_buffer else None}

    def load_replay_state(self, state: dict[str, Any]) -> None:
        """Restore the counters, the summary and (when saved) the buffer of a
        ``replay_state()``."""
        self.env_steps, self.updates = int(state["env_steps"]), int(state["updates"])
        self._owed = float(state["owed"])
        summary = state.get("summary")  # (checkpoints before it: a summary from here on)
        self._totals = {} if summary is None else dict(summary["totals"])
        self._counted = 0 if summary is None else int(summary["counted"])
        self._summarized = self.env_steps if summary is None else int(summary["summarized"])
        if state["buffer"] is not None:
            self.buffer.load_state_dict(state["buffer"])
            # (a buffer saved while it refilled: save_buffer turned on after such a resume)
            self._refill = int(state.get("refill", 0))
        else:  # the buffer starts empty: learning waits until it is refilled
            self.buffer.clear()
            self._refill = min(self.learning_starts, self.buffer.capacity)
