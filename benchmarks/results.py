"""Train configs over several seeds and tabulate the mean-action returns at step marks.

For each config and seed it runs the trainer in this process, one run after
the other (so runs never compete for the cores), then reads the run's
metrics.jsonl. For each ``--marks`` step count (default 1M) and config it
reports the median, min and max over the seeds of the mean-action
(evaluation) return of the last evaluation at or before the mark, the
target and a published reference for the task, the wall-clock time to the
mark (the trainer's phases, training with its updates and evaluations;
start-up and checkpoints are not in it) and env steps per second over those
phases (training steps only, evaluation time included). A table per seed
follows, and with ``--plots DIR`` a PNG per config with the evaluation
curves of its seeds overlaid.

    python benchmarks/results.py --configs halfcheetah hopper walker ant reacher \\
        --seeds 0 1 2 --plots docs/results --out results.md
    python benchmarks/results.py --configs humanoid --marks 1000000 3000000 --plots docs/results

Runs already in ``--logdir/CONFIG-seedS`` are resumed, or only read when they
reached their budget, so an interrupted benchmark goes on with the same
command; ``--fresh`` starts them over.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.config import load_config
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer

# The target at 1M steps and the published PPO results it is measured
# against, by env id (SB3 rl-baselines3-zoo benchmark.md: v3 tasks, one run,
# deterministic evaluation; Tianshou: 10 seeds, the best average in training).
REFERENCES: dict[str, tuple[str, str]] = {
    "HalfCheetah-v5": (">= 6,000", "SB3 zoo 5,819; Tianshou 5,784"),
    "Hopper-v5": (">= 2,500", "SB3 zoo 2,410"),
    "Walker2d-v5": (">= 3,500", "SB3 zoo 3,479"),
    "Ant-v5": (">= 2,500", "SB3 zoo 1,327"),
    "Reacher-v5": (">= -5", "Tianshou (off-policy) -2.6 to -3.3"),
    "Humanoid-v5": ("report", ""),
}
# The same for the SAC configs (configs/sac/), against Tianshou's SAC at 1M steps.
SAC_REFERENCES: dict[str, tuple[str, str]] = {
    "HalfCheetah-v5": (">= 11,000", "Tianshou SAC 12,139; CleanRL 9,635"),
    "Hopper-v5": (">= 3,300", "Tianshou SAC 3,542"),
    "Walker2d-v5": (">= 4,500", "Tianshou SAC 5,007"),
    "Ant-v5": (">= 5,000", "Tianshou SAC 5,850"),
    "Humanoid-v5": (">= 5,000", "Tianshou SAC 5,489"),
}


def eval_at(records: list[dict[str, Any]], mark: int) -> dict[str, Any] | None:
    """The last evaluation record at or before ``mark`` steps, or up to 1% past it: a run
    whose updates take whole rollouts ends its budget a little past it (``impala``'s 1M
    steps at 1,000,448), and that final evaluation is the one at the mark. None where the run
    ended before the mark (its last record more than 1% short of it): an earlier evaluation
    is not the return at the mark."""
    if max((r["step"] for r in records), default=0) < mark * 0.99:
        return None
    evals = [r for r in records if r["phase"] == "eval" and r["step"] <= mark * 1.01]
    return evals[-1] if evals else None


def first_reached(records: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    """The first evaluation record with a return of at least ``threshold``."""
    for record in records:
        if record["phase"] == "eval" and record["score"] >= threshold:
            return record
    return None


def summarize(records: list[dict[str, Any]], mark: int,
              threshold: float | None) -> dict[str, Any]:
    """One seed's figures: the return, phase wall-clock and steps/s at ``mark``."""
    record = eval_at(records, mark)
    row: dict[str, Any] = {"score": None, "step": None, "wall_time": None, "steps_per_s": None}
    if record is not None:
        row.update(score=record["score"], step=record["step"], wall_time=record["wall_time"],
                   steps_per_s=record["step"] / record["wall_time"])
    if threshold is not None:
        row["reached"] = first_reached(records, threshold)
    return row


