"""Atari through ale-py (the atari extra): the preprocessing of training and evaluation envs,
and configs/atari/pong.toml end to end through train.py, batchrl.evaluate and a video."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ale_py")

import gymnasium as gym  # noqa: E402

from batchrl.config import available_configs, load_config  # noqa: E402
from batchrl.envs.atari import make  # noqa: E402
from batchrl.envs.errors import EnvSpecError  # noqa: E402
from batchrl.envs.factory import choose_backend, make_batch_env  # noqa: E402
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
        assert train.observation_space.shape == (84, 84, 4)  # (frames on the last axis)
        assert train.observation_space.dtype == np.uint8
        assert "ClipReward" in wrappers(train) and "ClipReward" not in wrappers(evaluate)
        assert "PlayOnAfterLifeLoss" in wrappers(train)
        assert "PlayOnAfterLifeLoss" not in wrappers(evaluate)
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


def test_a_training_episode_after_a_lost_life_plays_on_with_the_lives_left():
    """As the papers' wrappers: the reset after a lost life continues the game (its frame
    count goes on); after the last life, or with a seed, a new game starts."""
    env = make("ALE/Breakout-v5", sticky_actions=0.0)
    ale = env.unwrapped.ale
    rng = np.random.default_rng(0)
    try:
        env.reset(seed=0)
        lives = []
        for _ in range(20_000):
            _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
            assert not truncated
            if terminated:
                frame = info["episode_frame_number"]
                observ, info = env.reset()
                assert observ.dtype == np.uint8 and observ.shape == (84, 84, 4)
                lives.append(ale.lives())
                if lives[-1] == 5:  # the game was over: a new one
                    break
                assert info["episode_frame_number"] == frame + 4  # (one no-op step on)
        assert lives == [4, 3, 2, 1, 5]
        for _ in range(2000):  # a seeded reset after a lost life starts a new game
            if env.step(int(rng.integers(4)))[2]:
                break
        assert ale.lives() == 4
        env.reset(seed=1)
        assert ale.lives() == 5
    finally:
        env.close()


def test_every_atari_config_plays_a_game_with_pixels():
    names = [name for name in available_configs() if name.startswith("atari/")]
    assert {"atari/pong", "atari/breakout", "atari/boxing", "atari/freeway"} <= set(names)
    for name in names:
        config = load_config(name)
        assert config.env.id == "batchrl.envs.atari:make"
        assert config.env.eval_kwargs == {"training": False}
        backend = choose_backend(config.env.id, config.env.backend, config.env.kwargs)
        assert (backend, config.env.vector_id) == ("workers", "batchrl.envs.atari:make_vector")
        assert config.algorithm.keys["torso"] == "nature_cnn"
        assert config.algorithm.keys["objective"] == "clip"
        env = make(**config.env.kwargs)
        try:
            assert env.observation_space.shape == (84, 84, 4)
            observ, _ = env.reset(seed=0)
            env.action_space.seed(0)
            frames = [observ] + [env.step(env.action_space.sample())[0] for _ in range(30)]
            assert all(frame.dtype == np.uint8 and frame.shape == (84, 84, 4)
                       for frame in frames), name
            assert len({frame.tobytes() for frame in frames}) > 1, name  # the game moves
        finally:
            env.close()


@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_training_rewards_are_clipped_evaluation_rewards_are_the_raw_scores(backend):
    # Space Invaders scores 5 to 30 points an alien: random play lands some at once.
    from batchrl.envs.atari import make_vector

    rewards = {}
    for training in (True, False):
        seen = set()
        if backend == "workers":
            env = make("ALE/SpaceInvaders-v5", training=training, sticky_actions=0.0)
            env.reset(seed=0)
            env.action_space.seed(0)
            for _ in range(300):
                _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
                seen.add(float(reward))
                if terminated or truncated:
                    env.reset()
        else:
            env = make_vector(1, "ALE/SpaceInvaders-v5", training=training, sticky_actions=0.0)
            env.reset(seed=0)
            actions = np.random.default_rng(0).integers(0, 6, (300, 1))
            for action in actions:  # (next-step autoreset: an ended game starts anew)
                seen.add(float(env.step(action)[1][0]))
        env.close()
        rewards[training] = seen
    assert rewards[True] == {0.0, 1.0}
    assert max(rewards[False]) >= 5.0 and rewards[False] <= {0.0, 5.0, 10.0, 15.0, 20.0,
                                                               25.0, 30.0, 200.0}


def vector_pong(num_envs: int, max_length: int | None = None, **kwargs):
    return make_batch_env("batchrl.envs.atari:make", num_envs, max_length, kwargs,
                          backend="vector", vector_id="batchrl.envs.atari:make_vector")


def test_ale_vector_env_is_a_batch_member_with_the_worker_protocol():
    """ale-py's AtariVectorEnv steps the batch in native threads: the observations of ``make``'s
    envs, seeded resets that repeat, partial resets, and next-step autoreset as the protocol's
    ``autoreset`` (a time limit of 12 steps ends the episodes)."""
    first, second = vector_pong(3, 12), vector_pong(3, 12)
    single = make()
    try:
        assert first.observation_space == single.observation_space
        assert first.action_space == single.action_space
        assert first.workers  # (ale-py's send/recv: the games step while the caller goes on)
        observ = first.reset(seed=5)
        assert observ.shape == (3, 84, 84, 4) and observ.dtype == np.uint8
        np.testing.assert_array_equal(second.reset(seed=5), observ)
        actions = np.array([2, 3, 0])
        for step in range(12):
            if step == 5:  # (refused before anything is sent)
                with pytest.raises(ValueError, match=r"only after its episode ended, and then "
                                                     r"always; envs \[1\] did not end"):
                    second.step(actions, autoreset=np.array([False, True, False]))
            observ, reward, terminated, truncated, infos = first.step(actions)
            np.testing.assert_array_equal(second.step(actions)[0], observ)
            assert reward.dtype == np.float64 and len(infos) == 3
            assert truncated.all() == (step == 11) and not terminated.any()
        assert infos[1]["episode_frame_number"] > 48 and "lives" in infos[1]
        # The ended envs reset instead of stepping; the others, reset first, step. Stepping an
        # ended env would reset it: refused.
        with pytest.raises(ValueError, match=r"envs \[0, 1, 2\] ended their episodes: reset"):
            first.step(actions)
        rows = first.reset([2], seed=[9])
        observ, reward, terminated, truncated, infos = first.step(
            actions, autoreset=np.array([True, True, False]))
        assert reward.tolist() == [0.0, 0.0, 0.0] and not (terminated | truncated).any()
        assert infos[0]["episode_frame_number"] <= 4 * 30 and not np.array_equal(observ[2],
                                                                                 rows[0])
        np.testing.assert_array_equal(second.reset([2], seed=[9]), rows)
    finally:
        for env in (first, second, single):
            env.close()


def test_the_vector_env_finds_every_games_rom():
    """The ROM's name comes from the env's registration (ALE/TicTacToe3D-v5 is
    tic_tac_toe_3d, not what splitting the id at capitals gives)."""
    from batchrl.envs.atari import make_vector

    for game in ("ALE/TicTacToe3D-v5", "ALE/MsPacman-v5"):
        env = make_vector(1, game)
        try:
            observ, _ = env.reset(seed=0)
            assert observ.shape == (1, 84, 84, 4) and observ.dtype == np.uint8
            observ, *_ = env.step(np.zeros(1, dtype=np.int64))
            assert observ.shape == (1, 84, 84, 4)
        finally:
            env.close()


def test_a_vector_backend_needs_a_vector_env(tmp_path):
    with pytest.raises(ValueError, match="env.backend='vector' needs env.vector_id"):
        load_config("atari/pong", ["env.backend=vector", "env.vector_id="])
    with pytest.raises(EnvSpecError,
                       match="single_pong returned OrderEnforcing, not a gymnasium.vector"):
        make_batch_env("batchrl.envs.atari:make", 2, backend="vector",
                       vector_id="tests.test_atari:single_pong")


def single_pong(num_envs, max_episode_steps=None):
    return gym.make("ALE/Pong-v5")


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
    assert process.returncode == 0, process.stderr
    assert "30 frames" in process.stdout, process.stdout
    import imageio.v3 as iio
    frames = iio.imread(video)  # (a GIF writer may merge repeated frames)
    assert frames.shape[1:] == (210, 160, 3) and frames.std() > 5  # the game's colours


def test_evaluation_envs_of_another_action_space_are_refused_before_training(tmp_path, capsys):
    from batchrl.train import main

    code = main(["--config", "atari/pong", "--logdir", str(tmp_path / "r"), "--no-progress",
                 "--steps", "1024", "--set", "env.eval_kwargs.env_id=ALE/Breakout-v5"])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: env.eval_kwargs builds envs whose action space is "
                            "Discrete(4), not the training envs' Discrete(6)"), error
    assert not list((tmp_path / "r").glob("ckpt-*.pt"))


@pytest.mark.parametrize("setting, message", [
    ("env.kwargs.env_id=ALE/Nope-v5", "env_id 'ALE/Nope-v5': Environment `Nope` doesn't exist"),
    ("env.kwargs.sticky_actions=2.0", "sticky_actions must be a probability in [0, 1], got 2.0"),
    ("env.eval_kwargs.training=maybe", "training must be true or false, got 'maybe'"),
    ("env.kwargs.frame_skip=-1", "frame_skip must be an integer >= 1, got -1"),
])
@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_wrong_atari_arguments_are_config_errors(tmp_path, capsys, setting, message, backend):
    from batchrl.train import main

    code = main(["--config", "atari/pong", "--logdir", str(tmp_path / "r"), "--no-progress",
                 "--steps", "1024", "--set", setting, "--set", f"env.backend={backend}"])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {message}") and error.endswith(
        "(the Atari env's argument, from env.kwargs or env.eval_kwargs)"), error


def test_the_banner_names_what_the_vector_backend_builds(tmp_path, capsys):
    """With env.backend = "vector" the envs come from env.vector_id, whatever env.id says."""
    from batchrl.train import main

    code = main(["--config", "cartpole", "--logdir", str(tmp_path / "r"), "--no-progress",
                 "--steps", "64", "--set", "env.backend=vector", "--set", "env.num_agents=2",
                 "--set", "env.vector_id=batchrl.envs.atari:make_vector",
                 "--set", "train.eval_episodes=0", "--set", "train.device=cpu"])
    assert code == 0
    assert capsys.readouterr().out.startswith(
        "Training batchrl.envs.atari:make_vector with 2 agents for 64 steps (env backend vector)")
