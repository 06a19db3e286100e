"""Episode buffers: one running episode per agent, and the episodes kept for an update."""

from __future__ import annotations

from typing import Mapping

import torch


class EpisodeMemory:
    """Preallocated tensors for the running episodes and the update memory.

    Args:
      num_agents: batch size N of the env.
      capacity: episodes kept for one update (``update_every``).
      max_length: longest possible episode T (the env's time limit).
      step_fields: name -> ``(shape, dtype)`` of values stored every step.
      episode_fields: name -> ``(shape, dtype)`` of values stored once per
        episode (e.g. the observation after the last step).
      device: where every buffer lives.

    Running buffers are ``(N, T, *shape)``, the update memory
    ``(capacity, T, *shape)``. Writes index by agent, never loop over agents.
    """

    def __init__(self, num_agents: int, capacity: int, max_length: int,
                 step_fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 episode_fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = {},
                 device: str | torch.device = "cpu"):
        self.num_agents, self.capacity, self.max_length = num_agents, capacity, max_length
        self.device = torch.device(device)

        def alloc(rows: int, fields, per_step: bool) -> dict[str, torch.Tensor]:
            time = (max_length,) if per_step else ()
            return {name: torch.zeros((rows, *time, *shape), dtype=dtype, device=self.device)
                    for name, (shape, dtype) in fields.items()}

        self.running = alloc(num_agents, step_fields, True)
        self.running.update(alloc(num_agents, episode_fields, False))
        self.running_length = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        self.stored = alloc(capacity, step_fields, True)
        self.stored.update(alloc(capacity, episode_fields, False))
        self.stored_length = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.count = 0
        self.step_fields = frozenset(step_fields)
        self._flat = {name: self.running[name].view(num_agents * max_length, *shape)
                      if self.running[name].numel() else None
                      for name, (shape, _) in step_fields.items()}
        self._ones = torch.ones(num_agents, dtype=torch.int64, device=self.device)
        # An upper bound of running_length.max(), kept without reading the
        # tensor: append checks the real lengths only when it reaches max_length.
        self._longest = 0
        self.episode_fields = frozenset(episode_fields)

    def append(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store one step for each agent; every step field must be given, ``(K, *shape)``."""
        if values.keys() != self.step_fields:
            raise KeyError(f"append needs exactly the step fields {sorted(self.step_fields)}, "
                           f"got {sorted(values)}")
        if agent_indices.shape[0] == 0:
            return
        if self._longest + 1 > self.max_length:
            # The cheap bound says an episode may be full: look at the lengths.
            self._longest = int(self.running_length.max())
            if int(self.running_length[agent_indices].max()) + 1 > self.max_length:
                raise RuntimeError(
                    f"an episode ran longer than max_length={self.max_length} steps; set "
                    f"max_length to at least the env's time limit")
        steps = self.running_length[agent_indices]
        # Rows of the (N * T, *shape) views: one index_copy_ per field, the
        # cheapest scatter for the handful of rows of one env step.
        rows = steps.add_(agent_indices, alpha=self.max_length)
        for name, value in values.items():
            flat = self._flat[name]
            if flat is not None:  # zero-width fields (no recurrent state) cost nothing
                flat.index_copy_(0, rows, value if value.dtype == flat.dtype
                                 else value.to(flat.dtype))
        self.running_length.index_add_(0, agent_indices, self._ones[:agent_indices.shape[0]])
        self._longest += 1

    def set_episode(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store per-episode values (``(K, *shape)``) for these agents' running episodes."""
        for name, value in values.items():
            if name not in self.episode_fields:
                raise KeyError(f"{name!r} is not an episode field; known: "
                               f"{sorted(self.episode_fields)}")
            self.running[name][agent_indices] = value.to(self.running[name].dtype)

    def discard(self, agent_indices: torch.Tensor) -> None:
        """Forget the running episodes of these agents."""
        self.running_length[agent_indices] = 0

    def finish(self, agent_indices: torch.Tensor) -> int:
        """Move these agents' episodes into the update memory, as far as it has
        room (extra episodes are dropped), and clear their running buffers.

        Returns the number of episodes stored."""
        room = self.capacity - self.count
        keep = agent_indices[:room]
        stored = int(keep.numel())
        if stored:
            slots = slice(self.count, self.count + stored)
            for name, buffer in self.running.items():
                self.stored[name][slots] = buffer[keep]
            self.stored_length[slots] = self.running_length[keep]
            self.count += stored
        self.discard(agent_indices)
        return stored

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def data(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The stored episodes and their lengths ``(count,)``.

        Step fields are ``(count, T', ...)`` with ``T'`` the longest stored
        episode (later steps are padding in every row), episode fields
        ``(count, ...)``.
        """
        length = self.stored_length[:self.count]
        longest = int(length.max()) if self.count else 0
        return ({name: value[:self.count, :longest] if name in self.step_fields
                 else value[:self.count] for name, value in self.stored.items()}, length)

    def clear(self) -> None:
        """Empty the update memory (running episodes are kept)."""
        self.count = 0

    def state_dict(self) -> dict[str, object]:
        """Buffers and counters, for exact resumption mid-collection."""
        return {"running": dict(self.running), "running_length": self.running_length,
                "stored": dict(self.stored), "stored_length": self.stored_length,
                "count": self.count}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        for name in self.running:
            self.running[name].copy_(state["running"][name])
            self.stored[name].copy_(state["stored"][name])
        self.running_length.copy_(state["running_length"])
        self.stored_length.copy_(state["stored_length"])
        self._longest = int(self.running_length.max()) if self.num_agents else 0
        self.count = int(state["count"])
