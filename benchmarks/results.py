"""Train a config for a step budget over several seeds and tabulate the results.

For each seed it runs the trainer (in this process, one seed after the other,
so runs do not compete for the cores), then reads the run's metrics.jsonl and
reports the mean-action (evaluation) return at each step mark, the wall-clock
time, env steps per second over the whole run (updates and evaluations
included), and the wall-clock time at which the evaluation return first
reached ``--threshold``.

    python benchmarks/results.py --config halfcheetah --seeds 0 1 2 \\
        --steps 3000000 --marks 1000000 3000000 --threshold 3000 --out results.md

Existing runs in ``--logdir/CONFIG-seedS`` are resumed (or only read when
finished), so an interrupted benchmark can be restarted with the same command.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from batchrl.config import load_config
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer


def eval_at(records: list[dict[str, Any]], mark: int) -> float | None:
    """Mean-action return of the last evaluation at or before ``mark`` steps."""
    scores = [r["score"] for r in records if r["phase"] == "eval" and r["step"] <= mark]
    return scores[-1] if scores else None


def first_reached(records: list[dict[str, Any]], threshold: float) -> tuple[int, float] | None:
    """``(step, wall seconds)`` of the first evaluation with return >= threshold."""
    for record in records:
        if record["phase"] == "eval" and record["score"] >= threshold:
            return record["step"], record["wall_time"]
    return None


def summarize(records: list[dict[str, Any]], marks: list[int],
              threshold: float | None) -> dict[str, Any]:
    train = [r for r in records if r["phase"] == "train"]
    last = records[-1]
    steps = train[-1]["step"] if train else 0
    row = {"steps": steps, "wall_time": last["wall_time"],
           "steps_per_s": steps / last["wall_time"] if last["wall_time"] else 0.0,
           "marks": {mark: eval_at(records, mark) for mark in marks}}
    if threshold is not None:
        row["reached"] = first_reached(records, threshold)
    return row


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--marks", type=int, nargs="+", default=[1_000_000, 3_000_000])
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--logdir", type=Path, default=Path("logs/results"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    rows = []
    for seed in args.seeds:
        overrides = args.overrides + [f"train.seed={seed}"]
        if args.steps is not None:
            overrides.append(f"train.steps={args.steps}")
        config = load_config(args.config, overrides)
        logdir = args.logdir / f"{args.config}-seed{seed}"
        records = read_metrics(logdir)
        done = any(r["phase"] == "train" and r["step"] >= config.train.steps for r in records)
        if not done:
            Trainer(config, logdir).run()
            records = read_metrics(logdir)
        rows.append((seed, summarize(records, args.marks, args.threshold)))

    header = ["seed"] + [f"eval return @ {mark:,}" for mark in args.marks]
    header += ["train steps", "wall-clock", "steps/s"]
    if args.threshold is not None:
        header.append(f"first eval >= {args.threshold:g} (step, time)")
    lines = [f"{args.config}: mean-action return (evaluation phases), seeds {args.seeds}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for seed, row in rows:
        cells = [str(seed)] + [fmt(row["marks"][mark]) for mark in args.marks]
        cells += [f"{row['steps']:,}", f"{row['wall_time'] / 60:.1f} min",
                  fmt(row["steps_per_s"])]
        if args.threshold is not None:
            reached = row["reached"]
            cells.append("not reached" if reached is None else
                         f"{reached[0]:,} steps, {reached[1] / 60:.1f} min")
        lines.append("| " + " | ".join(cells) + " |")
    medians = ["median"]
    for mark in args.marks:
        values = [row["marks"][mark] for _, row in rows if row["marks"][mark] is not None]
        medians.append(fmt(statistics.median(values)) if values else "-")
    lines.append("| " + " | ".join(medians + [""] * (len(header) - len(medians))) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
