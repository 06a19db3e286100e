"""Environment steps per second: the Ray env backend against the local workers.

Measures how many env steps per second (batch steps x envs) HalfCheetah-v5
reaches with random actions on this one machine, with the same number of
workers (``--workers``, default 2) hosting the envs in both cases:

  * ``workers``: ``batch_env_from(backend="workers", share_main=False)``:
    ``EnvWorker`` child processes pinned to cores, arrays in shared memory;
  * ``ray``: ``batch_env_from(backend="ray")``: ``RayEnvWorker`` actors of a
    private Ray instance started on this machine, one actor call per worker
    per batch step.

The ratio ``ray / workers`` is the price of Ray's transport (a gRPC call
with pickled arrays instead of a shared-memory write and a wake-up byte)
where a cluster brings no extra cores; on a cluster, Ray's gain is the cores
of the other machines. The main process steps no envs in either layout.

Measurements follow ``benchmarks/envstep.py`` (its ``measure`` and
``step_all``): same seeded reset, warm-up steps, the same pre-generated
random actions for both backends, construction time reported apart, rounds
with alternating backend order and the median of ``--repeats`` rounds. Ray
is started once, before the first round (about 5 s, not part of any figure).

Run it from the repository root (about 1-2 minutes on a 2-core machine;
needs ``pip install 'batchrl[ray]'``):

    python benchmarks/raystep.py
    python benchmarks/raystep.py --envs 8 32 --workers 2 --steps 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from envstep import add_arguments, check_arguments, measure  # noqa: E402  (the sibling benchmark's helpers)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.envs.factory import batch_env_from  # noqa: E402
from batchrl.hardware import usable_cores  # noqa: E402

BACKENDS = ("workers", "ray")


def builder(workers: int) -> Any:
    """``measure``'s builder for ``BACKENDS`` with ``workers`` workers."""

    def build(backend: str, env_id: str, num_envs: int) -> tuple[Any, list[int]]:
        make = functools.partial(gym.make, env_id)
        if backend == "workers":
            env = batch_env_from(make, num_envs, "workers", workers, share_main=False)
            return env, [worker.pid for worker in env.workers]
        if backend == "ray":
            env = batch_env_from(make, num_envs, "ray", workers)
            return env, []  # Ray's own processes: they stay until ray.shutdown()
        raise ValueError(f"unknown backend {backend!r}")

    return build


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, envs=[8, 32], steps=1000, repeats=3)
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes / Ray actors in both backends (default: 2)")
    args = parser.parse_args()
    check_arguments(parser, args)
    if args.workers < 1:
        parser.error("--workers must be positive")
    return args


def main() -> int:
    """Start Ray, run every round, print the table and a JSON summary."""
    args = parse_args()
    try:
        import ray
    except ImportError:
        print("error: this benchmark needs Ray: pip install 'batchrl[ray]'", file=sys.stderr)
        return 2
    started = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Started here, once: the Ray backend then uses this instance (and leaves it
    # running between measurements) instead of starting one per build.
    # (each actor reserves a CPU: room for --workers above the cores)
    ray.init(num_cpus=max(usable_cores(), args.workers), logging_level=logging.WARNING)
    probe = gym.make(args.env_id)
    space = probe.action_space
    probe.close()
    rng = np.random.default_rng(args.seed)
    actions = rng.uniform(space.low, space.high,
                          size=(args.warmup + args.steps, max(args.envs), *space.shape)
                          ).astype(space.dtype)
    print(f"{args.env_id}, random actions, infos returned, {args.workers} workers per "
          f"backend, {args.steps} timed batch steps after {args.warmup} warm-up steps, "
          f"median of {args.repeats} rounds, {usable_cores()} usable cores; Python "
          f"{platform.python_version()}, gymnasium {gym.__version__}, ray {ray.__version__}",
          flush=True)

    build = builder(args.workers)
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    background: list[float] = []
    worker_pids: set[int] = set()
    for round_index in range(args.repeats):
        background.append(psutil.cpu_percent(interval=0.5))
        order = BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]
        for num_envs in args.envs:
            for backend in order:
                sample = measure(backend, args.env_id, actions[:, :num_envs], args.warmup,
                                 args.seed, builder=build)
                worker_pids.update(sample.pop("pids"))
                samples.setdefault((num_envs, backend), []).append(sample)
                print(f"  round {round_index + 1}/{args.repeats}: {num_envs:3d} envs "
                      f"{backend:8s} {sample['steps_per_s']:10,.0f} steps/s  "
                      f"(build {sample['build_s']:.2f} s)", file=sys.stderr, flush=True)
    ray.shutdown()

    results: dict[str, dict[str, Any]] = {}
    print()
    print("| envs | workers steps/s | ray steps/s | ray / workers | build s (workers, ray) |")
    print("|---:|---:|---:|---:|---:|")
    for num_envs in args.envs:
        row = {}
        for backend in BACKENDS:
            runs = samples[(num_envs, backend)]
            row[backend] = statistics.median(s["steps_per_s"] for s in runs)
            row[f"{backend}_build_s"] = statistics.median(s["build_s"] for s in runs)
            row[f"{backend}_samples"] = [round(s["steps_per_s"]) for s in runs]
        results[str(num_envs)] = row
        print(f"| {num_envs} | {row['workers']:,.0f} | {row['ray']:,.0f} | "
              f"{row['ray'] / row['workers']:.2f}x | {row['workers_build_s']:.2f}, "
              f"{row['ray_build_s']:.2f} |")
    print()
    print(f"Background CPU load before each round: "
          f"{', '.join(f'{load:.0f}%' for load in background)} of all cores.")
    if max(background) > 15:
        print("WARNING: other programs were using the CPU; the rates are noisy.")
    leftover = [p.pid for p in psutil.Process().children(recursive=True)
                if p.pid in worker_pids]
    if leftover:
        print(f"WARNING: env worker processes still running: {leftover}", file=sys.stderr)
    print(f"Total time {time.perf_counter() - started:.0f} s.")
    summary = {"env_id": args.env_id, "workers": args.workers, "steps": args.steps,
               "repeats": args.repeats, "max_background_cpu_percent": max(background),
               "steps_per_s": {n: {b: round(r[b]) for b in BACKENDS}
                               for n, r in results.items()}}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(summary, results=results), file, indent=2)
    return 1 if leftover else 0


if __name__ == "__main__":
    sys.exit(main())
