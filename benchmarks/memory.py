"""Memory stability: RSS, file descriptors and processes over a long sampling run.

Builds the trainer's env in its worker layout, ``make_batch_env(ENV_ID, N, 1000,
backend="workers")`` (``EnvWorker`` processes, one per usable core; batchrl's
wrappers), wraps it in
``TensorBatchEnv`` and lets a ``BatchPPO`` in training mode act through
``simulate()``, the loop of ``train.py``: normalisers updated, every
transition stored, and a real PPO update (25 full-batch epochs) every
``--update-every`` finished episodes (default N, i.e. every 1000 batch steps).
``--no-updates`` replaces the update with a no-op on this ``BatchPPO``
instance (the episode memory still fills and is cleared as before): the
sampling path alone. A huge ``update_every`` cannot stand in for it, because
the episode memory is preallocated (``update_every`` x 1000 steps).

The run takes ``--steps`` env steps in total. After a warm-up of ``--warmup``
steps (default 20,000, which with the default ``--update-every`` includes the
first update, so that torch's allocator, thread pools and caches have settled)
it records the start values, then samples every 1/``--samples`` of the rest
(5% by default):

  * the resident set size (RSS, psutil) of this process and of each worker
    process (``batch_env.workers``);
  * this process's open file descriptors, threads, and shared-memory mappings
    (``/dev/shm`` entries of its memory maps: the workers' blocks).

At the end it closes the env and checks that nothing outlived it: no worker
process still running and no other child process that was not there before
the env was built (the ``forkserver`` process and the resource tracker, which
``multiprocessing`` keeps for the life of this process, are started before
that baseline), no more shared-memory mappings than before the env was built,
and, once the closed env object is freed (as when ``Trainer.run()`` returns),
no more file descriptors either. Descriptors a closed env still holds while it
is referenced are reported, not counted as a leak.

Run it from the repository root (about 3-4 minutes on a 2-core machine with
the defaults, half of it in the 62 updates; ``--no-updates`` is faster):

    python benchmarks/memory.py
    python benchmarks/memory.py --pixels    # bytes per stored Atari frame, then exit
    python benchmarks/memory.py --envs 32 --steps 2000000 --json memory.json

It prints a markdown table and a one-line JSON summary. The exit code is 1
when the RSS of any process grew by ``--max-growth`` percent (default 5) or
more from start to end, when the file descriptors, threads or shared-memory
mappings of this process grew during the run, or when anything (process,
descriptor, mapping) is left after ``close()``; else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing.forkserver
import platform
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.ppo import BatchPPO, PPOConfig
from batchrl.envs.factory import make_batch_env
from batchrl.envs.process.channel import context
from batchrl.tensor_env import TensorBatchEnv
from batchrl.hardware import usable_cores
from batchrl.simulation import simulate

MIB = 1024 * 1024
MAX_LENGTH = 1000


def shm_mappings(process: psutil.Process) -> int:
    """Number of ``/dev/shm`` regions mapped into ``process`` (shared-memory blocks)."""
    return sum(1 for region in process.memory_maps(grouped=True)
               if region.path.startswith("/dev/shm/"))


def rss(pid: int) -> int | None:
    """Resident set size of process ``pid`` in bytes; None if it is gone."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def sample(step: int, parent: psutil.Process, pids: list[int], started: float
           ) -> dict[str, Any]:
    """One measurement: RSS of this process and of the workers, descriptors, threads."""
    return {"step": step, "seconds": round(time.perf_counter() - started, 2),
            "parent_rss": parent.memory_info().rss,
            "worker_rss": [rss(pid) for pid in pids],
            "fds": parent.num_fds(), "threads": parent.num_threads()}


