"""Several learners (``train.learners = M``): start them, and stop them together.

Each learner is a process with ``env.num_agents / M`` envs of its own and a full copy of the
algorithm; after every backward pass the gradients are averaged over all learners
(``batchrl.parts.distributed.LearnerGroup``), so all of them hold the same weights after every
update. Learner 0, the writer, keeps the run's log, checkpoints and evaluations. Launches:

- ``python train.py --config NAME --set train.learners=M``: this process becomes learner 0
  and starts the others here, joined over 127.0.0.1 (gloo on the CPU, NCCL between GPUs),
  each pinned to its share of the cores in this process's affinity mask. Ctrl-C stops all of
  them, a learner that fails stops the run with an error naming it, and none outlives the
  launching process.
- The same on a Ray cluster (``env.ray_address``, or ``env.backend = "ray"``): learners 1 to
  M-1 are Ray actors, one per bundle of a placement group spread over the nodes, each
  reserving ``train.learner_resources``; they step their envs on their node (the ``ray``
  backend becomes worker processes there; another backend stays as it is). Learner 0 is the
  launching process, and steps its envs in processes there too.
- ``torchrun --standalone --nproc-per-node M -m batchrl.train --config NAME``: every process
  torchrun starts is a learner (its ``RANK``), each of a node's pinned to its share
  (``LOCAL_RANK``) of the cores; torchrun places and stops them (not with the ``ray``
  backend or ``env.ray_address``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing as mp
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable

import torch

from batchrl.checkpoint import CheckpointError
from batchrl.config import Config, ConfigError
from batchrl.envs import check_main_guard, main_not_reimported
from batchrl.envs.errors import EnvSpecError, SpaceMismatchError, UnsupportedSpaceError
from batchrl.errors import error_line
from batchrl.hardware import allowed_cores, core_share, usable_cores
from batchrl.interrupt import Interrupted, exit_reporting, signals_held, start_worker
from batchrl.parts.distributed import LearnerGroup, launched_by_torchrun, preemption_count
from batchrl.trainer import Trainer, check_learner_support, on_a_cluster, resolve_device


class LearnerError(RuntimeError):
    """A learner other than the writer failed or died, which stopped the run."""


def check_learners(config: Config, learners: int, local: bool = True) -> None:
    """``ConfigError`` when ``learners`` learners cannot run ``config`` (here, with
    ``local``: one machine's cores or GPUs), the algorithm's class and hyperparameters
    included (``check_learner_support``)."""
    agents = config.env.num_agents
    if agents % learners:
        raise ConfigError(f"env.num_agents ({agents}) must be divisible by train.learners "
                          f"({learners}): each learner steps an equal share of the envs")
    if config.train.collectors:
        raise ConfigError(f"train.learners = {learners} runs each learner's own envs, not "
                          f"collectors: set train.collectors = 0 or train.learners = 1")
    _check_preemption(config, learners)
    if str(config.train.device).startswith("cuda:"):  # (torchrun and Ray learners too)
        raise ConfigError(f"train.device = {config.train.device!r} puts every learner on one "
                          f"GPU: use 'cuda' (or 'auto'), and each learner takes its own")
    if local:
        device = resolve_device(config.train.device)
        if device.type == "cuda":
            gpus = torch.cuda.device_count()
            if learners > gpus:
                raise ConfigError(f"train.learners ({learners}) is more than the {gpus} GPUs "
                                  f"here: each learner takes one (or set train.device = "
                                  f"'cpu')")
        elif learners > usable_cores():
            raise ConfigError(f"train.learners ({learners}) is more than the "
                              f"{usable_cores()} usable CPU cores here: each learner needs "
                              f"at least one")
    check_learner_support(config, learners)


def _check_preemption(config: Config, learners: int) -> None:
    """``ConfigError`` unless ``train.preemption_threshold`` is 0 or cuts some of
    ``learners`` learners (torchrun's one process included)."""
    threshold = config.train.preemption_threshold
    if threshold and learners == 1:
        raise ConfigError("train.preemption_threshold cuts the rollouts of some of several "
                          "learners: set train.learners >= 2, or the threshold to 0")
    if threshold:
        try:
            preemption_count(threshold, learners)
        except ValueError as exc:
            raise ConfigError(f"train.preemption_threshold: {exc}") from None


def run(config: Config, logdir: Path, progress: bool = True,
        handle_signals: bool = False) -> dict[str, Any]:
    """Train as ``config`` says with ``train.learners`` learners (one: ``Trainer`` here);
    under ``torchrun``, as the learner it started. Returns the writer's last evaluation
    record (``{}`` on the other learners). Raises as ``Trainer.run`` does, and
    ``LearnerError`` when another learner failed."""
    if launched_by_torchrun():
        return _run_torchrun(config, logdir, progress, handle_signals)
    if config.train.learners == 1:
        _check_preemption(config, 1)
        return Trainer(config, logdir, progress, handle_signals).run()
    if on_a_cluster(config):
        return _run_ray(config, logdir, progress, handle_signals)
    return _run_local(config, logdir, progress, handle_signals)


def _run_torchrun(config: Config, logdir: Path, progress: bool,
                  handle_signals: bool) -> dict[str, Any]:
    device = resolve_device(config.train.device)
    learners = LearnerGroup.from_torchrun(device)
    try:
        if config.train.learners not in (1, learners.size):
            raise ConfigError(f"train.learners = {config.train.learners}, but torchrun "
                              f"started {learners.size} processes: set --nproc-per-node "
                              f"(times the nodes) to train.learners")
        if on_a_cluster(config):
            raise ConfigError("env.backend = 'ray' or env.ray_address launches the learners on "
                              "a Ray cluster from train.py; torchrun places them itself, each "
                              "stepping its envs in its own processes: set env.backend = "
                              "'workers' and env.ray_address = ''")
        config.train.learners = learners.size  # (the saved config records it)
        check_learners(config, learners.size, local=False)
        # As the local learners: else every learner of a node would pin its env workers
        # from the node's first core on.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local > 1:
            os.sched_setaffinity(0, core_share(allowed_cores(), learners.local_rank, local))
        writer = learners.is_writer
        return Trainer(config, logdir, progress and writer, handle_signals and writer,
                       learners=learners).run()
    finally:
        learners.close()


def _free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _run_ray(config: Config, logdir: Path, progress: bool,
             handle_signals: bool) -> dict[str, Any]:
    from batchrl.learners.ray import RayLearners  # (imports Ray)
    size = config.train.learners
    check_learners(config, size, local=False)
    # Every learner computes on learner 0's kind of device: one group, gloo or NCCL.
    device = resolve_device(config.train.device).type
    if device == "cuda" and not config.train.learner_resources.get("GPU", 0) > 0:
        raise ConfigError(f"train.device = {config.train.device!r} is CUDA for learner 0 "
                          f"here, but train.learner_resources reserves no GPU for the other "
                          f"learners: add GPU = 1 to it, or set train.device = 'cpu'")
    remote = RayLearners(size - 1, config.train.learner_resources, config.env.ray_address)
    finished = False
    try:
        import ray
        address = ray.util.get_node_ip_address()
        port = _free_port(address)
        # A learner is the unit Ray places: it steps its envs in processes of its node
        # (the Trainer's), one per CPU it reserves unless env.workers says.
        cpus = int(config.train.learner_resources.get("CPU", 1))
        on_node = dataclasses.replace(
            config, train=dataclasses.replace(config.train, device=device),
            env=dataclasses.replace(config.env, workers=config.env.workers or max(1, cpus)))
        remote.start([functools.partial(_remote_main, on_node, logdir, rank, size, address,
                                        port) for rank in range(1, size)])
        nodes = ", ".join(f"learner {rank} on node {node[:8]}"
                          for rank, (node, _) in enumerate(remote.nodes, 1))
        print(f"{size} learners: learner 0 here, {nodes}", flush=True)
        result = _lead(config, logdir, progress, handle_signals, address, port,
                       remote.failure, lambda: remote.failure(0.0) is not None)
        finished = True
        return result
    finally:
        if finished:
            remote.wait(10.0)
        remote.close()


def _lead(config: Config, logdir: Path, progress: bool, handle_signals: bool, address: str,
          port: int, failure: Callable[[], str | None],
          gone: Callable[[], bool]) -> dict[str, Any]:
    """Learner 0: meet the others at ``address:port`` and train. An error that another
    learner caused becomes a ``LearnerError`` naming it (``failure()`` says which, if any);
    ``gone()`` says, without waiting, whether one of them has stopped."""
    learners = None
    try:
        learners = LearnerGroup.connect(0, config.train.learners, address, port,
                                        resolve_device(config.train.device), gone=gone)
        return Trainer(config, logdir, progress, handle_signals, learners=learners).run()
    except (ConfigError, EnvSpecError, UnsupportedSpaceError, SpaceMismatchError,
            CheckpointError, Interrupted, KeyboardInterrupt):
        raise  # (the user's input, which every learner rejects alike; or a stop)
    except Exception as exc:
        line = failure()
        if line is not None:
            raise LearnerError(line) from exc
        raise
    finally:
        if learners is not None:
            learners.close()


def _remote_main(config: Config, logdir: Path, rank: int, size: int, address: str,
                 port: int) -> None:
    """Learner ``rank`` in a Ray actor."""
    # (Ray shows an actor only the GPUs it reserved: its first is its own)
    learners = LearnerGroup.connect(rank, size, address, port,
                                    resolve_device(config.train.device), local_rank=0)
    try:
        Trainer(config, logdir, progress=False, learners=learners).run()
    finally:
        learners.close()


def _run_local(config: Config, logdir: Path, progress: bool,
               handle_signals: bool) -> dict[str, Any]:
    size = config.train.learners
    check_learners(config, size)
    cores = allowed_cores()
    shares = [core_share(cores, rank, size) for rank in range(size)]
    port = _free_port()
    ctx = mp.get_context("spawn")  # (no inherited threads: torch's pools make fork unsafe)
    errors = ctx.Queue()
    processes = []
    own_cores = os.sched_getaffinity(0)
    finished = False
    check_main_guard()
    try:
        for rank in range(1, size):
            process = ctx.Process(target=_learner_main, name=f"batchrl-learner-{rank}",
                                  args=(config, logdir, rank, size, port, os.getpid(),
                                        shares[rank], errors))
            with main_not_reimported(), signals_held():
                process.start()
            processes.append(process)
        pids = [os.getpid()] + [process.pid for process in processes]
        print(f"{size} learners, cores {shares}: pids {', '.join(map(str, pids))}", flush=True)
        os.sched_setaffinity(0, shares[0])
        result = _lead(config, logdir, progress, handle_signals, "127.0.0.1", port,
                       functools.partial(_failure, processes, errors),
                       lambda: any(process.exitcode is not None for process in processes))
        finished = True
        return result
    finally:
        try:
            _stop(processes, 10.0 if finished else 0.0)
            errors.cancel_join_thread()
            errors.close()
        finally:
            os.sched_setaffinity(0, own_cores)


def _learner_main(config: Config, logdir: Path, rank: int, size: int, port: int,
                  parent_pid: int, cores: list[int], errors: Any) -> None:
    """Learner ``rank`` (not the writer): tied to the launching process's life, deaf to
    Ctrl-C (learner 0 decides when the run stops). A failure is sent to the launching
    process as one line before the process exits with code 1."""
    learners = None
    try:
        if not start_worker(parent_pid):
            return
        os.sched_setaffinity(0, cores)
        learners = LearnerGroup.connect(rank, size, "127.0.0.1", port,
                                        resolve_device(config.train.device))
        Trainer(config, logdir, progress=False, learners=learners).run()
    except BaseException as exc:  # noqa: BLE001 - reported to learner 0, then exit
        line = error_line(exc)  # (read once learner 0's collective failed)
        exit_reporting(f"learner {rank}: {line}", errors, (rank, line))
    finally:
        if learners is not None:
            with contextlib.suppress(Exception):
                learners.close()


def _failure(processes: list[Any], errors: Any) -> str | None:
    """What stopped the run when another learner did. A learner killed by a signal (the OOM
    killer, a crash in native code) comes first: when it dies, the others' collectives fail
    and they report those errors. Not SIGABRT: NCCL's watchdog aborts the learners whose
    peer failed. Else the first error reported, else an exit."""
    reported = None
    with contextlib.suppress(Exception):
        rank, line = errors.get(timeout=2.0)
        reported = f"learner {rank} failed: {line}"
    for rank, process in enumerate(processes, 1):
        process.join(0 if reported else 2.0)
        if process.exitcode is not None and process.exitcode < 0 \
                and process.exitcode != -signal.SIGABRT:
            return f"learner {rank} (pid {process.pid}) {_ended(process.exitcode)}"
    if reported:
        return reported
    for rank, process in enumerate(processes, 1):
        if process.exitcode not in (None, 0):
            return f"learner {rank} (pid {process.pid}) {_ended(process.exitcode)}"
    return None


def _ended(exitcode: int) -> str:
    """How a process of this exit code ended, in words."""
    return (f"was killed by signal {-exitcode}" if exitcode < 0
            else f"exited with code {exitcode}")


def _stop(processes: list[Any], timeout: float) -> None:
    """Give the learners ``timeout`` seconds to finish (they end the run with learner 0),
    then kill the rest."""
    for process in processes:
        process.join(timeout if process.exitcode is None else 0)
        if process.exitcode is None:
            process.kill()
            process.join(5.0)
