"""Environment steps per second: batchrl's BatchEnv against Gymnasium's vector envs.

Measures how many env steps per second (batch steps x envs) HalfCheetah-v5 reaches
with random actions, for several batch sizes, with

  * ``batchrl``: ``make_batch_env``'s worker layout (backend ``"workers"``, what
    ``"auto"`` gives envs without a native version): ``EnvWorker`` processes,
    one per usable core, each pinned to its core and hosting its share of the
    envs, with observations and actions in shared memory; finished envs are
    reset with ``batch_env.reset(indices)``;
  * ``BatchVectorEnv``: the same layout behind Gymnasium's ``VectorEnv`` API
    (next-step autoreset, infos gathered into Gymnasium's dict of arrays every
    step);
  * ``batchrl-process``: ``BatchEnv`` over one ``ExternalProcess`` per env (the
    BatchPPO paper's layout), stepped in parallel;
  * ``SyncVectorEnv``: ``gymnasium.vector.SyncVectorEnv``, all envs in this process;
  * ``AsyncVectorEnv``: ``gymnasium.vector.AsyncVectorEnv(shared_memory=True)``;
    the Gymnasium vector envs reset finished envs themselves (their default
    next-step autoreset);
  * ``native``: ``make_batch_env(..., backend="vector")`` (what ``"auto"`` gives
    these tasks) over
    ``batchrl.envs.mujoco_batch`` (the tasks it has, with ``mjbatch`` installed:
    ``pip install -e .[native]``): the simulations stepped in mjbatch's C++
    threads, observations, rewards and resets computed in numpy for the batch;
    it takes actions in the task's own range, as the others do, and applies
    ``wrap_env``'s action clipping and 32-bit floats, which the others leave out;
  * ``envpool``: EnvPool's C++ thread pool with its own MuJoCo port of the
    task, when ``envpool`` is installed (``pip install envpool``): the ceiling
    a Python env loop can approach.

All backends build the plain ``gymnasium.make(env_id)`` env (no batchrl
wrappers) and return the step infos.

Every measurement builds the backend, resets it with the same seed, takes a few
warm-up steps and then times ``--steps`` batch steps with pre-generated random
actions, the same ones for every backend; construction time is reported apart
and is not part of the rate. Worker processes use the ``forkserver`` start
method for both multi-process backends. The whole round (every backend at
every batch size, backend order rotated each round) is repeated ``--repeats``
times; the table gives each backend's median rate and, as ratios, the median
of the per-round ratios, so that machine noise hits both sides of a ratio
alike. As a reference, the "physical limit" of a MuJoCo env is its bare
simulation's rate on one core (``mj_step`` with the env's frame skip on its
``MjData``, none of the env's Python) times the number of usable cores, an
upper bound no backend can beat; the table gives each backend's fraction of it.
One in-process Gymnasium env's rate times the cores is printed beside it (for
other envs it is the limit).
Other programs' CPU load is sampled before each round and reported, with a
warning when the machine was busy (the rates are then noisy).

Run it from the repository root (takes about 2-4 minutes on a 2-core machine):

    python benchmarks/envstep.py
    python benchmarks/envstep.py --envs 2 8 32 --steps 1500 --repeats 5 --json out.json

It prints a markdown table, the physical limit and a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.envs import BatchEnv, BatchVectorEnv, ExternalProcess
from batchrl.envs.factory import batch_env_from, make_batch_env
from batchrl.envs.mujoco_batch import TASKS
from batchrl.hardware import usable_cores

try:
    import envpool
except ImportError:  # optional: only adds a column
    envpool = None

try:
    import mjbatch
except ImportError:  # the native extra: only adds a column
    mjbatch = None

BACKENDS = ("batchrl", "BatchVectorEnv", "batchrl-process", "SyncVectorEnv", "AsyncVectorEnv") + (
    ("envpool",) if envpool is not None else ()) + (("native",) if mjbatch is not None else ())


def build(backend: str, env_id: str, num_envs: int) -> tuple[Any, list[int]]:
    """Construct ``backend`` with ``num_envs`` envs.

    Returns:
      the env and the process ids of its workers (empty for in-process backends).
    """
    make = functools.partial(gym.make, env_id)
    if backend == "single":
        return make(), []
    if backend == "batchrl":
        env = batch_env_from(make, num_envs)  # make_batch_env's layout, without wrappers
        return env, [worker.pid for worker in env.workers]
    if backend == "BatchVectorEnv":
        env = BatchVectorEnv([make] * num_envs)
        return env, [worker.pid for worker in env.batch.workers]
    if backend == "batchrl-process":
        env = BatchEnv([ExternalProcess(make) for _ in range(num_envs)], blocking=False)
        return env, [worker.pid for worker in env.workers]
    if backend == "native":
        # (the task's own action range, as the others take the same actions: no rescaling)
        return make_batch_env(env_id, num_envs, backend="vector",
                              kwargs={"env_id": env_id, "normalize_ranges": False},
                              vector_id="batchrl.envs.mujoco_batch:make_vector"), []
    if backend == "envpool":
        return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs), []
    if backend == "SyncVectorEnv":
        return gym.vector.SyncVectorEnv([make] * num_envs), []
    if backend == "AsyncVectorEnv":
        env = gym.vector.AsyncVectorEnv([make] * num_envs, shared_memory=True,
                                        context="forkserver")
        return env, [process.pid for process in env.processes]
    raise ValueError(f"unknown backend {backend!r}")


def step_all(env: Any, actions: np.ndarray) -> None:
    """Take one step per row of ``actions`` (shape ``(T, num_envs, *act_shape)``),
    resetting finished episodes the way each backend expects."""
    if isinstance(env, BatchEnv):
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action)
            done = terminated | truncated
            if done.any():
                env.reset(np.flatnonzero(done))
    elif isinstance(env, gym.vector.VectorEnv) or hasattr(env, "config"):
        for action in actions:  # autoresets by itself (Gymnasium and EnvPool)
            env.step(action)
    else:  # a single in-process env
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action[0])
            if terminated or truncated:
                env.reset()


def measure(backend: str, env_id: str, actions: np.ndarray, warmup: int,
            seed: int, builder: Callable[[str, str, int], tuple[Any, list[int]]] = build
            ) -> dict[str, Any]:
    """Build, seed-reset and warm up ``backend``, then time the remaining actions.

    Args:
      actions: ``(warmup + steps, num_envs, *act_shape)``; the batch size is
        ``actions.shape[1]``.
      builder: ``builder(backend, env_id, num_envs)`` returns the env and its
        worker pids (``build`` by default; other benchmarks pass their own).
    Returns:
      ``{"steps_per_s", "build_s", "pids"}``; the env is closed before returning.
    """
    num_envs = actions.shape[1]
    start = time.perf_counter()
    env, pids = builder(backend, env_id, num_envs)
    build_s = time.perf_counter() - start
    try:
        env.reset(seed=seed)
        step_all(env, actions[:warmup])
        start = time.perf_counter()
        step_all(env, actions[warmup:])
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    return {"steps_per_s": num_envs * (len(actions) - warmup) / elapsed,
            "build_s": build_s, "pids": pids}


def raw_step_rate(env_id: str, actions: np.ndarray, warmup: int, seed: int) -> float | None:
    """Steps per second of ``env_id``'s bare simulation on one core: ``mj_step`` called
    ``frame_skip`` times per step on its ``MjData`` with the actions of ``actions[:, 0]``,
    none of the env's Python (observations, rewards, resets); ``None`` for an env that is
    not a Gymnasium MuJoCo env. The fastest of three passes over the actions: a limit is a
    bound, which the host's hiccups during one short pass would lower."""
    env = gym.make(env_id)
    try:
        sim = env.unwrapped
        if not hasattr(sim, "model") or not hasattr(sim, "frame_skip"):
            return None
        import mujoco

        env.reset(seed=seed)
        model, data, substeps = sim.model, sim.data, sim.frame_skip
        for action in actions[:warmup, 0]:
            data.ctrl[:] = action
            mujoco.mj_step(model, data, nstep=substeps)
        fastest = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for action in actions[warmup:, 0]:
                data.ctrl[:] = action
                mujoco.mj_step(model, data, nstep=substeps)
            fastest = min(fastest, time.perf_counter() - start)
        return (len(actions) - warmup) / fastest
    finally:
        env.close()


