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
import torch  # noqa: E402

from batchrl.config import available_configs, load_config  # noqa: E402
from batchrl.envs.atari import make, make_vector  # noqa: E402
from batchrl.envs.errors import EnvSpecError  # noqa: E402
from batchrl.envs.factory import choose_backend, make_batch_env  # noqa: E402
from helpers import Minimal, finish, start_train_py  # noqa: E402

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


def breakout_lives(until_lives: int, max_length: int | None = None) -> tuple[int, list[tuple]]:
    """Random actions (from seed 0) in a one-env batch of ``make_vector``'s Breakout, each step
    after an ended episode with ``autoreset``, until a step that started an episode shows
    ``until_lives`` lives: the steps taken, and ``("ended", episode frame)`` of every step that
    ended an episode and ``(lives, episode frame, reward, terminated, truncated)`` of every
    step that started one."""
    env = vector_pong(1, max_length, env_id="ALE/Breakout-v5", sticky_actions=0.0)
    rng = np.random.default_rng(0)
    try:
        env.reset(seed=0)
        events, ended = [], False
        for step in range(20_000):
            _, reward, terminated, truncated, infos = env.step(
                rng.integers(0, 4, 1), autoreset=np.array([ended]))
            info = infos[0]
            if ended:
                events.append((info["lives"], info["episode_frame_number"], float(reward[0]),
                               bool(terminated[0]), bool(truncated[0])))
                if info["lives"] == until_lives:
                    return step + 1, events
            ended = bool(terminated[0] or truncated[0])
            if ended:
                events.append(("ended", info["episode_frame_number"]))
    finally:
        env.close()
    raise AssertionError(f"lives never reached {until_lives}")


def test_a_vector_training_episode_after_a_lost_life_plays_on_with_the_lives_left():
    """ale-py's vector env as the papers' wrappers and make's envs: the episode after a lost
    life continues the game (one no-op step on, no reward, neither flag); after the last life
    a new game starts. A no-op step that reaches the time limit starts a new game at once."""
    _, events = breakout_lives(until_lives=5)
    ends, begins = events[0::2], events[1::2]
    assert [lives for lives, *_ in begins] == [4, 3, 2, 1, 5]
    assert all(begin[2:] == (0.0, False, False) for begin in begins)
    assert [begin[1] for begin in begins[:-1]] == [frame + 4 for _, frame in ends[:-1]]
    assert begins[-1][1] <= 4 * 30  # (a new game: its no-op starts only)
    # The same game with a time limit one step after its first lost life: the step that
    # would play on reaches it, and a new game starts instead.
    steps, _ = breakout_lives(until_lives=4)
    _, events = breakout_lives(until_lives=5, max_length=steps)
    assert events[1][0] == 5 and events[1][1] <= 4 * 30 and events[1][2:] == (0.0, False, False)


def test_the_vector_env_finds_every_games_rom():
    """The ROM's name comes from the env's registration (ALE/TicTacToe3D-v5 is
    tic_tac_toe_3d, not what splitting the id at capitals gives)."""
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
    # (the factory's name alone would not say which game)
    assert out.startswith("Training BatchPPO on batchrl.envs.atari:make(env_id='ALE/Pong-v5', "
                          "sticky_actions=0.0) with 4 agents"), out
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
    assert process.stdout.startswith("batchrl.envs.atari:make(env_id='ALE/Pong-v5', "
                                     "sticky_actions=0.0, training=False), "), process.stdout
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
        "Training BatchPPO on batchrl.envs.atari:make_vector with 2 agents for 64 steps "
        "(env backend vector)")


# --- every argument of make and make_vector, and what it promises ---------------------------

