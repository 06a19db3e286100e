"""The cost of one SAC gradient step: batchrl's ``SAC`` against Stable-Baselines3's, side by side.

batchrl in float32 and with ``precision="bfloat16"`` (its layers computed in bfloat16). All
with 256-256 networks, a batch of 256 transitions drawn from a filled replay buffer, Adam,
automatic entropy tuning, on HalfCheetah-v5's sizes (17 observations, 6 actions), one torch
thread, on the CPU. Rounds alternate between them; the table gives each one's median time per
gradient step and the median of the per-round ratios to SB3. SB3 is a benchmark-only
dependency (the ``bench`` extra does not install it: ``pip install stable-baselines3``).

    python benchmarks/sac_update.py              # about a minute; an idle machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.sac import SAC


def batchrl_sac(observation: gym.spaces.Box, action: gym.spaces.Box, fill: int,
                precision: str = "float32") -> SAC:
    algo = SAC(observation, action, 1, buffer_size=fill, learning_starts=0, precision=precision)
    for _ in range(fill):
        obs = torch.randn(1, observation.shape[0])
        algo.buffer.add(reward=torch.randn(1), terminated=torch.zeros(1, dtype=torch.bool),
                        done=torch.zeros(1, dtype=torch.bool), observ=obs,
                        next_observ=obs + 0.1, action=torch.rand(1, action.shape[0]) * 2 - 1)
    return algo


def sb3_sac(env_id: str, fill: int):
    from stable_baselines3 import SAC as SB3SAC
    from stable_baselines3.common.logger import configure

    model = SB3SAC("MlpPolicy", gym.make(env_id), buffer_size=fill, batch_size=256,
                   learning_starts=0, device="cpu", verbose=0)
    model.set_logger(configure(None, []))  # (learn() sets one; train() alone needs it)
    space = model.observation_space
    for _ in range(fill):
        obs = np.random.randn(1, space.shape[0]).astype(np.float32)
        action = np.random.uniform(-1, 1, (1, *model.action_space.shape))
        model.replay_buffer.add(obs, obs + 0.1, action, np.random.randn(1), np.zeros(1), [{}])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="HalfCheetah-v5")
    parser.add_argument("--steps", type=int, default=200, help="gradient steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = gym.make(args.env_id)
    ours = {precision: batchrl_sac(env.observation_space, env.action_space, 10_000, precision)
            for precision in ("float32", "bfloat16")}
    theirs = sb3_sac(args.env_id, 10_000)
    steps: dict[str, Callable[[], None]] = {
        "batchrl": lambda: [ours["float32"].gradient_step() for _ in range(args.steps)],
        "batchrl, train.precision = bfloat16":
            lambda: [ours["bfloat16"].gradient_step() for _ in range(args.steps)],
        "SB3": lambda: theirs.train(gradient_steps=args.steps, batch_size=256)}
    for algo in ours.values():
        algo.gradient_step()
    theirs.train(gradient_steps=5, batch_size=256)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(args.rounds):
        shift = round_index % len(names)  # (no variant always first)
        for name in names[shift:] + names[:shift]:
            run = steps[name]
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / args.steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"SAC gradient step, {args.env_id} sizes, 256-256 networks, batch 256, 1 thread, "
          f"median of {args.rounds} rounds of {args.steps}:\n")
    print("| | ms per gradient step | vs SB3 |\n|---|---:|---:|")
    for name, seconds in medians.items():
        ratio = statistics.median(sb3 / ours for sb3, ours in zip(times["SB3"], times[name]))
        print(f"| {name} | {seconds * 1e3:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
