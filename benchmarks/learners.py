"""Several learners (``train.learners``) on this machine, side by side in one run:

* **All-reduce**: averaging one gradient of a config's networks over 2 learners (gloo over
  127.0.0.1, one process each, as ``train.py`` starts them): milliseconds per call and per
  update (one all-reduce of both networks' gradients per gradient step), against the
  update's own time on one learner.
* **Training**: ``--steps`` steps of ``python train.py --config CONFIG`` without evaluations,
  with 1 and with 2 learners (each stepping its half of ``env.num_agents``), and with 2
  learners and DD-PPO's preemption (``--preemption``, ``train.preemption_threshold``), one
  after the other: steps/s over the training phases. ``--straggler`` runs them again with a
  busy loop on the last core, where learner 1 runs: a slow node, which preemption is for.

    python benchmarks/learners.py                        # halfcheetah, ~3 minutes; idle machine
    python benchmarks/learners.py --config ant --steps 100000
    python benchmarks/learners.py --steps 100000 --straggler   # preemption against a slow core
    python benchmarks/learners.py --set env.backend=workers    # the env layout of the runs

``docs/learners.md`` turns these figures into a model of when more learners pay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

ROOT = Path(__file__).resolve().parent.parent


def _algorithm(config_name: str, learners: int):
    """The config, its BatchPPO for one learner's share of the agents, and the action size."""
    import gymnasium as gym

    from batchrl.config import load_config
    from batchrl.envs import wrap_env
    config = load_config(config_name, ["train.device=cpu"])
    env = wrap_env(gym.make(config.env.id))
    algo = config.make_algorithm(env.observation_space, env.action_space,
                                 config.env.num_agents // learners, "cpu")
    env.close()
    return config, algo, env.action_space.shape[0]


def _allreduce_worker(rank: int, port: int, config_name: str, calls: int, results) -> None:
    import torch

    from batchrl.parts.distributed import LearnerGroup
    torch.set_num_threads(1)
    _, algo, _ = _algorithm(config_name, 2)
    # One all-reduce per gradient step of both networks' gradients (as BatchPPO takes them).
    networks = [algo.policy] if algo.shared_torso else [algo.policy, algo.value]
    parameters = [p for network in networks for p in network.parameters()]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    learners = LearnerGroup.connect(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        for _ in range(10):  # warm-up: connections, buffers
            learners.average_gradients(parameters)
        start = time.perf_counter()
        for _ in range(calls):
            learners.average_gradients(parameters)
        elapsed = time.perf_counter() - start
        results.put((rank, elapsed / calls, sum(p.numel() for p in parameters), len(networks)))
    finally:
        learners.close()


def allreduce(config_name: str, calls: int) -> dict[str, float]:
    """Seconds per all-reduce of a gradient step's gradients between 2 learners."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=_allreduce_worker,
                             args=(rank, port, config_name, calls, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    found = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(30)
    per_call = max(seconds for _, seconds, _, _ in found)
    return {"per_call": per_call, "parameters": found[0][2], "networks": found[0][3]}


def update_seconds(config_name: str, updates: int) -> tuple[float, int]:
    """Seconds of one update of one learner with all the config's agents (random data), and
    its gradient steps."""
    import torch

    from batchrl.parts.memory import RolloutMemory
    torch.manual_seed(0)
    config, algo, action_size = _algorithm(config_name, 1)
    memory = algo.memory
    assert isinstance(memory, RolloutMemory)
    keys = config.algorithm.keys
    rows = config.env.num_agents * keys["rollout_length"]
    steps = keys["update_epochs"] * -(-rows // (keys["minibatch_size"] or rows))
    agents = torch.arange(config.env.num_agents)
    obs_size = algo.observation_space.shape[0]
    for _ in range(keys["rollout_length"]):
        observ = torch.randn(config.env.num_agents, obs_size)
        memory.append(agents, observ=observ, action=torch.randn(len(agents), action_size),
                      mean_or_logits=torch.zeros(len(agents), action_size),
                      log_std=torch.zeros(len(agents), action_size),
                      reward=torch.randn(len(agents)), state=torch.zeros(len(agents), 0))
    memory.end_segments(agents, bootstrap_observ=torch.randn(len(agents), obs_size),
                        terminated=torch.zeros(len(agents)))
    algo.update()  # warm-up
    start = time.perf_counter()
    for _ in range(updates):
        algo.update()
    return (time.perf_counter() - start) / updates, steps


def training(config_name: str, learners: int, steps: int, preemption: float = 0.0,
             overrides: tuple[str, ...] = ()) -> float:
    """steps/s of the training phases of a ``train.py`` run (``overrides``: ``--set`` pairs)."""
    with tempfile.TemporaryDirectory() as logdir:
        command = [sys.executable, str(ROOT / "train.py"), "--config", config_name,
                   "--logdir", logdir, "--no-progress", "--set", "train.eval_episodes=0",
                   "--set", f"train.steps={steps}", "--set", f"train.learners={learners}",
                   "--set", "train.device=cpu",
                   "--set", f"train.preemption_threshold={preemption}",
                   *[arg for pair in overrides for arg in ("--set", pair)]]
        subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
        records = [json.loads(line) for line in
                   (Path(logdir) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["phase"] == "train"][-1]
    return last["step"] / last["wall_time"]


@contextlib.contextmanager
def busy_core(core: int):
    """A process spinning on ``core`` for the duration."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="halfcheetah")
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--preemption", type=float, default=0.5,
                        help="train.preemption_threshold of the third run (0: no third run)")
    parser.add_argument("--straggler", action="store_true",
                        help="also run them with a busy loop on the last core")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a config override for the training runs, e.g. env.backend=workers")
    args = parser.parse_args()

    reduce = allreduce(args.config, args.calls)
    update, gradient_steps = update_seconds(args.config, 5)
    per_update = reduce["per_call"] * gradient_steps
    print(f"{args.config}: {reduce['parameters']:,} parameters in {reduce['networks']} "
          f"network(s); {gradient_steps} gradient steps per update")
    print(f"all-reduce (2 learners, gloo, 127.0.0.1): {reduce['per_call'] * 1e3:.3f} ms per "
          f"call, {per_update * 1e3:.1f} ms per update; one learner's update: "
          f"{update * 1e3:.0f} ms ({per_update / update:.2f} of it)")
    runs = [("1", 1, 0.0), ("2", 2, 0.0)]
    if args.preemption:
        runs.append((f"2, preemption {args.preemption:g}", 2, args.preemption))
    settings = [("", contextlib.nullcontext)]
    if args.straggler:
        core = sorted(os.sched_getaffinity(0))[-1]
        settings.append((f", core {core} busy", lambda: busy_core(core)))
    print("\n| learners | steps/s | ratio |\n|---|---:|---:|")
    for suffix, setting in settings:
        with setting():
            first = None
            for name, learners, preemption in runs:  # (each row as soon as its run ends)
                rate = training(args.config, learners, args.steps, preemption,
                                tuple(args.overrides))
                first = first or rate
                print(f"| {name}{suffix} | {rate:,.0f} | {rate / first:.2f} |", flush=True)


if __name__ == "__main__":
    main()
