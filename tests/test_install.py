"""An installed batchrl (a wheel, not an editable checkout) is a working tool:
``batchrl-train`` and ``batchrl-evaluate`` with the task configs, from any directory."""

from __future__ import annotations

import configparser
import email.parser
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import batchrl
from helpers import REPO


def listed_packages() -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config["options"]["packages"].split()


def test_setup_cfg_lists_every_package_directory():
    found = sorted(".".join(path.parent.relative_to(REPO).parts)
                   for path in (REPO / "batchrl").rglob("__init__.py"))
    assert sorted(set(listed_packages()) - {"batchrl.configs"}) == found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(REPO)], check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("batchrl-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_holds_the_package_its_configs_and_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {
        "batchrl", f"batchrl-{batchrl.__version__}.dist-info"}
    configs = sorted(path.relative_to(REPO).as_posix() for path in
                     (REPO / "configs").rglob("*.toml"))
    assert sorted(name for name in names if name.endswith(".toml")) == [
        f"batchrl/{config}" for config in configs]
    assert not [name for name in names if name.endswith((".png", ".gif", ".mp4"))]
    (metadata_name,) = [name for name in names if name.endswith("dist-info/METADATA")]
    metadata = email.parser.Parser().parsestr(
        zipfile.ZipFile(wheel).read(metadata_name).decode())
    assert set(metadata.get_all("Provides-Extra")) == {"ray", "video", "test", "bench", "atari",
                                                          "native"}
    assert metadata["Requires-Python"] == ">=3.10"
    requires = metadata.get_all("Requires-Dist")
    assert "torch>=2.4" in requires and "mujoco<3.16,>=3.1" in requires
    # The video extra films every config's env: classic control needs pygame.
    assert 'gymnasium[classic-control]>=1.0; extra == "video"' in requires
    assert metadata.get_payload().startswith("# batchrl")  # the README
    (entry_points,) = [name for name in names if name.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "batchrl-train = batchrl.train:cli" in text
    assert "batchrl-evaluate = batchrl.evaluate:cli" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_installed_commands_train_and_evaluate_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # torch first, as the Makefile does: the pinned CPU build, not the newest CUDA one.
    subprocess.run(pip + ["torch==2.13.0"], check=True, capture_output=True, timeout=600)
    subprocess.run(pip + [str(wheel)], check=True, capture_output=True, timeout=600)
    work = tmp_path / "elsewhere"
    work.mkdir()
    environ = {key: value for key, value in os.environ.items()
               if key not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / command[0]), *command[1:]], cwd=work,
                              env=environ, capture_output=True, text=True, timeout=300)

    where = run("python", "-c", "import batchrl; print(batchrl.__file__)")
    assert where.stdout.startswith(str(venv)), where  # the installed copy, not the checkout
    listed = run("batchrl-train", "--help")
    assert listed.returncode == 0 and "halfcheetah" in listed.stdout
    assert "paper/halfcheetah" in listed.stdout
    trained = run("batchrl-train", "--config", "cartpole", "--steps", "3000", "--logdir", "run",
                  "--no-progress", "--set", "train.eval_episodes=3")
    assert trained.returncode == 0, trained.stderr
    assert "Final evaluation:" in trained.stdout
    assert json.loads((work / "run" / "config.json").read_text())["env"]["id"] == "CartPole-v1"
    evaluated = run("batchrl-evaluate", "run", "--episodes", "2")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "return over 2 episodes" in evaluated.stdout
    # A user's own file still works, and the module form is the same command.
    (work / "mine.toml").write_text('[env]\nid = "CartPole-v1"\nnum_agents = 2\n'
                                    'backend = "inline"\n[train]\nsteps = 200\n'
                                    'eval_episodes = 1\n')
    module = run("python", "-m", "batchrl.train", "--config", "mine.toml", "--logdir", "mine",
                 "--no-progress")
    assert module.returncode == 0, module.stderr
    unknown = run("batchrl-train", "--config", "nosuch")
    assert unknown.returncode == 2
    assert "available: ant, atari/boxing, atari/breakout" in unknown.stderr
