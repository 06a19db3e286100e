"""Wall-clock time until the mean-action return first reaches a threshold:
batchrl's ``halfcheetah`` config against Stable-Baselines3 PPO with rl-zoo3's
HalfCheetah settings, side by side on this machine.

* ``batchrl``: ``python train.py --config halfcheetah`` in a subprocess, as
  users run it (its evaluations: ``train.eval_episodes`` mean-action episodes
  after every training phase). The script watches metrics.jsonl and stops the
  run with SIGINT once an evaluation reaches the threshold.
* ``SB3``: ``PPO`` with rl-zoo3's tuned HalfCheetah hyperparameters (the same
  as ``benchmarks/training.py``: one env, ``VecNormalize``, 512-step
  rollouts, 20 epochs of 64-step minibatches, ``log_std_init=-2``, ReLU
  256-256 networks), evaluated every ``--sb3-eval-every`` steps with
  ``evaluate_policy(deterministic=True)`` over ``--sb3-eval-episodes``
  episodes on a second env that shares the training env's observation
  statistics; training stops at the first evaluation that reaches the
  threshold.

For each it reports the env steps at that evaluation and two times: the
wall-clock of the whole run until then (start-up and evaluations included:
batchrl's whole process with its imports; SB3's clock starts after torch and
SB3 are imported) and the training time alone (evaluations excluded; for batchrl the trainer's
training phases, for SB3 ``learn()`` less the evaluation callbacks). Runs go
one after the other, never concurrently; run it on an idle machine.

    python benchmarks/time_to_return.py --seeds 0 1 2
    python benchmarks/time_to_return.py --threshold 3000 --max-steps 1000000 --sb3-max-steps 300000

Stable-Baselines3 is not a dependency of batchrl: ``pip install
stable-baselines3`` for this script (``--skip-sb3`` measures batchrl alone).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from results import first_reached  # noqa: E402
from training import SB3_HYPERPARAMS, SB3_MISSING, sb3_available  # noqa: E402


def eval_durations(records: list[dict[str, Any]]) -> list[float]:
    """Seconds each evaluation phase took (``wall_time`` is cumulative)."""
    durations, previous = [], 0.0
    for record in records:
        if record["phase"] == "eval":
            durations.append(record["wall_time"] - previous)
        previous = record["wall_time"]
    return durations


def run_batchrl(config: str, threshold: float, max_steps: int, seed: int,
                overrides: list[str]) -> dict[str, Any]:
    """Train until an evaluation reaches ``threshold`` (or ``max_steps``)."""
    with tempfile.TemporaryDirectory(prefix="batchrl-ttr-") as logdir:
        command = [sys.executable, str(ROOT / "train.py"), "--config", config,
                   "--logdir", logdir, "--steps", str(max_steps), "--no-progress",
                   "--set", f"train.seed={seed}", "--set", "train.device=cpu"]
        for override in overrides:
            command += ["--set", override]
        print("batchrl: " + " ".join(command), file=sys.stderr, flush=True)
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
        reached, seen_at = None, None
        while process.poll() is None:
            time.sleep(0.25)
            records = read_metrics(Path(logdir))
            reached = first_reached(records, threshold)
            if reached is not None:
                seen_at = time.perf_counter() - start
                process.send_signal(signal.SIGINT)
                break
        process.wait()
        # (collectors' runs also log updates, without wall_time)
        records = [r for r in read_metrics(Path(logdir)) if r["phase"] in ("train", "eval")]
    if reached is None:
        last = [r for r in records if r["phase"] == "eval"]
        return {"reached": False, "steps": records[-1]["step"] if records else 0,
                "best": max((r["score"] for r in last), default=None)}
    before = [r for r in records if r["wall_time"] <= reached["wall_time"]]
    evals = sum(eval_durations(before))
    return {"reached": True, "steps": reached["step"], "score": reached["score"],
            "wall": seen_at, "train_seconds": reached["wall_time"] - evals}


def run_sb3(env_id: str, threshold: float, max_steps: int, seed: int, eval_every: int,
            eval_episodes: int) -> dict[str, Any]:
    """Train SB3 PPO (rl-zoo3's HalfCheetah settings) until an evaluation
    reaches ``threshold`` (or ``max_steps``)."""
    try:
        from stable_baselines3 import PPO
        from stable_baselines3.common.callbacks import BaseCallback
        from stable_baselines3.common.env_util import make_vec_env
        from stable_baselines3.common.evaluation import evaluate_policy
        from stable_baselines3.common.vec_env import VecNormalize
    except ImportError:
        print(SB3_MISSING, file=sys.stderr)
        raise SystemExit(2) from None
    from torch import nn

    start = time.perf_counter()
    env = VecNormalize(make_vec_env(env_id, n_envs=1, seed=seed), gamma=SB3_HYPERPARAMS["gamma"])
    eval_env = VecNormalize(make_vec_env(env_id, n_envs=1, seed=seed + 1000), training=False,
                            norm_reward=False)
    policy_kwargs = dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU,
                         net_arch=dict(pi=[256, 256], vf=[256, 256]))
    model = PPO("MlpPolicy", env, policy_kwargs=policy_kwargs, device="cpu", seed=seed,
                verbose=0, **SB3_HYPERPARAMS)
    result: dict[str, Any] = {"reached": False, "eval_seconds": 0.0, "best": None}

    class EvaluateAndStop(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.next = eval_every

        def _on_step(self) -> bool:
            if self.num_timesteps < self.next:
                return True
            self.next += eval_every
            began = time.perf_counter()
            eval_env.obs_rms = env.obs_rms.copy()
            score, _ = evaluate_policy(model, eval_env, n_eval_episodes=eval_episodes,
                                       deterministic=True)
            now = time.perf_counter()
            result["eval_seconds"] += now - began
            result["best"] = max(score, result["best"] or score)
            print(f"SB3 seed {seed}: {self.num_timesteps:,} steps, mean-action return "
                  f"{score:,.0f} ({now - start:.0f} s)", file=sys.stderr, flush=True)
            if score >= threshold:
                result.update(reached=True, steps=self.num_timesteps, score=score,
                              wall=now - start)
                return False
            return True

    learn_start = time.perf_counter()
    try:
        model.learn(total_timesteps=max_steps, callback=EvaluateAndStop())
    finally:
        env.close()
        eval_env.close()
    result["train_seconds"] = time.perf_counter() - learn_start - result["eval_seconds"]
    result.setdefault("steps", int(model.num_timesteps))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--env-id", default="HalfCheetah-v5", help="SB3's env (the config's)")
    parser.add_argument("--threshold", type=float, default=3000.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="batchrl's budget if the threshold is never reached")
    parser.add_argument("--sb3-max-steps", type=int, default=300_000)
    parser.add_argument("--sb3-eval-every", type=int, default=10_000)
    parser.add_argument("--sb3-eval-episodes", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="batchrl config override")
    parser.add_argument("--skip-sb3", action="store_true")
    args = parser.parse_args()
    if not args.skip_sb3 and not sb3_available():
        print(SB3_MISSING, file=sys.stderr)
        return 2

    rows: list[tuple[str, int, dict[str, Any]]] = []
    for seed in args.seeds:
        rows.append(("batchrl", seed, run_batchrl(args.config, args.threshold, args.max_steps,
                                                  seed, args.overrides)))
        if not args.skip_sb3:
            rows.append(("SB3", seed, run_sb3(args.env_id, args.threshold, args.sb3_max_steps,
                                              seed, args.sb3_eval_every,
                                              args.sb3_eval_episodes)))

    print(f"\nTime until the mean-action return first reaches {args.threshold:,.0f} on "
          f"{args.env_id} (batchrl config {args.config!r}; SB3 PPO with rl-zoo3's settings, "
          f"evaluated every {args.sb3_eval_every:,} steps over {args.sb3_eval_episodes} "
          f"episodes)\n")
    print("| framework | seed | env steps | return | wall-clock (all) | training time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seed, row in rows:
        if row["reached"]:
            print(f"| {name} | {seed} | {row['steps']:,} | {row['score']:,.0f} | "
                  f"{row['wall']:.0f} s | {row['train_seconds']:.0f} s |")
        else:
            best = "-" if row["best"] is None else f"best {row['best']:,.0f}"
            print(f"| {name} | {seed} | not reached in {row['steps']:,} | {best} | - | - |")
    for name in ("batchrl", "SB3"):
        walls = [row["wall"] for n, _, row in rows if n == name and row["reached"]]
        if walls:
            print(f"{name}: median wall-clock {statistics.median(walls):.0f} s over "
                  f"{len(walls)} seed(s) that reached it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
