"""batchrl.evaluate: evaluate() in-process, the command line and --video."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos.base import Algorithm
from batchrl.algos.reinforce import Reinforce
from batchrl.checkpoint import list_checkpoints
from batchrl.config import ConfigError, load_config
from batchrl.evaluate import EvaluationError, evaluate, find_gl_backend, main, video_writer_problem
from batchrl.trainer import Trainer
from helpers import agent_pixels, assert_same

RESULT_LINE = re.compile(r"^(-?\d+\.\d) ± (\d+\.\d) return over (\d+) episodes, "
                         r"mean length (\d+\.\d)$", re.MULTILINE)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrl.evaluate", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("cartpole")
    Trainer(load_config("cartpole", ["train.steps=2000", "env.num_agents=4",
                                     "algorithm.update_every=4", "train.eval_episodes=4"]),
            logdir, progress=False).run()
    return logdir


def test_evaluate_returns_exact_episode_count_and_is_seeded(cartpole_run):
    result = evaluate(cartpole_run, episodes=5, agents=2, device="cpu")
    assert result["episodes"] == len(result["scores"]) == len(result["lengths"]) == 5
    assert result["agents"] == 2
    assert result["score"] == pytest.approx(np.mean(result["scores"]))
    assert result["score_std"] == pytest.approx(np.std(result["scores"]))
    # CartPole pays 1 per step: returns equal lengths.
    assert result["scores"] == [float(n) for n in result["lengths"]]
    assert 1 <= result["length"] <= 500
    latest = list_checkpoints(cartpole_run)[-1]
    assert result["checkpoint"] == str(latest)
    assert result["step"] >= 2000 and result["video"] is None
    assert evaluate(cartpole_run, episodes=5, agents=2, device="cpu")["scores"] == result["scores"]
    # Default agents: min(episodes, env.num_agents); an older checkpoint on request.
    oldest = list_checkpoints(cartpole_run)[0]
    older = evaluate(cartpole_run, episodes=3, checkpoint=oldest, device="cpu")
    assert older["agents"] == 3 and older["checkpoint"] == str(oldest)
    # More agents than episodes, on request: the last play none (as in a run's evaluations).
    more = evaluate(cartpole_run, episodes=2, agents=4, device="cpu")
    assert more["agents"] == 4 and more["episodes"] == 2
    assert more["scores"] == evaluate(cartpole_run, episodes=2, agents=2, device="cpu")["scores"]
    assert older["step"] == int(oldest.stem.split("-")[1])


def test_sampled_actions_are_seeded_by_the_evaluation_seed(cartpole_run):
    mean = evaluate(cartpole_run, episodes=6, agents=3, device="cpu")
    sampled = evaluate(cartpole_run, episodes=6, agents=3, device="cpu", actions="sample")
    assert mean["actions"] == "mean" and sampled["actions"] == "sample"
    # A barely trained CartPole policy is far from deterministic: sampling changes the episodes.
    assert sampled["lengths"] != mean["lengths"]
    again = evaluate(cartpole_run, episodes=6, agents=3, device="cpu", actions="sample")
    assert again["scores"] == sampled["scores"]
    other_seed = evaluate(cartpole_run, episodes=6, agents=3, device="cpu", actions="sample",
                          seed=1)
    assert other_seed["scores"] != sampled["scores"]
    with pytest.raises(ConfigError, match="--actions must be one of mean, sample, got 'greedy'"):
        evaluate(cartpole_run, episodes=1, actions="greedy")
    process = run_cli(cartpole_run, "--episodes", "2", "--device", "cpu", "--actions", "sample")
    assert process.returncode == 0 and "sampled actions" in process.stdout, process.stderr


def test_evaluations_that_sample_leave_the_training_run_as_it_was(tmp_path):
    """train.eval_actions='sample' draws from generators of its own: the run learns exactly
    what it learns with mean-action evaluations, and its evaluations repeat with its seed."""
    runs = {}
    for name, actions in (("mean", "mean"), ("sample", "sample"), ("again", "sample")):
        config = load_config("cartpole", ["train.steps=1500", "env.num_agents=4",
                                          "algorithm.update_every=4", "train.eval_episodes=4",
                                          "train.device=cpu", f"train.eval_actions={actions}"])
        Trainer(config, tmp_path / name, progress=False).run()
        checkpoint = torch.load(list_checkpoints(tmp_path / name)[-1], weights_only=False)
        evals = [row["score"] for row in map(json.loads, (tmp_path / name / "metrics.jsonl")
                                              .read_text().splitlines())
                 if row.get("phase") == "eval"]
        runs[name] = checkpoint, evals
    # The whole learned state (networks, optimisers, statistics) and the generators.
    assert_same(runs["mean"][0]["algorithm"], runs["sample"][0]["algorithm"], "algorithm")
    assert_same(runs["mean"][0]["rng"], runs["sample"][0]["rng"], "rng")
    assert runs["sample"][1] == runs["again"][1] and len(runs["sample"][1]) >= 2
    assert runs["sample"][1] != runs["mean"][1]


class MeanOnly(Reinforce):
    """A user's algorithm whose constructor takes no eval_actions."""

    def __init__(self, observation_space, action_space, num_agents, max_length, device="cpu"):
        super().__init__(observation_space, action_space, num_agents, max_length, device)


