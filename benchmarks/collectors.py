"""Decoupled collection on this machine: training throughput of a config with 0 (the
synchronous loop), 1 and 2 collectors, side by side in one invocation, with where the time goes
and the policy lag.

Each mode trains the config in this process with the real ``Trainer`` (evaluations off, CPU,
``train.steps`` = ``--steps``) and is timed over its training phases (``wall_time`` in
``metrics.jsonl``: the trainer's own start-up excluded, the collectors' included, as they start
within the first phase; "after start-up" leaves that out). The modes run one after the
other, ``--repeats`` times in turn (A B C A B C ...), and the table shows the median.

Where the time goes:
  * synchronous: ``sampling`` is the phases' time outside the algorithm's updates (env steps,
    inference, bookkeeping; the learner idles), ``updates`` the time inside ``update()`` (the
    envs idle);
  * collectors: ``waiting`` is the learner's time waiting for a round of rollouts (mostly the
    first, while the collectors start), ``updates`` its time in ``learn()`` (the collectors go
    on meanwhile); ``after start-up`` the steps/s without that first wait and the round that
    ended it; ``collect`` the
    collectors' own rate while they step (steps/s summed over collectors, waits for a free
    slot excluded).

Run from the repository root on an otherwise idle machine:

    python benchmarks/collectors.py                    # halfcheetah, 100k steps, 3 repeats
    python benchmarks/collectors.py --config impala/halfcheetah
    python benchmarks/collectors.py --collectors 0 1 2 4 --steps 200000

It prints a markdown table and a one-line JSON summary; ratios are to the synchronous loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.algos.impala import IMPALA
from batchrl.algos.ppo import BatchPPO
from batchrl.config import load_config
from batchrl.hardware import usable_cores
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer


def run(name: str, collectors: int, steps: int, extra: list[str]) -> dict[str, Any]:
    """One training run; its throughput and time split."""
    config = load_config(name, [f"train.collectors={collectors}", f"train.steps={steps}",
                                "train.eval_episodes=0", "train.device=cpu",
                                "train.eval_every=10", *extra])
    spent = [0.0]
    # The learning steps of the synchronous loop: BatchPPO's update, IMPALA's learn.
    methods = [(BatchPPO, "update"), (IMPALA, "learn")]
    originals = [getattr(cls, name) for cls, name in methods]

    def timer(method: Any) -> Any:
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return timed

    for (cls, name), method in zip(methods, originals):
        setattr(cls, name, timer(method))
    try:
        with tempfile.TemporaryDirectory() as logdir:
            Trainer(config, Path(logdir), progress=False).run()
            records = read_metrics(Path(logdir))
    finally:
        for (cls, name), method in zip(methods, originals):
            setattr(cls, name, method)
    trains = [r for r in records if r["phase"] == "train"]
    seconds = trains[-1]["wall_time"]
    result = {"collectors": collectors, "steps": trains[-1]["step"], "seconds": seconds,
              "steps_per_s": trains[-1]["step"] / seconds}
    updates = [r for r in records if r["phase"] == "update"]
    if updates:
        # The first round waits for the collectors to start (processes, imports, envs): its
        # wait and the steps that arrived with it are left out.
        result.update(
            steady=((trains[-1]["step"] - updates[0]["step"])
                    / (seconds - updates[0]["learner_wait_s"])),
            waiting=sum(r["learner_wait_s"] for r in updates),
            updates=sum(r["learner_learn_s"] for r in updates),
            collect=statistics.median(r["collectors_steps_per_s"] for r in updates),
            lag_mean=statistics.mean(r["collectors_lag_mean"] for r in updates),
            lag_max=max(r["collectors_lag_max"] for r in updates))
    else:
        result.update(sampling=seconds - spent[0], updates=spent[0])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--collectors", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every mode")
    args = parser.parse_args()
    results: dict[int, list[dict[str, Any]]] = {count: [] for count in args.collectors}
    for _ in range(args.repeats):
        for count in args.collectors:
            results[count].append(run(args.config, count, args.steps, args.set))

    def median(count: int, key: str) -> float | None:
        values = [r[key] for r in results[count] if key in r]
        return statistics.median(values) if values else None

    base = median(0, "steps_per_s") if 0 in results else None
    print(f"{args.config}, {args.steps:,} training steps per run, median of {args.repeats}; "
          f"{usable_cores()} usable cores, torch {torch.__version__}\n")
    print("| collectors | steps/s | ratio | after start-up | sampling s | waiting s | "
          "updates s | collect steps/s | lag mean | lag max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for count in args.collectors:
        rate = median(count, "steps_per_s")

        def cell(key: str, form: str = "{:.1f}") -> str:
            value = median(count, key)
            return "-" if value is None else form.format(value)

        ratio = f"{rate / base:.2f}" if base else "-"
        label = "0 (synchronous)" if count == 0 else str(count)
        print(f"| {label} | {rate:,.0f} | {ratio} | {cell('steady', '{:,.0f}')} | "
              f"{cell('sampling')} | {cell('waiting')} | "
              f"{cell('updates')} | {cell('collect', '{:,.0f}')} | {cell('lag_mean', '{:.2f}')} "
              f"| {cell('lag_max', '{:.0f}')} |")
        summary[count] = {key: median(count, key) for key in results[count][0]}
    print("\n" + json.dumps({"config": args.config, "steps": args.steps, "modes": summary}))


if __name__ == "__main__":
    main()
