"""Training on a CUDA device: every shipped family through ``train.py`` with
``train.device = "cuda"``, a GPU run's checkpoint evaluated and resumed on the CPU, collectors
feeding a GPU learner, bfloat16 autocast on the GPU, and uint8 pixels reaching the GPU as uint8.

Skipped without a CUDA device (the development machines have none); run on a GPU machine with
``pytest tests/test_cuda.py``. Runs on a GPU are not bit-exact (cuBLAS and cuDNN pick kernels per
run), so these tests check that runs work and learn, not that they repeat.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchrl.checkpoint import list_checkpoints
from batchrl.evaluate import evaluate
from batchrl.metrics import read_metrics
from batchrl.train import main as train_main
from helpers import sets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CARTPOLE = ["env.num_agents=4", "algorithm.update_every=4", "train.eval_episodes=4"]
# batchrl.testing.envs:pixel_side: a 36x36 uint8 task a random policy scores 5 of 10 on and
# a policy that reads the image 10 (20 in the evaluation envs).
PIXEL_TASK = ["env.id=batchrl.testing.envs:pixel_side", "env.kwargs={length=10}",
              "env.max_length=20", "env.backend=inline", "env.eval_kwargs={length=20}",
              "train.eval_episodes=16"]


def train(logdir: Path, config: str, *overrides: str, steps: int | None = None) -> None:
    args = ["--config", config, "--logdir", str(logdir), "--no-progress",
            *sets("train.device=cuda", *overrides)]
    if steps is not None:
        args += ["--steps", str(steps)]
    assert train_main(args) == 0


def saved(logdir: Path) -> dict:
    """The newest checkpoint's algorithm state, its tensors on the devices they were saved
    from."""
    return torch.load(list_checkpoints(logdir)[-1], weights_only=False)["algorithm"]


def on_the_gpu(state: dict) -> bool:
    return all(value.device.type == "cuda" for value in state.values())


def last_eval(logdir: Path) -> float:
    return [r for r in read_metrics(logdir) if r["phase"] == "eval"][-1]["score"]


def write_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_ppo_on_the_gpu_learns_cartpole_and_its_checkpoint_evaluates_and_resumes_on_the_cpu(
        tmp_path):
    logdir = tmp_path / "run"
    train(logdir, "cartpole", *CARTPOLE, "train.steps=30000", "train.eval_every=25")
    assert last_eval(logdir) >= 150, read_metrics(logdir)
    assert on_the_gpu(saved(logdir)["policy"])
    on_cpu = evaluate(logdir, episodes=4, device="cpu")
    assert on_cpu["score"] >= 150, on_cpu
    on_gpu = evaluate(logdir, episodes=4, device="cuda")
    assert on_gpu["score"] >= 150, on_gpu
    # train.device is a machine key: a GPU run goes on on the CPU
    assert train_main(["--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                       "--steps", "32000", *sets("train.device=cpu")]) == 0
    assert read_metrics(logdir)[-1]["step"] >= 32000


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_atari_network_and_objective_learn_the_pixel_task_on_the_gpu(tmp_path, precision):
    """The Pong config (Nature CNN, clipped objective, uint8 frames scaled on the device) in
    both precisions: bfloat16 is autocast on the CUDA device."""
    logdir = tmp_path / precision
    train(logdir, "atari/pong", *PIXEL_TASK, f"train.precision={precision}",
          "train.steps=4000", "train.eval_every=2", "algorithm.rollout_length=32",
          "algorithm.minibatch_size=64", "algorithm.policy_lr=1e-3", "algorithm.value_lr=1e-3",
          "algorithm.discount=0.9", "algorithm.lr_schedule=constant")
    assert last_eval(logdir) >= 19.0, read_metrics(logdir)
    assert on_the_gpu(saved(logdir)["policy"])


def test_impala_with_collector_processes_feeds_a_gpu_learner(tmp_path):
    """Collectors act on the CPU with weights the GPU learner publishes."""
    logdir = tmp_path / "impala"
    train(logdir, "impala/cartpole", "train.collectors=2", "train.steps=60000",
          "train.eval_every=25")
    assert last_eval(logdir) >= 100, read_metrics(logdir)
    assert on_the_gpu(saved(logdir)["policy"])
    assert evaluate(logdir, episodes=4, device="cpu")["episodes"] == 4


def test_sac_and_its_replay_buffer_on_the_gpu_resume_on_the_cpu(tmp_path):
    """SAC from a config that names only the class: the buffer on the device, a checkpoint
    with the buffer continued on the CPU."""
    config = write_config(tmp_path / "sac.toml", '[env]\nid = "Pendulum-v1"\nnum_agents = 2\n'
                          'max_length = 200\nbackend = "inline"\n\n[train]\nsteps = 6000\n'
                          'phase_steps = 3000\neval_episodes = 2\n\n[algorithm]\n'
                          'class = "batchrl.algos:SAC"\n')
    logdir = tmp_path / "sac"
    train(logdir, config, steps=3000)
    assert on_the_gpu(saved(logdir)["buffer"]["tensors"])
    assert train_main(["--config", config, "--logdir", str(logdir), "--no-progress",
                       "--steps", "6000", *sets("train.device=cpu")]) == 0
    checkpoint = torch.load(sorted(logdir.glob("ckpt-*.pt"))[-1], weights_only=False)
    assert checkpoint["algorithm"]["updates"] == 6000 - 5000  # learning starts at 5,000


def test_dqn_with_a_convolutional_torso_learns_the_pixel_task_on_the_gpu(tmp_path):
    """uint8 frames stored as uint8 in the device's replay buffer."""
    config = write_config(tmp_path / "dqn.toml", '[env]\nid = "batchrl.testing.envs:pixel_side"\n'
                          'num_agents = 4\nmax_length = 20\nbackend = "inline"\n\n[train]\n'
                          'steps = 4000\nphase_steps = 2000\neval_episodes = 20\n\n'
                          '[algorithm]\nclass = "batchrl.algos:DQN"\ntorso = "nature_cnn"\n'
                          'hidden = [64]\nbatch_size = 32\nlearning_starts = 500\n'
                          'exploration_steps = 2000\ntarget_update_every = 100\n')
    logdir = tmp_path / "dqn"
    train(logdir, config)
    assert last_eval(logdir) >= 9.0, read_metrics(logdir)  # (a random policy: 5 of 10)
    frames = saved(logdir)["buffer"]["tensors"]["observ"]
    assert frames.device.type == "cuda" and frames.dtype == torch.uint8