def growth(start: float, end: float) -> float:
    """Percent change from ``start`` to ``end``."""
    return 100.0 * (end - start) / start


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that still run (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.Error:
            pass
    return running


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--envs", type=int, default=16, help="batch size N (default: 16)")
    parser.add_argument("--steps", type=int, default=1_000_000,
                        help="env steps in total, warm-up included (default: 1000000)")
    parser.add_argument("--warmup", type=int, default=20_000,
                        help="env steps before the start values are taken (default: 20000)")
    parser.add_argument("--samples", type=int, default=20,
                        help="measurements after the warm-up (default: 20, every 5%%)")
    parser.add_argument("--update-every", type=int, default=None,
                        help="episodes per PPO update (default: --envs)")
    parser.add_argument("--no-updates", action="store_true",
                        help="replace the PPO update by a no-op (sampling path only)")
    parser.add_argument("--max-growth", type=float, default=5.0,
                        help="largest allowed RSS growth in percent (default: 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write every sample to PATH")
    parser.add_argument("--pixels", action="store_true",
                        help="print the bytes per stored step of configs/atari/pong.toml's "
                             "rollout memory and exit")
    args = parser.parse_args()
    if args.envs < 1 or args.samples < 1 or args.warmup < 0:
        parser.error("--envs and --samples must be positive, --warmup >= 0")
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    args.update_every = args.update_every or args.envs
    return args


def pixel_memory() -> None:
    """Bytes per stored step of BatchPPO's rollout memory for ``configs/atari/pong.toml``
    (4 stacked 84x84 frames kept as uint8), against the same memory with float32 frames."""
    import gymnasium as gym
    import numpy as np

    from batchrl.config import load_config

    config = load_config("atari/pong")
    space = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)  # (the envs' layout)
    algo = BatchPPO(space, gym.spaces.Discrete(6), config.env.num_agents, total_steps=1,
                    **config.algorithm.keys)
    memory = algo.memory
    agents, steps = memory.num_agents, memory.num_agents * memory.length
    data = memory.data()
    step_bytes = sum(b.numel() * b.element_size() for b in memory.buffers.values())
    # End fields (the observation to bootstrap from): a row per segment end, at least one per
    # agent and rollout (its cut), one more per episode that ends in it.
    end_row = sum(data[name].shape[1:].numel() * data[name].element_size()
                  for name in memory.end_fields)
    total = step_bytes + agents * end_row
    frame = int(np.prod(space.shape))
    as_float = total + (steps + agents) * frame * 3  # (4 bytes instead of 1 per pixel)
    print(f"atari/pong rollout memory: {agents} agents x {memory.length} steps, "
          f"{total / 2**20:.1f} MiB: {total / steps:,.0f} bytes per stored step "
          f"(observations as uint8, {frame:,} bytes each; {end_row:,} bytes per segment end, "
          f"counted once per agent: more where episodes end); with float32 frames "
          f"{as_float / steps:,.0f} bytes ({as_float / total:.2f}x). Transport: "
          f"{frame:,} bytes per env step through shared memory.")


