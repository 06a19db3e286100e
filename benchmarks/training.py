"""Training throughput: batchrl's ``halfcheetah`` config against Stable-Baselines3 PPO.

Measures env steps per wall-clock second over a whole training run, PPO
updates included, of

  * ``batchrl``: the real trainer, run the way users run it, as a subprocess
    ``python train.py --config halfcheetah --logdir TMP --steps N --no-progress
    --set train.eval_episodes=0 --set train.device=cpu`` (the config's
    agents, rollouts and updates as configs/halfcheetah.toml sets them;
    ``make_batch_env``'s default layout (``env.backend = "auto"``: native batched
    envs for the MuJoCo tasks that have them, else one ``EnvWorker`` process per usable
    core; the table says which); learner with ``train.threads`` = 1 thread while sampling, and during
    updates the policy and value steps side by side, one thread each). Evaluations are turned off so that only
    training steps are timed. The time is the sum of the trainer's training
    phases as it records them in ``metrics.jsonl`` (``wall_time``: sampling,
    inference, bookkeeping and updates); it leaves out interpreter start-up,
    imports, env and network construction (TorchScript), and the checkpoint
    and plot written after every phase and at the end. The whole subprocess's
    wall time, which includes all of that, is reported too as a second row;
  * ``SB3``: Stable-Baselines3's ``PPO`` with rl-zoo3's tuned hyperparameters
    for HalfCheetah (``hyperparams/ppo.yml``, entry ``HalfCheetah-v4``, as in
    rl-zoo3 2.9.2): ``n_envs: 1`` (``make_vec_env``: a ``DummyVecEnv`` with a
    ``Monitor``), ``normalize: true`` (``VecNormalize`` with ``gamma`` = the
    algorithm's 0.98, as rl-zoo3 does), ``n_steps: 512``, ``batch_size: 64``,
    ``n_epochs: 20``, ``gamma: 0.98``, ``gae_lambda: 0.92``, ``learning_rate:
    2.0633e-05``, ``ent_coef: 0.000401762``, ``clip_range: 0.1``,
    ``max_grad_norm: 0.8``, ``vf_coef: 0.58096``, ``policy_kwargs:
    dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU,
    net_arch=dict(pi=[256, 256], vf=[256, 256]))``, ``device="cpu"``, no
    evaluation callback, ``verbose=0``. The time is that of ``model.learn()``
    alone (model and env construction excluded). Torch's thread count is left
    at its default (SB3 does not change it) and reported.

Both frameworks train on ``HalfCheetah-v5``: rl-zoo3's entry is for v4, which
Gymnasium 1.x marks as out of date; v5 is the same task (17-d observation,
6-d action, 1000-step episodes), so v5 is used in place of v4 for both. They run
in this order, one after the other, never concurrently, on the same machine.
The SB3 run is shorter by default: its rate is steady from the first 512-step
rollout on (each rollout is followed by the same 160 minibatch steps).

Other programs' CPU load is sampled before, between and after the runs, and
estimated during each run (the machine's busy share less that of the run's own
process tree); a warning is printed above 15%. Run it on an idle machine: SB3's
torch threads (one per core by default) slow down badly when other programs
share the cores (in one test on 2 busy cores it fell from about 600 to 50
steps/s).

Stable-Baselines3 is not a dependency of batchrl: it is imported only inside
``run_sb3``; install it with ``pip install stable-baselines3`` (or pass
``--skip-sb3`` to measure batchrl alone).

Run it from the repository root (on an idle 2-core machine under a minute for
batchrl's 150k steps and about 40 s for SB3's 20k steps):

    python benchmarks/training.py
    python benchmarks/training.py --steps 300000 --sb3-steps 50000 --json out.json

It prints a markdown table (env steps, seconds, steps/s, ratio to SB3), the
machine (cores, CPU, torch and its threads) and a one-line JSON summary. The
target is batchrl >= 5x SB3's steps/s; the exit code is 0 whether or not it is
met (1 only when a run fails, 2 when SB3 is missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

from batchrl.hardware import usable_cores
from batchrl.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 5.0

SB3_MISSING = ("stable-baselines3 is not installed (it is not a dependency of batchrl). "
               "Install it with:\n    pip install stable-baselines3\n"
               "or run with --skip-sb3 to measure batchrl alone.")

# rl-zoo3 hyperparams/ppo.yml, entry HalfCheetah-v4 (besides normalize: true,
# n_envs: 1, policy: 'MlpPolicy' and n_timesteps: 1e6, handled apart).
SB3_HYPERPARAMS: dict[str, Any] = {
    "batch_size": 64,
    "n_steps": 512,
    "gamma": 0.98,
    "learning_rate": 2.0633e-05,
    "ent_coef": 0.000401762,
    "clip_range": 0.1,
    "n_epochs": 20,
    "gae_lambda": 0.92,
    "max_grad_norm": 0.8,
    "vf_coef": 0.58096,
}


def background_load() -> float:
    """Other programs' share of all cores (percent), sampled over half a second."""
    return psutil.cpu_percent(interval=0.5)