def test_uint8_pixels_reach_the_gpu_as_uint8():
    from batchrl.tensor_env import TensorBatchEnv
    from batchrl.envs import BatchEnv
    from batchrl.testing.envs import pixel_side

    with TensorBatchEnv(BatchEnv([pixel_side() for _ in range(2)]), device="cuda") as env:
        observ = env.reset(seed=0)
        assert observ.dtype == torch.uint8 and observ.device.type == "cuda"
        observ, reward, done = env.step(torch.zeros(2, dtype=torch.int64, device="cuda"))
        assert observ.dtype == torch.uint8 and reward.device.type == "cuda"


def test_more_learners_than_gpus_is_a_clear_error(tmp_path, capsys):
    learners = torch.cuda.device_count() + 1
    code = train_main(["--config", "cartpole", "--logdir", str(tmp_path / "r"), "--no-progress",
                       *sets("train.device=cuda", f"train.learners={learners}",
                             f"env.num_agents={2 * learners}")])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(torch.cuda.device_count()) in error and "GPU" in error, error


def test_a_cpu_run_on_a_gpu_machine_leaves_cuda_alone(tmp_path):
    """Checkpoints of a CPU run hold no GPU generator states: reading them would start CUDA
    (and take GPU memory) in a run that does not use it."""
    import subprocess
    import sys

    script = ("import sys, torch; from batchrl.train import main; "
              "code = main(sys.argv[1:]); print('cuda started:', torch.cuda.is_initialized()); "
              "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, "--config", "cartpole", "--logdir",
                           str(tmp_path / "cpu"), "--no-progress", "--steps", "600",
                           *sets(*CARTPOLE, "train.device=cpu")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cuda started: False" in done.stdout


def test_a_checkpoint_from_a_machine_with_more_gpus_resumes(tmp_path):
    """One generator state per GPU of the saving machine: resuming where there are fewer GPUs
    restores the ones that exist."""
    logdir = tmp_path / "run"
    train(logdir, "cartpole", *CARTPOLE, steps=600)
    path = list_checkpoints(logdir)[-1]
    state = torch.load(path, weights_only=False)
    assert state["rng"]["cuda"] is not None
    state["rng"]["cuda"] = [*state["rng"]["cuda"], state["rng"]["cuda"][0]]
    torch.save(state, path)
    train(logdir, "cartpole", *CARTPOLE, steps=1200)
    assert read_metrics(logdir)[-1]["step"] >= 1200
