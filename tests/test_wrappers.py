"""wrap_env and its parts on real Gymnasium and MuJoCo envs."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import TransformObservation

from batchrl import BatchEnv
from batchrl.envs import convert_to_32bit, range_normalize, wrap_env


def wrapper_chain(env: gym.Env) -> list[str]:
    names = []
    while isinstance(env, gym.Wrapper):
        names.append(type(env).__name__)
        env = env.env
    return names + [type(env).__name__]


def test_pendulum_observations_are_normalized_to_unit_range():
    raw, env = gym.make("Pendulum-v1"), wrap_env(gym.make("Pendulum-v1"))
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    low, high = raw.observation_space.low, raw.observation_space.high  # [-1 -1 -8], [1 1 8]
    obs, _ = env.reset(seed=0)
    raw_obs, _ = raw.reset(seed=0)
    assert obs.dtype == np.float32
    np.testing.assert_allclose(obs, 2 * (raw_obs - low) / (high - low) - 1, rtol=0, atol=1e-6)
    # The angular velocity (bounds +-8) is divided by 8; cos and sin stay as they are.
    np.testing.assert_allclose(obs, raw_obs / np.float32([1, 1, 8]), rtol=0, atol=1e-6)
    rng = np.random.default_rng(0)
    for _ in range(20):
        action = rng.uniform(-1, 1, 1).astype(np.float32)
        obs, reward, terminated, truncated, _ = env.step(action)
        raw_obs, raw_reward, *_ = raw.step(2 * action)  # [-1, 1] -> [-2, 2]
        assert obs.dtype == np.float32 and env.observation_space.contains(obs)
        assert type(reward) is np.float32
        np.testing.assert_allclose(obs, raw_obs / np.float32([1, 1, 8]), rtol=0, atol=1e-6)
        assert reward == pytest.approx(raw_reward, rel=1e-6)
        assert not terminated and not truncated


@pytest.mark.parametrize("action, raw_action", [
    (0.25, 0.5), (-1.0, -2.0), (1.0, 2.0),
    (1.7, 2.0), (5.0, 2.0), (-3.0, -2.0),  # clipped to [-1, 1] before rescaling
])
def test_pendulum_actions_are_rescaled_and_clipped(action, raw_action):
    class LastAction(gym.ActionWrapper):  # (Pendulum would clip a torque past 2 itself)
        def action(self, action):
            self.last = np.array(action)
            return action

    inner = LastAction(gym.make("Pendulum-v1"))
    raw, env = gym.make("Pendulum-v1"), wrap_env(inner)
    assert env.action_space.shape == (1,) and env.action_space.dtype == np.float32
    env.reset(seed=1)
    raw.reset(seed=1)
    obs, reward, *_ = env.step(np.array([action], np.float32))
    np.testing.assert_allclose(inner.last, [raw_action], rtol=0, atol=1e-6)  # what Pendulum got
    raw_obs, raw_reward, *_ = raw.step(np.array([raw_action], np.float32))
    np.testing.assert_allclose(obs, raw_obs / np.float32([1, 1, 8]), rtol=0, atol=1e-6)
    assert reward == pytest.approx(raw_reward, rel=1e-6)
    # The torque mattered: without it the pendulum ends up elsewhere.
    idle = gym.make("Pendulum-v1")
    idle.reset(seed=1)
    assert not np.allclose(obs, idle.step(np.zeros(1, np.float32))[0] / np.float32([1, 1, 8]))


def test_halfcheetah_infinite_observations_are_left_alone():
    raw, env = gym.make("HalfCheetah-v5"), wrap_env(gym.make("HalfCheetah-v5"))
    space = env.observation_space
    assert space.shape == (17,) and space.dtype == np.float32
    assert np.isinf(space.low).all() and np.isinf(space.high).all()
    assert "RescaleObservation" not in wrapper_chain(env)
    obs, _ = env.reset(seed=2)
    raw_obs, _ = raw.reset(seed=2)
    assert raw_obs.dtype == np.float64 and obs.dtype == np.float32
    np.testing.assert_array_equal(obs, raw_obs.astype(np.float32))
    rng = np.random.default_rng(1)
    for _ in range(5):
        action = rng.uniform(-1, 1, 6).astype(np.float32)
        obs, reward, terminated, truncated, _ = env.step(action)
        raw_obs, raw_reward, *_ = raw.step(action)
        np.testing.assert_allclose(obs, raw_obs.astype(np.float32), rtol=1e-5, atol=1e-5)
        assert type(reward) is np.float32
        assert reward == pytest.approx(raw_reward, rel=1e-5, abs=1e-5)


def test_halfcheetah_actions_are_clipped():
    raw, env = gym.make("HalfCheetah-v5"), wrap_env(gym.make("HalfCheetah-v5"))
    env.reset(seed=3)
    raw.reset(seed=3)
    action = np.array([3.0, -3.0, 0.5, -0.25, 1.5, -7.0], np.float32)
    obs, *_ = env.step(action)
    raw_obs, *_ = raw.step(np.clip(action, -1, 1))
    np.testing.assert_allclose(obs, raw_obs.astype(np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(raw.unwrapped.data.ctrl, np.clip(action, -1, 1))
    np.testing.assert_allclose(env.unwrapped.data.ctrl, np.clip(action, -1, 1), atol=1e-6)


@pytest.mark.parametrize("env_id", ["Pendulum-v1", "HalfCheetah-v5"])
def test_time_limit_truncates_after_max_episode_steps(env_id):
    env = wrap_env(gym.make(env_id), max_episode_steps=5)
    for episode in range(2):
        env.reset(seed=episode)
        for step in range(1, 6):
            _, _, terminated, truncated, _ = env.step(np.zeros(env.action_space.shape,
                                                               np.float32))
            assert not terminated
            assert truncated == (step == 5), f"step {step}"


def test_time_limit_on_cartpole_and_no_action_wrappers_for_discrete_actions():
    env = wrap_env(gym.make("CartPole-v1"), max_episode_steps=3)
    assert env.action_space == gym.spaces.Discrete(2)
    assert env.observation_space == gym.make("CartPole-v1").observation_space  # inf bounds
    assert wrapper_chain(env)[:2] == ["TransformReward", "TimeLimit"]
    env.reset(seed=0)
    results = [env.step(step % 2)[2:4] for step in range(3)]
    assert results == [(False, False), (False, False), (False, True)]


def test_wrappers_are_applied_in_batchppo_order():
    assert wrapper_chain(wrap_env(gym.make("Pendulum-v1"), max_episode_steps=9))[:5] == [
        "TransformReward", "ClipAction", "RescaleAction", "RescaleObservation", "TimeLimit"]
    assert wrapper_chain(wrap_env(gym.make("HalfCheetah-v5")))[:4] == [
        "TransformReward", "TransformObservation", "ClipAction", "RescaleAction"]
    limited = wrap_env(gym.make("Pendulum-v1"), max_episode_steps=9)
    assert limited.get_wrapper_attr("_max_episode_steps") == 9


@pytest.mark.parametrize("steps", [0, -3])
def test_non_positive_max_episode_steps_is_rejected(steps):
    with pytest.raises(ValueError, match=f"max_episode_steps must be positive, got {steps}"):
        wrap_env(gym.make("Pendulum-v1"), max_episode_steps=steps)


def test_range_normalize_and_convert_to_32bit_on_their_own():
    env = range_normalize(gym.make("Pendulum-v1"))
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    assert env.action_space == gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    cheetah = range_normalize(gym.make("HalfCheetah-v5"))
    assert np.isinf(cheetah.observation_space.low).all()
    assert cheetah.observation_space.dtype == np.float64
    converted = convert_to_32bit(gym.make("HalfCheetah-v5"))
    assert converted.observation_space.dtype == np.float32
    assert np.isinf(converted.observation_space.high).all()
    obs, _ = converted.reset(seed=0)
    assert obs.dtype == np.float32
    _, reward, *_ = converted.step(np.zeros(6, np.float32))
    assert type(reward) is np.float32


class ConstantPartEnv(gym.Env):
    """Observations in a finite Box whose second dimension's bounds are equal (a constant)."""

    observation_space = gym.spaces.Box(np.array([0.0, 3.0], np.float32),
                                       np.array([4.0, 3.0], np.float32))
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([1.0, 3.0], np.float32), {}

    def step(self, action):
        return np.array([4.0, 3.0], np.float32), 0.0, False, False, {}