def test_an_algorithm_that_cannot_sample_in_evaluation_is_refused():
    config = load_config("cartpole_reinforce", ["train.eval_actions=sample"])
    config.algorithm.path = f"{__name__}:MeanOnly"
    with pytest.raises(ConfigError, match="train.eval_actions='sample' needs an algorithm whose "
                                          "constructor takes eval_actions"):
        config.make_algorithm(gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
                              gym.spaces.Discrete(2), 2, "cpu")
    with pytest.raises(ConfigError, match="train.eval_actions must be one of mean, sample"):
        load_config("cartpole", ["train.eval_actions=greedy"])


def test_bad_arguments_and_unreadable_checkpoint(cartpole_run, tmp_path):
    with pytest.raises(ConfigError, match="episodes"):
        evaluate(cartpole_run, episodes=0)
    with pytest.raises(ConfigError, match=r"\.mp4"):
        evaluate(cartpole_run, episodes=1, video=tmp_path / "run.avi")
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(cartpole_run / "config.json", broken)
    (broken / "ckpt-000000000010.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(EvaluationError, match="cannot read checkpoint"):
        evaluate(broken, episodes=1)


def test_cli_reports_an_env_that_fails_to_build_as_train_py_does(cartpole_run, tmp_path):
    """A run whose evaluation envs take a keyword their env does not: one error line naming
    the env and the keyword (then the env's traceback, as train.py shows it), exit 1."""
    import json

    run = tmp_path / "bad_eval_kwargs"
    shutil.copytree(cartpole_run, run)
    saved = json.loads((run / "config.json").read_text())
    saved["env"]["eval_kwargs"] = {"bogus": 1}
    (run / "config.json").write_text(json.dumps(saved))
    process = run_cli(run, "--episodes", "1", "--device", "cpu")
    assert process.returncode == 1, process.stderr
    first = process.stderr.splitlines()[0]
    assert first.startswith("error: CartPole-v1 failed in construct(): TypeError: ") and \
        "'bogus'" in first, process.stderr


def test_cli_prints_mean_std_and_length(cartpole_run):
    process = run_cli(cartpole_run, "--episodes", "3", "--device", "cpu")
    assert process.returncode == 0, process.stderr
    match = RESULT_LINE.search(process.stdout)
    assert match, process.stdout
    mean, std, count, length = match.groups()
    assert int(count) == 3 and 1 <= float(length) <= 500
    assert float(mean) == float(length)  # (CartPole pays 1 a step)
    assert "CartPole-v1" in process.stdout and "Traceback" not in process.stderr


def test_cli_without_checkpoint_exits_2_with_listing(cartpole_run, tmp_path):
    logdir = tmp_path / "fresh"
    logdir.mkdir()
    shutil.copy(cartpole_run / "config.json", logdir)
    (logdir / "metrics.jsonl").write_text("")
    process = run_cli(logdir, "--episodes", "3")
    assert process.returncode == 2
    assert "Traceback" not in process.stderr
    assert process.stderr.startswith("error: ") and "no checkpoint" in process.stderr
    assert "config.json, metrics.jsonl" in process.stderr


def test_main_without_run_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    error = capsys.readouterr().err
    assert "no config.json" in error and "does not exist" in error
    assert main([str(tmp_path)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_ten_episodes_by_default(cartpole_run):
    result = evaluate(cartpole_run, device="cpu")  # (the run has 4 agents)
    assert result["episodes"] == len(result["scores"]) == 10 and result["agents"] == 4


@pytest.mark.parametrize("args, message", [
    (["--agents", "0"], "agents must be >= 1, got 0"),
    (["--agents", "2", "--video", "v.gif"], "--agents sets the envs stepped in lockstep "
                                             "without a video"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_arguments_exit_2_before_any_run_is_read(tmp_path, capsys, args, message):
    # (checked first: the log directory need not even exist)
    assert main([str(tmp_path / "missing"), *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error


def test_classic_control_video_needs_pygame_or_works(cartpole_run, tmp_path, monkeypatch,
                                                    capfd):
    problem = video_writer_problem()
    if problem:
        pytest.skip(problem)
    # CartPole renders with pygame, not OpenGL: pin MUJOCO_GL (restored after
    # the test) so that no backend is probed or set for this process.
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # as in a bare session
    path = tmp_path / "cartpole.mp4"
    try:
        import pygame  # noqa: F401
    except ImportError:
        with pytest.raises(EvaluationError, match=r"pygame.*batchrl\[video\]"):
            evaluate(cartpole_run, video=path)
    else:
        result = evaluate(cartpole_run, video=path)
        assert result["video_frames"] >= 2 and path.stat().st_size > 1000
        assert "XDG_RUNTIME_DIR" not in capfd.readouterr().err  # SDL's complaint


def test_a_video_without_pygame_names_the_video_extra(cartpole_run, tmp_path):
    # pygame blocked in the child (None in sys.modules: import pygame fails), as where the
    # video extra is not installed.
    video = tmp_path / "cartpole.gif"
    process = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pygame'] = None; "
         "from batchrl.evaluate import main; sys.exit(main(sys.argv[1:]))",
         str(cartpole_run), "--video", str(video), "--device", "cpu"],
        capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert lines[0].startswith("error: cannot render CartPole-v1: pygame is not installed")
    assert 'pip install "batchrl[video]"' in lines[0] and not video.exists()


@pytest.fixture
def pygame_video(monkeypatch):
    """CartPole filmed with pygame; MUJOCO_GL pinned so that no OpenGL backend is probed."""
    pytest.importorskip("pygame")
    monkeypatch.setenv("MUJOCO_GL", "egl")


def test_the_filmed_episodes_are_the_evaluations(cartpole_run, tmp_path, pygame_video):
    """A video's episode i is reset with seed + i and acts as the evaluation does: it films
    the episodes that as many agents as episodes run side by side."""
    plain = evaluate(cartpole_run, episodes=3, agents=3, seed=5, device="cpu")
    assert len(set(plain["lengths"])) > 1  # (the seeds make different episodes)
    filmed = evaluate(cartpole_run, episodes=3, seed=5, device="cpu",
                      video=tmp_path / "v.gif", max_frames=2)
    assert filmed["actions"] == "mean" and filmed["camera"] == "the env's own view"
    assert filmed["lengths"] == plain["lengths"] and filmed["scores"] == plain["scores"]
    from PIL import Image

    with Image.open(tmp_path / "v.gif") as image:
        assert image.info["loop"] == 0  # (it plays for ever)


class LastAction(Algorithm):
    """A policy that also sees each agent's last action: state of every agent that it does
    not declare (``per_agent_state``), so it acts only for its training run's agent count."""

    def __init__(self, observation_space, action_space, num_agents, device="cpu"):
        super().__init__(device)
        self.net = torch.nn.Linear(observation_space.shape[0] + 1, action_space.n)
        self.last = torch.zeros(num_agents)

    def begin_episodes(self, agent_indices):
        self.last[agent_indices] = 0.0
        return {}

    @torch.no_grad()
    def perform(self, agent_indices, observ):
        action = self.net(torch.cat([observ, self.last[:, None]], 1)).argmax(-1)
        self.last = action.float()
        return action, {}

    def experience(self, *args):
        return {}

    def end_episodes(self, agent_indices):
        return {}

    def state_dict(self):
        return {"net": self.net.state_dict(), "last": self.last}

    def load_state_dict(self, state):
        self.net.load_state_dict(state["net"])
        self.last = state["last"]


def test_a_video_of_an_algorithm_that_fits_only_its_training_runs_agents(tmp_path,
                                                                       pygame_video):
    """Filmed beside unfilmed envs: each of its calls still covers all of its agents."""
    config = tmp_path / "last_action.toml"
    config.write_text('[env]\nid = "CartPole-v1"\nnum_agents = 3\nbackend = "inline"\n'
                      '[train]\nsteps = 300\nphase_steps = 300\neval_episodes = 2\n'
                      '[algorithm]\nclass = "test_evaluate:LastAction"\n')
    logdir = tmp_path / "run"
    Trainer(load_config(str(config)), logdir, progress=False).run()
    filmed = evaluate(logdir, episodes=2, seed=5, device="cpu", video=tmp_path / "v.gif",
                      max_frames=2)
    assert filmed["episodes"] == 2 and (tmp_path / "v.gif").exists()


def test_camera_options_for_an_env_that_is_not_mujoco_are_an_error(cartpole_run, tmp_path,
                                                                  pygame_video):
    path = tmp_path / "v.gif"
    for options in ({"camera": "track"}, {"width": 64}):
        with pytest.raises(EvaluationError, match="--camera, --width and --height apply to "
                                                  "MuJoCo envs; CartPoleEnv renders its own "
                                                  "view"):
            evaluate(cartpole_run, device="cpu", video=path, **options)
    assert not path.exists()


def test_a_sampled_video_follows_its_seed_alone(cartpole_run, tmp_path, pygame_video):
    """With sampled actions the video draws from torch's generators seeded by the seed:
    the same episode whatever the global random state, and the evaluation's."""
    lengths = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        lengths.append(evaluate(cartpole_run, episodes=1, seed=3, device="cpu",
                                actions="sample", video=tmp_path / f"{global_seed}.gif",
                                max_frames=2)["lengths"])
    plain = evaluate(cartpole_run, episodes=1, agents=1, seed=3, device="cpu",
                     actions="sample")
    assert lengths[0] == lengths[1] == plain["lengths"]


def test_an_mp4_plays_at_the_envs_frame_rate(cartpole_run, tmp_path, pygame_video):
    problem = video_writer_problem()
    if problem:
        pytest.skip(problem)
    import imageio_ffmpeg

    path = tmp_path / "v.mp4"
    result = evaluate(cartpole_run, episodes=1, device="cpu", video=path, max_frames=25)
    assert result["video_frames"] == 25
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(path))
    fps = gym.make("CartPole-v1").metadata["render_fps"]  # 50
    assert frames == 25 and seconds == pytest.approx(25 / fps, abs=0.05)
    assert first_frame(path).shape == (400, 600, 3)  # CartPole's own (even) size, kept


def first_frame(path: Path) -> np.ndarray:
    import imageio.v2 as imageio

    with imageio.get_reader(path) as reader:
        return reader.get_data(0)


class OddFrames(gym.Wrapper):
    """CartPole's frames less a row and a column: 399x599 pixels."""

    def render(self):
        return self.env.render()[1:, 1:]


def cartpole_with_odd_frames(**kwargs) -> gym.Env:
    return OddFrames(gym.make("CartPole-v1", **kwargs))


def copy_with_env(run: Path, tmp_path: Path, env_id: str) -> Path:
    """A copy of the training run ``run`` whose config names the env ``env_id``."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["env"]["id"] = env_id
    (copy / "config.json").write_text(json.dumps(saved))
    return copy


class OddWidth(gym.Wrapper):
    """CartPole's frames less a column: 400x599 pixels (one side odd)."""

    def render(self):
        return self.env.render()[:, 1:]


def cartpole_with_an_odd_width(**kwargs) -> gym.Env:
    return OddWidth(gym.make("CartPole-v1", **kwargs))


@pytest.mark.parametrize("constructor", ["cartpole_with_odd_frames",
                                         "cartpole_with_an_odd_width"])
def test_an_mp4_of_frames_with_odd_sides_is_rounded_up_to_whole_blocks(cartpole_run, tmp_path,
                                                                       pygame_video,
                                                                       constructor):
    """H.264 in yuv420p takes only even sides: imageio scales the frames up to 16s (when
    either side is odd)."""
    problem = video_writer_problem()
    if problem:
        pytest.skip(problem)
    run = copy_with_env(cartpole_run, tmp_path, f"{__name__}:{constructor}")
    path = tmp_path / "v.mp4"
    result = evaluate(run, episodes=1, device="cpu", video=path, max_frames=3)
    assert result["video_frames"] == 3 and first_frame(path).shape == (400, 608, 3)


class RenderFails(gym.Wrapper):
    """Renders ``frames`` frames, then fails (a renderer that breaks halfway)."""

    def __init__(self, env: gym.Env, frames: int):
        super().__init__(env)
        self.left = frames

    def render(self):
        if self.left == 0:
            raise RuntimeError("the renderer broke")
        self.left -= 1
        return self.env.render()


def cartpole_whose_renderer_breaks(**kwargs) -> gym.Env:
    return RenderFails(gym.make("CartPole-v1", **kwargs), frames=3)


class TerminatedWhileFilmed(gym.Wrapper):
    """Sends its own process SIGTERM at its third rendered frame (a ``kill`` mid-video)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.frames = 0

    def render(self):
        self.frames += 1
        if self.frames == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.env.render()


def cartpole_terminated_while_filmed(**kwargs) -> gym.Env:
    return TerminatedWhileFilmed(gym.make("CartPole-v1", **kwargs))


def test_sigterm_while_filming_exits_143_and_leaves_no_file(cartpole_run, tmp_path,
                                                            pygame_video, capsys):
    if video_writer_problem():
        pytest.skip(video_writer_problem())
    run = copy_with_env(cartpole_run, tmp_path, f"{__name__}:cartpole_terminated_while_filmed")
    path = tmp_path / "out" / "v.mp4"  # (written as v.partial.mp4 until whole)
    before = signal.getsignal(signal.SIGTERM)
    assert main([str(run), "--video", str(path), "--device", "cpu"]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "Terminated"
    assert list(path.parent.glob("*")) == []  # neither the animation nor its partial file
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_a_video_that_fails_midway_leaves_no_file(cartpole_run, tmp_path, pygame_video, suffix):
    problem = video_writer_problem() if suffix == ".mp4" else None
    if problem:
        pytest.skip(problem)
    run = copy_with_env(cartpole_run, tmp_path, f"{__name__}:cartpole_whose_renderer_breaks")
    path = tmp_path / "out" / f"v{suffix}"
    with pytest.raises(EvaluationError, match="the renderer broke"):
        evaluate(run, episodes=1, device="cpu", video=path)
    assert list(path.parent.glob("*")) == []  # neither the video nor its partial file


def cartpole_without_frames(render_mode: str | None = None) -> gym.Env:
    """Takes a render_mode and ignores it: render() returns None."""
    return gym.make("CartPole-v1")


class GreyFrames(gym.Wrapper):
    """CartPole's frames as one channel: (400, 600) arrays, not RGB ones."""

    def render(self):
        return self.env.render()[..., 0]


def cartpole_with_grey_frames(**kwargs) -> gym.Env:
    return GreyFrames(gym.make("CartPole-v1", **kwargs))


@pytest.mark.parametrize("constructor, error", [
    ("cartpole_whose_renderer_breaks", "RuntimeError: the renderer broke"),
    ("cartpole_without_frames", "TypeError: render() returned NoneType, not an RGB array; the "
                                "env must accept render_mode='rgb_array'"),
    ("cartpole_with_grey_frames", "TypeError: render() returned ndarray, not an RGB array; the "
                                  "env must accept render_mode='rgb_array'")])
# (cartpole_without_frames ignores its render_mode, and Gymnasium warns of that)
@pytest.mark.filterwarnings("ignore:.*calling render method without specifying any render mode")
def test_a_renderer_that_is_not_mujocos_fails_with_its_own_error(cartpole_run, tmp_path,
                                                                 pygame_video, constructor,
                                                                 error):
    """CartPole renders with pygame: the message is its renderer's error, with no advice
    about MuJoCo's OpenGL backends (MUJOCO_GL is set, as evaluate() sets it)."""
    env_id = f"{__name__}:{constructor}"
    run = copy_with_env(cartpole_run, tmp_path, env_id)
    with pytest.raises(EvaluationError) as caught:
        evaluate(run, episodes=1, device="cpu", video=tmp_path / "v.gif")
    assert str(caught.value) == f"cannot render {env_id}: {error}"


def cartpole_without_render_modes() -> gym.Env:
    return gym.make("CartPole-v1")


def test_an_env_that_takes_no_render_mode_cannot_be_filmed(cartpole_run, tmp_path,
                                                           pygame_video):
    env_id = f"{__name__}:cartpole_without_render_modes"
    run = copy_with_env(cartpole_run, tmp_path, env_id)
    path = tmp_path / "v.gif"
    with pytest.raises(EvaluationError, match=f"cannot build {env_id} with "
                                              f"render_mode='rgb_array': .*render_mode"):
        evaluate(run, device="cpu", video=path)
    assert not path.exists()


def test_a_one_frame_gif(cartpole_run, tmp_path, pygame_video):
    """Pillow writes one frame as a still image, whose duration is a number, not a list."""
    from PIL import Image

    path = tmp_path / "still.gif"
    result = evaluate(cartpole_run, episodes=1, device="cpu", video=path, max_frames=1)
    assert result["video_frames"] == 1
    with Image.open(path) as image:
        assert getattr(image, "n_frames", 1) == 1


def test_the_video_extra_brings_what_each_config_needs_to_be_filmed():
    """Classic control renders with pygame (gymnasium[classic-control]); MuJoCo with
    PyOpenGL, which mujoco itself requires, and the system's EGL or OSMesa."""
    import configparser

    import gymnasium as gym

    from batchrl.config import available_configs

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    video = setup["options.extras_require"]["video"].split()
    installed = setup["options"]["install_requires"].split()
    atari = setup["options.extras_require"]["atari"].split()
    needs = {"gymnasium.envs.classic_control": ("gymnasium[classic-control]", video),
             "gymnasium.envs.mujoco": ("gymnasium[mujoco]", installed),
             "batchrl.envs.atari": ("ale-py", atari)}  # (ALE renders the game's own frames)
    for name in available_configs():
        env_id = load_config(name).env.id
        entry = env_id if ":" in env_id else str(gym.spec(env_id).entry_point)
        module = entry.split(":")[0]
        family = next((key for key in needs if module.startswith(key)), None)
        assert family is not None, f"{name}: {env_id} ({module}): which extra films it?"
        requirement, listed = needs[family]
        assert any(line.startswith(requirement) for line in listed), (name, requirement)


def _video_skip_reason() -> str | None:
    problem = video_writer_problem()
    if problem:
        return problem
    backend, failures = find_gl_backend()
    if backend is None:
        tried = "; ".join(f"MUJOCO_GL={name}: {why}" for name, why in failures.items())
        return f"no MuJoCo OpenGL backend renders here ({tried})"
    return None


# Reacher for 2 agents: BatchPPO (the reacher config) and SAC, filmed alike (the video needs
# only the Algorithm interface).
REACHER_RUNS = {
    "batchppo": ("reacher", [
        "env.backend=inline", "env.num_agents=2", "train.steps=100", "train.eval_episodes=2",
        "algorithm.update_every=2", "algorithm.update_epochs=2", "algorithm.policy_layers=[16]",
        "algorithm.value_layers=[16]", "algorithm.inference=\"eager\""]),
    "sac": ("sac/halfcheetah", [
        'env.id="Reacher-v5"', "env.num_agents=2", "env.max_length=50", "train.steps=200",
        "train.phase_steps=200", "train.eval_episodes=2", "algorithm.buffer_size=1000",
        "algorithm.learning_starts=100", "algorithm.batch_size=16", "algorithm.hidden=[16]"]),
}


@pytest.mark.parametrize("algorithm", REACHER_RUNS)
def test_mujoco_video(tmp_path, algorithm):
    reason = _video_skip_reason()
    if reason:
        pytest.skip(reason)
    import imageio.v2 as imageio
    import imageio_ffmpeg

    logdir = tmp_path / "reacher"
    name, overrides = REACHER_RUNS[algorithm]
    Trainer(load_config(name, overrides), logdir, progress=False).run()
    video = tmp_path / "out" / "reacher.mp4"
    process = run_cli(logdir, "--episodes", "2", "--video", video, "--device", "cpu")
    assert process.returncode == 0, process.stderr
    assert RESULT_LINE.search(process.stdout), process.stdout
    # Reacher-v5 never terminates: a 50-step episode is 51 frames with the reset one;
    # it has no camera of its own, so a free one follows its first body.
    assert "(102 frames, a camera following body 'body0')" in process.stdout
    assert "  episode 2: return " in process.stdout and ", 50 steps" in process.stdout
    assert video.stat().st_size > 2000
    assert list(video.parent.glob("*.partial.mp4")) == []  # (renamed once whole)
    frames, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert frames == 102
    first = imageio.get_reader(video).get_data(0)
    assert first.ndim == 3 and first.shape[2] == 3 and first.std() > 5  # not a blank frame


@pytest.fixture(scope="module")
def pushed_cheetah_run(tmp_path_factory) -> Path:
    """A barely trained HalfCheetah that a wrapper pushes 0.25 m forward per step:
    about 40 m in its 150-step episode."""
    reason = _video_skip_reason()
    if reason:
        pytest.skip(reason)
    logdir = tmp_path_factory.mktemp("pushed")
    Trainer(load_config("halfcheetah", [
        'env.id="helpers:make_pushed_cheetah"', "env.backend=inline", "env.num_agents=1",
        "env.max_length=150", "train.steps=150", "train.eval_episodes=1",
        "algorithm.update_every=1", "algorithm.update_epochs=1", "algorithm.policy_layers=[8]",
        "algorithm.value_layers=[8]", "algorithm.inference=\"eager\""]), logdir, progress=False).run()
    return logdir


@pytest.mark.slow
def test_the_video_keeps_a_running_agent_in_view(pushed_cheetah_run, tmp_path):
    import imageio.v2 as imageio

    def visible(camera):
        path = tmp_path / f"{camera}.mp4"
        result = evaluate(pushed_cheetah_run, video=path, camera=camera, width=160,
                          height=120, device="cpu")
        with imageio.get_reader(path) as reader:
            frames = list(reader.iter_data())
        assert len(frames) == result["video_frames"] == 151
        assert frames[0].shape == (120, 160, 3)
        return result, np.mean([agent_pixels(frame) > 30 for frame in frames])

    result, share = visible(None)
    assert result["camera"] == "the model's tracking camera 'track'" and share > 0.95
    # Gymnasium's default view loses it within the first metres.
    result, share = visible("free")
    assert result["camera"] == "the free camera" and share < 0.3


def test_video_camera_errors_exit_2(pushed_cheetah_run, tmp_path, capsys):
    video = tmp_path / "v.mp4"
    assert main([str(pushed_cheetah_run), "--video", str(video), "--camera", "nosuch"]) == 2
    error = capsys.readouterr().err
    assert "the model has no camera 'nosuch'; its cameras: 'track'" in error
    assert main([str(pushed_cheetah_run), "--camera", "track"]) == 2
    assert "add --video PATH.mp4" in capsys.readouterr().err
    assert main([str(pushed_cheetah_run), "--video", str(video), "--width", "8"]) == 2
    assert "at least 16 pixels" in capsys.readouterr().err
    assert not video.exists()
    # A video that cannot be written (its folder is a file): one line, no partial file.
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    assert main([str(pushed_cheetah_run), "--video", str(blocked / "v.mp4")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: cannot write the video {blocked}")


@pytest.mark.slow
def test_a_model_without_a_tracking_camera_gets_a_following_one(monkeypatch):
    from batchrl.video import follow_agent
    from helpers import make_pushed_cheetah

    reason = _video_skip_reason()
    if reason:
        pytest.skip(reason)
    # Rendering here, not through batchrl.evaluate: choose the backend as it does (unset,
    # Gymnasium would try glfw, which needs a display), whatever tests ran before.
    backend, _ = find_gl_backend()
    monkeypatch.setenv("MUJOCO_GL", os.environ.get("MUJOCO_GL") or backend)

    env = make_pushed_cheetah(render_mode="rgb_array", width=160, height=120)
    try:
        env.unwrapped.model.cam_mode[0] = 0  # the "track" camera made a fixed one
        assert follow_agent(env) == "a camera following body 'torso'"
        env.reset(seed=0)
        seen = []
        for _ in range(150):
            env.step(np.zeros(6, np.float32))
            seen.append(agent_pixels(env.render()) > 30)
        assert np.mean(seen) > 0.95
    finally:
        env.close()


@pytest.mark.parametrize("suffix", [".gif", ".webp"])
def test_a_short_animated_preview(pushed_cheetah_run, tmp_path, suffix):
    from PIL import Image

    path = tmp_path / f"preview{suffix}"
    result = evaluate(pushed_cheetah_run, video=path, width=160, height=120, max_frames=20,
                      device="cpu")
    assert result["video_frames"] == 20 and result["lengths"] == [150]  # the episode is whole
    with Image.open(path) as image:
        assert image.is_animated and image.n_frames == 20 and image.size == (160, 120)
        if suffix == ".gif":  # HalfCheetah's 20 frames a second
            assert image.info["duration"] == 50
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # (written whole, then named)
    with pytest.raises(ConfigError, match="max-frames must be >= 1"):
        evaluate(pushed_cheetah_run, video=path, max_frames=0)


def test_animations_keep_at_most_50_frames_a_second_and_the_recordings_length():
    from batchrl.video import animation_timing

    # Hopper's 125 frames a second: GIF delays of 8 ms would be stored as 0 and shown slowly.
    kept, durations = animation_timing(250, 125)
    assert kept[:3] == [0, 3, 6] and len(kept) == 83  # (the 84th, 8 ms: the 83rd lasts on)
    assert min(durations) >= 20 and sum(durations) == 2000  # 250 frames at 125 fps: 2 s
    kept, durations = animation_timing(10, 15)  # Atari's 15: every frame, 60-70 ms each
    assert kept == list(range(10)) and set(durations) == {60, 70} and sum(durations) == 670
    kept, durations = animation_timing(10, 50)  # CartPole's 50: every frame, 20 ms each
    assert kept == list(range(10)) and durations == [20] * 10


class NumberedFrames(gym.Wrapper):
    """CartPole rendering frame ``i`` since its creation as a grey image of value ``10 * i``,
    at 100 frames a second (a GIF keeps every second one)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 100}

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.rendered = 0

    def render(self):
        self.rendered += 1
        return np.full((16, 24, 3), 10 * (self.rendered - 1), np.uint8)


def cartpole_with_numbered_frames(**kwargs) -> gym.Env:
    return NumberedFrames(gym.make("CartPole-v1", **kwargs))


def test_an_animation_of_a_fast_env_keeps_every_nth_frame_of_the_whole_recording(
        cartpole_run, tmp_path, pygame_video):
    """At 100 frames a second a GIF keeps frames 0, 2, 4, ... (50 a second), each shown for
    20 ms: the whole recording at its pace, not its first half slowed down."""
    from PIL import Image

    run = copy_with_env(cartpole_run, tmp_path, f"{__name__}:cartpole_with_numbered_frames")
    path = tmp_path / "v.gif"
    result = evaluate(run, episodes=1, device="cpu", video=path, max_frames=20)
    assert result["video_frames"] == 20
    with Image.open(path) as image:
        values, durations = [], []
        for index in range(image.n_frames):
            image.seek(index)
            values.append(int(np.asarray(image.convert("RGB"))[0, 0, 0]))
            durations.append(image.info["duration"])
    assert values == list(range(0, 200, 20)) and durations == [20] * 10


def test_an_animation_that_cannot_be_written_is_an_error(cartpole_run, tmp_path,
                                                         pygame_video):
    """A GIF is written once the episodes are over: a folder it cannot be written into is
    the same one-line error as an MP4's, not a result without its video."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(EvaluationError, match=f"cannot write the video {blocked}"):
        evaluate(cartpole_run, episodes=1, device="cpu", video=blocked / "v.gif",
                 max_frames=2)


def test_agents_for_an_algorithm_without_per_agent_state_is_a_notice(tmp_path, capsys):
    # Reinforce's state is sized by the training run's agents: --agents cannot change
    # them, and the user is told so instead of left to believe 4 envs ran.
    logdir = tmp_path / "reinforce"
    Trainer(load_config("cartpole_reinforce", ["train.steps=64", "env.num_agents=2",
                                               "train.eval_every=8", "train.eval_episodes=2",
                                               "algorithm.update_every=4"]),
            logdir, progress=False).run()
    assert main([str(logdir), "--agents", "4", "--episodes", "3", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "note: --agents 4 ignored: Reinforce declares no per_agent_state, so its checkpoint "
        "only fits the training run's 2 agents; evaluating with those (the 3 episodes count "
        "the same)"]
    assert ", 2 agents\n" in out and "over 3 episodes" in out
    # Asking for the training run's agents needs no notice.
    assert main([str(logdir), "--agents", "2", "--episodes", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().err == ""
