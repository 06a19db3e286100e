"""Learning from pixels, side by side on this machine: Atari stepping, the cost of BatchPPO's
update in float32 and bfloat16, and training steps/s of ``configs/atari/pong.toml`` against
Stable-Baselines3's PPO with rl-zoo3's Atari settings.

* **Stepping** (random actions, ``--envs`` envs, ``--seconds`` each): ``make_batch_env`` with
  the config's env as ``train.py`` builds it, on backend ``workers`` (Gymnasium's wrappers in
  worker processes) and backend ``vector`` (ale-py's C++ ``AtariVectorEnv`` as the batch's
  member, ``env.vector_id``); Gymnasium's ``SyncVectorEnv`` of the same envs, and
  ``AtariVectorEnv`` alone.
* **Update**: one BatchPPO update of the config (8 agents x 128 steps, 4 epochs of 4
  minibatches of 256 frames) on random frames, seconds per update and per gradient step, in
  ``float32`` and ``bfloat16`` (``train.precision``).
* **Training**: ``--steps`` steps of ``python train.py --config atari/pong`` (no evaluations)
  in the config's precision (``"auto"``: bfloat16 on a CPU that computes it, else float32)
  on both backends, in float32 too where that is bfloat16 (backend ``workers``, the config's;
  bfloat16 is not trained where the CPU would emulate it), and of SB3's ``PPO("CnnPolicy")`` on
  ``make_atari_env`` (its ``AtariWrapper``, 8 envs in one process, 4 stacked frames) with
  rl-zoo3's hyperparameters
  (128-step rollouts, 4 epochs, minibatches of 256, clip 0.1, entropy 0.01, learning rate
  2.5e-4), both on the CPU. steps/s: for batchrl the trainer's training phases (start-up,
  checkpoints and plots left out), for SB3 its ``learn()`` (after its envs and model are
  built), one run after the other, each over the steps it took.

    python benchmarks/atari.py                      # ~5 minutes, run it on an idle machine
    python benchmarks/atari.py --steps 40960 --skip-sb3

Stable-Baselines3 is not a dependency of batchrl: ``pip install stable-baselines3`` for this
script (``--skip-sb3`` measures batchrl alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchrl

ROOT = Path(__file__).resolve().parent.parent
GAME = "ALE/Pong-v5"


def stepping(envs: int, seconds: float) -> dict[str, float]:
    import gymnasium as gym

    from batchrl.config import load_config
    from batchrl.envs.atari import make
    from batchrl.envs.factory import make_batch_env

    config = load_config("atari/pong")
    kwargs = config.env.kwargs
    rates = {}
    rng = np.random.default_rng(0)

    def run(step, reset) -> float:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            reset(step(rng.integers(0, 6, envs)))
            steps += envs
        return steps / (time.perf_counter() - start)

    for backend in ("workers", "vector"):
        batch = make_batch_env(config.env.id, envs, config.env.max_length, kwargs, backend,
                               infos=True, vector_id="batchrl.envs.atari:make_vector")
        try:
            batch.reset(seed=0)

            def reset_batch(result) -> None:
                ended = np.flatnonzero(result[2] | result[3])
                if ended.size:
                    batch.reset(ended)

            rates[f"batchrl, backend {backend}"] = run(batch.step, reset_batch)
        finally:
            batch.close()
    for name, vector in (
            ("Gymnasium SyncVectorEnv", gym.vector.SyncVectorEnv([lambda: make(**kwargs)] * envs)),
            ("ale-py AtariVectorEnv alone", gym.make_vec(
                GAME, envs, vectorization_mode="vector_entry_point", frameskip=4,
                repeat_action_probability=0.0, stack_num=4))):
        try:
            vector.reset(seed=0)  # (both reset finished envs themselves)
            rates[name] = run(vector.step, lambda result: None)
        finally:
            vector.close()
    return rates


def update_cost(precision: str, repeats: int = 3) -> tuple[float, int, int]:
    """One BatchPPO update of the pong config on random frames: its seconds (median of
    ``repeats``), frames and gradient steps, all sized by the config and the env's spaces."""
    import torch

    from batchrl.algos import BatchPPO
    from batchrl.config import load_config
    from batchrl.envs.atari import make

    config = load_config("atari/pong")
    keys = dict(config.algorithm.keys)
    env = make(**config.env.kwargs)
    observ_space, action_space = env.observation_space, env.action_space
    env.close()
    agents, length = config.env.num_agents, keys["rollout_length"]
    frames_per_update = agents * length
    gradient_steps = keys["update_epochs"] * (frames_per_update // keys["minibatch_size"])
    algo = BatchPPO(observ_space, action_space, agents, total_steps=10 ** 7,
                    precision=precision, **keys)
    algo.train()
    indices = torch.arange(agents)
    frames = torch.randint(0, 256, (agents, *observ_space.shape), dtype=torch.uint8)
    zeros = torch.zeros(agents)
    times = []
    for _ in range(repeats + 1):
        for _ in range(length):
            action, _ = algo.perform(indices, frames)
            start = time.perf_counter()
            if algo.experience(indices, frames, action, torch.randn(agents), zeros, frames,
                               zeros):
                times.append(time.perf_counter() - start)
    # (the first update includes one-time set-up)
    return float(np.median(times[1:])), frames_per_update, gradient_steps


def batchrl_training(steps: int, precision: str, backend: str) -> float:
    """steps/s of train.py --config atari/pong for ``steps`` steps without evaluations."""
    with tempfile.TemporaryDirectory() as logdir:
        subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "atari/pong",
                        "--logdir", logdir, "--no-progress", "--set", f"train.steps={steps}",
                        "--set", "train.eval_episodes=0", "--set", "train.eval_every=10",
                        "--set", f"train.precision={precision}",
                        "--set", f"env.backend={backend}", "--set", "train.device=cpu"],
                       check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in Path(logdir, "metrics.jsonl").open()]
    return records[-1]["step"] / records[-1]["wall_time"]