def test_range_normalize_maps_a_dimension_with_equal_bounds_to_zero():
    env = wrap_env(ConstantPartEnv())
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    np.testing.assert_array_equal(env.reset(seed=0)[0], [-0.5, 0.0])
    np.testing.assert_array_equal(env.step(0)[0], [1.0, 0.0])


def test_wrap_env_shows_the_algorithms_the_bounded_action_range():
    # ClipAction alone would show an unbounded Box: the algorithms see the range the env acts in.
    assert wrap_env(gym.make("Pendulum-v1")).action_space == gym.spaces.Box(-1.0, 1.0, (1,),
                                                                            np.float32)
    cheetah = wrap_env(gym.make("HalfCheetah-v5")).action_space
    assert np.all(cheetah.low == -1.0) and np.all(cheetah.high == 1.0)


class IntegerBoxEnv(gym.Env):
    """Observations in a finite integer Box of ``dtype`` (not pixels)."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, dtype: type = np.int64):
        self.observation_space = gym.spaces.Box(0, 10, (3,), dtype)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([0, 5, 10], self.observation_space.dtype), {}

    def step(self, action):
        return np.array([4, 10, 1], self.observation_space.dtype), 1.0, False, False, {}


def test_convert_to_32bit_makes_integer_boxes_other_than_uint8_float32():
    env = convert_to_32bit(IntegerBoxEnv())
    assert env.observation_space == gym.spaces.Box(0.0, 10.0, (3,), np.float32)
    observ, _ = env.reset(seed=0)
    assert observ.dtype == np.float32 and observ.tolist() == [0.0, 5.0, 10.0]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint16, np.int64])
def test_wrap_env_rescales_finite_integer_boxes_as_floats(dtype):
    """Any integer Box but uint8 becomes float32 before its range is rescaled to [-1, 1]."""
    env = wrap_env(IntegerBoxEnv(dtype))
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    observ, _ = env.reset(seed=0)
    assert observ.dtype == np.float32
    np.testing.assert_allclose(observ, [-1.0, 0.0, 1.0], atol=1e-6)
    observ, *_ = env.step(0)
    np.testing.assert_allclose(observ, [-0.2, 1.0, -0.8], atol=1e-6)


def pendulum_with_bounds(low, high) -> gym.Env:
    """Pendulum whose observation space has the given bounds (its observations unchanged)."""
    env = gym.make("Pendulum-v1")
    return TransformObservation(env, lambda observ: observ,
                                gym.spaces.Box(np.float32(low), np.float32(high), dtype=np.float32))


@pytest.mark.parametrize("low, high", [
    ([-1, -1, -8], [1, 1, np.inf]),   # finite below, one dimension unbounded above
    ([-1, -1, -np.inf], [1, 1, 8]),   # one dimension unbounded below, finite above
], ids=["unbounded-above", "unbounded-below"])
def test_a_box_with_one_infinite_bound_is_left_alone(low, high):
    """A Box is rescaled only when every low and every high bound is finite."""
    env = wrap_env(pendulum_with_bounds(low, high))
    assert env.observation_space == gym.spaces.Box(np.float32(low), np.float32(high),
                                                   dtype=np.float32)
    raw = gym.make("Pendulum-v1")
    observ, _ = env.reset(seed=0)
    np.testing.assert_array_equal(observ, raw.reset(seed=0)[0])
    observ, *_ = env.step(np.array([0.5], np.float32))
    np.testing.assert_allclose(observ, raw.step(np.array([1.0], np.float32))[0], atol=1e-6)


def test_a_time_limit_of_one_step_truncates_the_first_step():
    """``max_episode_steps=1`` is a valid limit: every episode is one step long."""
    env = wrap_env(gym.make("Pendulum-v1"), max_episode_steps=1)
    for seed in range(2):
        env.reset(seed=seed)
        _, _, terminated, truncated, _ = env.step(np.zeros(1, np.float32))
        assert truncated and not terminated


@pytest.mark.parametrize("make", [lambda: gym.make("HalfCheetah-v5"),
                                  lambda: IntegerBoxEnv(np.int64)],
                         ids=["float64-unbounded", "int64-bounded"])
def test_wrap_env_converts_observations_to_float32_without_warnings(make):
    """Building the float32 observation space warns about no lost bound precision."""
    env = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = wrap_env(env)
    assert wrapped.observation_space.dtype == np.float32


class IntegerActionEnv(gym.Env):
    """Actions in a finite int64 Box (a count per dimension), remembered as the env got them."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Box(0, 10, (2,), np.int64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.last = np.array(action)
        return np.zeros(2, np.float32), 0.0, False, False, {}


