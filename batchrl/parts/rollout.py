"""Fixed-length rollouts: what an acting policy records while the envs step, in one layout for
the synchronous loop, collector processes and the learner.

A rollout holds ``T`` consecutive steps of ``B`` agents across episode boundaries, as TorchBeast's
unrolls do. ``RolloutBuffer`` writes one step at a time into preallocated tensors (which may live in
shared memory, so that a collector process writes straight into the learner's queue);
``Rollout`` is the finished batch an algorithm's ``learn`` reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from batchrl.parts.packing import PackedObservations

Fields = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""name -> ``(shape, dtype)`` of a value recorded per agent and step (shape without B, T)."""


@dataclass
class Rollout:
    """``B`` agents' next ``T`` steps (one device, ``B`` first, then ``T``).

    Attributes:
      observ: ``(B, T + 1, *obs_shape)`` in the observation space's dtype (uint8 images stay
        uint8): ``observ[:, t]`` the observation acted on at step ``t``, ``observ[:, T]`` the one
        after the last step (where that step ended the episode, the next episode's first is not
        known yet: use ``final_observ``).
      action: ``(B, T, *act_shape)``, float32 (Box) or int64 (Discrete).
      reward, done, terminated: ``(B, T)`` float32; ``done`` 1.0 where step ``t`` ended the
        episode (terminated or truncated), ``terminated`` where it reached a terminal state.
      final_observ: ``(B, T, *obs_shape)``: where ``done``, the last observation of the ended
        episode (to bootstrap a truncated one from); zero elsewhere.
      valid: ``(B, T)`` bool: steps a loss may use (an episode cut by a reset or an env restart
        loses its last step, which then ends it without a terminal state).
      behaviour: name -> ``(B, T, ...)``: what the acting policy recorded at each step
        (``Algorithm.behaviour_fields``), e.g. its log-probabilities or distribution parameters.
      agents: ``(B,)`` int64, each row's agent index in the learner's batch of ``num_agents``.
      version: ``(B,)`` int64, the version of the weights that acted in each row.
    """

    observ: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    done: torch.Tensor
    terminated: torch.Tensor
    final_observ: torch.Tensor
    valid: torch.Tensor
    behaviour: dict[str, torch.Tensor]
    agents: torch.Tensor
    version: torch.Tensor

    @property
    def length(self) -> int:
        """``T``, the steps per agent."""
        return self.action.shape[1]

    @property
    def size(self) -> int:
        """``B``, the agents (rows)."""
        return self.action.shape[0]

    def next_observ(self, where: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T, *obs_shape)``: the observation after each step (the ended episode's last one
        where the step ended it); given ``where``, a ``(B, T)`` bool mask, only those steps'
        ``(K, *obs_shape)`` (agent, then step)."""
        done, after, final = self.done.bool(), self.observ[:, 1:], self.final_observ
        if where is not None:
            done, after, final = done[where], after[where], final[where]
        return torch.where(done.reshape(*done.shape, *(1,) * (after.dim() - done.dim())),
                           final, after)

    def to(self, device: str | torch.device) -> "Rollout":
        """This rollout on ``device`` (itself when it is there)."""
        return self._map(lambda tensor: tensor.to(device))

    def clone(self) -> "Rollout":
        """A copy that owns its tensors (of a buffer that will be overwritten)."""
        return self._map(torch.clone)

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> "Rollout":
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values["behaviour"] = {name: function(value) for name, value in self.behaviour.items()}
        return Rollout(**{name: value if name == "behaviour" else function(value)
                          for name, value in values.items()})

    @staticmethod
    def cat(rollouts: Sequence["Rollout"]) -> "Rollout":
        """Rollouts of the same length side by side: ``B`` is the sum of theirs."""
        if len(rollouts) == 1:
            return rollouts[0]
        first = rollouts[0]
        values = {field.name: torch.cat([getattr(r, field.name) for r in rollouts])
                  for field in dataclasses.fields(first) if field.name != "behaviour"}
        values["behaviour"] = {name: torch.cat([r.behaviour[name] for r in rollouts])
                               for name in first.behaviour}
        return Rollout(**values)


def rollout_tensors(num_agents: int, length: int, observ_shape: Sequence[int],
                    observ_dtype: torch.dtype, action_shape: Sequence[int],
                    action_dtype: torch.dtype, behaviour: Fields,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed tensors for a ``RolloutBuffer`` of ``num_agents`` x ``length`` steps: ``Rollout``'s
    fields by name (``behaviour`` fields as ``"behaviour.NAME"``). Allocate them once, or in
    shared memory (``tensor.share_memory_()``) for a buffer another process fills."""
    n, t = num_agents, length
    fields: dict[str, tuple[Sequence[int], torch.dtype]] = {
        "observ": ((n, t + 1, *observ_shape), observ_dtype),
        "action": ((n, t, *action_shape), action_dtype),
        "reward": ((n, t), torch.float32), "done": ((n, t), torch.float32),
        "terminated": ((n, t), torch.float32),
        "final_observ": ((n, t, *observ_shape), observ_dtype),
        "valid": ((n, t), torch.bool),
        "agents": ((n,), torch.int64), "version": ((n,), torch.int64)}
    for name, (shape, dtype) in behaviour.items():
        fields[f"behaviour.{name}"] = ((n, t, *shape), dtype)
    return {name: torch.zeros(tuple(shape), dtype=dtype, device=device)
            for name, (shape, dtype) in fields.items()}