def main() -> int:
    """Run the loop, print the table and the JSON summary; returns the exit code."""
    args = parse_args()
    if args.pixels:
        pixel_memory()
        return 0
    torch.set_num_threads(1)  # as the trainer (train.threads)
    parent = psutil.Process()
    # multiprocessing keeps the fork server (and the resource tracker it starts)
    # for the life of this process: start them before the baseline.
    context()
    multiprocessing.forkserver.ensure_running()
    before = {"fds": parent.num_fds(), "shm": shm_mappings(parent),
              "children": {p.pid for p in parent.children(recursive=True)}}

    batch_env = make_batch_env(args.env_id, args.envs, MAX_LENGTH, backend="workers")
    workers = batch_env.workers
    pids = [worker.pid for worker in workers]
    sizes = [len(worker) for worker in workers]
    main_share = args.envs - sum(sizes)
    updating = ("no updates" if args.no_updates
                else f"an update every {args.update_every} episodes")
    print(f"{args.env_id}, {args.envs} envs ({len(workers)} worker process(es) with "
          f"{', '.join(map(str, sizes)) or '-'} envs, {main_share} in this process), "
          f"{args.steps:,} env steps in total, the first {args.warmup:,} a warm-up; BatchPPO "
          f"training with {updating}; {usable_cores()} usable cores, Python "
          f"{platform.python_version()}, torch {torch.__version__}", flush=True)
    # Episodes end args.envs at a time (all of MAX_LENGTH steps): the first update comes
    # once whole batches of them reach update_every.
    first_update = -(-args.update_every // args.envs) * args.envs * MAX_LENGTH
    if not args.no_updates and args.warmup < first_update:
        print(f"NOTE: the warm-up ({args.warmup:,} steps) ends before the first update "
              f"(after {first_update:,} steps with episodes of {MAX_LENGTH}); its "
              f"allocations then count as growth.")

    samples: list[dict[str, Any]] = []
    shm_during: dict[str, int] = {}
    updates = 0
    started = elapsed = 0.0
    try:
        env = TensorBatchEnv(batch_env)
        torch.manual_seed(args.seed)
        algo = BatchPPO(env.observation_space, env.action_space, args.envs,
                        PPOConfig(update_every=args.update_every), max_length=MAX_LENGTH)
        algo.train()
        if args.no_updates:
            algo.update = lambda: {}  # this instance only: memory still fills and clears
        batch_env.reset(seed=args.seed)
        started = time.perf_counter()  # construction (TorchScript) not timed
        interval = max(1, round((args.steps - args.warmup) / args.samples / args.envs))
        step, reset = 0, True
        next_sample = None
        while step < args.steps:
            simulate(env, algo, reset=reset)
            reset = False
            step += args.envs
            if next_sample is None and step >= args.warmup:
                samples.append(sample(step, parent, pids, started))  # the start values
                shm_during["start"] = shm_mappings(parent)
                next_sample = step + interval * args.envs
            elif next_sample is not None and (step >= next_sample or step >= args.steps):
                samples.append(sample(step, parent, pids, started))
                next_sample += interval * args.envs
                last = samples[-1]
                print(f"  {step:>10,} steps {last['seconds']:7.1f} s  parent "
                      f"{last['parent_rss'] / MIB:7.1f} MiB  workers "
                      f"{' '.join(f'{r / MIB:.1f}' if r else '-' for r in last['worker_rss'])}"
                      f" MiB  fds {last['fds']}", file=sys.stderr, flush=True)
        shm_during["end"] = shm_mappings(parent)
        updates = algo.updates
        elapsed = time.perf_counter() - started
    finally:
        batch_env.close()

    # close() stops the workers; give the fork server a moment to reap them.
    deadline = time.monotonic() + 10.0
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left_workers = alive(pids)
    left_children = [p.pid for p in parent.children(recursive=True)
                     if p.pid not in before["children"] and p.pid in alive([p.pid])]
    closed = {"fds": parent.num_fds(), "shm": shm_mappings(parent)}
    # What a closed env still holds is released when it is freed, as when
    # Trainer.run() returns: the leak check is against that.
    del env, algo, batch_env, workers
    gc.collect()
    freed = {"fds": parent.num_fds(), "shm": shm_mappings(parent)}

    start, end = samples[0], samples[-1]
    failures: list[str] = []
    rows = []

    def rss_row(name: str, first: int | None, last: int | None, peak: int | None) -> None:
        if first is None or last is None:
            rows.append(f"| {name} RSS (MiB) | - | - | - | FAIL: process gone |")
            failures.append(f"{name} disappeared")
            return
        change = growth(first, last)
        ok = change < args.max_growth
        if not ok:
            failures.append(f"{name} RSS grew {change:+.1f}%")
        rows.append(f"| {name} RSS (MiB) | {first / MIB:,.1f} | {last / MIB:,.1f} "
                    f"| {peak / MIB:,.1f} | {change:+.1f}% {'ok' if ok else 'FAIL'} |")

    rss_row("parent", start["parent_rss"], end["parent_rss"],
            max(s["parent_rss"] for s in samples))
    for index, pid in enumerate(pids):
        values = [s["worker_rss"][index] for s in samples]
        peak = max((v for v in values if v is not None), default=None)
        rss_row(f"worker {index} (pid {pid}, {sizes[index]} envs)", values[0], values[-1], peak)

    def count_row(name: str, first: int, last: int, peak: int | None = None) -> None:
        ok = last <= first
        if not ok:
            failures.append(f"{name}: {first} -> {last}")
        rows.append(f"| {name} | {first} | {last} | {'-' if peak is None else peak} "
                    f"| {'ok' if ok else 'FAIL'} |")

    count_row("parent open fds", start["fds"], end["fds"], max(s["fds"] for s in samples))
    count_row("parent threads", start["threads"], end["threads"],
              max(s["threads"] for s in samples))
    count_row("parent shared-memory mappings", shm_during["start"], shm_during["end"])
    held = closed["fds"] - before["fds"]
    rows.append(f"| parent open fds: before build / after close(), env object alive "
                f"| {before['fds']} | {closed['fds']} | - | "
                + ("ok" if held <= 0 else f"note: {held:+d}, released when the env is freed")
                + " |")
    count_row("parent open fds: before build / env freed", before["fds"], freed["fds"])
    count_row("shared-memory mappings: before build / after close()", before["shm"],
              closed["shm"])
    count_row("worker processes running after close", 0, len(left_workers))
    count_row("new child processes left after close", 0, len(left_children))

    print()
    print("| measure | start | end | peak | result |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))
    print()
    print(f"{step:,} env steps in {elapsed:.0f} s ({step / elapsed:,.0f} steps/s), "
          f"{updates} PPO updates; start = after {start['step']:,} steps, end = after "
          f"{end['step']:,}; {len(samples)} samples. Parent RSS over the run (MiB): "
          + " ".join(f"{s['parent_rss'] / MIB:.0f}" for s in samples))
    if failures:
        print("FAILED: " + "; ".join(failures))
    else:
        print(f"OK: RSS growth below {args.max_growth:g}% everywhere, nothing leaked.")

    summary = {
        "env_id": args.env_id, "envs": args.envs, "steps": step, "warmup": args.warmup,
        "updates": updates, "no_updates": args.no_updates, "seconds": round(elapsed, 1),
        "parent_rss_mib": [round(start["parent_rss"] / MIB, 1),
                           round(end["parent_rss"] / MIB, 1)],
        "parent_rss_growth_percent": round(growth(start["parent_rss"], end["parent_rss"]), 2),
        "worker_rss_growth_percent": [
            None if s is None or e is None else round(growth(s, e), 2)
            for s, e in zip(start["worker_rss"], end["worker_rss"])],
        "fds": [start["fds"], end["fds"]],
        "fds_before_closed_freed": [before["fds"], closed["fds"], freed["fds"]],
        "threads": [start["threads"], end["threads"]],
        "workers_left": len(left_workers), "children_left": len(left_children),
        "shm_before_after_close": [before["shm"], closed["shm"]],
        "ok": not failures,
    }
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(summary, pids=pids, samples=samples, failures=failures), file,
                      indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
