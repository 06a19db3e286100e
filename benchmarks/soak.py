"""Soak test: a long training-style run with random env faults and restarts.

Builds ``--envs`` envs of ``--env-id`` (HalfCheetah-v5 by default; episodes
of exactly 1000 steps, cut by the time limit) in worker processes, each
wrapped in ``FaultyEnv`` that injects a random fault (raise, abort, segfault,
exit, hang, NaN observation, infinite reward) on average once every
``--fault-every`` env steps of the whole batch. The batch env restarts failed
workers (``max_restarts`` as large as needed; a hang is caught by a 2 s step
timeout) and a ``BatchPPO`` in training mode acts through ``simulate()``,
updating every ``--envs`` episodes, as ``train.py`` does with
``env.restart_crashed_envs = true``.

It checks, and prints, that:

  * nothing hangs: a watchdog ends the run (exit code 3) when no step
    finishes for ``--hang-limit`` seconds;
  * steps are counted correctly: every finished episode has exactly 1000
    steps (a lost or doubled step across a restart would change that), and the
    steps counted (envs that stepped, not the ones restarted instead) equal
    the steps in finished, running and discarded episodes;
  * every fault led to a restart (restarts <= faults: faults that hit the same
    worker in the same step need only one). Faults strike in ``step`` only
    (resets run inside the worker's step when an episode ends), which the
    step accounting relies on;
  * this process's RSS grows by less than 5% from the end of the warm-up
    (``--warmup`` steps and the first update), and its number of open file
    descriptors is the same;
  * after ``close()`` no worker or other child process is left, and no
    shared-memory block is still mapped.

    python benchmarks/soak.py                   # 16 envs, 1M steps: ~5-6 minutes on 2 cores
    python benchmarks/soak.py --steps 200000 --fault-every 5000
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing.forkserver
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.ppo import BatchPPO, PPOConfig
from batchrl.envs.factory import batch_env_from
from batchrl.testing.faults import FAULTS, FaultyEnv
from batchrl.envs.process.channel import context
from batchrl.tensor_env import TensorBatchEnv
from batchrl.envs.wrappers import wrap_env
from batchrl.simulation import Simulation
from memory import alive, growth, shm_mappings

MIB = 1024 * 1024
MAX_LENGTH = 1000


def faulty_env(env_id: str, every: int, log_dir: str) -> FaultyEnv:
    """The task, wrapped as train.py does, with random faults; each fault
    leaves a file in ``log_dir`` just before it strikes."""
    import gymnasium as gym
    env = wrap_env(gym.make(env_id), MAX_LENGTH)
    return FaultyEnv(env, FAULTS, every=every, log_dir=log_dir, hang_seconds=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--fault-every", type=int, default=20_000,
                        help="mean env steps of the whole batch between two faults")
    parser.add_argument("--warmup", type=int, default=50_000)
    parser.add_argument("--hang-limit", type=float, default=60.0)
    args = parser.parse_args()
    if args.envs < 1 or args.fault_every < 1 or args.warmup < 0:
        parser.error("--envs and --fault-every must be positive, --warmup >= 0")
    # The baseline is taken after the warm-up at an update: BatchPPO here updates after
    # one episode per env (MAX_LENGTH steps each).
    first_update = args.envs * MAX_LENGTH
    if args.steps <= max(args.warmup, first_update):
        parser.error(f"--steps must be larger than --warmup ({args.warmup:,}) and than the "
                     f"steps before the first update ({first_update:,} with {args.envs} envs)")
    torch.set_num_threads(1)
    parent = psutil.Process()
    context()
    multiprocessing.forkserver.ensure_running()  # kept for life: before the baseline
    children_before = {p.pid for p in parent.children(recursive=True)}
    shm_before = shm_mappings(parent)
    log_dir = tempfile.mkdtemp(prefix="batchrl-soak-")

    constructor = functools.partial(faulty_env, args.env_id, args.fault_every, log_dir)
    batch_env = batch_env_from(constructor, args.envs, timeout=2.0,
                               max_restarts=10 * args.steps // args.fault_every + 10,
                               infos=False, label=f"{args.env_id} (faulty)")
    sizes = [len(worker) for worker in batch_env.workers]
    print(f"{args.env_id}, {args.envs} envs in {len(sizes)} workers ({sizes}), "
          f"{args.steps:,} steps, a fault every {args.fault_every:,} steps on average "
          f"({', '.join(FAULTS)})", flush=True)

    progress = {"time": time.monotonic(), "done": False}

    def watchdog() -> None:
        while not progress["done"]:
            time.sleep(1.0)
            if time.monotonic() - progress["time"] > args.hang_limit:
                print(f"FAIL: no step finished for {args.hang_limit} s: a hang", flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    env = TensorBatchEnv(batch_env)
    simulation = Simulation(env)
    torch.manual_seed(0)
    algo = BatchPPO(env.observation_space, env.action_space, args.envs,
                    PPOConfig(update_every=args.envs), max_length=MAX_LENGTH)
    counted = finished = finished_steps = discarded = 0
    lengths: set[int] = set()
    start_rss = start_fds = None
    started = time.perf_counter()
    done = torch.ones(args.envs, dtype=torch.bool)
    try:
        while counted < args.steps:
            before = simulation.episode_length.clone()
            done_before = done
            done, _, _ = simulation.step(algo, reset=counted == 0)
            progress["time"] = time.monotonic()
            restarted = env.restarted
            counted += args.envs - (0 if restarted is None else len(restarted))
            if restarted is not None:
                # Steps of the restarted agents' episodes, unless they had just
                # ended (then this call reset them before stepping).
                kept = ~done_before[restarted]
                discarded += int(before[restarted][kept].sum())
            if done.any():
                ended = simulation.episode_length[done]
                lengths.update(ended.tolist())
                finished += len(ended)
                finished_steps += int(ended.sum())
            # The baseline after the first update: it allocates for good.
            if start_rss is None and counted >= args.warmup and algo.updates:
                start_rss, start_fds = parent.memory_info().rss, parent.num_fds()
        running = int(simulation.episode_length[~done].sum())
        end_rss, end_fds = parent.memory_info().rss, parent.num_fds()
        elapsed = time.perf_counter() - started
        pids = [worker.pid for worker in batch_env.workers]
    finally:
        progress["done"] = True
        batch_env.close()
    restarts, updates = batch_env.restarts, algo.updates
    faults = sorted(path.name.split("-")[-1] for path in Path(log_dir).iterdir())
    deadline = time.monotonic() + 10.0
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    del env, algo, batch_env
    gc.collect()
    left = [p.pid for p in parent.children(recursive=True)
            if p.pid not in children_before and alive([p.pid])]
    shm_left = shm_mappings(parent) - shm_before

    if start_rss is None:  # (restarts cut episodes: the first update may come later)
        print(f"FAIL: no update after the warm-up within {counted:,} steps: no baseline for "
              f"the memory figures; run more --steps")
        return 1
    counts = {name: faults.count(name) for name in FAULTS}
    print(f"{counted:,} env steps in {elapsed:.0f} s ({counted / elapsed:,.0f} steps/s), "
          f"{updates} updates, {finished} episodes finished")
    print(f"faults injected: {len(faults)} ({', '.join(f'{k} {v}' for k, v in counts.items())}); "
          f"worker restarts: {restarts}")
    print(f"RSS of this process after the warm-up {start_rss / MIB:.1f} MiB, at the end "
          f"{end_rss / MIB:.1f} MiB ({growth(start_rss, end_rss):+.2f}%); open descriptors "
          f"{start_fds} -> {end_fds}")
    total = finished_steps + running + discarded
    print(f"steps: counted {counted:,} = finished {finished_steps:,} + running {running:,} "
          f"+ discarded {discarded:,} ({total:,}); finished episode lengths {sorted(lengths)}")
    print(f"after close: {len(left)} child processes, {shm_left} shared-memory mappings left")
    failures = []
    if total != counted:
        failures.append("steps do not add up")
    if lengths - {MAX_LENGTH}:
        failures.append(f"episodes of other lengths than {MAX_LENGTH}: a step lost or doubled")
    if not 0 < restarts <= len(faults):
        failures.append(f"{restarts} restarts for {len(faults)} faults")
    if growth(start_rss, end_rss) >= 5.0:
        failures.append("RSS grew by 5% or more")
    if end_fds != start_fds:
        failures.append("the number of open descriptors changed")
    if left or shm_left:
        failures.append("processes or shared memory left behind")
    print("FAIL: " + "; ".join(failures) if failures else
          "OK: no hang, steps add up, every fault restarted, RSS flat, nothing leaked")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
