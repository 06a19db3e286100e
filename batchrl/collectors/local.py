"""Collectors as processes of this machine: rollouts in shared memory, weights in shared memory.

The learner allocates each collector a fixed set of rollout slots (``rollout_tensors`` in shared
memory) before any collector starts. A collector takes one of its free slots (it waits while none
is free: its queue is bounded), fills it in place with one rollout and puts the slot's number in
the ``full`` queue; the learner copies a batch out and hands the slots back. Weights are one
shared copy of the algorithm's ``acting_state``, rewritten under a lock at each publish with a
version number.

Update ``k`` learns from the ``k``-th rollout of every collector (its round ``k``), side by side:
every update sees every agent once, as in the synchronous loop. So a collector that starts round
``k`` once the learner has published version ``k - max_policy_lag`` never exceeds the lag limit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (shares tensors between processes when pickled)

from batchrl.collectors.collector import CollectorError, CollectorSpec, Link, collect
from batchrl.envs.process.channel import context, start_worker
from batchrl.parts.rollout import Rollout, RolloutBuffer, rollout_tensors

__all__ = ["LocalCollectors"]

_POLL_SECONDS = 0.1
_IDLE = -1


class _Shared:
    """The state collectors and learner share (picklable to a child process)."""

    def __init__(self, ctx: Any, slots: list[list[dict[str, torch.Tensor]]],
                 weights: dict[str, torch.Tensor], max_lag: int | None):
        collectors = len(slots)
        self.slots = slots  # [collector][slot]
        self.weights = weights
        self.free = [ctx.Queue() for _ in range(collectors)]
        for free, own in zip(self.free, slots):
            for slot in range(len(own)):
                free.put(slot)
        self.full = ctx.Queue()
        self.errors = ctx.Queue()  # (collector, one line) of a collector that failed
        self.lock = ctx.Lock()
        self.version = ctx.Value("q", -1, lock=False)  # read and written under self.lock
        self.rounds = ctx.Array("q", [0] * collectors, lock=False)  # each one's next round
        self.stop = ctx.Event()
        # (round, slot) each collector holds while it fills a slot; slot _IDLE when none.
        self.holding = ctx.Array("q", [_IDLE] * (2 * collectors), lock=False)
        self.max_lag = max_lag


class _SharedLink(Link):
    """A collector process's end of ``_Shared``."""

    def __init__(self, shared: _Shared, index: int):
        self.shared, self.index = shared, index

    def begin(self) -> tuple[dict[str, torch.Tensor], Any] | None:
        shared, index = self.shared, self.index
        round_, slot = shared.holding[2 * index], shared.holding[2 * index + 1]
        if slot == _IDLE:  # (else a predecessor that failed left this rollout to finish)
            while True:
                if shared.stop.is_set():
                    return None
                try:
                    slot = shared.free[index].get(timeout=_POLL_SECONDS)
                    break
                except queue.Empty:
                    pass
            with shared.lock:
                round_ = shared.rounds[index]
                shared.rounds[index] = round_ + 1
                shared.holding[2 * index], shared.holding[2 * index + 1] = round_, slot
        if shared.max_lag is not None:
            while shared.version.value < round_ - shared.max_lag:
                if shared.stop.is_set():
                    return None
                time.sleep(0.001)
        return shared.slots[index][slot], (round_, slot)

    def weights(self, known: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        shared = self.shared
        if shared.version.value == known:
            return None
        with shared.lock:
            return shared.version.value, {name: value.clone()
                                          for name, value in shared.weights.items()}

    def send(self, token: Any, meta: dict[str, Any]) -> None:
        round_, slot = token
        shared = self.shared
        with shared.lock:
            shared.full.put((round_, self.index, slot, meta))
            shared.holding[2 * self.index] = shared.holding[2 * self.index + 1] = _IDLE


def _collector_main(spec: CollectorSpec, index: int, shared: _Shared, incarnation: int,
                    parent_pid: int) -> None:
    """A collector process: tied to the learner's life, deaf to Ctrl-C (the learner stops it).
    An error is sent to the learner as one line before the process exits with code 1."""
    if not start_worker(parent_pid):
        return
    try:
        collect(spec, index, _SharedLink(shared, index), incarnation)
    except BaseException as exc:  # noqa: BLE001 - reported to the learner, then exit
        shared.errors.put((index, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        shared.errors.close()
        shared.errors.join_thread()
        os._exit(1)


class LocalCollectors:
    """``spec.collectors`` collector processes of this machine and the learner's end of their
    queue (see the module docstring).

    Args:
      spec: how each collector builds its env and acting algorithm.
      observation_space, action_space: the env's (sizes the slots; observations keep their dtype).
      behaviour: the algorithm's ``behaviour_fields()``.
      acting_state: the learner algorithm's ``acting_state()`` (the published version 0).
      max_policy_lag: the largest lag a rollout may have when learned (``None``: no limit).
      queue_size: finished rollouts of each collector that may wait for the learner (its
        slots beyond the one it fills).
      max_restarts: collector failures replaced in the pool's life before ``CollectorError``.
      report: called with a line for each collector replaced.
    """

    def __init__(self, spec: CollectorSpec, observation_space: Any, action_space: Any,
                 behaviour: dict, acting_state: dict[str, torch.Tensor],
                 max_policy_lag: int | None = None, queue_size: int | None = None,
                 max_restarts: int = 0, report: Callable[[str], None] = print):
        self.spec, self.report = spec, report
        self.max_restarts, self.restarts = max_restarts, 0
        count = spec.collectors
        queue_size = 2 if queue_size is None else queue_size
        discrete = isinstance(action_space, gym.spaces.Discrete)
        observ_dtype = torch.from_numpy(np.zeros(0, observation_space.dtype)).dtype
        slots = [[rollout_tensors(len(spec.agents(index)), spec.rollout_length,
                                  observation_space.shape, observ_dtype,
                                  () if discrete else action_space.shape,
                                  torch.int64 if discrete else torch.float32, behaviour)
                  for _ in range(1 + queue_size)] for index in range(count)]
        for own in slots:
            for slot in own:
                for tensor in slot.values():
                    tensor.share_memory_()
        weights = {name: value.detach().to("cpu", copy=True).share_memory_()
                   for name, value in acting_state.items()}
        self._ctx = context()
        self.shared = _Shared(self._ctx, slots, weights, max_policy_lag)
        self.version = -1
        self._round = 0  # the next batch's
        self._waiting: dict[tuple[int, int], tuple[int, dict]] = {}  # (round, c) -> (slot, meta)
        self._processes: list[Any] = [None] * count
        self._delivered = [False] * count  # whether each one's current process sent a rollout
        self._incarnations = [0] * count
        self.publish(acting_state)
        for index in range(count):
            self._start(index)

    def _start(self, index: int) -> None:
        process = self._ctx.Process(
            target=_collector_main, name=f"batchrl-collector-{index}",
            args=(self.spec, index, self.shared, self._incarnations[index], os.getpid()))
        process.start()
        self._processes[index] = process

    @property
    def queued(self) -> int:
        """Finished rollouts waiting for the learner."""
        with contextlib.suppress(NotImplementedError):
            return self.shared.full.qsize() + len(self._waiting)
        return len(self._waiting)

    def publish(self, acting_state: dict[str, torch.Tensor]) -> int:
        """Make ``acting_state`` the newest weights; returns its version."""
        shared = self.shared
        with shared.lock:
            for name, value in acting_state.items():
                shared.weights[name].copy_(value.detach())
            self.version = shared.version.value = shared.version.value + 1
        return self.version

    def receive(self, check: Callable[[], None] = lambda: None
                ) -> tuple[Rollout, list[dict[str, Any]]]:
        """The next batch: one rollout of every agent (``collectors`` rollouts side by side,
        copied out of shared memory) and their ``meta``. Waits for it, replacing failed
        collectors; ``check`` runs while waiting (it may raise to stop)."""
        shared, count, round_ = self.shared, self.spec.collectors, self._round
        while not all((round_, index) in self._waiting for index in range(count)):
            try:
                finished, index, slot, meta = shared.full.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                check()
                self._supervise()
                continue
            self._waiting[finished, index] = (slot, meta)
            self._delivered[index] = True
        taken = [self._waiting.pop((round_, index)) for index in range(count)]
        rollouts = [RolloutBuffer(shared.slots[index][slot]).rollout()
                    for index, (slot, _) in enumerate(taken)]
        batch = Rollout.cat(rollouts) if count > 1 else rollouts[0].clone()
        for index, (slot, _) in enumerate(taken):
            shared.free[index].put(slot)
        self._round += 1
        return batch, [meta for _, meta in taken]

    def _supervise(self) -> None:
        """Replace collectors that exited (their unfinished rollout is left to the new one);
        one that failed before its first rollout fails the run (it would fail again)."""
        exited = [index for index, process in enumerate(self._processes)
                  if process.exitcode is not None]
        errors = {}  # (read after the exits: a failed collector sends its error first)
        with contextlib.suppress(queue.Empty):
            while exited:
                index, line = self.shared.errors.get(timeout=_POLL_SECONDS)
                errors[index] = line
        for index in exited:
            process = self._processes[index]
            why = errors.get(index, f"exited with code {process.exitcode}")
            if not self._delivered[index]:
                raise CollectorError(f"collector {index} failed before its first rollout: "
                                     f"{why}")
            if self.restarts >= self.max_restarts:
                raise CollectorError(f"collector {index} failed ({why}) after "
                                     f"{self.restarts} replacements (at most "
                                     f"{self.max_restarts}: env.max_restarts)")
            self.restarts += 1
            self._incarnations[index] += 1
            self._delivered[index] = False
            self.report(f"collector {index} failed ({why}); replaced [{self.restarts} of at "
                        f"most {self.max_restarts}]")
            process.close()
            self._start(index)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every collector (and with them their env workers) and wait for them."""
        self.shared.stop.set()
        deadline = time.monotonic() + timeout
        for process in self._processes:
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join(1.0)
        for channel in (*self.shared.free, self.shared.full, self.shared.errors):
            channel.cancel_join_thread()
            channel.close()

    def __enter__(self) -> "LocalCollectors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
