"""The learner's cost per batch step, with the env's cost taken out.

Runs ``simulate()`` with BatchPPO in training mode (observation and reward
statistics updated, transitions stored; update steps left out) on a batch of
do-nothing envs stepped in this process, with HalfCheetah-v5's spaces (17
observations, 6 actions) and the default 200-100 networks. What is left of a
batch step is the learner: inference, the normalisers, the episode memory and
``simulate``'s bookkeeping, plus a few microseconds of ``BatchEnv``. This is
the cost that ``benchmarks/sampling.py``'s ratio to the raw env rate pays
for.

    python benchmarks/learner.py                 # 8 and 32 envs
    python benchmarks/learner.py --envs 8 --steps 5000 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.ppo import BatchPPO, PPOConfig
from batchrl.envs.batch import BatchEnv
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import simulate


class NullEnv(gym.Env):
    """HalfCheetah-shaped env whose step costs next to nothing: the same
    observation every step, episodes of ``length`` steps."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)

    def __init__(self, length: int, seed: int):
        self.length, self.steps = length, 0
        self.observ = np.random.default_rng(seed).normal(size=17).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.steps = 0
        return self.observ, {}

    def step(self, action: np.ndarray):
        self.steps += 1
        return self.observ, 1.0, False, self.steps >= self.length, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=3000, help="batch steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"simulate() with BatchPPO on do-nothing envs, median of {args.rounds} rounds of "
          f"{args.steps} batch steps, torch {torch.__version__} with 1 thread")
    print("| envs | learner us per batch step | us per env step |")
    print("|---:|---:|---:|")
    for num_envs in args.envs:
        # Episodes of 1000 steps, as HalfCheetah's; the memory holds all the
        # episodes of the run, so no update runs.
        episodes = num_envs * ((200 + args.rounds * args.steps) // 1000 + 1)
        env = TensorBatchEnv(BatchEnv([NullEnv(1000, seed) for seed in range(num_envs)]))
        torch.manual_seed(0)
        algo = BatchPPO(env.observation_space, env.action_space, num_envs,
                        PPOConfig(update_every=episodes, update_threads=1),
                        max_length=1000)
        simulate(env, algo, reset=True)
        for _ in range(200):
            simulate(env, algo)
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                simulate(env, algo)
            rounds.append((time.perf_counter() - start) / args.steps)
        assert algo.updates == 0
        env.close()
        cost = statistics.median(rounds) * 1e6
        print(f"| {num_envs} | {cost:.0f} | {cost / num_envs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
