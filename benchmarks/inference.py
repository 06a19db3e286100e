"""Policy inference latency of BatchPPO: eager vs TorchScript vs torch.compile.

Times ``BatchPPO.perform`` (observation normalisation and, in training mode,
the update of its statistics; the actor; bookkeeping)
and the bare actor for each inference mode at several batch sizes, with the
HalfCheetah-v5 shapes (17 observations, 6 actions) and the default 200-100
networks, sampling actions as in training. Modes are interleaved round by
round and the median is reported, so machine noise hits them alike.

    python benchmarks/inference.py                 # CPU, batch 8 and 32
    python benchmarks/inference.py --device cuda --batch 32 256
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
from batchrl.algos.ppo_config import INFERENCE_MODES


def time_calls(fn, calls: int, device: torch.device) -> float:
    """Mean seconds per call of ``fn()`` over ``calls`` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", nargs="+", default=list(INFERENCE_MODES),
                        choices=INFERENCE_MODES)
    args = parser.parse_args()
    device = torch.device(args.device)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
    act_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)

    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
          f"{args.calls} calls x {args.rounds} rounds, median per call")
    print("| batch | mode | perform() us | actor us | speed vs script |")
    print("|---:|---|---:|---:|---:|")
    for batch in args.batch:
        algos, times = {}, {mode: ([], []) for mode in args.modes}
        for mode in args.modes:
            torch.manual_seed(0)
            algos[mode] = BatchPPO(obs_space, act_space, batch,
                                   PPOConfig(inference=mode), device)
        agents = torch.arange(batch, device=device)
        observ = torch.randn(batch, 17, device=device)
        state = torch.zeros(batch, 0, device=device)
        for mode, algo in algos.items():  # warm-up, includes compilation
            for _ in range(20):
                algo.perform(agents, observ)
        for _ in range(args.rounds):
            for mode, algo in algos.items():
                with torch.no_grad():
                    times[mode][0].append(time_calls(lambda: algo.perform(agents, observ),
                                                     args.calls, device))
                    times[mode][1].append(time_calls(lambda: algo.actor(observ, state, False),
                                                     args.calls, device))
        base = statistics.median(times["script"][0]) if "script" in times else None
        for mode in args.modes:
            perform = statistics.median(times[mode][0])
            actor = statistics.median(times[mode][1])
            ratio = f"{base / perform:.2f}x" if base else "-"
            print(f"| {batch} | {mode} | {perform * 1e6:.0f} | {actor * 1e6:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
