"""Collectors as processes of this machine: rollouts in shared memory, weights in shared memory.

The learner allocates each collector a fixed set of rollout slots
(``CollectorSpec.rollout_tensors`` in shared memory) before any collector starts. A collector
takes one of its free slots (it waits while none is free: its queue is bounded), fills it in
place with one rollout and reports the slot in its ``full`` queue; the learner copies a batch
out and hands the slots back. Weights are one shared copy of the algorithm's ``acting_state``
with a version, rewritten by the learner under a sequence lock (collectors retry a copy that a
publish overlapped), so a collector that dies anywhere holds no lock the learner needs. Each
collector has queues of its own, which the learner replaces with new ones, rebuilt from what it
received, when it replaces the collector.

Update ``k`` learns from the ``k``-th rollout of every collector (its round ``k``), side by side:
every update sees every agent once, as in the synchronous loop. So a collector that starts round
``k`` once the learner has published version ``k - max_policy_lag`` never exceeds the lag limit.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import time
from typing import Any, Callable

import gymnasium as gym
import torch
import torch.multiprocessing  # noqa: F401  (shares tensors between processes when pickled)

from batchrl.collectors.collector import CollectorSpec, Link, Replacements, collect
from batchrl.envs.process.channel import context
from batchrl.envs.process.main_guard import check_main_guard, main_not_reimported
from batchrl.errors import error_line
from batchrl.hardware import core_share, pinnable_cores
from batchrl.interrupt import exit_reporting, start_worker
from batchrl.parts.rollout import Fields, Rollout, RolloutBuffer

__all__ = ["LocalCollectors"]

_POLL_SECONDS = 0.1


class _Shared:
    """The state collectors and learner share (picklable to a child process)."""

    def __init__(self, ctx: Any, slots: list[list[dict[str, torch.Tensor]]],
                 weights: dict[str, torch.Tensor], max_lag: int | None):
        collectors = len(slots)
        self.slots = slots  # [collector][slot]
        self.weights = weights
        self.free = [ctx.Queue() for _ in range(collectors)]  # learner -> collector: slots
        self.full = [ctx.Queue() for _ in range(collectors)]  # collector -> learner
        for free, own in zip(self.free, slots):
            for slot in range(len(own)):
                free.put(slot)
        # collector -> learner: the one line of its error (a queue of each collector's own, so
        # that one killed while it writes there leaves no lock held that a successor needs)
        self.errors = [ctx.Queue() for _ in range(collectors)]
        # The weights' sequence number: odd while the learner rewrites them.
        self.sequence = ctx.Value("q", 0, lock=False)
        self.version = ctx.Value("q", -1, lock=False)
        self.rounds = ctx.Array("q", [0] * collectors, lock=False)  # each one's next round
        self.stop = ctx.Value("b", 0, lock=False)
        self.max_lag = max_lag

    def __getstate__(self) -> dict[str, Any]:
        # A collector gets its own slots as an argument: every shared tensor is a file
        # descriptor in each process that holds it.
        return {name: value for name, value in self.__dict__.items() if name != "slots"}

    def for_collector(self, index: int) -> "_Shared":
        """A copy to send collector ``index``, with its own queues only: another's may be
        replaced (their semaphores removed) before this one has loaded what it was sent."""
        view = copy.copy(self)
        for name in ("free", "full", "errors"):
            setattr(view, name, [channel if which == index else None
                                 for which, channel in enumerate(getattr(self, name))])
        return view


class _SharedLink(Link):
    """A collector process's end of ``_Shared``."""

    def __init__(self, shared: _Shared, index: int, slots: list[dict[str, torch.Tensor]]):
        self.shared, self.index, self.slots = shared, index, slots

    def begin(self) -> tuple[dict[str, torch.Tensor], Any] | None:
        shared, index = self.shared, self.index
        while True:
            if shared.stop.value:
                return None
            try:
                slot = shared.free[index].get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                pass
        round_ = shared.rounds[index]
        shared.rounds[index] = round_ + 1
        if shared.max_lag is not None:
            while shared.version.value < round_ - shared.max_lag:
                if shared.stop.value:
                    return None
                time.sleep(0.001)
        return self.slots[slot], (round_, slot)

    def weights(self, known: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        shared = self.shared
        while True:
            before = shared.sequence.value
            if before % 2:  # a publish is under way
                if shared.stop.value:  # (one a failure cut short stays odd: no new weights)
                    return None
                time.sleep(0.0005)
                continue
            version = shared.version.value
            if version == known:
                return None
            state = {name: value.clone() for name, value in shared.weights.items()}
            if shared.sequence.value == before:
                return version, state

    def send(self, token: Any, meta: dict[str, Any]) -> None:
        round_, slot = token
        self.shared.full[self.index].put((round_, slot, meta))


def _collector_main(spec: CollectorSpec, index: int, shared: _Shared,
                    slots: list[dict[str, torch.Tensor]], incarnation: int,
                    parent_pid: int, cores: list[int]) -> None:
    """A collector process: tied to the learner's life, deaf to Ctrl-C (the learner stops it),
    pinned to ``cores`` (its share of the machine's, where it pins its env workers in turn;
    ``[]``: not pinned). An error is sent to the learner as one line before the process
    exits with code 1."""
    try:
        if not start_worker(parent_pid):
            return
        if cores:
            os.sched_setaffinity(0, cores)
        collect(spec, index, _SharedLink(shared, index, slots), incarnation)
    except BaseException as exc:  # noqa: BLE001 - reported to the learner, then exit
        line = error_line(exc)  # (read by the learner after this exit, with what it sent)
        exit_reporting(f"collector {index}: {line}", shared.errors[index], line,
                       [shared.full[index]])


class LocalCollectors:
    """``spec.collectors`` collector processes of this machine and the learner's end of their
    queues (see the module docstring).

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

    def __init__(self, spec: CollectorSpec, observation_space: gym.Space,
                 action_space: gym.Space, behaviour: Fields,
                 acting_state: dict[str, torch.Tensor], max_policy_lag: int | None = None,
                 queue_size: int | None = None, max_restarts: int = 0,
                 report: Callable[[str], None] = print):
        self.spec = spec
        count = spec.collectors
        self.replacements = Replacements(count, max_restarts, report)
        queue_size = 2 if queue_size is None else queue_size
        slots = [[spec.rollout_tensors(index, observation_space, action_space, behaviour)
                  for _ in range(1 + queue_size)] for index in range(count)]
        for own in slots:
            for slot in own:
                for tensor in slot.values():
                    tensor.share_memory_()
        weights = {name: value.detach().to("cpu", copy=True).share_memory_()
                   for name, value in acting_state.items()}
        check_main_guard()
        self._ctx = context()
        self.shared = _Shared(self._ctx, slots, weights, max_policy_lag)
        self.version = -1
        self._round = 0  # the next batch's
        self._waiting: dict[tuple[int, int], tuple[int, dict]] = {}  # (round, c) -> (slot, meta)
        self._processes: list[Any] = [None] * count
        # (a share of the cores for each collector: else each would pin its env workers to
        # the same first cores of the machine)
        self._cores = pinnable_cores()
        self.publish(acting_state)
        try:
            for index in range(count):
                self._start(index)
        except BaseException:
            self.close()
            raise

    def _start(self, index: int) -> None:
        process = self._ctx.Process(
            target=_collector_main, name=f"batchrl-collector-{index}",
            args=(self.spec, index, self.shared.for_collector(index), self.shared.slots[index],
                  self.replacements.incarnations[index], os.getpid(),
                  core_share(self._cores, index, self.spec.collectors)))
        with main_not_reimported():
            process.start()
        self._processes[index] = process

    @property
    def restarts(self) -> int:
        """Collectors replaced so far."""
        return self.replacements.count

    @property
    def pids(self) -> list[int | None]:
        """The process id of each collector (``None`` before it started)."""
        return [None if process is None else process.pid for process in self._processes]

    @property
    def queued(self) -> int:
        """Finished rollouts waiting for the learner."""
        self._drain()
        return len(self._waiting)

    def publish(self, acting_state: dict[str, torch.Tensor]) -> int:
        """Make ``acting_state`` the newest weights; returns its version."""
        shared = self.shared
        shared.sequence.value += 1  # odd: collectors retry a copy that overlaps this
        for name, value in acting_state.items():
            shared.weights[name].copy_(value.detach())
        self.version = shared.version.value = shared.version.value + 1
        shared.sequence.value += 1
        return self.version

    def _drain(self, index: int | None = None) -> bool:
        """Take what the collectors (or collector ``index``) reported; whether anything came."""
        came = False
        for which in range(self.spec.collectors) if index is None else (index,):
            with contextlib.suppress(queue.Empty):
                while True:
                    finished, slot, meta = self.shared.full[which].get_nowait()
                    self._waiting[finished, which] = (slot, meta)
                    self.replacements.delivered[which] = came = True
        return came

    def receive(self, check: Callable[[], None] = lambda: None
                ) -> tuple[Rollout, list[dict[str, Any]]]:
        """The next batch: one rollout of every agent (``collectors`` rollouts side by side,
        copied out of shared memory) and their ``meta``. Waits for it, replacing failed
        collectors; ``check`` runs while waiting (it may raise to stop)."""
        shared, count, round_ = self.shared, self.spec.collectors, self._round
        polled = time.monotonic()
        while not all((round_, index) in self._waiting for index in range(count)):
            if not self._drain():
                time.sleep(0.001)
            if time.monotonic() - polled > _POLL_SECONDS:
                check()
                self._supervise()
                polled = time.monotonic()
        taken = [self._waiting.pop((round_, index)) for index in range(count)]
        rollouts = [RolloutBuffer(shared.slots[index][slot]).rollout()
                    for index, (slot, _) in enumerate(taken)]
        batch = Rollout.cat(rollouts) if count > 1 else rollouts[0].clone()
        for index, (slot, _) in enumerate(taken):
            shared.free[index].put(slot)
        self._round += 1
        return batch, [meta for _, meta in taken]

    def _supervise(self) -> None:
        """Replace collectors that exited; a first one that failed before its first rollout
        fails the run (it would fail again)."""
        for index, process in enumerate(self._processes):
            if process.exitcode is None:
                continue
            # (read after the exit: a collector flushes its error line before it exits)
            try:
                why = self.shared.errors[index].get(timeout=_POLL_SECONDS)
            except queue.Empty:
                why = f"exited with code {process.exitcode}" + (
                    " (a step that outlasted env.timeout? see its traceback on stderr)"
                    if process.exitcode == 1 and self.spec.step_timeout else "")
            # What it sent before it died counts: a first rollout means it got going.
            self._drain(index)
            self.replacements.failed(index, why)
            process.close()
            self._processes[index] = None  # (close() skips it if its successor fails to start)
            self._renew(index)
            self._start(index)

    def _renew(self, index: int) -> None:
        """New queues for collector ``index``'s successor (the failed one may have died holding
        a queue's lock), rebuilt from what the learner received: it continues at the first
        round not received, with the slots that hold no received rollout; an empty error
        queue."""
        shared = self.shared
        self._drain(index)
        received = {finished: slot for (finished, which), (slot, _) in self._waiting.items()
                    if which == index}
        shared.rounds[index] = max(received, default=self._round - 1) + 1
        for channel in (shared.free[index], shared.full[index], shared.errors[index]):
            channel.cancel_join_thread()
            channel.close()
        shared.free[index], shared.full[index], shared.errors[index] = (
            self._ctx.Queue(), self._ctx.Queue(), self._ctx.Queue())
        for slot in range(len(shared.slots[index])):
            if slot not in received.values():
                shared.free[index].put(slot)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every collector (and with them their env workers) and wait for them."""
        self.shared.stop.value = 1
        deadline = time.monotonic() + timeout
        for process in self._processes:
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join(1.0)
        for channel in (*self.shared.free, *self.shared.full, *self.shared.errors):
            channel.cancel_join_thread()
            channel.close()

    def __enter__(self) -> "LocalCollectors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
