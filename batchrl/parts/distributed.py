"""Several learners (``train.learners``): one learner's view of them, and their collectives.

The learners of a run (``train.learners = M``) each step their own share of the envs and hold
a full copy of the algorithm. After every backward pass their gradients are averaged by an
all-reduce (``torch.distributed``: gloo on the CPU, NCCL between GPUs), so every learner takes
the same optimiser step and all of them hold the same weights after every update. Learner 0
(the writer) keeps the run's log, checkpoints and evaluations.
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from batchrl.parts.normalize import Statistics, StreamingNormalizer

# A collective waits this long for a learner that is still busy (an evaluation by learner 0, a
# slow env) before it fails; a learner that died fails it at once (its connections close).
DEFAULT_TIMEOUT = datetime.timedelta(hours=1)
# How long the learners of a run may take to meet (start their processes, import torch).
CONNECT_TIMEOUT = datetime.timedelta(minutes=2)
# The store's count of the learners (other than learner 0) that reached it.
_JOINED = "batchrl/joined"
# DD-PPO's preemption cuts a learner's rollout only once it holds this fraction of it.
PREEMPT_FEWEST = 0.25
# What torchrun sets in every process it starts.
TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LearnerGroup:
    """Learner ``rank`` of ``size``, joined to the others by a ``torch.distributed`` process
    group (made with ``connect`` or ``from_torchrun``). Every method that communicates is a
    collective: all learners call it, in the same order.

    Args:
      rank: this learner's index, 0 (the writer) to ``size - 1``.
      size: the number of learners ``M``.
      local_rank: its index among the learners of its machine (its GPU there); ``rank``
        unless given.
      store: a key-value store all learners reach (``torch.distributed.Store``), for what
        they tell each other without waiting for one another (``report_finished``).
    """

    def __init__(self, rank: int, size: int, local_rank: int | None = None,
                 store: dist.Store | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"learner rank must be in [0, {size}), got {rank}")
        self.rank, self.size = rank, size
        self.local_rank = rank if local_rank is None else local_rank
        self.store = store

    @classmethod
    def connect(cls, rank: int, size: int, address: str, port: int, device: torch.device,
                timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                local_rank: int | None = None,
                gone: Callable[[], bool] | None = None) -> "LearnerGroup":
        """Join the ``size`` learners that meet at ``address:port`` (learner 0 listens there).

        Learner 0 waits for the others in Python, so that Ctrl-C acts at once, and gives up
        with ``RuntimeError`` as soon as ``gone()`` says that one of them stopped (the
        launcher knows its processes) or after ``CONNECT_TIMEOUT``. (A learner that stops
        after it joined, while the process group connects, still holds the others in C for
        up to ``CONNECT_TIMEOUT``.)"""
        _use_gpu(device, rank if local_rank is None else local_rank)
        # Meeting is bounded by CONNECT_TIMEOUT (a learner that failed to start must not keep
        # the others waiting for an hour); the collectives after it by ``timeout``.
        store = dist.TCPStore(address, port, size, rank == 0, timeout=CONNECT_TIMEOUT,
                              wait_for_workers=False)
        if rank == 0:
            _wait_for_joins(store, size - 1, gone or (lambda: False))
        else:
            store.add(_JOINED, 1)
        _import_before_a_group()
        dist.init_process_group(_backend(device), store=store, rank=rank, world_size=size,
                                timeout=timeout)
        return cls(rank, size, local_rank, store)

    @classmethod
    def from_torchrun(cls, device: torch.device,
                      timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> "LearnerGroup":
        """Join the learners of a ``torchrun`` launch (its ``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR`` and ``MASTER_PORT``)."""
        _use_gpu(device, int(os.environ.get("LOCAL_RANK", 0)))
        _import_before_a_group()
        dist.init_process_group(_backend(device), init_method="env://", timeout=timeout)
        group = cls(dist.get_rank(), dist.get_world_size(),
                    int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        # torchrun's own store is not public: learner 0 opens one on a free port of its host.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, None, True, timeout=CONNECT_TIMEOUT,
                              wait_for_workers=False) if group.is_writer else None
        port = group.broadcast(store.port if store is not None else None)
        group.store = store or dist.TCPStore(os.environ["MASTER_ADDR"], port, None, False,
                                             timeout=CONNECT_TIMEOUT)
        return group

    @property
    def is_writer(self) -> bool:
        """Whether this learner keeps the run's log, checkpoints and evaluations."""
        return self.rank == 0

    def average_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's ``.grad`` by its mean over the learners: one all-reduce
        of all of them in a single flat tensor. Every learner passes the same parameters (the
        same networks); a learner whose step left a parameter without a gradient counts
        zeros for it, and the parameter gets the mean if another learner's step gave it one
        (so the learners' all-reduces always match and their parameters stay identical)."""
        parameters = list(parameters)
        if not parameters:
            return
        given = [p.grad is not None for p in parameters]
        device = parameters[0].device
        # (after the gradients: how many learners had each one)
        flags = (torch.ones(len(parameters), dtype=parameters[0].dtype, device=device)
                 if all(given) else  # (a copy from the host only where a gradient is missing)
                 torch.tensor(given, dtype=parameters[0].dtype, device=device))
        flat = torch.cat([p.grad.reshape(-1) if has else
                          torch.zeros(p.numel(), dtype=p.dtype, device=device)
                          for p, has in zip(parameters, given)] + [flags])
        dist.all_reduce(flat)
        counts = flat[-len(parameters):]
        means = flat[:-len(parameters)].div_(self.size)
        # (read on the host only by a learner that lacks a gradient: no wait otherwise)
        others = None if all(given) else counts.tolist()
        offset = 0
        for index, (p, has) in enumerate(zip(parameters, given)):
            mean = means[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if has:
                p.grad.copy_(mean)
            elif others[index]:
                p.grad = mean.clone()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` (any shape) over the learners, in float64."""
        total = value.detach().to(torch.float64).clone()
        dist.all_reduce(total)
        return (total / self.size).to(value.dtype)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the learners, in float64."""
        total = value.detach().to(torch.float64).clone()
        dist.all_reduce(total)
        return total

    def merge(self, normalizer: StreamingNormalizer, synced: Statistics | None) -> Statistics:
        """Give every learner's ``normalizer`` the statistics of all the learners' values:
        ``synced`` (the merged statistics of the last call, ``None`` before the first) plus
        what each learner added since, merged in learner order, so that the result is the
        same on every learner and equals one normaliser's over the union of the values (up
        to float64 rounding). Returns it, the next call's ``synced``."""
        current = normalizer.statistics()
        if synced is None:
            synced = Statistics(*(torch.zeros_like(value) for value in current))
        own = (current - synced).flat()
        everyone = [torch.empty_like(own) for _ in range(self.size)]
        dist.all_gather(everyone, own)
        merged = synced
        for flat in everyone:
            merged = merged + Statistics.from_flat(flat, tuple(current.mean.shape))
        normalizer.load_statistics(merged)
        return merged

    def gather_to_writer(self, value: Any) -> list[Any] | None:
        """Every learner's ``value`` (picklable), in learner order, on the writer; ``None`` on
        the others."""
        values: list[Any] | None = [None] * self.size if self.is_writer else None
        dist.gather_object(_to(value, "cpu"), values, dst=0)  # (tensors arrive on the CPU)
        return values

    def broadcast(self, value: Any, device: torch.device | str | None = None) -> Any:
        """Learner 0's ``value`` (picklable) on every learner (the others pass anything); its
        tensors travel through the CPU and arrive on ``device`` (default: the CPU)."""
        box = [_to(value, "cpu") if self.is_writer else None]
        dist.broadcast_object_list(box, src=0)
        return box[0] if device is None else _to(box[0], device)

    def report_finished(self, rollout: int) -> None:
        """Tell the others that this learner collected the whole of its rollout number
        ``rollout`` (``finished`` counts them; DD-PPO's preemption). Does not wait."""
        self.store.add(f"finished/{rollout}", 1)
        # Every learner left the rollout before: they all took part in its update.
        self.store.delete_key(f"finished/{rollout - 1}")

    def finished(self, rollout: int) -> int:
        """How many learners reported rollout number ``rollout`` finished (so far)."""
        return int(self.store.add(f"finished/{rollout}", 0))

    def close(self) -> None:
        """Leave the process group (when it was made)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def preemption_count(threshold: float, size: int) -> int:
    """How many of ``size`` learners must collect their whole rollout before the others' are
    cut, for DD-PPO's preemption ``threshold`` (a fraction of the learners, in (0, 1)).
    ``ValueError`` when the threshold is out of range or takes all of them (the last learner
    would never be cut: preemption would change nothing)."""
    if not 0 < threshold < 1:
        raise ValueError(f"the preemption threshold is the fraction of learners whose finished "
                         f"rollouts cut the others', in (0, 1) (0: off), got {threshold}")
    count = math.ceil(round(threshold * size, 9))  # (0.6 * 5 is 3.0000000000000004)
    if count >= size:
        raise ValueError(f"a preemption threshold of {threshold} with {size} learners waits "
                         f"for all {size} (the last is never cut): use at most "
                         f"{math.floor(100 * (size - 1) / size) / 100:.2f}, or more learners")
    return count


def _use_gpu(device: torch.device, local_rank: int) -> None:
    """On GPUs, make the learner's own (``cuda:local_rank``) the current one: NCCL's
    collectives run there."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else local_rank)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its run id and
    ``torch.distributed``'s environment variables are set)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def _to(value: Any, device: torch.device | str) -> Any:
    """``value`` with the tensors of its dicts, lists and tuples moved to ``device``: a pickled
    tensor is unpickled on the device it left, so a GPU learner's state sent as it is would be
    rebuilt on the receiver's copy of that GPU."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((key, _to(item, device)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to(item, device) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to(item, device) for item in value)
    return value


def _import_before_a_group() -> None:
    """Import ``torch.distributed.nn`` before the process group is made: its functions take
    ``group.WORLD`` as a default argument, evaluated at import, so imported later (torch
    imports it with ``torch._dynamo``, which an optimiser's first step imports) it would keep
    the group, its gloo threads and its store alive after ``destroy_process_group``. (Not
    with this module: a process that imports it, a Ray collector say, takes longer to end
    when Ray kills it.)"""
    importlib.import_module("torch.distributed.nn")


def _wait_for_joins(store: dist.Store, others: int, gone: Callable[[], bool]) -> None:
    """Wait until ``others`` learners added themselves to ``_JOINED`` in ``store``."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while (joined := int(store.add(_JOINED, 0))) < others:
        if gone():
            raise RuntimeError(f"a learner stopped before all learners met ({joined} of "
                               f"{others} had joined learner 0)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {joined} of {others} learners joined learner 0 within "
                               f"{CONNECT_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)