def play(env, actions, seed, vector=False):
    """Observations and infos of ``actions`` played from ``env.reset(seed=seed)`` (a
    ``make_vector`` env of one game with ``vector``; an ended episode is reset unseeded, as
    training does: a training env plays on after a lost life)."""
    observ, info = env.reset(seed=seed)
    frames, infos = [observ], [info]
    for action in actions:
        observ, _, terminated, truncated, info = env.step(
            np.array([action]) if vector else int(action))
        frames.append(observ)
        infos.append(info)
        if not vector and (terminated or truncated):  # (a vector env resets itself)
            observ, info = env.reset()
            frames.append(observ)
    return np.stack(frames), infos


def test_the_stack_holds_the_preprocessed_screens_oldest_first_on_the_last_axis():
    """With frame_skip=1 the newest frame is the screen resized as AtariPreprocessing does
    (cv2 INTER_AREA), and each step shifts the stack by one frame."""
    import cv2

    env = make("ALE/Breakout-v5", training=False, sticky_actions=0.0, noop_max=0, frame_skip=1)
    ale = env.unwrapped.ale
    try:
        previous, _ = env.reset(seed=0)
        for action in np.random.default_rng(0).integers(0, 4, 40):
            observ = env.step(int(action))[0]
            screen = cv2.resize(ale.getScreenGrayscale(), (84, 84), interpolation=cv2.INTER_AREA)
            np.testing.assert_array_equal(observ[..., -1], screen)
            np.testing.assert_array_equal(observ[..., :-1], previous[..., 1:])
            previous = observ
    finally:
        env.close()


def test_the_vector_backends_steps_return_channels_last_stacks_too():
    """The steps through ale-py's send/recv (VectorWorker's path), not only the resets."""
    env = vector_pong(2)
    try:
        previous = env.reset(seed=0)
        for _ in range(8):
            observ = env.step(np.array([2, 3]))[0]
            assert observ.shape == (2, 84, 84, 4) and observ.dtype == np.uint8
            np.testing.assert_array_equal(observ[..., :-1], previous[..., 1:])
            previous = observ
        assert not np.array_equal(observ[..., 0], observ[..., -1])  # (the game moved)
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_the_preprocessing_arguments_shape_the_observations_and_actions(backend):
    kwargs = dict(env_id="ALE/Breakout-v5", screen_size=64, frame_stack=2, frame_skip=3,
                  noop_max=0, sticky_actions=0.0, full_action_space=True)
    vector = backend == "vector"
    env = make_vector(1, **kwargs) if vector else make(**kwargs)
    try:
        space = env.single_observation_space if vector else env.observation_space
        assert space.shape == (64, 64, 2)
        assert (env.single_action_space if vector else env.action_space).n == 18
        frames, infos = play(env, [0, 1, 2], seed=0, vector=vector)
        assert frames.shape[-3:] == (64, 64, 2)
        numbers = [np.ravel(info["episode_frame_number"])[0] for info in infos]
        assert numbers == [0, 3, 6, 9]  # (no no-op start, 3 frames a step)
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_sticky_actions_and_no_op_starts_follow_their_arguments(backend):
    """Without sticky actions and no-op starts a game is the same from every seed; either of
    them makes the seed matter."""
    vector = backend == "vector"
    actions = np.random.default_rng(0).integers(0, 6, 60)

    def same_from_seeds_0_and_1(**kwargs):  # (Pong's ball moves during the no-ops)
        env = (make_vector(1, "ALE/Pong-v5", training=False, **kwargs) if vector
               else make("ALE/Pong-v5", training=False, **kwargs))
        try:
            return np.array_equal(play(env, actions, 0, vector)[0],
                                  play(env, actions, 1, vector)[0])
        finally:
            env.close()

    assert same_from_seeds_0_and_1(sticky_actions=0.0, noop_max=0)
    assert not same_from_seeds_0_and_1(sticky_actions=0.25, noop_max=0)
    assert not same_from_seeds_0_and_1(sticky_actions=0.0, noop_max=30)
    assert not same_from_seeds_0_and_1(noop_max=0)  # (v5's 0.25 by default)


