"""What a training run writes for people: metrics.jsonl, TensorBoard events, a plot."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from batchrl.files import atomic_write, fsync_directory

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"


def actions_words(eval_actions: str) -> str:
    """How evaluations with ``train.eval_actions`` act, in words for a legend or a line."""
    return "mean action" if eval_actions == "mean" else "sampled actions"


def episodes_words(count: int) -> str:
    """``"1 episode"``, ``"10 episodes"``."""
    return f"{count} episode" if count == 1 else f"{count} episodes"


def read_metrics(logdir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (one per phase, and with collectors one per update,
    ``"phase": "update"``), oldest first."""
    path = Path(logdir) / METRICS_FILE
    records = []
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash; everything after it is lost too
    return records


def _wait_for_a_new_events_name(logdir: Path) -> None:
    """Wait for the next second if this process already opened an event file in ``logdir``
    in this one. TensorBoard reads a run's event files in the order of their names: the
    second, the host, the process and a count of the process's writers, which does not
    sort as a number (``10`` before ``9``). A later session of the same process in the same
    second (a resume through the Python API) could be read first, and its steps then
    purged as out of order."""
    now = time.time()
    same_second = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}."
    if any(Path(logdir).glob(same_second + "*")):
        time.sleep(1.0 - now % 1.0)


class RunLog:
    """Appends phase records to ``metrics.jsonl`` and scalars to TensorBoard. TensorBoard
    hides earlier sessions' events from ``purge_step`` on, and ``truncate(step)`` drops their
    records after ``step``: a run resumed from the checkpoint at ``step`` neither repeats nor
    loses a phase."""

    def __init__(self, logdir: Path, purge_step: int | None = None, eval_actions: str = "mean"):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.eval_actions = eval_actions  # what the evaluations act with, for the plot's legend
        _wait_for_a_new_events_name(self.logdir)
        self.writer = SummaryWriter(str(self.logdir), purge_step=purge_step)

    def truncate(self, step: int) -> None:
        """Keep only the records with ``step`` at most ``step``."""
        kept = [r for r in read_metrics(self.logdir) if r["step"] <= step]
        with atomic_write(self.logdir / METRICS_FILE) as file:
            file.writelines(json.dumps(record) + "\n" for record in kept)

    def update(self, record: dict[str, Any]) -> None:
        """Append one update's record (``"phase": "update"``, with collectors: the policy lag,
        the queue's fill, steps/s); TensorBoard gets its numbers from the summary."""
        with open(self.logdir / METRICS_FILE, "a") as file:
            file.write(json.dumps({**record, "phase": "update"}) + "\n")

    def sync(self) -> None:
        """Make the records written so far durable: called before a checkpoint is written, so
        that after a power loss the run resumed from it keeps every record up to its step."""
        path = self.logdir / METRICS_FILE
        if path.exists():
            with open(path, "a") as file:
                os.fsync(file.fileno())
            fsync_directory(self.logdir)

    def phase(self, record: dict[str, Any]) -> None:
        """Append one phase's record and write its numbers to TensorBoard."""
        with open(self.logdir / METRICS_FILE, "a") as file:
            file.write(json.dumps(record) + "\n")
        for key in ("score", "length", "steps_per_s"):
            if record.get(key) is not None:
                self.writer.add_scalar(f"{record['phase']}/{key}", record[key], record["step"])

    def scalars(self, values: dict[str, Any], step: int) -> None:
        """Write the summaries of ``simulate()`` and the algorithm: numbers (Python numbers,
        or tensors or arrays of one element); ``TypeError`` naming the first that is not."""
        for name, value in values.items():
            self.writer.add_scalar(name, _number(name, value), step)

    def plot(self) -> Path:
        """Redraw the learning curve from ``metrics.jsonl``; returns the PNG's path."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = read_metrics(self.logdir)
        figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
        for phase, label, color in (("train", "training (sampled actions)", "tab:red"),
                                    ("eval", f"evaluation ({actions_words(self.eval_actions)})",
                                     "tab:blue")):
            points = [(r["step"], r["score"]) for r in records
                      if r["phase"] == phase and r.get("score") is not None]
            if points:
                axis.plot(*zip(*points), label=label, color=color,
                          marker="o" if phase == "eval" else None, markersize=3)
        axis.set(xlabel="env steps", ylabel="episode return")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
        figure.tight_layout()
        path = self.logdir / CURVE_FILE
        temporary = path.with_name("learning_curve.tmp.png")
        try:
            figure.savefig(temporary)
            os.replace(temporary, path)
        except BaseException:  # (a full disk: keep the last whole plot, and no part of one)
            temporary.unlink(missing_ok=True)
            raise
        finally:
            plt.close(figure)
        return path

    def close(self) -> None:
        self.writer.close()


def _number(name: str, value: Any) -> float:
    """``value`` as a float, or ``TypeError`` saying that the summary ``name`` is none."""
    if isinstance(value, (int, float)):
        return value
    size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size",
                                                                                 None)
    if size == 1:
        try:
            return float(value.item())
        except (AttributeError, TypeError, ValueError):
            pass
    text = repr(value)
    if len(text) > 60:
        text = f"a {type(value).__name__}" + (f" of {size} elements" if size else "")
    raise TypeError(f"the summary {name!r} is {text}: an algorithm's summaries map names to "
                    f"numbers (a float, or a tensor of one element)")
