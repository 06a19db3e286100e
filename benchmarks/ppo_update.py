"""The cost of BatchPPO's update on a config's own rollouts, in variants, side by side.

Each round builds the config's envs (``make_batch_env``, the ``auto`` backend) and BatchPPO for
each variant in turn, steps ``--updates`` rollouts with ``simulate()`` and times every
``update()`` after the first. Rounds alternate the variants (each round starting at the next);
the table gives each one's median milliseconds per update and per 1,000 samples, and the
median of its per-round ratios to the first row. Variants:

* ``config``: the config as it is (float32; policy and value steps side by side in threads);
* ``fused_adam``: ``algorithm.fused_adam = true`` (``torch.optim.Adam(fused=True)``, not
  bit-identical to the default per-parameter Adam);
* ``bfloat16``: ``train.precision = "bfloat16"``;
* ``bfloat16_fused``: both;
* ``bfloat16_fused_relu``: both, with ReLU networks (``algorithm.activation = "relu"``): what
  the activation costs (it changes what the networks learn);
* ``one_thread``: ``algorithm.update_threads = 1`` (the two steps one after the other).

    python benchmarks/ppo_update.py                       # halfcheetah; an idle machine
    python benchmarks/ppo_update.py --config hopper --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.config import load_config
from batchrl.envs.factory import make_batch_env
from batchrl.simulation import simulate
from batchrl.tensor_env import TensorBatchEnv

VARIANTS = {"config": [], "fused_adam": ["algorithm.fused_adam=true"],
            "bfloat16": ['train.precision="bfloat16"'],
            "bfloat16_fused": ['train.precision="bfloat16"', "algorithm.fused_adam=true"],
            "bfloat16_fused_relu": ['train.precision="bfloat16"', "algorithm.fused_adam=true",
                                    'algorithm.activation="relu"'],
            "one_thread": ["algorithm.update_threads=1"]}


def update_times(config_name: str, variant: str, updates: int) -> tuple[list[float], int]:
    """Seconds of each update after the first, and the samples of one update."""
    config = load_config(config_name, ["train.device=cpu"] + VARIANTS[variant])
    torch.manual_seed(0)
    torch.set_num_threads(1)  # (as train.py acts; updates set their own threads)
    env_config = config.env
    batch_env = make_batch_env(env_config.id, env_config.num_agents, env_config.max_length,
                               env_config.kwargs, env_config.backend, infos=False)
    env = TensorBatchEnv(batch_env, torch.device("cpu"))
    try:
        algo = config.make_algorithm(env.observation_space, env.action_space, len(env),
                                     torch.device("cpu"))
        length = getattr(algo.config, "rollout_length", None)
        if not length:
            raise SystemExit(f"{config_name}: this benchmark needs fixed-length rollouts "
                             f"(algorithm.rollout_length)")
        times: list[float] = []
        update = algo.update

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = update(*args, **kwargs)
            times.append(time.perf_counter() - start)
            return result

        algo.update = timed
        for step in range(updates * length):
            simulate(env, algo, reset=step == 0)
        return times[1:], len(env) * length
    finally:
        env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--updates", type=int, default=8, help="rollouts per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {name: [] for name in args.variants}
    samples = 0
    for round_index in range(args.rounds):
        shift = round_index % len(args.variants)  # (no variant always first)
        for name in args.variants[shift:] + args.variants[:shift]:
            times, samples = update_times(args.config, name, args.updates)
            medians[name].append(statistics.median(times))
    reference = medians[args.variants[0]]
    print(f"{args.config}: {samples:,} samples per update, medians of {args.rounds} rounds of "
          f"{args.updates - 1} updates\n")
    print("| variant | ms per update | ms per 1,000 samples | ratio | rounds (ms) |")
    print("|---|---:|---:|---:|---|")
    for name, values in medians.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{1000 * value:.0f}" for value in values)
        ratio = statistics.median(v / r for v, r in zip(values, reference))  # (per round)
        print(f"| {name} | {1000 * median:.1f} | {1e6 * median / samples:.1f} | "
              f"{ratio:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