def test_the_defaults_are_v5_sticky_actions_and_up_to_30_no_ops():
    env = make("ALE/Breakout-v5")
    try:
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
        starts = {env.reset(seed=seed)[1]["episode_frame_number"] for seed in range(8)}
        assert len(starts) > 2 and all(1 <= start <= 30 for start in starts)
    finally:
        env.close()


@pytest.mark.parametrize("training", [True, False])
def test_seeded_resets_repeat_the_game(training):
    """Sticky actions and no-op starts drawn from the reset's seed, through every wrapper
    (PlayOnAfterLifeLoss too): the same seed and actions give the same frames."""
    actions = np.random.default_rng(1).integers(0, 4, 50)
    first, second = make("ALE/Breakout-v5", training=training), make("ALE/Breakout-v5",
                                                                     training=training)
    try:
        frames = play(first, actions, seed=3)[0]
        np.testing.assert_array_equal(play(second, actions, seed=3)[0], frames)
        np.testing.assert_array_equal(play(first, actions, seed=3)[0], frames)
        assert not np.array_equal(play(first, actions, seed=4)[0], frames)
    finally:
        first.close()
        second.close()


def test_training_envs_without_life_episodes_or_clipping_when_asked():
    env = make("ALE/Breakout-v5", terminal_on_life_loss=False)
    rng = np.random.default_rng(0)
    try:
        assert "PlayOnAfterLifeLoss" not in wrappers(env)
        env.reset(seed=0)
        for _ in range(2000):
            _, _, terminated, _, info = env.step(int(rng.integers(4)))
            if info["lives"] < 5:
                break
        assert info["lives"] == 4 and not terminated
    finally:
        env.close()
    env = make("ALE/SpaceInvaders-v5", clip_rewards=False, sticky_actions=0.0)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        rewards = {env.step(env.action_space.sample())[1] for _ in range(300)}
        assert max(rewards) >= 5.0
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_rewards_are_clipped_per_step_and_below_too(backend):
    """Skiing pays about -6 a step of 4 frames: a training step gets -1 (not 0, not the
    sum of clipped frames), an evaluation step the raw score."""
    for training in (True, False):
        if backend == "vector":
            env = make_vector(1, "ALE/Skiing-v5", training=training, sticky_actions=0.0)
            env.reset(seed=0)
            rewards = {float(env.step(np.array([a]))[1][0]) for a in [0, 1, 2] * 10}
        else:
            env = make("ALE/Skiing-v5", training=training, sticky_actions=0.0)
            env.reset(seed=0)
            rewards = {float(env.step(a)[1]) for a in [0, 1, 2] * 10}
        env.close()
        if training:
            assert rewards == {-1.0}
        else:
            assert max(rewards) <= -2.0


def breakout_until_a_life_is_lost(env):
    """Random actions in ``make_vector``'s one Breakout env (from seed 0) until its first life
    is lost or its episode ends: ``(terminated, info)`` of that step."""
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    for _ in range(2000):
        _, _, terminated, _, info = env.step(rng.integers(0, 4, 1))
        if info["lives"][0] < 5 or terminated[0]:
            return terminated, info
    raise AssertionError("no life lost in 2000 steps")


def test_vector_training_episodes_end_with_a_life_evaluation_episodes_do_not():
    for training in (True, False):
        env = make_vector(1, "ALE/Breakout-v5", training=training, sticky_actions=0.0)
        try:
            terminated, info = breakout_until_a_life_is_lost(env)
            assert info["lives"][0] == 4 and bool(terminated[0]) == training
        finally:
            env.close()