def plot(name: str, runs: dict[int, list[dict[str, Any]]], marks: list[int],
         path: Path) -> None:
    """The evaluation curves of ``runs`` (seed -> records), overlaid, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6), dpi=100)
    for seed, records in sorted(runs.items()):
        points = [(r["step"], r["score"]) for r in records if r["phase"] == "eval"]
        if points:
            steps, scores = zip(*points)
            axis.plot(steps, scores, marker="o", markersize=2.5, label=f"seed {seed}")
    for mark in marks:
        axis.axvline(mark, color="grey", linestyle=":", linewidth=1)
    axis.set_title(f"{name}: mean-action return")
    axis.set_xlabel("env steps")
    axis.set_ylabel("episode return")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def fmt_return(value: float | None) -> str:
    """A return, with one decimal where it is small (Reacher's are about -4)."""
    return fmt(value, 1 if value is not None and abs(value) < 100 else 0)


def spread(values: list[float]) -> tuple[float | None, float | None, float | None]:
    return ((statistics.median(values), min(values), max(values)) if values
            else (None, None, None))


def mark_name(mark: int) -> str:
    return f"{mark / 1e6:g}M" if mark % 100_000 == 0 else f"{mark:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["halfcheetah"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--marks", type=int, nargs="+", default=[1_000_000],
                        help="env steps at which returns are compared (default 1M)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training budget of every run (default: each config's)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="also report when the return first reached this")
    parser.add_argument("--logdir", type=Path, default=Path("logs/results"))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for every run")
    parser.add_argument("--fresh", action="store_true", help="start existing runs over")
    parser.add_argument("--plots", type=Path, default=None,
                        help="write CONFIG.png (the seeds' curves) into this directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()
    marks = sorted(args.marks)

    # config -> (env id, seed -> mark -> row)
    results: dict[str, tuple[str, dict[int, dict[int, dict[str, Any]]]]] = {}
    for name in args.configs:
        runs, rows, env_id = {}, {}, ""
        for seed in args.seeds:
            overrides = args.overrides + [f"train.seed={seed}"]
            if args.steps is not None:
                overrides.append(f"train.steps={args.steps}")
            config = load_config(name, overrides)
            env_id = config.env.id
            logdir = args.logdir / f"{name.replace('/', '-')}-seed{seed}"
            if args.fresh and logdir.exists():
                shutil.rmtree(logdir)
            records = read_metrics(logdir)
            if not any(r["phase"] == "train" and r["step"] >= config.train.steps
                       for r in records):
                print(f"== {name}, seed {seed}: training into {logdir}", flush=True)
                Trainer(config, logdir, progress=False).run()
                records = read_metrics(logdir)
            runs[seed] = records
            rows[seed] = {mark: summarize(records, mark, args.threshold) for mark in marks}
        results[name] = (env_id, rows)
        if args.plots is not None:
            plot(name, runs, marks, args.plots / f"{name.replace('/', '-')}.png")

    lines = []
    for mark in marks:
        at = mark_name(mark)
        lines += [f"Mean-action return of the last evaluation at or before {at} env steps, "
                  f"seeds {', '.join(map(str, args.seeds))}", "",
                  f"| config | env | median @ {at} | min | max | target | published | "
                  f"wall-clock to {at} | steps/s |",
                  "|---|---|---:|---:|---:|---|---|---:|---:|"]
        for name, (env_id, rows) in results.items():
            seeds = [row[mark] for row in rows.values()]
            median, low, high = spread([r["score"] for r in seeds if r["score"] is not None])
            wall = spread([r["wall_time"] for r in seeds if r["wall_time"] is not None])[0]
            rate = spread([r["steps_per_s"] for r in seeds if r["steps_per_s"] is not None])[0]
            # (the targets and published figures are for 1M steps)
            references = SAC_REFERENCES if name.startswith("sac/") else REFERENCES
            target, published = (references.get(env_id, ("", "")) if mark == 1_000_000
                                 else ("", ""))
            lines.append(f"| `{name}` | {env_id} | {fmt_return(median)} | {fmt_return(low)} | {fmt_return(high)} | "
                         f"{target} | {published} | "
                         f"{'-' if wall is None else f'{wall / 60:.1f} min'} | {fmt(rate)} |")
        lines.append("")
    lines += ["Per seed (return of the last evaluation at or before each mark, and the "
              "phases' wall-clock to it):", "",
              "| config | seed | " + " | ".join(f"return @ {mark_name(m)} | wall-clock"
                                                 for m in marks) + " | steps/s |"
              + (f" first >= {args.threshold:g} |" if args.threshold is not None else ""),
              "|---|---:|" + "---:|---:|" * len(marks) + "---:|"
              + ("---|" if args.threshold is not None else "")]
    for name, (_, rows) in results.items():
        for seed, by_mark in rows.items():
            cells = [f"`{name}`", str(seed)]
            for mark in marks:
                row = by_mark[mark]
                cells += [fmt_return(row["score"]),
                          "-" if row["wall_time"] is None else f"{row['wall_time'] / 60:.1f} min"]
            cells.append(fmt(by_mark[marks[-1]]["steps_per_s"]))
            if args.threshold is not None:
                reached = by_mark[marks[-1]]["reached"]
                cells.append("not reached" if reached is None else
                             f"{reached['step']:,} steps, {reached['wall_time'] / 60:.1f} min")
            lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