def _ratio(row: dict[str, Any], reference: dict[str, Any]) -> float:
    """The median over rounds of ``row``'s rate over ``reference``'s in the same round."""
    return statistics.median(a / b for a, b in zip(row["samples"], reference["samples"]))


def markdown_table(results: dict[int, dict[str, dict[str, Any]]],
                   limits: list[float] | None = None) -> str:
    """Format median rates as a markdown table; a ratio column is the median of the
    per-round ratios (every round measures every backend, so noise that hits one round
    hits both sides of its ratio). ``limits``: each round's physical limit, for a column
    of the fraction of it reached."""
    references = [name for name in ("batchrl", "SyncVectorEnv", "AsyncVectorEnv", "envpool")
                  if name in next(iter(results.values()))]
    limit_header, limit_rule = (" of the limit |", "---:|") if limits else ("", "")
    lines = ["| envs | backend | steps/s | " + " | ".join(f"vs {name}" for name in references)
             + f" |{limit_header} spread | build s |",
             "|---:|---|---:|" + "---:|" * len(references) + limit_rule + "---:|---:|"]
    for num_envs, rows in results.items():
        for backend, row in rows.items():
            ratios = " | ".join(f"{_ratio(row, rows[name]):.2f}x" for name in references)
            of_limit = (f" {_ratio(row, {'samples': limits}):.2f} |" if limits else "")
            lines.append(f"| {num_envs} | {backend} | {row['steps_per_s']:,.0f} | {ratios} |"
                         f"{of_limit} ±{row['spread'] / 2:.0%} | {row['build_s']:.2f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, envs: list[int], steps: int,
                  repeats: int) -> None:
    """The options this benchmark shares with ``raystep.py`` (their defaults
    differ): env id, batch sizes, steps, warm-up, rounds, seed, JSON output."""
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--envs", type=int, nargs="+", default=envs,
                        help=f"batch sizes to measure (default: {' '.join(map(str, envs))})")
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"timed batch steps per measurement (default: {steps})")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed batch steps after the reset (default: 10)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"rounds over all backends; the median is reported "
                             f"(default: {repeats})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write all results to PATH")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless the shared options are in range."""
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or min(args.envs) < 1:
        parser.error("--steps, --repeats and --envs must be positive, --warmup >= 0")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, envs=[2, 8, 32], steps=1500, repeats=5)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends to measure (default: all)")
    args = parser.parse_args()
    check_arguments(parser, args)
    return args


def measured(args: argparse.Namespace) -> list[str]:
    """The backends asked for that can run ``args.env_id``."""
    return [name for name in BACKENDS if name in args.backends
            and (name != "native" or args.env_id in TASKS)]


def main() -> int:
    """Run every round, print the table and the JSON summary; returns the exit code."""
    args = parse_args()
    started = time.perf_counter()
    cores = usable_cores()
    probe = gym.make(args.env_id)
    space = probe.action_space
    probe.close()
    rng = np.random.default_rng(args.seed)
    actions = rng.uniform(space.low, space.high,
                          size=(args.warmup + args.steps, max(args.envs), *space.shape)
                          ).astype(space.dtype)
    print(f"{args.env_id}, random actions, {args.steps} timed batch steps after "
          f"{args.warmup} warm-up steps, median of {args.repeats} rounds, {cores} usable "
          f"cores; Python {platform.python_version()}, gymnasium {gym.__version__}",
          flush=True)

    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    single: list[float] = []
    raws: list[float] = []  # the bare simulation's rate on one core, per round
    worker_pids: set[int] = set()
    background: list[float] = []
    for round_index in range(args.repeats):
        # Nothing of ours runs now, so this is other programs' share of all cores.
        background.append(psutil.cpu_percent(interval=0.5))
        single.append(measure("single", args.env_id, actions[:, :1], args.warmup,
                              args.seed)["steps_per_s"])
        raw = raw_step_rate(args.env_id, actions, args.warmup, args.seed)
        if raw is not None:
            raws.append(raw)
        # Rotate the order so no backend always runs first or last. batchrl comes
        # first in round 0 so the fork server starts with batchrl's preload
        # (numpy, gymnasium, torch), which speeds up both multi-process backends.
        backends = measured(args)
        shift = round_index % len(backends)
        order = backends[shift:] + backends[:shift]
        for num_envs in args.envs:
            for backend in order:
                sample = measure(backend, args.env_id, actions[:, :num_envs], args.warmup,
                                 args.seed)
                worker_pids.update(sample.pop("pids"))
                samples.setdefault((num_envs, backend), []).append(sample)
                print(f"  round {round_index + 1}/{args.repeats}: {num_envs:3d} envs "
                      f"{backend:15s} {sample['steps_per_s']:10,.0f} steps/s  "
                      f"(build {sample['build_s']:.2f} s)", file=sys.stderr, flush=True)

    results: dict[int, dict[str, dict[str, Any]]] = {}
    for num_envs in args.envs:
        for backend in measured(args):
            rates = [s["steps_per_s"] for s in samples[(num_envs, backend)]]
            median = statistics.median(rates)
            results.setdefault(num_envs, {})[backend] = {
                "steps_per_s": median,
                "spread": (max(rates) - min(rates)) / median,
                "build_s": statistics.median(s["build_s"] for s in samples[(num_envs, backend)]),
                "samples": rates,
            }
    single_rate = statistics.median(single)
    limits = [raw * cores for raw in raws]
    limit = statistics.median(limits) if limits else single_rate * cores

    print()
    print(markdown_table(results, limits or None))
    print()
    if limits:
        print(f"Physical limit: the bare simulation (mj_step x frame_skip, no Python env) steps "
              f"{statistics.median(raws):,.0f} steps/s on one core x {cores} usable cores = "
              f"{limit:,.0f} steps/s; \"of the limit\" is the median of the rounds' fractions "
              f"of it.")
    print(f"One in-process Gymnasium env steps {single_rate:,.0f} steps/s x {cores} usable "
          f"cores = {single_rate * cores:,.0f} steps/s.")
    print("steps/s: median of the rounds; vs X: median of the per-round ratios; spread: half "
          "the min-max range of the rounds, relative to the median; build s: median "
          "construction time, not part of steps/s.")

    print(f"Background CPU load before each round: "
          f"{', '.join(f'{load:.0f}%' for load in background)} of all cores.")
    if max(background) > 15:
        print("WARNING: other programs were using the CPU; the rates are noisy and "
              "lower than on an idle machine.")

    leftover = [p.pid for p in psutil.Process().children(recursive=True)
                if p.pid in worker_pids]
    if leftover:
        print(f"WARNING: env worker processes still running: {leftover}", file=sys.stderr)

    summary = {
        "env_id": args.env_id, "steps": args.steps, "repeats": args.repeats, "cores": cores,
        "physical_limit": round(limit),
        "gymnasium_env_limit": round(single_rate * cores),
        "max_background_cpu_percent": max(background),
        "steps_per_s": {str(n): {b: round(r["steps_per_s"]) for b, r in rows.items()}
                        for n, rows in results.items()},
        "leftover_workers": len(leftover),
    }
    print(f"Total time {time.perf_counter() - started:.0f} s.")
    print(json.dumps(summary))
    if args.json:
        full = dict(summary, warmup=args.warmup, seed=args.seed,
                    single_env_steps_per_s=single, raw_steps_per_s=raws, results=results)
        with open(args.json, "w") as file:
            json.dump(full, file, indent=2)
    return 1 if leftover else 0


if __name__ == "__main__":
    sys.exit(main())