def test_no_fire_is_pressed_after_a_reset_or_a_lost_life():
    """Breakout serves only on FIRE: no-ops alone never lose a life, after a new game's reset
    or after a lost life, on both backends (the reset that plays on starts a fresh frame
    stack; the vector env's play-on step ignores the action sent with it)."""
    env = make("ALE/Breakout-v5", sticky_actions=0.0, noop_max=0)
    try:
        env.reset(seed=0)
        assert not any(env.step(0)[2] for _ in range(150))
        env.step(1)  # FIRE: served; the no-ops then lose the ball
        assert any(env.step(0)[2] for _ in range(150)) and env.unwrapped.ale.lives() == 4
        observ, _ = env.reset()  # (plays on)
        assert env.unwrapped.ale.lives() == 4
        assert all(np.array_equal(observ[..., i], observ[..., -1]) for i in range(3))
        assert not any(env.step(0)[2] for _ in range(150))
        assert env.unwrapped.ale.lives() == 4
    finally:
        env.close()
    env = make_vector(1, "ALE/Breakout-v5", sticky_actions=0.0, noop_max=0)
    try:
        env.reset(seed=0)
        for _ in range(150):
            _, _, terminated, truncated, info = env.step(np.zeros(1, np.int64))
            assert not (terminated[0] or truncated[0])
        assert info["lives"][0] == 5
        env.step(np.ones(1, np.int64))  # FIRE: served; the no-ops then lose the ball
        for _ in range(300):
            _, _, terminated, _, info = env.step(np.zeros(1, np.int64))
            if terminated[0]:
                break
        assert terminated[0] and info["lives"][0] == 4
        # The step that plays on after the lost life takes no action of the policy's: a FIRE
        # sent with it serves no ball.
        env.step(np.ones(1, np.int64))
        for _ in range(150):
            _, _, terminated, truncated, info = env.step(np.zeros(1, np.int64))
            assert not (terminated[0] or truncated[0])
        assert info["lives"][0] == 4
    finally:
        env.close()


def test_videos_film_the_colour_screen_at_the_games_pace():
    env = make("ALE/Pong-v5", render_mode="rgb_array")
    try:
        env.reset(seed=0)
        env.step(0)
        frame = env.render()
        assert frame.shape == (210, 160, 3)
        np.testing.assert_array_equal(frame, env.unwrapped.ale.getScreenRGB())
        assert env.metadata["render_fps"] == 15  # (60 Hz, a frame a step of 4)
    finally:
        env.close()
    env = make("ALE/Pong-v5", frame_skip=2)
    assert env.metadata["render_fps"] == 30
    env.close()


@pytest.mark.parametrize("kwargs", [dict(sticky_actions=1.0), dict(sticky_actions=0),
                                    dict(noop_max=0), dict(frame_skip=1, frame_stack=1)])
def test_every_valid_atari_argument_is_accepted(kwargs):
    make("ALE/Pong-v5", **kwargs).close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(env_id=5), "env_id must be an Atari game's id such as 'ALE/Pong-v5', got 5"),
    (dict(sticky_actions=True), "sticky_actions must be a probability in [0, 1], got True"),
    (dict(frame_stack=True), "frame_stack must be an integer >= 1, got True"),
    (dict(noop_max=-1), "noop_max must be an integer >= 0, got -1"),
    (dict(screen_size=0), "screen_size must be an integer >= 1, got 0"),
])
@pytest.mark.parametrize("backend", ["workers", "vector"])
def test_wrong_atari_arguments_are_refused_by_both_makers(kwargs, message, backend):
    with pytest.raises(EnvSpecError) as info:
        make_vector(1, **kwargs) if backend == "vector" else make(**kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_vector_training_envs_without_life_episodes_or_clipping_when_asked():
    """make_vector passes terminal_on_life_loss and clip_rewards on for training envs too."""
    env = make_vector(1, "ALE/Breakout-v5", terminal_on_life_loss=False, sticky_actions=0.0)
    try:
        terminated, info = breakout_until_a_life_is_lost(env)
        assert info["lives"][0] == 4 and not terminated[0]
    finally:
        env.close()
    env = make_vector(1, "ALE/SpaceInvaders-v5", clip_rewards=False, sticky_actions=0.0)
    try:
        env.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 6, (300, 1))
        rewards = {float(env.step(action)[1][0]) for action in actions}
        assert max(rewards) >= 5.0
    finally:
        env.close()


