"""Atari through ale-py (the atari extra): the preprocessing of training and evaluation envs,
and configs/atari/pong.toml end to end through train.py, batchrl.evaluate and a video."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ale_py")

from batchrl.config import available_configs, load_config  # noqa: E402
from batchrl.envs.atari import make  # noqa: E402
from helpers import finish, start_train_py  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def wrappers(env) -> list[str]:
    names = []
    while hasattr(env, "env"):
        names.append(type(env).__name__)
        env = env.env
    return names


def test_training_envs_clip_rewards_and_end_with_a_life_evaluation_envs_do_not():
    train, evaluate = make("ALE/Breakout-v5"), make("ALE/Breakout-v5", training=False)
    try:
        assert train.observation_space.shape == (4, 84, 84)
        assert train.observation_space.dtype == np.uint8
        assert "ClipReward" in wrappers(train) and "ClipReward" not in wrappers(evaluate)
        assert train.get_wrapper_attr("terminal_on_life_loss") is True
        assert evaluate.get_wrapper_attr("terminal_on_life_loss") is False
        # Random play: the training episode ends with the first lost life, the evaluation
        # episode goes on after it.
        observ, info = train.reset(seed=0)
        assert observ.dtype == np.uint8 and info["lives"] == 5
        for _ in range(2000):
            observ, _, terminated, truncated, info = train.step(train.action_space.sample())
            if terminated or truncated:
                break
        assert terminated and info["lives"] == 4
        evaluate.reset(seed=0)
        for _ in range(2000):
            _, _, terminated, truncated, info = evaluate.step(evaluate.action_space.sample())
            assert not terminated or info["lives"] == 0
            if info["lives"] < 5:
                break
        assert info["lives"] == 4 and not terminated
    finally:
        train.close()
        evaluate.close()


def test_every_atari_config_plays_a_game_with_pixels():
    names = [name for name in available_configs() if name.startswith("atari/")]
    assert {"atari/pong", "atari/breakout", "atari/boxing", "atari/freeway"} <= set(names)
    for name in names:
        config = load_config(name)
        assert config.env.id == "batchrl.envs.atari:make"
        assert config.env.eval_kwargs == {"training": False}
        assert config.algorithm.keys["torso"] == "nature_cnn"
        assert config.algorithm.keys["objective"] == "clip"
        env = make(**config.env.kwargs)
        try:
            assert env.observation_space.shape == (4, 84, 84)
        finally:
            env.close()


@pytest.mark.slow
def test_pong_trains_evaluates_and_films(tmp_path):
    """configs/atari/pong.toml for two short phases (an update and a whole-game evaluation on
    envs of its own each), then evaluated and filmed in colour. (Resuming a pixel run exactly:
    tests/test_pixels.py.)"""
    logdir = tmp_path / "pong"
    code, out, err = finish(start_train_py(
        "--config", "atari/pong", "--logdir", str(logdir), "--steps", "2048",
        "--set", "env.num_agents=4", "--set", "train.eval_every=2",
        "--set", "train.eval_episodes=1", "--set", "algorithm.update_threads=1"), timeout=200)
    assert code == 0, err
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["phase"]) for r in records] == [
        (1024, "train"), (1024, "eval"), (2048, "train"), (2048, "eval")]
    for record in records:
        if record["phase"] == "eval":  # a whole game to 21: raw scores
            assert -21 <= record["score"] <= 21 and record["length"] > 700
    video = tmp_path / "pong.gif"
    process = subprocess.run([sys.executable, "-m", "batchrl.evaluate", str(logdir),
                              "--video", str(video), "--max-frames", "30"],
                             capture_output=True, text=True, timeout=200)
    if "imageio" in process.stderr and process.returncode == 2:
        pytest.skip(process.stderr.strip())
    assert process.returncode == 0, process.stderr
    assert "30 frames" in process.stdout, process.stdout
    import imageio.v3 as iio
    frames = iio.imread(video)  # (a GIF writer may merge repeated frames)
    assert frames.shape[1:] == (210, 160, 3) and frames.std() > 5  # the game's colours