def test_real_actions_for_an_integer_box_reach_the_envs_as_the_nearest_integers_in_range():
    """A Gaussian policy's actions for an integer Box: rounded (a cast would truncate 2.6 to
    2), within its bounds (-3.2 to 0, 10.4 to 10), in its dtype."""
    envs = [IntegerActionEnv(), IntegerActionEnv()]
    batch = BatchEnv(envs, blocking=True)
    batch.reset(seed=0)
    batch.step(np.array([[2.6, -0.6], [10.4, -3.2]], np.float32))
    assert [env.last.tolist() for env in envs] == [[3, 0], [10, 0]]
    assert all(env.last.dtype == np.int64 for env in envs)
    batch.step(np.array([[7, 1], [0, 10]], np.int64))  # (integers pass as they are)
    assert [env.last.tolist() for env in envs] == [[7, 1], [0, 10]]


def test_integer_action_boxes_reach_the_env_as_finite_actions_in_range():
    """An integer action Box is left as it is (rescaled as integers, its scale would round to
    0 and the env would get infinite actions): the env gets actions in its range."""
    env = wrap_env(IntegerActionEnv())
    env.reset(seed=0)
    low, high = env.action_space.low, env.action_space.high
    assert env.action_space == gym.spaces.Box(0, 10, (2,), np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.step(((low + high) / 2).astype(env.action_space.dtype))
    got = env.unwrapped.last
    assert np.isfinite(got).all() and np.all((got >= 0) & (got <= 10)), got
