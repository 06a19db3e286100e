"""Episode buffers: one running episode per agent, and the episodes kept for an update."""

from __future__ import annotations

from typing import Mapping

import torch

from batchrl.parts import numpy_views


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
        self._shapes = {name: torch.Size(shape) for name, (shape, _) in step_fields.items()}
        self._ones = torch.ones(num_agents, dtype=torch.int64, device=self.device)
        self._make_views()
        # An upper bound of running_length.max(), kept without reading the
        # tensor: append checks the real lengths only when it reaches max_length.
        self._longest = 0
        self.episode_fields = frozenset(episode_fields)

    def _make_views(self) -> None:
        """``_flat``: ``(N * T, *shape)`` views of the running step buffers
        (``None`` for zero-width fields); ``_views``: numpy views of
        ``running_length`` and of those, for ``append`` on the CPU (see
        ``batchrl.parts.numpy_views``), or ``None`` for torch operations."""
        rows = self.num_agents * self.max_length
        self._flat = {name: self.running[name].view(rows, *shape)
                      if self.running[name].numel() else None
                      for name, shape in self._shapes.items()}
        length = numpy_views.view(self.running_length)
        self._views = None if length is None else (
            length, {name: None if flat is None else numpy_views.view(flat)
                     for name, flat in self._flat.items()})

    # A copy (deepcopy, pickle) makes views of its own buffers: copied views
    # would be copies.
    def __getstate__(self) -> dict[str, object]:
        return {name: value for name, value in self.__dict__.items()
                if name not in ("_flat", "_views")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._make_views()

    def append(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store one step for each agent; every step field must be given, ``(K, *shape)``."""
        if values.keys() != self.step_fields:
            raise KeyError(f"append needs exactly the step fields {sorted(self.step_fields)}, "
                           f"got {sorted(values)}")
        count = agent_indices.shape[0]
        for name, value in values.items():
            # (numpy would broadcast some wrong shapes without a word; zero-width
            # fields are never written)
            if self._flat[name] is not None and (value.shape[0] != count
                                                 or value.shape[1:] != self._shapes[name]):
                raise ValueError(f"append: {name!r} must have shape "
                                 f"{(count, *self._shapes[name])}, got {tuple(value.shape)}")
        if count == 0:
            return
        if self._longest + 1 > self.max_length:
            # The cheap bound says an episode may be full: look at the lengths.
            self._longest = int(self.running_length.max())
            if int(self.running_length[agent_indices].max()) + 1 > self.max_length:
                raise RuntimeError(
                    f"an episode ran longer than max_length={self.max_length} steps; set "
                    f"max_length to at least the env's time limit")
        if self._views is not None and self._append_views(agent_indices, values):
            return
        steps = self.running_length[agent_indices]
        # Rows of the (N * T, *shape) views: one index_copy_ per field, the
        # cheapest scatter for the handful of rows of one env step.
        rows = steps.add_(agent_indices, alpha=self.max_length)
        for name, value in values.items():
            flat = self._flat[name]
            if flat is not None:  # zero-width fields (no recurrent state) cost nothing
                if value.requires_grad:  # stored data, not part of a graph
                    value = value.detach()
                flat.index_copy_(0, rows, value if value.dtype == flat.dtype
                                 else value.to(flat.dtype))
        self.running_length.index_add_(0, agent_indices, self._ones[:agent_indices.shape[0]])
        self._longest += 1

    def _append_views(self, agent_indices: torch.Tensor, values: dict[str, torch.Tensor]) -> bool:
        """``append`` in numpy; False (nothing written) when some tensor is not
        readable by numpy."""
        length, flats = self._views
        arrays = {name: numpy_views.view(value) for name, value in values.items()
                  if flats[name] is not None}
        agents = numpy_views.view(agent_indices)
        if agents is None or any(array is None for array in arrays.values()):
            return False
        rows = length[agents]
        rows += agents * self.max_length
        for name, array in arrays.items():
            flats[name][rows] = array
        length[agents] += 1  # agents are distinct: no repeated index to lose
        self._longest += 1
        return True

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


class RolloutMemory:
    """Fixed-length rollouts: the next ``length`` steps of every agent, across
    episode boundaries, for algorithms that update every ``length`` steps
    instead of after whole episodes.

    Args:
      num_agents: batch size N of the env.
      length: steps per agent in one rollout (T).
      step_fields: name -> ``(shape, dtype)`` of values stored every step.
      end_fields: name -> ``(shape, dtype)`` of values stored at the last
        step of a segment (the state after it: a final observation, whether
        it was terminal), zero elsewhere.
      device: where every buffer lives.

    A rollout splits into segments, stretches of one episode. A segment ends
    where its episode ended or where the rollout is cut (``end_segments``),
    or it is dropped (``discard``) when its episode was cut without a state to
    bootstrap from. Buffers are ``(N, T, *shape)``; ``ends`` ``(N, T)`` bool
    marks the last step of each segment and ``valid`` ``(N, T)`` bool the
    steps an update may use. Writes index by agent, never loop over agents.
    """

    def __init__(self, num_agents: int, length: int,
                 step_fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 end_fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]] = {},
                 device: str | torch.device = "cpu"):
        if length < 1:
            raise ValueError(f"a rollout needs length >= 1, got {length}")
        self.num_agents, self.length = num_agents, length
        self.device = torch.device(device)
        fields = {**step_fields, **end_fields,
                  "ends": ((), torch.bool), "valid": ((), torch.bool)}
        self.buffers = {name: torch.zeros((num_agents, length, *shape), dtype=dtype,
                                          device=self.device)
                        for name, (shape, dtype) in fields.items()}
        self.step_fields = frozenset(step_fields)
        self.end_fields = frozenset(end_fields)
        self._shapes = {name: torch.Size(shape) for name, (shape, _) in fields.items()}
        self._widths = {name: shape.numel() for name, shape in self._shapes.items()}
        # Steps stored per agent, and where each agent's running segment began.
        self.steps = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        self.segment_start = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        # Kept in Python, as they are read at every step: the rows stored in
        # all, and an upper bound of steps.max().
        self._stored = 0
        self._longest = 0

    def _rows(self, agent_indices: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Rows of the ``(N * T, ...)`` views for these agents at these steps."""
        return agent_indices * self.length + steps

    def _flat(self, name: str) -> torch.Tensor:
        buffer = self.buffers[name]
        return buffer.view(self.num_agents * self.length, *buffer.shape[2:])

    def append(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store one step for each agent; every step field must be given, ``(K, *shape)``."""
        if values.keys() != self.step_fields:
            raise KeyError(f"append needs exactly the step fields {sorted(self.step_fields)}, "
                           f"got {sorted(values)}")
        count = agent_indices.shape[0]
        for name, value in values.items():
            # (zero-width fields, such as no recurrent state, are never written)
            if self._widths[name] and (value.shape[0] != count
                                       or value.shape[1:] != self._shapes[name]):
                raise ValueError(f"append: {name!r} must have shape "
                                 f"{(count, *self._shapes[name])}, got {tuple(value.shape)}")
        if count == 0:
            return
        if self._longest >= self.length:
            # The cheap bound says an agent may be full: look at the counts.
            self._longest = int(self.steps.max())
            if int(self.steps[agent_indices].max()) >= self.length:
                raise RuntimeError(f"the rollout of some agent already holds length="
                                   f"{self.length} steps; clear() the memory after an update")
        steps = self.steps[agent_indices]
        rows = self._rows(agent_indices, steps)
        for name, value in values.items():
            if self._widths[name]:
                flat = self._flat(name)
                flat.index_copy_(0, rows, value.detach().to(flat.dtype))
        self._flat("valid").index_fill_(0, rows, True)
        self.steps.index_add_(0, agent_indices, torch.ones_like(steps))
        self._stored += count
        self._longest += 1

    def end_segments(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """The running segments of these agents end at their last stored step
        (their episode ended, or the rollout is cut there); ``values`` are the
        end fields ``(K, *shape)`` of the state after that step. Agents with
        no step in their running segment are left alone."""
        unknown = set(values) - self.end_fields
        if unknown:
            raise KeyError(f"{sorted(unknown)[0]!r} is not an end field; known: "
                           f"{sorted(self.end_fields)}")
        steps = self.steps[agent_indices]
        started = steps > self.segment_start[agent_indices]
        rows = self._rows(agent_indices, steps - 1)[started]
        self._flat("ends").index_fill_(0, rows, True)
        for name, value in values.items():
            flat = self._flat(name)
            flat.index_copy_(0, rows, value[started].detach().to(flat.dtype))
        self.segment_start[agent_indices] = steps

    def discard(self, agent_indices: torch.Tensor) -> None:
        """The running episodes of these agents were cut with no state to
        bootstrap from (an env reset or restart): their running segments stay
        out of the update."""
        steps = self.steps[agent_indices]
        start = self.segment_start[agent_indices]
        time = torch.arange(self.length, device=self.device)
        dropped = (time >= start[:, None]) & (time < steps[:, None])
        self.buffers["valid"][agent_indices] &= ~dropped
        # An end, so that nothing after it reaches into the dropped steps.
        started = steps > start
        self._flat("ends").index_fill_(0, self._rows(agent_indices, steps - 1)[started], True)
        self.segment_start[agent_indices] = steps

    @property
    def full(self) -> bool:
        """Every agent stored ``length`` steps."""
        return self._stored >= self.num_agents * self.length

    @property
    def stored(self) -> int:
        """Steps stored over all agents."""
        return self._stored

    def data(self) -> dict[str, torch.Tensor]:
        """Every buffer, ``(N, T, ...)``: the step and end fields, ``ends`` and
        ``valid``. Steps an agent did not store yet are not valid."""
        return dict(self.buffers)

    def clear(self) -> None:
        """Start the next rollout (after an update); episodes go on in it."""
        for name, buffer in self.buffers.items():
            if name in self.end_fields or name in ("ends", "valid"):
                buffer.zero_()
        self.steps.zero_()
        self.segment_start.zero_()
        self._stored = self._longest = 0

    def state_dict(self) -> dict[str, object]:
        """Buffers and counters, for exact resumption mid-rollout."""
        return {"buffers": dict(self.buffers), "steps": self.steps,
                "segment_start": self.segment_start}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        for name, buffer in self.buffers.items():
            buffer.copy_(state["buffers"][name])
        self.steps.copy_(state["steps"])
        self.segment_start.copy_(state["segment_start"])
        self._stored = int(self.steps.sum())
        self._longest = int(self.steps.max()) if self.num_agents else 0
