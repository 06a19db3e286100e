"""Sampling speed: ``simulate()`` with BatchPPO acting, against the raw batch env.

For each batch size, builds the trainer's env in its worker layout (``make_batch_env`` with
``backend="workers"``: every env in an ``EnvWorker`` process, batchrl's wrappers) and
measures, round by round and interleaved:

  * ``raw``: ``BatchEnv.step`` with pre-generated random actions, finished envs
    reset with ``reset(indices)``: the env layer alone;
  * ``simulate``: ``simulate(TensorBatchEnv(batch_env), BatchPPO)`` in training
    mode (normalisers updated, transitions stored). Calls that ran a PPO
    update are left out of the time (this measures sampling; updates are
    ``benchmarks/training.py``'s subject);
  * ``overlap``: the same with ``simulate(..., overlap=True)``, the loop of
    ``train.py`` (``train.overlap``): the experience of a step is stored
    while the workers step the next one.

The ratio ``/ raw`` is the share of the env rate that survives inference and
bookkeeping (the target is >= 0.75). Learner threads: 1, as in the configs
(``train.threads``).

    python benchmarks/sampling.py                      # 8 and 32 envs
    python benchmarks/sampling.py --envs 8 --steps 3000 --rounds 5
    python benchmarks/sampling.py --envs 8 --workers 1 --share-main   # this process steps half
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.ppo import BatchPPO, PPOConfig
from batchrl.envs.factory import make_batch_env
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import flush, simulate


def raw_rate(batch_env, actions: np.ndarray) -> float:
    """Env steps per second of the bare batch env over ``actions`` ``(T, N, A)``."""
    start = time.perf_counter()
    for action in actions:
        _, _, terminated, truncated, _ = batch_env.step(action)
        done = terminated | truncated
        if done.any():
            batch_env.reset(np.flatnonzero(done))
    return actions.shape[0] * actions.shape[1] / (time.perf_counter() - start)


def simulate_rate(env: TensorBatchEnv, algo: BatchPPO, steps: int, overlap: bool) -> float:
    """Env steps per second of ``simulate``, leaving out calls that updated."""
    elapsed = 0.0
    counted = 0
    for _ in range(steps):
        updates = algo.updates
        start = time.perf_counter()
        simulate(env, algo, overlap=overlap)
        took = time.perf_counter() - start
        if algo.updates == updates:
            elapsed += took
            counted += 1
    return counted * len(env) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=2000, help="batch steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inference", default="script", choices=["script", "eager", "compile"])
    parser.add_argument("--workers", type=int, default=0,
                        help="env worker processes (0: make_batch_env's default)")
    parser.add_argument("--share-main", action="store_true",
                        help="this process steps a share of the envs too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.env_id}, {args.steps} batch steps per measurement, median of {args.rounds} "
          f"rounds, torch {torch.__version__} with 1 thread, inference {args.inference}")
    print("| envs | raw BatchEnv steps/s | simulate() steps/s | / raw | simulate(overlap) "
          "steps/s | / raw |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num_envs in args.envs:
        batch_env = make_batch_env(args.env_id, num_envs, 1000, backend="workers",
                                   workers=args.workers,
                                   share_main=args.share_main)
        try:
            env = TensorBatchEnv(batch_env)
            torch.manual_seed(0)
            algo = BatchPPO(env.observation_space, env.action_space, num_envs,
                            PPOConfig(update_every=num_envs, inference=args.inference,
                                      update_threads=1), max_length=1000)
            # The wrapped action space is unbounded (ClipAction); the task's is [-1, 1].
            shape = batch_env.action_space.shape
            actions = np.random.default_rng(0).uniform(
                -1.0, 1.0, (args.steps, num_envs, *shape)).astype(np.float32)
            batch_env.reset(seed=0)
            raw_rate(batch_env, actions[:50])  # warm-up
            simulate(env, algo, reset=True)
            simulate_rate(env, algo, 50, overlap=True)
            raws, sims, lagged = [], [], []
            for _ in range(args.rounds):
                raws.append(raw_rate(batch_env, actions))
                # The raw loop left envs mid-episode: start fresh episodes.
                simulate(env, algo, reset=True)
                sims.append(simulate_rate(env, algo, args.steps, overlap=False))
                simulate(env, algo, reset=True)
                lagged.append(simulate_rate(env, algo, args.steps, overlap=True))
                flush(env)
        finally:
            batch_env.close()
        raw, sim, lag = (statistics.median(values) for values in (raws, sims, lagged))
        # (ratios within each round, then their median: the host's drifts hit both sides)
        sim_ratio = statistics.median(s / r for s, r in zip(sims, raws))
        lag_ratio = statistics.median(s / r for s, r in zip(lagged, raws))
        print(f"| {num_envs} | {raw:,.0f} | {sim:,.0f} | {sim_ratio:.2f} | {lag:,.0f} | "
              f"{lag_ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