def sb3_training(steps: int) -> float:
    """steps/s of SB3's PPO with rl-zoo3's Atari settings for ``steps`` steps."""
    import ale_py
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    env = VecFrameStack(make_atari_env(GAME, n_envs=8, seed=0, env_kwargs={
        "frameskip": 1, "repeat_action_probability": 0.0}), n_stack=4)
    model = PPO("CnnPolicy", env, n_steps=128, n_epochs=4, batch_size=256,
                learning_rate=2.5e-4, clip_range=0.1, ent_coef=0.01, vf_coef=0.5,
                device="cpu", seed=0, verbose=0)
    start = time.perf_counter()
    model.learn(total_timesteps=steps)
    rate = model.num_timesteps / (time.perf_counter() - start)  # (whole rollouts: >= steps)
    env.close()
    return rate


def main() -> None:
    import torch

    from batchrl.hardware import resolve_precision

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="per stepping measurement")
    parser.add_argument("--steps", type=int, default=20480, help="per training measurement")
    parser.add_argument("--skip-sb3", action="store_true")
    args = parser.parse_args()

    print(f"Atari stepping, {GAME}, {args.envs} envs, random actions (agent steps/s):")
    rates = stepping(args.envs, args.seconds)
    base = rates["batchrl, backend workers"]
    for name, rate in rates.items():
        print(f"  {name:30s} {rate:8,.0f}  {rate / base:5.2f}x backend workers")

    updates = {precision: update_cost(precision) for precision in ("float32", "bfloat16")}
    _, frames, gradient_steps = updates["float32"]
    print(f"BatchPPO update of configs/atari/pong.toml ({frames:,} frames, {gradient_steps} "
          f"gradient steps):")
    costs = {precision: cost for precision, (cost, _, _) in updates.items()}
    for precision, cost in costs.items():
        print(f"  {precision:9s} {cost:6.2f} s per update, "
              f"{cost / gradient_steps * 1000:5.0f} ms per gradient step, "
              f"{costs['float32'] / cost:4.2f}x float32")

    print(f"Training steps/s, {args.steps:,} steps, no evaluations:")
    auto = resolve_precision("auto", torch.device("cpu"))
    runs = [(auto, "workers"), (auto, "vector")] + (
        [("float32", "workers")] if auto == "bfloat16" else [])
    if auto != "bfloat16":
        print("  (bfloat16 not trained: this CPU has no bfloat16 arithmetic and emulates it)")
    training = {f"batchrl atari/pong, {precision}, {backend}":
                batchrl_training(args.steps, precision, backend)
                for precision, backend in runs}
    if not args.skip_sb3:
        try:
            training["SB3 PPO, rl-zoo3 Atari settings"] = sb3_training(args.steps)
        except ImportError as exc:
            print(f"  (SB3 skipped: {exc}; pip install stable-baselines3)")
    reference = training.get("SB3 PPO, rl-zoo3 Atari settings")
    for name, rate in training.items():
        ratio = f"  {rate / reference:5.2f}x SB3" if reference else ""
        print(f"  {name:42s} {rate:7,.0f}{ratio}")


if __name__ == "__main__":
    main()
