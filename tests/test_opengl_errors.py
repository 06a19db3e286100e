"""A MuJoCo OpenGL backend (MUJOCO_GL) that cannot work here: training and evaluation
stop with one line that says what failed and what to install or set (exit code 2)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchrl.config import load_config
from batchrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
HAS_OSMESA = ctypes.util.find_library("OSMesa") is not None
NO_OSMESA = pytest.mark.skipif(HAS_OSMESA, reason="libOSMesa is installed here")

# MUJOCO_GL value, other environment changes (None: unset), and what the line must say.
CASES = {
    "osmesa": pytest.param("osmesa", {}, "MUJOCO_GL=osmesa does not work here (libOSMesa is "
                           "not installed): install OSMesa "
                           "(Debian/Ubuntu: apt-get install libosmesa6", marks=NO_OSMESA),
    "unknown": pytest.param("bogus", {}, "MUJOCO_GL=bogus is not an OpenGL backend MuJoCo "
                            "knows: set MUJOCO_GL to egl, osmesa or glfw, or unset it"),
    # libglvnd finds no EGL driver: EGL loads, but no display can be made.
    "egl": pytest.param("egl", {"__EGL_VENDOR_LIBRARY_FILENAMES": "/nonexistent.json"},
                        "MUJOCO_GL=egl does not work here ("),
    "glfw": pytest.param("glfw", {"DISPLAY": None, "WAYLAND_DISPLAY": None},
                         "MUJOCO_GL=glfw does not work here (no display: DISPLAY is not set)"),
}


def run(args: list[str], mujoco_gl: str, changes: dict[str, str | None],
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, MUJOCO_GL=mujoco_gl)
    # Set in this process once MuJoCo's EGL backend was imported (by other tests); with it,
    # import mujoco skips a failing OSMesa instead of failing as in a user's shell.
    env.pop("PYOPENGL_PLATFORM", None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def assert_one_line(process: subprocess.CompletedProcess, expected: str) -> None:
    lines = process.stderr.strip().splitlines()
    assert process.returncode == 2, process.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), process.stderr
    assert expected in lines[0], lines[0]


@pytest.fixture(scope="module")
def cheetah_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("cheetah")
    Trainer(load_config("halfcheetah", [
        "env.backend=inline", "env.num_agents=1", "env.max_length=10", "train.steps=10",
        "train.eval_episodes=1", "algorithm.update_every=1", "algorithm.update_epochs=1",
        "algorithm.policy_layers=[8]", "algorithm.value_layers=[8]", "algorithm.inference=\"eager\""]),
        logdir, progress=False).run()
    return logdir


@pytest.mark.parametrize("mujoco_gl, changes, expected",
                         [CASES["osmesa"], CASES["unknown"]])
def test_training_with_a_backend_that_cannot_load(mujoco_gl, changes, expected, tmp_path):
    # Worker processes import MuJoCo, which loads MUJOCO_GL's backend at once.
    logdir = tmp_path / "run"
    process = run(["train.py", "--config", "halfcheetah", "--steps", "20", "--logdir",
                   str(logdir), "--no-progress", "--set", "env.num_agents=2"],
                  mujoco_gl, changes)
    assert_one_line(process, "error: cannot build HalfCheetah-v5: " + expected)
    assert not logdir.exists()


@pytest.mark.parametrize("mujoco_gl, changes, expected", list(CASES.values()))
def test_video_with_a_backend_that_does_not_work(cheetah_run, tmp_path, mujoco_gl, changes,
                                                 expected):
    video = tmp_path / "cheetah.mp4"
    process = run(["-m", "batchrl.evaluate", str(cheetah_run), "--video", str(video),
                   "--max-frames", "2", "--device", "cpu"], mujoco_gl, changes)
    assert_one_line(process, expected)
    assert not video.exists()


@pytest.mark.parametrize("mujoco_gl, changes, expected",
                         [CASES["osmesa"], CASES["unknown"]])
def test_evaluation_without_video_names_the_backend(cheetah_run, mujoco_gl, changes,
                                                    expected):
    process = run(["-m", "batchrl.evaluate", str(cheetah_run), "--episodes", "1",
                   "--device", "cpu"], mujoco_gl, changes)
    assert_one_line(process, "error: cannot build HalfCheetah-v5: " + expected)