class RolloutBuffer:
    """Records a rollout of ``N`` agents, one step of all of them at a time.

    Args:
      tensors: from ``rollout_tensors`` (their shapes fix ``N``, ``T`` and the fields).
      packing: for Dict and Tuple observations (``packing_for``), which ``act`` and
        ``outcome`` then take as dicts or tuples of tensors and store packed.

    Per step: ``act(observ, action, behaviour)`` before the envs step, ``outcome(reward, done,
    terminated, next_observ)`` after; ``full`` once ``T`` steps were recorded, then ``rollout()``
    views the tensors (clone it before ``clear()`` if it must outlive the next rollout).
    """

    def __init__(self, tensors: dict[str, torch.Tensor],
                 packing: PackedObservations | None = None):
        self.tensors = tensors
        self._packing = packing
        self.num_agents, self.length = tensors["action"].shape[:2]
        self.step = 0
        self._behaviour = {name.partition(".")[2]: value for name, value in tensors.items()
                           if name.startswith("behaviour.")}

    @property
    def full(self) -> bool:
        """All ``T`` steps recorded."""
        return self.step >= self.length

    def start(self, agents: torch.Tensor, version: int) -> None:
        """Begin a new rollout of the learner's agents ``agents`` ``(N,)``, acted by weights
        ``version``."""
        self.step = 0
        self.tensors["agents"].copy_(agents)
        self.tensors["version"].fill_(version)
        for name in ("done", "terminated", "final_observ"):
            self.tensors[name].zero_()
        self.tensors["valid"].fill_(True)

    def act(self, observ: torch.Tensor, action: torch.Tensor,
            behaviour: Mapping[str, torch.Tensor]) -> None:
        """Step ``t``'s observation ``(N, *obs_shape)``, action and behaviour record."""
        t, tensors = self.step, self.tensors
        if t >= self.length:
            raise RuntimeError(f"the rollout already holds its {self.length} steps: start() "
                               f"the next one")
        if self._packing is not None:
            observ = self._packing.pack_all(observ)
        tensors["observ"][:, t].copy_(observ)
        tensors["action"][:, t].copy_(action)
        for name, value in self._behaviour.items():
            value[:, t].copy_(behaviour[name])

    def outcome(self, reward: torch.Tensor, done: torch.Tensor, terminated: torch.Tensor,
                next_observ: torch.Tensor) -> None:
        """Step ``t``'s reward, done and terminated ``(N,)`` and the observation after it
        (``(N, *obs_shape)``, the ended episode's last where ``done``); the next step follows."""
        t, tensors = self.step, self.tensors
        if self._packing is not None:
            next_observ = self._packing.pack_all(next_observ)
        tensors["reward"][:, t].copy_(reward)
        tensors["done"][:, t].copy_(done)
        tensors["terminated"][:, t].copy_(terminated)
        tensors["observ"][:, t + 1].copy_(next_observ)
        if bool(done.any()):
            ended = done.bool()
            tensors["final_observ"][:, t][ended] = next_observ[ended].to(
                tensors["final_observ"].dtype)
        self.step = t + 1

    def begin_episodes(self, agents: torch.Tensor) -> None:
        """New episodes start for ``agents`` ``(K,)``: those whose last recorded step did not
        end an episode were cut (a reset or a restarted env), see ``cut``."""
        if self.step:
            running = self.tensors["done"][agents, self.step - 1] == 0
            self.cut(agents[running])

    def cut(self, agents: torch.Tensor) -> None:
        """The running episodes of ``agents`` ``(K,)`` were cut without a last observation (a
        reset or a restarted env): their last recorded step ends them, bootstrapping from its
        own observation, and is not valid."""
        t, tensors = self.step, self.tensors
        if t == 0:
            return  # nothing of theirs in this rollout yet
        tensors["done"][agents, t - 1] = 1.0
        tensors["terminated"][agents, t - 1] = 0.0
        tensors["final_observ"][agents, t - 1] = tensors["observ"][agents, t - 1]
        tensors["valid"][agents, t - 1] = False

    def rollout(self) -> Rollout:
        """The recorded rollout, as views of the tensors."""
        tensors = self.tensors
        return Rollout(observ=tensors["observ"], action=tensors["action"],
                       reward=tensors["reward"], done=tensors["done"],
                       terminated=tensors["terminated"], final_observ=tensors["final_observ"],
                       valid=tensors["valid"], behaviour=dict(self._behaviour),
                       agents=tensors["agents"], version=tensors["version"])