class CPUWatch:
    """Other programs' CPU load while a run goes on: the machine's busy share
    minus that of the run's process tree (``root`` and its descendants).

    Call ``poll()`` now and then while the run lasts (descendants are only
    seen while they live) and ``stop()`` at its end; ``stop()`` returns the
    other programs' share of all cores in percent (a slight overestimate when
    descendants did work after the last poll).
    """

    def __init__(self, root: psutil.Process):
        self.root = root
        self.seen: dict[int, float] = {}
        self.baseline: dict[int, float] = {}
        psutil.cpu_percent(interval=None)  # the machine's counter starts now
        self.start = time.perf_counter()
        self.poll()
        self.baseline = dict(self.seen)

    def poll(self) -> None:
        try:
            processes = [self.root] + self.root.children(recursive=True)
        except psutil.Error:
            return  # the root has exited
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            self.seen[process.pid] = times.user + times.system

    def stop(self) -> float:
        self.poll()
        machine = psutil.cpu_percent(interval=None)
        elapsed = time.perf_counter() - self.start
        used = sum(seconds - self.baseline.get(pid, 0.0) for pid, seconds in self.seen.items())
        own = 100.0 * used / (elapsed * (os.cpu_count() or 1))
        return max(0.0, machine - own)


def cpu_model() -> str:
    """The CPU's model name where Linux tells it, else the platform's guess."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_batchrl(config: str, steps: int, device: str, overrides: list[str],
                seed: int) -> dict[str, Any]:
    """Train ``config`` for ``steps`` env steps with ``train.py`` in a subprocess.

    Returns:
      ``steps`` (training env steps taken; the last phase may run past the
      budget), ``seconds`` (the trainer's summed phase time), ``process_seconds``
      (the subprocess's wall time), per-phase rates and the resolved config.
    """
    with tempfile.TemporaryDirectory(prefix="batchrl-training-") as logdir:
        command = [sys.executable, str(ROOT / "train.py"), "--config", config,
                   "--logdir", logdir, "--steps", str(steps), "--no-progress",
                   "--set", "train.eval_episodes=0", "--set", f"train.device={device}",
                   "--set", f"train.seed={seed}"]
        for override in overrides:
            command += ["--set", override]
        print("batchrl: " + " ".join(command), file=sys.stderr, flush=True)
        start = time.perf_counter()
        # The trainer's own output goes to stderr, keeping stdout for the results.
        process = subprocess.Popen(command, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
        watch = CPUWatch(psutil.Process(process.pid))
        while True:
            try:
                returncode = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                watch.poll()
        process_seconds = time.perf_counter() - start
        others = watch.stop()
        if returncode != 0:
            raise RuntimeError(f"train.py exited with code {returncode}")
        # (collectors' runs also log their updates)
        records = [r for r in read_metrics(Path(logdir)) if r["phase"] != "update"]
        with open(Path(logdir) / "config.json") as file:
            resolved = json.load(file)
    train = [r for r in records if r["phase"] == "train"]
    if not train or len(train) != len(records):
        raise RuntimeError(f"expected only training phases in metrics.jsonl, got "
                           f"{[r['phase'] for r in records]}")
    # wall_time is cumulative over the run's phases (all of them training here).
    seconds = train[-1]["wall_time"]
    return {"steps": train[-1]["step"], "seconds": seconds,
            "steps_per_s": train[-1]["step"] / seconds,
            "process_seconds": process_seconds,
            "phase_steps_per_s": [r["steps_per_s"] for r in train],
            "updates": len(train), "config": resolved, "config_name": config,
            "others_cpu_percent": others}


def sb3_available() -> bool:
    """Whether ``stable_baselines3`` can be imported (without importing it)."""
    return importlib.util.find_spec("stable_baselines3") is not None


def run_sb3(env_id: str, steps: int, seed: int) -> dict[str, Any]:
    """Train SB3 PPO with rl-zoo3's HalfCheetah hyperparameters for ``steps`` env steps.

    Returns:
      ``steps`` (``model.num_timesteps``: whole 512-step rollouts, so it may
      exceed ``steps``), ``seconds`` (``model.learn()``'s wall time), the torch
      threads it ran with, the SB3 version and the construction time.
    """
    try:
        import stable_baselines3
        from stable_baselines3 import PPO
        from stable_baselines3.common.env_util import make_vec_env
        from stable_baselines3.common.vec_env import VecNormalize
    except ImportError:
        print(SB3_MISSING, file=sys.stderr)
        raise SystemExit(2) from None
    from torch import nn

    start = time.perf_counter()
    # As rl-zoo3: make_vec_env (DummyVecEnv, Monitor), then VecNormalize with the
    # algorithm's gamma.
    env = make_vec_env(env_id, n_envs=1, seed=seed)
    env = VecNormalize(env, gamma=SB3_HYPERPARAMS["gamma"])
    policy_kwargs = dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU,
                         net_arch=dict(pi=[256, 256], vf=[256, 256]))
    model = PPO("MlpPolicy", env, policy_kwargs=policy_kwargs, device="cpu", seed=seed,
                verbose=0, **SB3_HYPERPARAMS)
    build_seconds = time.perf_counter() - start
    threads = torch.get_num_threads()
    print(f"SB3: PPO('MlpPolicy', VecNormalize(make_vec_env({env_id!r}, n_envs=1)), "
          f"device='cpu', {threads} torch threads) learning {steps:,} steps",
          file=sys.stderr, flush=True)
    try:
        watch = CPUWatch(psutil.Process())
        start = time.perf_counter()
        model.learn(total_timesteps=steps)
        seconds = time.perf_counter() - start
        others = watch.stop()
    finally:
        env.close()
    return {"steps": int(model.num_timesteps), "seconds": seconds,
            "steps_per_s": model.num_timesteps / seconds, "threads": threads,
            "others_cpu_percent": others,
            "build_seconds": build_seconds, "version": stable_baselines3.__version__}


def markdown_table(batchrl: dict[str, Any] | None, sb3: dict[str, Any] | None) -> str:
    """Rows for batchrl (phase time and whole process) and SB3, with ratios to SB3."""
    lines = ["| framework | env steps | wall s | steps/s | vs SB3 |",
             "|---|---:|---:|---:|---:|"]

    def row(name: str, steps: int, seconds: float) -> None:
        rate = steps / seconds
        ratio = f"{rate / sb3['steps_per_s']:.1f}x" if sb3 else "-"
        lines.append(f"| {name} | {steps:,} | {seconds:,.1f} | {rate:,.0f} | {ratio} |")

    if batchrl:
        row(f"batchrl `{batchrl['config_name']}` (training phases)", batchrl["steps"],
            batchrl["seconds"])
        row("batchrl, whole `train.py` process", batchrl["steps"], batchrl["process_seconds"])
    if sb3:
        row(f"SB3 {sb3['version']} PPO, rl-zoo3 HalfCheetah (`learn()`)", sb3["steps"],
            sb3["seconds"])
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah",
                        help="batchrl config (default: halfcheetah)")
    parser.add_argument("--env-id", default="HalfCheetah-v5",
                        help="SB3's env; must match the config's env.id (default: HalfCheetah-v5)")
    parser.add_argument("--steps", type=int, default=150_000,
                        help="batchrl training env steps (default: 150000)")
    parser.add_argument("--sb3-steps", type=int, default=20_000,
                        help="SB3 training env steps (default: 20000, 40 updates)")
    parser.add_argument("--device", default="cpu",
                        help="batchrl's train.device (default: cpu, as SB3's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="extra batchrl config override")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-sb3", action="store_true", help="measure batchrl only")
    parser.add_argument("--skip-batchrl", action="store_true", help="measure SB3 only")
    parser.add_argument("--json", metavar="PATH", help="also write all results to PATH")
    args = parser.parse_args()
    if args.steps < 1 or args.sb3_steps < 1:
        parser.error("--steps and --sb3-steps must be positive")
    if args.skip_sb3 and args.skip_batchrl:
        parser.error("--skip-sb3 and --skip-batchrl leave nothing to measure")
    return args


def main() -> int:
    """Run both frameworks, print the table and the JSON summary; returns the exit code."""
    args = parse_args()
    if not args.skip_sb3 and not sb3_available():
        print(SB3_MISSING, file=sys.stderr)  # before spending minutes on batchrl
        return 2
    cores = usable_cores()
    print(f"Training throughput on {args.env_id}: batchrl config {args.config!r} "
          f"({args.steps:,} steps) vs SB3 PPO with rl-zoo3's HalfCheetah hyperparameters "
          f"({args.sb3_steps:,} steps), one after the other; {cores} usable cores "
          f"({os.cpu_count()} in the machine), {cpu_model()}; Python "
          f"{platform.python_version()}, torch {torch.__version__}", flush=True)

    background: dict[str, float] = {}
    batchrl = sb3 = None
    try:
        if not args.skip_batchrl:
            background["before batchrl"] = background_load()
            batchrl = run_batchrl(args.config, args.steps, args.device, args.overrides,
                                  args.seed)
        if not args.skip_sb3:
            background["before SB3"] = background_load()
            sb3 = run_sb3(args.env_id, args.sb3_steps, args.seed)
        background["after"] = background_load()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    print()
    print(markdown_table(batchrl, sb3))
    print()
    if batchrl:
        config = batchrl["config"]
        if config["env"]["id"] != args.env_id:
            print(f"WARNING: batchrl trained {config['env']['id']}, SB3 {args.env_id}.")
        ppo = config["algorithm"]
        update_threads = (f"{ppo['update_threads']}" if ppo["update_threads"]
                          else "1 + 1 (policy and value steps side by side)")
        phases = f"{batchrl['updates']} training phase" + ("s" if batchrl["updates"] != 1
                                                          else "")
        per_update = (f"rollouts of {ppo['rollout_length']} steps" if ppo.get("rollout_length")
                      else f"{ppo['update_every']} episodes")
        from batchrl.envs.factory import choose_backend
        env = config["env"]
        backend = choose_backend(env["id"], env["backend"], env["kwargs"],
                                 env["restart_crashed_envs"] or env["share_main"])
        print(f"batchrl: {config['env']['num_agents']} agents, {phases}, updates on "
              f"{per_update} x {ppo['update_epochs']} "
              f"epochs, env backend {backend!r}, device "
              f"{config['train']['device']}, torch threads {config['train']['threads']} "
              f"while sampling and {update_threads} in updates; steps/s per phase: "
              f"{', '.join(f'{rate:,.0f}' for rate in batchrl['phase_steps_per_s'])}. "
              f"The whole-process row adds start-up, env and network construction, "
              f"checkpoints and plots.")
    if sb3:
        print(f"SB3: n_envs 1, {sb3['steps'] // SB3_HYPERPARAMS['n_steps']} updates of "
              f"{SB3_HYPERPARAMS['n_steps']} steps x {SB3_HYPERPARAMS['n_epochs']} epochs of "
              f"{SB3_HYPERPARAMS['batch_size']}-step minibatches, device cpu, torch threads "
              f"{sb3['threads']} (its default); construction {sb3['build_seconds']:.1f} s, "
              f"not timed.")
    ratio = None
    if batchrl and sb3:
        ratio = batchrl["steps_per_s"] / sb3["steps_per_s"]
        verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
        process_rate = batchrl["steps"] / batchrl["process_seconds"]
        print(f"batchrl / SB3: {ratio:.1f}x (target >= {TARGET_RATIO:.0f}x: {verdict}); "
              f"whole process: {process_rate / sb3['steps_per_s']:.1f}x.")
    during = {name: run["others_cpu_percent"] for name, run in (("batchrl", batchrl),
                                                                ("SB3", sb3)) if run}
    print("Other programs' CPU load, in % of all cores: "
          + ", ".join(f"{name} {load:.0f}%" for name, load in background.items())
          + "; during the runs (estimated): "
          + ", ".join(f"{name} {load:.0f}%" for name, load in during.items()) + ".")
    busiest = max(max(background.values()), max(during.values()))
    if busiest > 15:
        print("WARNING: other programs were using the CPU; the rates are noisy and lower "
              "than on an idle machine.")

    summary: dict[str, Any] = {
        "env_id": args.env_id, "config": args.config, "cores": cores,
        "torch": torch.__version__,
        "max_background_cpu_percent": round(busiest, 1),
    }
    if batchrl:
        summary["batchrl"] = {
            "steps": batchrl["steps"], "seconds": round(batchrl["seconds"], 2),
            "steps_per_s": round(batchrl["steps_per_s"]),
            "process_seconds": round(batchrl["process_seconds"], 2),
            "process_steps_per_s": round(batchrl["steps"] / batchrl["process_seconds"]),
            "threads": batchrl["config"]["train"]["threads"],
            "update_threads": batchrl["config"]["algorithm"]["update_threads"]}
    if sb3:
        summary["sb3"] = {"version": sb3["version"], "steps": sb3["steps"],
                          "seconds": round(sb3["seconds"], 2),
                          "steps_per_s": round(sb3["steps_per_s"]), "threads": sb3["threads"]}
    if ratio is not None:
        summary["ratio"] = round(ratio, 2)
        summary["target_ratio"] = TARGET_RATIO
        summary["target_met"] = ratio >= TARGET_RATIO
    print(json.dumps(summary))
    if args.json:
        full = dict(summary, batchrl_full=batchrl, sb3_full=sb3, background=background)
        with open(args.json, "w") as file:
            json.dump(full, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
