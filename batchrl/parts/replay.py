"""A replay buffer for off-policy learning: the last transitions of every agent, sampled
uniformly, with n-step returns.

Transitions arrive one batch step at a time (all ``N`` agents) and are kept time-major in
tensors of ``capacity // N`` rows of ``N`` agents on one device, allocated whole when the
first transitions arrive (an algorithm that only evaluates never allocates them) and
overwritten oldest first. Each transition keeps its own next observation, so that a
truncated episode (a time limit) bootstraps from its last observation, while a terminated
one does not.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

Fields = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""name -> ``(shape, dtype)`` of a value stored per transition (shape without N)."""


class ReplayBuffer:
    """The last ``capacity`` transitions of ``num_agents`` agents.

    Args:
      num_agents: ``N``, the transitions each ``add`` stores (one per agent).
      capacity: transitions kept over all agents (rounded down to whole batch steps; at
        least one batch step).
      fields: name -> ``(shape, dtype)`` of the values stored per transition besides
        ``reward``, ``terminated`` and ``done``: ``observ`` and ``next_observ`` (in the
        observation's dtype: uint8 images stay uint8), ``action`` and anything else an
        algorithm keeps.
      discount: the discount of ``sample``'s n-step returns.
      n_step: steps summed into a sampled return before it bootstraps (1: one-step).
      device: where the tensors live.

    ``sample(B)`` draws ``B`` stored transitions uniformly (torch's global generator, which
    the trainer's checkpoints hold) and returns their fields ``(B, ...)`` with ``reward``
    the n-step return, ``next_observ`` the observation to bootstrap from and ``discount``
    ``discount ** m`` (``m`` steps summed), 0 where the episode terminated within them.
    A step ``add`` was told is lost (``lost``) is never drawn.
    """

    def __init__(self, num_agents: int, capacity: int, fields: Fields, discount: float = 0.99,
                 n_step: int = 1, device: str | torch.device = "cpu"):
        for name, value in (("num_agents", num_agents), ("capacity", capacity),
                            ("n_step", n_step)):
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        if num_agents < 1:
            raise ValueError(f"num_agents must be >= 1, got {num_agents}")
        if capacity < num_agents:
            raise ValueError(f"capacity ({capacity}) must hold at least one transition per "
                             f"agent ({num_agents} agents)")
        if n_step < 1:
            raise ValueError(f"n_step must be >= 1, got {n_step}")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        if "next_observ" not in fields:
            raise ValueError("fields must include 'next_observ', the observation after each "
                             "step (a truncated episode's last one), to bootstrap from")
        reserved = {"reward", "terminated", "done"} & set(fields)
        if reserved:
            raise ValueError(f"fields must not name {sorted(reserved)}: the buffer stores them")
        self.num_agents, self.rows = num_agents, capacity // num_agents
        self.discount, self.n_step = discount, n_step
        self.device = torch.device(device)
        shapes = {**{name: (tuple(shape), dtype) for name, (shape, dtype) in fields.items()},
                  "reward": ((), torch.float32), "terminated": ((), torch.bool),
                  "done": ((), torch.bool)}
        self._shapes = {name: ((self.rows, num_agents, *shape), dtype)
                        for name, (shape, dtype) in shapes.items()}
        self._tensors: dict[str, torch.Tensor] | None = None
        self.position = 0   # the row the next add writes
        self.filled = 0     # rows written, up to self.rows
        self._valid: torch.Tensor | None = None
        # How many steps each row holds that sample() must not draw (see add's ``lost``),
        # kept on the host: sampling checks nothing on the device while there are none.
        self._lost_per_row: dict[int, int] = {}
        self._powers = discount ** torch.arange(n_step + 1, device=self.device,
                                                dtype=torch.float32)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> ``(rows, N, *shape)``: every field's storage, allocated on first use."""
        if self._tensors is None:
            try:
                # Every field allocated before any is zeroed: a buffer too large for the
                # memory fails before gigabytes of its first fields were written.
                tensors = {name: torch.empty(shape, dtype=dtype, device=self.device)
                           for name, (shape, dtype) in self._shapes.items()}
                self._tensors = {name: tensor.zero_() for name, tensor in tensors.items()}
            except (MemoryError, RuntimeError) as exc:
                # (torch's CPU allocator raises a RuntimeError that says so)
                if not isinstance(exc, (MemoryError, torch.OutOfMemoryError)) and (
                        "can't allocate memory" not in str(exc)
                        and "not enough memory" not in str(exc)):
                    raise
                raise MemoryError(
                    f"a replay buffer of {self.capacity:,} transitions needs "
                    f"{self.nbytes / 1e9:,.1f} GB on {self.device} "
                    f"({self.nbytes // (self.rows * self.num_agents):,} bytes each), more than "
                    f"it can get: lower its capacity (an algorithm's buffer_size)") from exc
        return self._tensors

    @property
    def nbytes(self) -> int:
        """The bytes the buffer's storage takes once allocated (every field, every row)."""
        return sum(math.prod(shape) * dtype.itemsize
                   for shape, dtype in self._shapes.values())

    @property
    def valid(self) -> torch.Tensor:
        """``(rows, N)`` bool: the stored steps ``sample`` may draw (see ``add``'s ``lost``);
        allocated on first use, as the storage is."""
        if self._valid is None:
            self._valid = torch.ones(self._shapes["reward"][0], dtype=torch.bool,
                                     device=self.device)
        return self._valid

    @property
    def capacity(self) -> int:
        """Transitions the buffer holds when full."""
        return self.rows * self.num_agents

    def __len__(self) -> int:
        """Transitions stored."""
        return self.filled * self.num_agents

    def add(self, reward: torch.Tensor, terminated: torch.Tensor, done: torch.Tensor,
            lost: torch.Tensor | None = None, **values: torch.Tensor) -> None:
        """Store one batch step: every field ``(N, *shape)``; ``reward`` ``(N,)``;
        ``terminated`` and ``done`` ``(N,)`` (bool or 0/1): the step reached a terminal state,
        or ended the episode in any way (terminated or truncated). ``lost`` ``(K,)``: agents
        whose step is no transition (their env was restarted after a failure instead of
        stepping): it is never sampled, and their episodes end at their step before."""
        if values.keys() != self.tensors.keys() - {"reward", "terminated", "done"}:
            expected = sorted(self.tensors.keys() - {"reward", "terminated", "done"})
            raise KeyError(f"add needs the fields {expected}, got {sorted(values)}")
        row = self.position
        fields = (*values.items(), ("reward", reward), ("terminated", terminated),
                  ("done", done))
        for name, value in fields:  # (all checked before any is written)
            target = self.tensors[name][row]
            if value.shape != target.shape:
                raise ValueError(f"add: {name!r} must have shape {tuple(target.shape)}, got "
                                 f"{tuple(value.shape)}")
            if value.is_floating_point() and target.dtype == torch.uint8:
                raise ValueError(f"add: {name!r} is stored as {target.dtype}, got "
                                 f"{value.dtype} values (pixels are stored as bytes)")
        for name, value in fields:
            self.tensors[name][row].copy_(value.detach())
        if self._lost_per_row.pop(row, 0):
            self.valid[row] = True
        if lost is not None and len(lost):
            self.valid[row, lost] = False
            self._lost_per_row[row] = len(lost)
            if self.filled:
                self.tensors["done"][(row - 1) % self.rows, lost] = True
        self.position = (row + 1) % self.rows
        self.filled = min(self.filled + 1, self.rows)

    def clear(self) -> None:
        """Forget every stored transition (the memory stays allocated)."""
        self.position = self.filled = 0
        if self._valid is not None:
            self._valid.fill_(True)
        self._lost_per_row.clear()

    def cut(self, agents: torch.Tensor) -> None:
        """The episodes of ``agents`` ``(K,)`` were cut after their newest stored step (their
        envs were reset): n-step returns stop there, bootstrapping from its next observation."""
        if self.filled:
            self.tensors["done"][(self.position - 1) % self.rows, agents] = True

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly from those stored (see the class)."""
        if not self.filled:
            raise RuntimeError("sample() from an empty replay buffer: add() transitions first")
        oldest = self.position if self.filled == self.rows else 0
        age = torch.randint(self.filled, (batch_size,), device=self.device)  # 0: the oldest
        agent = torch.randint(self.num_agents, (batch_size,), device=self.device)
        row = (oldest + age) % self.rows
        # (after a restart, until its row is overwritten) draw again where a draw fell on a
        # lost step; on a GPU each round then waits for the device
        if self._lost_per_row:
            if sum(self._lost_per_row.values()) >= self.filled * self.num_agents:
                raise RuntimeError("sample(): every stored transition was lost")
            while bool((bad := ~self.valid[row, agent]).any()):
                count = int(bad.sum())
                age[bad] = torch.randint(self.filled, (count,), device=self.device)
                agent[bad] = torch.randint(self.num_agents, (count,), device=self.device)
                row = (oldest + age) % self.rows
        picked = {name: value[row, agent] for name, value in self.tensors.items()
                  if name not in ("reward", "terminated", "done")}
        if self.n_step == 1:
            picked["reward"] = self.tensors["reward"][row, agent]
            picked["discount"] = self.discount * (~self.tensors["terminated"][row, agent])
            return picked
        # The next n steps of each picked agent, up to the newest row and the episode's end.
        offsets = torch.arange(self.n_step, device=self.device)
        ahead = (self.filled - 1 - age)[:, None]          # rows stored after the picked one
        rows = (row[:, None] + offsets) % self.rows       # (B, n)
        reward = self.tensors["reward"][rows, agent[:, None]]
        done = self.tensors["done"][rows, agent[:, None]]
        ended_before = torch.cumsum(done.int(), 1) - done.int()  # episode ends before step k
        counted = (offsets <= ahead) & (ended_before == 0)       # (B, n) steps summed
        steps = counted.sum(1)                                   # m >= 1
        picked["reward"] = (reward * self._powers[:self.n_step] * counted).sum(1)
        last = (row + steps - 1) % self.rows
        picked["next_observ"] = self.tensors["next_observ"][last, agent]
        terminal = self.tensors["terminated"][last, agent]
        picked["discount"] = self._powers[steps] * ~terminal
        return picked

    def state_dict(self) -> dict[str, object]:
        """The stored transitions (the rows written so far only: a checkpoint of a buffer
        still filling is that much smaller) and where the next one goes, for exact
        resumption. A full buffer's tensors are the live ones, not copies (a copy would
        double the memory of a buffer of gigabytes): serialise the state before the buffer
        takes another step, as the trainer's checkpoints do."""
        if self._tensors is None:  # (nothing stored yet: no storage to allocate for it)
            tensors = {name: torch.zeros((0, *shape[1:]), dtype=dtype, device=self.device)
                       for name, (shape, dtype) in self._shapes.items()}
        else:
            tensors = (dict(self._tensors) if self.filled == self.rows else  # (a copy, not
                       {name: value[:self.filled].clone()    # a view: torch.save would write
                        for name, value in self._tensors.items()})  # all rows)
        return {"tensors": tensors, "rows": self.rows, "position": self.position,
                "filled": self.filled, "valid": self.valid[:self.filled].clone()
                if self.filled else torch.ones((0, self.num_agents), dtype=torch.bool,
                                               device=self.device)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        tensors, filled = state["tensors"], int(state["filled"])
        for name, (shape, _) in self._shapes.items():
            rows = state.get("rows", len(tensors[name]))  # (older checkpoints: every row)
            saved = (int(rows), *tensors[name].shape[1:])
            if saved != shape:
                raise ValueError(f"replay buffer {name!r}: saved {saved}, this buffer "
                                 f"{shape} (another capacity or number of agents)")
        self.clear()
        if not filled:
            return
        for name, tensor in self.tensors.items():
            tensor[:filled] = tensors[name][:filled]
        self.position, self.filled = int(state["position"]), filled
        if "valid" in state:  # (older checkpoints: every step valid)
            self.valid[:filled] = state["valid"][:filled]
        lost = (~self.valid).sum(1)
        self._lost_per_row = {row: int(lost[row]) for row in lost.nonzero().flatten().tolist()}
