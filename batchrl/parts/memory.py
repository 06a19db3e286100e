"""Episode buffers: one running episode per agent, and the episodes kept for an update."""

from __future__ import annotations

from typing import Mapping

import torch

from batchrl.parts import numpy_views

_Fields = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)


def _check_append(values: Mapping[str, torch.Tensor], step_fields: frozenset[str],
                  shapes: Mapping[str, torch.Size], count: int) -> None:
    """Check ``values``: exactly ``step_fields``, each in ``shapes`` ``(count, *shape)``."""
    if values.keys() != step_fields:
        raise KeyError(f"append needs exactly the step fields {sorted(step_fields)}, "
                       f"got {sorted(values)}")
    for name, value in values.items():
        shape = shapes.get(name)  # (numpy would broadcast some wrong shapes without a word)
        if shape is not None and (value.shape[0] != count or value.shape[1:] != shape):
            raise ValueError(f"append: {name!r} must have shape {(count, *shape)}, got "
                             f"{tuple(value.shape)}")


class EpisodeMemory:
    """Preallocated tensors for the running episodes and the update memory.

    Args:
      num_agents: batch size N of the env.
      capacity: episodes kept for one update (``update_every``).
      max_length: longest possible episode T (the env's time limit).
      step_fields, episode_fields: name -> ``(shape, dtype)`` of values stored every
        step, and once per episode (e.g. the observation after the last step).

    Running buffers are ``(N, T, *shape)``, the update memory ``(capacity, T, *shape)`` (episode
    fields without ``T``), all on ``device``. Writes index by agent, never loop over agents.
    """

    def __init__(self, num_agents: int, capacity: int, max_length: int, step_fields: _Fields,
                 episode_fields: _Fields = {}, device: str | torch.device = "cpu"):
        self.num_agents, self.capacity, self.max_length = num_agents, capacity, max_length
        self.device = torch.device(device)

        def alloc(rows: int) -> dict[str, torch.Tensor]:
            return {name: torch.zeros((rows, *time, *shape), dtype=dtype, device=self.device)
                    for fields, time in ((step_fields, (max_length,)), (episode_fields, ()))
                    for name, (shape, dtype) in fields.items()}

        self.running, self.stored = alloc(num_agents), alloc(capacity)
        self.running_length = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        self.stored_length = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.count = 0
        self.step_fields, self.episode_fields = frozenset(step_fields), frozenset(episode_fields)
        # The written step fields: zero-width ones (no recurrent state) cost nothing.
        self._shapes = {name: torch.Size(shape) for name, (shape, _) in step_fields.items()
                        if self.running[name].numel()}
        self._ones = torch.ones(num_agents, dtype=torch.int64, device=self.device)
        # A bound of running_length.max() kept without reading it: append looks at max_length.
        self._longest = 0
        self._make_views()

    def _make_views(self) -> None:
        """``_flat``: ``(N * T, *shape)`` views of the written step buffers; ``_views``: numpy
        views of ``running_length`` and of those for ``append``, or ``None`` (torch ops)."""
        self._flat = {name: self.running[name].flatten(0, 1) for name in self._shapes}
        length = numpy_views.view(self.running_length)
        flats = {name: numpy_views.view(flat) for name, flat in self._flat.items()}
        self._views = (None if length is None or any(v is None for v in flats.values())
                       else (length, flats))

    # A copy (deepcopy, pickle) makes views of its own buffers, not copies of these.
    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_flat", "_views")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._make_views()

    def append(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store one step for each agent; every step field must be given, ``(K, *shape)``."""
        count = agent_indices.shape[0]
        _check_append(values, self.step_fields, self._shapes, count)
        if count == 0:
            return
        if self._longest + 1 > self.max_length:  # an episode may be full: look at the lengths
            self._longest = int(self.running_length.max())
            if int(self.running_length[agent_indices].max()) + 1 > self.max_length:
                raise RuntimeError(f"an episode ran longer than max_length={self.max_length} "
                                   f"steps; set max_length to at least the env's time limit")
        if self._views is not None and self._append_views(agent_indices, values):
            return
        # Rows of the (N * T, *shape) views: index_copy_ is the cheapest scatter here.
        rows = self.running_length[agent_indices].add_(agent_indices, alpha=self.max_length)
        for name, flat in self._flat.items():
            value = values[name]
            if value.requires_grad:  # stored data, not part of a graph
                value = value.detach()
            flat.index_copy_(0, rows, value if value.dtype == flat.dtype else value.to(flat.dtype))
        self.running_length.index_add_(0, agent_indices, self._ones[:count])
        self._longest += 1

    def _append_views(self, agent_indices: torch.Tensor, values: dict[str, torch.Tensor]) -> bool:
        """``append`` in numpy; False (nothing written) when numpy cannot read some tensor."""
        length, flats = self._views
        arrays = {name: numpy_views.view(values[name]) for name in flats}
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
        """Move these agents' episodes into the update memory as far as it has room
        (the rest are dropped), clear their running buffers; returns the number stored."""
        keep = agent_indices[:self.capacity - self.count]
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
        """Whether ``capacity`` episodes are stored."""
        return self.count >= self.capacity

    def data(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The stored episodes and their lengths ``(count,)``: step fields ``(count, T', ...)``
        with ``T'`` the longest stored episode (padding after each episode's length),
        episode fields ``(count, ...)``."""
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
    """Fixed-length rollouts: the next ``length`` steps of every agent, across episodes.

    Args:
      num_agents, length: batch size N of the env, and steps per agent in a rollout (T).
      step_fields, end_fields: name -> ``(shape, dtype)`` of values stored every step,
        and at the last step of a segment only (the state after it).

    A rollout splits into segments, stretches of one episode, which end where the episode
    ended or the rollout is cut (``end_segments``), or are dropped (``discard``). Step
    buffers are ``(N, T, *shape)`` on ``device``; ``ends`` ``(N, T)`` bool marks the last step
    of each segment, ``valid`` the steps an update may use. End fields take a row per segment
    end, not per step (an image to bootstrap from costs its bytes once per segment, not at
    every step); their rows grow when a rollout needs more.
    """

    def __init__(self, num_agents: int, length: int, step_fields: _Fields,
                 end_fields: _Fields = {}, device: str | torch.device = "cpu"):
        if length < 1:
            raise ValueError(f"a rollout needs length >= 1, got {length}")
        self.num_agents, self.length = num_agents, length
        self.device = torch.device(device)
        fields = {**step_fields, "ends": ((), torch.bool), "valid": ((), torch.bool)}
        self.buffers = {name: torch.zeros((num_agents, length, *shape), dtype=dtype,
                                          device=self.device)
                        for name, (shape, dtype) in fields.items()}
        self.step_fields, self.end_fields = frozenset(step_fields), frozenset(end_fields)
        # A row per segment end, in the order they came: its row of the (N * T) steps and
        # its values. Every rollout ends at least N segments (its cut): room for N at first.
        self._end_count = 0
        self._end_rows = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        self._end_values = {name: torch.zeros((num_agents, *shape), dtype=dtype,
                                              device=self.device)
                            for name, (shape, dtype) in end_fields.items()}
        # The written step fields: zero-width ones (no recurrent state) cost nothing.
        self._shapes = {name: torch.Size(shape) for name, (shape, _) in step_fields.items()
                        if torch.Size(shape).numel()}
        # Steps stored per agent, and where each agent's running segment began.
        self.steps = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        self.segment_start = torch.zeros(num_agents, dtype=torch.int64, device=self.device)
        # Read at every step, so kept in Python: rows stored, a bound of steps.max().
        self._stored = self._longest = 0

    def _flat(self, name: str) -> torch.Tensor:
        buffer = self.buffers[name]
        return buffer.view(self.num_agents * self.length, *buffer.shape[2:])

    def append(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """Store one step for each agent; every step field must be given, ``(K, *shape)``."""
        count = agent_indices.shape[0]
        _check_append(values, self.step_fields, self._shapes, count)
        if count == 0:
            return
        if self._longest >= self.length:  # an agent may be full: look at the counts
            self._longest = int(self.steps.max())
            if int(self.steps[agent_indices].max()) >= self.length:
                raise RuntimeError(f"the rollout of some agent already holds length="
                                   f"{self.length} steps; clear() the memory after an update")
        steps = self.steps[agent_indices]
        rows = agent_indices * self.length + steps  # of the (N * T, ...) views
        for name in self._shapes:
            flat = self._flat(name)
            flat.index_copy_(0, rows, values[name].detach().to(flat.dtype))
        self._flat("valid").index_fill_(0, rows, True)
        self.steps.index_add_(0, agent_indices, torch.ones_like(steps))
        self._stored += count
        self._longest += 1

    def end_segments(self, agent_indices: torch.Tensor, **values: torch.Tensor) -> None:
        """The running segments of these agents end at their last stored step (their
        episode ended, or the rollout is cut there); ``values`` are the end fields
        ``(K, *shape)`` of the state after it (zeros for those not given). The ``K`` agents
        must be distinct; those with an empty segment are left alone."""
        unknown = set(values) - self.end_fields
        if unknown:
            raise KeyError(f"{sorted(unknown)[0]!r} is not an end field; known: "
                           f"{sorted(self.end_fields)}")
        steps = self.steps[agent_indices]
        started = steps > self.segment_start[agent_indices]
        rows = (agent_indices * self.length + steps - 1)[started]
        self._flat("ends").index_fill_(0, rows, True)
        first = self._end_count
        last = first + rows.shape[0]
        self._reserve(last)
        self._end_rows[first:last] = rows
        for name, stored in self._end_values.items():
            value = values.get(name)
            if value is None:
                stored[first:last] = 0
            else:
                stored[first:last] = value[started].detach().to(stored.dtype)
        self._end_count = last
        self.segment_start[agent_indices] = steps

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` segment ends (at least twice the old room when it grows)."""
        if rows <= self._end_rows.shape[0]:
            return
        # (a rollout ends at most N * T segments)
        room = min(max(rows, 2 * self._end_rows.shape[0]), self.num_agents * self.length)
        kept = self._end_count

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = old.new_zeros((room, *old.shape[1:]))
            new[:kept] = old[:kept]
            return new

        self._end_rows = grown(self._end_rows)
        self._end_values = {name: grown(value) for name, value in self._end_values.items()}

    def discard(self, agent_indices: torch.Tensor) -> None:
        """The running episodes of these agents were cut with no state to bootstrap from (an env
        reset or restart): their running segments stay out of the update."""
        steps = self.steps[agent_indices]
        time = torch.arange(self.length, device=self.device)
        dropped = (time >= self.segment_start[agent_indices][:, None]) & (time < steps[:, None])
        self.buffers["valid"][agent_indices] &= ~dropped
        self.end_segments(agent_indices)  # so that nothing after it reaches into the dropped steps

    @property
    def full(self) -> bool:
        """Every agent stored ``length`` steps."""
        return self._stored >= self.num_agents * self.length

    @property
    def stored(self) -> int:
        """Steps stored over all agents."""
        return self._stored

    def data(self) -> dict[str, torch.Tensor]:
        """The step fields, ``ends`` and ``valid``, ``(N, T, ...)`` (steps an agent did not
        store yet are not valid), and the end fields ``(E, ...)``: a row for each of the
        ``E`` segment ends, in the order of ``ends``' true entries (agent, then step), as
        ``buffer[data["ends"]]`` would give them from buffers of every step."""
        data = dict(self.buffers)
        count = self._end_count
        if count != int(data["ends"].sum()):  # (each end row must match one step of ends)
            raise RuntimeError("end_segments was given an agent twice in one call")
        order = torch.argsort(self._end_rows[:count])  # (the rows are distinct)
        data.update({name: value[:count][order] for name, value in self._end_values.items()})
        return data

    def clear(self) -> None:
        """Start the next rollout (after an update); episodes go on in it."""
        for name in ("ends", "valid"):
            self.buffers[name].zero_()
        self._end_count = 0
        self.steps.zero_()
        self.segment_start.zero_()
        self._stored = self._longest = 0

    def state_dict(self) -> dict[str, object]:
        """Buffers and counters, for exact resumption mid-rollout."""
        count = self._end_count
        # (copies of the filled rows: a saved view would write all the room behind it)
        return {"buffers": dict(self.buffers), "steps": self.steps,
                "segment_start": self.segment_start, "end_rows": self._end_rows[:count].clone(),
                "end_values": {name: value[:count].clone()
                               for name, value in self._end_values.items()}}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        buffers = state["buffers"]
        for name, buffer in self.buffers.items():
            buffer.copy_(buffers[name])
        if "end_rows" in state:
            rows, values = state["end_rows"], state["end_values"]
        else:  # (a checkpoint that kept the end fields at every step)
            rows = buffers["ends"].flatten().nonzero().squeeze(1)
            values = {name: buffers[name].flatten(0, 1)[rows] for name in self.end_fields}
        self._end_count = 0
        self._reserve(rows.shape[0])
        self._end_count = rows.shape[0]
        self._end_rows[:self._end_count] = rows
        for name, value in self._end_values.items():
            value[:self._end_count] = values[name]
        self.steps.copy_(state["steps"])
        self.segment_start.copy_(state["segment_start"])
        self._stored = int(self.steps.sum())
        self._longest = int(self.steps.max()) if self.num_agents else 0
