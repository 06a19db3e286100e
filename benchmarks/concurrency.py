"""Several trainings on one machine: does batchrl share the cores gracefully?

Runs ``python train.py --config CONFIG --steps N --set train.eval_episodes=0``
(no evaluations, no other flag) in these set-ups, one after the other:

  * ``alone``: one run;
  * ``pair`` / ``triple``: two or three runs started at once;
  * ``nice``: one run next to a ``nice -n 19`` busy loop (another program's
    background work);
  * ``disjoint``: with two or more usable cores, two runs started at once,
    each confined by ``taskset`` to its own half of the cores.

A run's rate is its env steps over the time of its training phases as the
trainer records it (``wall_time`` in ``metrics.jsonl``: sampling, inference and
updates; start-up, checkpoints and plots left out). For runs started at once the
combined rate is all their steps over the longest run's time (not the sum of
their rates, which counts a run that finishes first twice: the others then run
alone, faster). Printed: one markdown table with each set-up's combined rate
and its ratio to ``alone`` measured in the same invocation (the host's speed
changes between days: compare ratios, not rates of different days). With
``--rounds R`` the whole sequence runs R times, so each set-up's runs alternate
with ``alone`` runs; the table then gives each round's figures and the median
of the per-round ratios, which drifts of the host's speed within an hour move
far less than a single pair of runs. Targets of
the issue "The default layout: fast on a shared machine": ``pair`` and
``triple`` >= 0.9x, ``nice`` >= 0.85x.

Run it on an otherwise idle machine, from the repository root::

    python benchmarks/concurrency.py                       # all set-ups, 150k steps each
    python benchmarks/concurrency.py --modes nice --rounds 5 --steps 100000
    python benchmarks/concurrency.py --modes alone pair --steps 100000 --set env.share_main=false
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.hardware import allowed_cores

ROOT = Path(__file__).resolve().parent.parent
MODES = ("alone", "pair", "triple", "nice", "disjoint")
RUNS = {"alone": 1, "pair": 2, "triple": 3, "nice": 1}  # disjoint: one run per half of the cores
TARGETS = {"pair": 0.9, "triple": 0.9, "nice": 0.85}


def start_run(logdir: Path, args: argparse.Namespace, cpus: list[int] | None) -> subprocess.Popen:
    command = [sys.executable, str(ROOT / "train.py"), "--config", args.config,
               "--logdir", str(logdir), "--steps", str(args.steps), "--no-progress",
               "--set", "train.eval_episodes=0"]
    for override in args.set:
        command += ["--set", override]
    if cpus is not None:
        command = ["taskset", "-c", ",".join(map(str, cpus))] + command
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def steps_and_time(logdir: Path) -> tuple[int, float]:
    """The run's env steps and the time of its training phases."""
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    return last["step"], last["wall_time"]


def combined(runs: list[tuple[int, float]]) -> float:
    """Steps per second of runs started at once: all their steps over the longest one's time."""
    return sum(steps for steps, _ in runs) / max(seconds for _, seconds in runs)


def measure(mode: str, args: argparse.Namespace, workdir: Path) -> list[tuple[int, float]]:
    """``(steps, seconds)`` of each run of one set-up."""
    cores = allowed_cores()
    half = len(cores) // 2
    placements = ([cores[:half], cores[half:]] if mode == "disjoint"
                  else [None] * RUNS[mode])
    busy = None
    if mode == "nice":
        busy = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
    logdirs = [workdir / f"{mode}-{i}-{time.monotonic_ns()}" for i in range(len(placements))]
    try:
        runs = [start_run(logdir, args, cpus) for logdir, cpus in zip(logdirs, placements)]
        for run in runs:
            _, stderr = run.communicate()
            if run.returncode != 0:
                raise SystemExit(f"a {mode} run failed (exit {run.returncode}):\n{stderr}")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return [steps_and_time(logdir) for logdir in logdirs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--steps", type=int, default=150_000)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run's train.py (e.g. env.share_main=false)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole sequence this many times (alternating set-ups)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if "disjoint" in args.modes and len(allowed_cores()) < 2:
        parser.error("disjoint needs at least two usable cores")
    modes = ["alone"] + [mode for mode in args.modes if mode != "alone"]
    results: dict[str, list[list[tuple[int, float]]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="batchrl-concurrency-") as tmp:
        for round_index in range(args.rounds):
            for mode in modes:
                runs = measure(mode, args, Path(tmp))
                results[mode].append(runs)
                print(f"round {round_index + 1}, {mode}: "
                      + " + ".join(f"{s / t:,.0f}" for s, t in runs) + " steps/s",
                      file=sys.stderr, flush=True)
    alone = [combined(runs) for runs in results["alone"]]
    print(f"\n`{args.config}`, {args.steps:,} steps per run, {args.rounds} round(s), "
          f"{len(allowed_cores())} allowed cores, overrides: {args.set or 'none'}\n")
    print("| set-up | runs (steps/s), one round per cell | combined | vs alone "
          "| median vs alone | target |")
    print("|---|---|---:|---:|---:|---|")
    for mode, rounds in results.items():
        target = f">= {TARGETS[mode]}x" if mode in TARGETS else ""
        ratios = [combined(runs) / base for runs, base in zip(rounds, alone)]
        cells = "; ".join(" + ".join(f"{s / t:,.0f}" for s, t in runs) for runs in rounds)
        print(f"| {mode} | {cells} "
              f"| {'; '.join(f'{combined(runs):,.0f}' for runs in rounds)} "
              f"| {'; '.join(f'{ratio:.2f}x' for ratio in ratios)} "
              f"| {statistics.median(ratios):.2f}x | {target} |")


if __name__ == "__main__":
    main()