class Scripted(Minimal):
    """Plays ``actions`` from each episode's start, whatever it sees."""

    def __init__(self, actions):
        super().__init__()
        self.actions, self.step = actions, 0

    def begin_episodes(self, agent_indices):
        self.step = 0
        return {}

    def perform(self, agent_indices, observ):
        self.step += 1
        return torch.full((len(agent_indices),), int(self.actions[self.step - 1])), {}


def test_a_video_films_a_whole_evaluation_game_in_colour_at_the_games_pace(tmp_path):
    """batchrl.evaluate --video (record_video) films an Atari run's evaluation env
    (env.eval_kwargs: whole games, raw scores), not a training one (its episode ends with the
    first life, its score clipped); the frames are the console's colour screens, not the
    network's 84x84 stacks, and the GIF lasts as long as the game, at 15 steps a second."""
    from PIL import Image

    from batchrl.video import record_video

    actions = np.random.default_rng(0).integers(0, 6, 400)
    config = load_config("atari/pong", ['env.kwargs.env_id="ALE/SpaceInvaders-v5"',
                                        "env.max_length=350"])
    path = tmp_path / "invaders.gif"
    recording = record_video(config, Scripted(actions).eval(), torch.device("cpu"), path,
                             seed=7, failures={})

    def played(training):  # (score, length, first screen) of the game the script plays
        env = make("ALE/SpaceInvaders-v5", training=training, sticky_actions=0.0,
                   render_mode="rgb_array")
        try:
            env.reset(seed=7)
            first, score = env.render(), 0.0
            for length, action in enumerate(actions[:350], 1):
                _, reward, terminated, truncated, _ = env.step(int(action))
                score += float(reward)
                if terminated or truncated:
                    break
            return score, length, first
        finally:
            env.close()

    score, length, first = played(training=False)
    assert played(training=True)[:2] != (score, length)  # (what a training env films)
    assert score > 20 and score % 5 == 0 and length < 350  # (game over: a whole game)
    assert recording.scores == [score] and recording.lengths == [length]
    assert recording.frames == length + 1  # (the reset's frame and each step's)
    with Image.open(path) as image:
        assert image.size == (160, 210)
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), first)
        durations = []
        for index in range(image.n_frames):  # (a GIF writer merges repeated frames)
            image.seek(index)
            durations.append(image.info["duration"])
    assert abs(sum(durations) - 1000 * recording.frames / 15) <= 10


def test_a_reset_whose_no_op_step_ends_the_game_starts_a_new_one():
    """When the no-op step that plays on after a lost life ends the game itself (here: it
    reaches the emulator's frame limit), the reset starts a new game instead of returning
    the ended one's screen."""

    def lose_a_life(env):  # the frame number at which Breakout's first ball is lost
        env.reset(seed=0)
        env.step(1)  # FIRE serves; the no-ops then lose the ball
        for _ in range(150):
            _, _, terminated, truncated, info = env.step(0)
            if terminated or truncated:
                return terminated, truncated, info
        raise AssertionError("no life lost")

    env = make("ALE/Breakout-v5", sticky_actions=0.0, noop_max=0)
    try:
        terminated, _, info = lose_a_life(env)
        frame = info["episode_frame_number"]
        assert terminated and info["lives"] == 4
    finally:
        env.close()
    env = make("ALE/Breakout-v5", sticky_actions=0.0, noop_max=0,
               max_num_frames_per_episode=frame + 4)  # (the no-op step reaches it)
    try:
        terminated, truncated, info = lose_a_life(env)
        assert terminated and not truncated and info["lives"] == 4
        _, info = env.reset()
        assert info["lives"] == 5 and info["episode_frame_number"] == 0
        assert not any(env.step(0)[3] for _ in range(3))  # (a whole new game)
    finally:
        env.close()
