"""BatchEnv over real ExternalProcess workers, compared with the same envs stepped
one after the other in this process."""

from __future__ import annotations

import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.wrappers import RescaleAction, TransformObservation

from batchrl.envs import BatchEnv, EnvWorker, ExternalProcess, wrap_env
from batchrl.envs.errors import EnvError, SpaceMismatchError, UnsupportedSpaceError
from helpers import Sequential, assert_same_log

# Ship this module's env classes and constructors to the workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUM_ENVS = 3
NUM_STEPS = 40
SEED = 123
# Short time limits so that episodes end (and get reset) within NUM_STEPS.
TIME_LIMIT = {"CartPole-v1": 15, "Pendulum-v1": 12, "HalfCheetah-v5": 9}


def make_env(env_id: str, wrapped: bool) -> gym.Env:
    if wrapped:
        return wrap_env(gym.make(env_id), max_episode_steps=TIME_LIMIT[env_id])
    if env_id == "CartPole-v1":
        return gym.make(env_id)  # ends by termination
    return gym.make(env_id, max_episode_steps=TIME_LIMIT[env_id])


def sample_actions(space: gym.Space, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(space, gym.spaces.Discrete):
        return rng.integers(space.start, space.start + space.n, size=n)
    # Infinite bounds are those of ClipAction's space: go past [-1, 1] to clip.
    low = np.where(np.isfinite(space.low), space.low, -1.5)
    high = np.where(np.isfinite(space.high), space.high, 1.5)
    return rng.uniform(low, high, size=(n, *space.shape)).astype(space.dtype)


def rollout(env, n: int, num_steps: int = NUM_STEPS) -> list[tuple]:
    """Reset with SEED, step with seeded random actions, reset the finished envs
    (and, every 5 steps, one more env mid-episode); log every result."""
    rng = np.random.default_rng(0)
    log = [("reset", list(range(n)), env.reset(list(range(n)), seed=SEED))]
    for t in range(num_steps):
        actions = sample_actions(env.action_space, n, rng)
        obs, rewards, terminated, truncated, infos = env.step(actions)
        assert len(infos) == n and all(isinstance(info, dict) for info in infos)
        log.append(("step", obs, rewards, terminated, truncated, list(infos)))
        finished = terminated | truncated
        if t % 5 == 2:
            finished[(t // 5) % n] = True
        indices = np.flatnonzero(finished).tolist()
        if indices:
            log.append(("reset", indices, env.reset(indices)))
    return log


@pytest.mark.parametrize("wrapped", [False, True], ids=["raw", "wrapped"])
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "HalfCheetah-v5"])
def test_external_batch_matches_sequential_in_process(env_id, wrapped):
    reference = Sequential([make_env(env_id, wrapped) for _ in range(NUM_ENVS)])
    expected = rollout(reference, NUM_ENVS)
    reference.close()

    envs = [ExternalProcess(lambda: make_env(env_id, wrapped), label=env_id)
            for _ in range(NUM_ENVS)]
    try:
        # The same workers serve both modes: each rollout starts with a seeded
        # reset, which fully determines the envs' state.
        for blocking in (True, False):
            batch = BatchEnv(envs, blocking=blocking)
            assert len(batch) == NUM_ENVS
            assert batch.observation_space == reference.observation_space
            assert batch.action_space == reference.action_space
            got = rollout(batch, NUM_ENVS)
            assert_same_log(got, expected)
    finally:
        batch.close()
    assert all(env.closed for env in envs)

    # The run did what it should: distinct seeds, episodes that ended.
    first = got[0][2]
    assert first.shape == (NUM_ENVS, *reference.observation_space.shape)
    assert not np.array_equal(first[0], first[1])
    steps = [entry for entry in got if entry[0] == "step"]
    terminated = sum(int(entry[3].sum()) for entry in steps)
    truncated = sum(int(entry[4].sum()) for entry in steps)
    if env_id == "CartPole-v1" and not wrapped:
        assert terminated > 0 and truncated == 0
    elif env_id == "CartPole-v1":
        assert terminated > 0 and truncated > 0
    else:
        assert terminated == 0 and truncated > 0
    if wrapped:
        assert all(entry[1].dtype == np.float32 for entry in steps)


def test_in_process_batch_matches_sequential():
    expected = rollout(Sequential([gym.make("Pendulum-v1", max_episode_steps=12)
                                   for _ in range(NUM_ENVS)]), NUM_ENVS)
    with BatchEnv([gym.make("Pendulum-v1", max_episode_steps=12)
                   for _ in range(NUM_ENVS)]) as batch:
        got = rollout(batch, NUM_ENVS)
    assert_same_log(got, expected)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "parallel"])
def test_partial_reset_only_touches_given_indices(blocking, external):
    n = 4
    batch = BatchEnv([external("Pendulum-v1") for _ in range(n)], blocking=blocking)
    mirror = Sequential([gym.make("Pendulum-v1") for _ in range(n)])  # same operations
    control = Sequential([gym.make("Pendulum-v1") for _ in range(n)])  # never reset again
    rng = np.random.default_rng(1)

    for env in (batch, mirror, control):
        env.reset(seed=7)
    for _ in range(5):
        actions = sample_actions(batch.action_space, n, rng)
        obs = batch.step(actions)[0]
        mirror.step(actions)
        np.testing.assert_array_equal(obs, control.step(actions)[0])

    new_obs = batch.reset([3, 1])
    np.testing.assert_array_equal(new_obs, mirror.reset([3, 1]))
    assert new_obs.shape == (2, 3)
    for _ in range(10):
        actions = sample_actions(batch.action_space, n, rng)
        obs, rewards, terminated, truncated, _ = batch.step(actions)
        m_obs, m_rewards, _, _, _ = mirror.step(actions)
        c_obs, c_rewards, _, _, _ = control.step(actions)
        np.testing.assert_array_equal(obs, m_obs)
        np.testing.assert_array_equal(rewards, m_rewards)
        # Envs 0 and 2 carry on exactly as if nothing had happened...
        np.testing.assert_array_equal(obs[[0, 2]], c_obs[[0, 2]])
        np.testing.assert_array_equal(rewards[[0, 2]], c_rewards[[0, 2]])
        # ... while envs 1 and 3 really started over.
        assert not np.allclose(obs[1], c_obs[1]) and not np.allclose(obs[3], c_obs[3])
        assert not terminated.any() and not truncated.any()
    mirror.close()
    control.close()


# -- reset seeds and indices ---------------------------------------------------


@pytest.fixture
def cartpoles(external):
    return BatchEnv([external("CartPole-v1") for _ in range(3)])


def reset_obs(seed: int) -> np.ndarray:
    return gym.make("CartPole-v1").reset(seed=seed)[0]


def test_reset_int_seed_gives_env_i_seed_plus_i(cartpoles):
    obs = cartpoles.reset(seed=10)
    np.testing.assert_array_equal(obs, np.stack([reset_obs(10), reset_obs(11), reset_obs(12)]))
    assert obs.dtype == np.float32
    # The offset is the env's index in the batch, not its position in `indices`.
    obs = cartpoles.reset([2, 0], seed=np.int64(20))
    np.testing.assert_array_equal(obs, np.stack([reset_obs(22), reset_obs(20)]))


def test_reset_list_of_seeds(cartpoles):
    obs = cartpoles.reset([0, 2], seed=[5, 99])
    np.testing.assert_array_equal(obs, np.stack([reset_obs(5), reset_obs(99)]))
    obs = cartpoles.reset(seed=[3, 4, 5])
    np.testing.assert_array_equal(obs, np.stack([reset_obs(3), reset_obs(4), reset_obs(5)]))


def test_reset_without_seed_continues_the_env_rng(cartpoles):
    cartpoles.reset(seed=1)
    reference = [gym.make("CartPole-v1") for _ in range(3)]
    for i, env in enumerate(reference):
        env.reset(seed=1 + i)
    np.testing.assert_array_equal(cartpoles.reset(),
                                  np.stack([env.reset()[0] for env in reference]))


def test_reset_with_wrong_number_of_seeds_is_rejected_before_any_reset(cartpoles):
    cartpoles.reset(seed=0)
    with pytest.raises(ValueError, match=r"got 1 seeds for 2 envs to reset"):
        cartpoles.reset([0, 1], seed=[4])
    with pytest.raises(ValueError, match=r"got 4 seeds for 3 envs to reset"):
        cartpoles.reset(seed=[1, 2, 3, 4])
    # Nothing was reset: the envs continue from their seed-0 state.
    reference = Sequential([gym.make("CartPole-v1") for _ in range(3)])
    reference.reset(seed=0)
    actions = np.array([0, 1, 0])
    np.testing.assert_array_equal(cartpoles.step(actions)[0], reference.step(actions)[0])


@pytest.mark.parametrize("indices, error, message", [
    ([3], IndexError, r"env indices \[3\] out of range for a batch of 3 envs"),
    ([0, -1], IndexError, r"env indices \[-1\] out of range for a batch of 3 envs"),
    ([1, 1], ValueError, r"env indices must be unique, got \[1, 1\]"),
    ([[0, 1]], TypeError, r"indices must be a 1-D sequence of ints"),
    ([0.0, 1.0], TypeError, r"indices must be a 1-D sequence of ints"),
])
def test_reset_rejects_bad_indices(cartpoles, indices, error, message):
    with pytest.raises(error, match=message):
        cartpoles.reset(indices)


def test_reset_no_indices_returns_empty_batch(cartpoles):
    obs = cartpoles.reset([])
    assert obs.shape == (0, 4) and obs.dtype == np.float32


# -- spaces ----------------------------------------------------------------------


@pytest.mark.parametrize("position", [1, 2])
def test_observation_space_mismatch_names_env_and_both_spaces(external, position):
    envs = [external("CartPole-v1") for _ in range(3)]
    envs[position] = external("Pendulum-v1")
    with pytest.raises(SpaceMismatchError) as info:
        BatchEnv(envs)
    message = str(info.value)
    assert "equal observation spaces" in message
    assert f"env {position} has {gym.make('Pendulum-v1').observation_space}" in message
    assert f"env 0 has {gym.make('CartPole-v1').observation_space}" in message


def rescaled_pendulum():
    return RescaleAction(gym.make("Pendulum-v1"), np.float32(-1), np.float32(1))


def test_action_space_mismatch_names_env_and_both_spaces(external):
    with pytest.raises(SpaceMismatchError) as info:
        BatchEnv([external("Pendulum-v1"), external(rescaled_pendulum)])
    message = str(info.value)
    assert "equal action spaces" in message
    assert "env 1 has Box(-1.0, 1.0, (1,), float32)" in message
    assert "env 0 has Box(-2.0, 2.0, (1,), float32)" in message


class TupleActionEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


def text_in_dict_observation_cartpole():
    env = gym.make("CartPole-v1")
    return TransformObservation(env, lambda obs: {"x": obs, "name": ("cart",)},
                                gym.spaces.Dict({"x": env.observation_space,
                                                 "name": gym.spaces.Tuple((gym.spaces.Text(8),))}))


@pytest.mark.parametrize("constructor, message", [
    (text_in_dict_observation_cartpole, r"unsupported observation space Dict\('name': "
                                        r"Tuple\(Text\(.*its part 'name.0' is Text\("),
    (TupleActionEnv, r"unsupported action space Tuple\(Discrete\(2\), Discrete\(3\)\): "
                     r"a batch env needs one of Box, Discrete, MultiDiscrete, MultiBinary$"),
], ids=["text-in-dict-obs", "tuple-action"])
def test_unsupported_spaces_are_rejected(external, constructor, message):
    with pytest.raises(UnsupportedSpaceError, match=message):
        BatchEnv([external(constructor), external(constructor)])


def test_empty_batch_is_rejected():
    with pytest.raises(ValueError, match="at least one env"):
        BatchEnv([])


def make_cartpole_env():
    return gym.make("CartPole-v1")


class CartPoleEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,))
    action_space = gym.spaces.Discrete(2)

    def step(self, action):
        raise AssertionError("never stepped")


@pytest.mark.parametrize("constructor", [make_cartpole_env, CartPoleEnv,
                                         lambda: gym.make("CartPole-v1")],
                         ids=["function", "class", "lambda"])
def test_constructors_instead_of_envs_say_what_to_pass(constructor):
    with pytest.raises(TypeError, match=r"BatchEnv takes envs, got the constructor .*: pass "
                                        r"make\(\) .* or ExternalProcess\(make\) / EnvWorker"):
        BatchEnv([constructor, constructor])


# -- action validation -------------------------------------------------------------


@pytest.fixture
def pendulums(external):
    return BatchEnv([external("Pendulum-v1") for _ in range(3)])


def assert_not_stepped(batch: BatchEnv, env_id: str, valid_actions) -> None:
    """The rejected call sent nothing: the next valid step is the first one
    after the seed-0 reset."""
    reference = Sequential([gym.make(env_id) for _ in range(len(batch))])
    reference.reset(seed=0)
    got = batch.step(valid_actions)
    expected = reference.step(valid_actions)
    for g, e in zip(got[:4], expected[:4]):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("actions, error, message", [
    (np.zeros(2, np.int64), ValueError,
     r"actions must have shape \(3,\) .* for Discrete\(2\), got \(2,\)"),
    ([0, 1], ValueError, r"actions must have shape \(3,\) .*, got \(2,\)"),
    (np.zeros((3, 1), np.int64), ValueError, r"must have shape \(3,\) .*, got \(3, 1\)"),
    (np.zeros(3), TypeError,
     r"actions for Discrete\(2\) must be integers, got dtype float64"),
    (np.array([0, 2, -1]), ValueError,
     r"actions out of range for Discrete\(2\) in envs \[1, 2\]: \[2, -1\]"),
], ids=["short", "short-list", "extra-dim", "float", "out-of-range"])
def test_bad_discrete_actions_are_rejected(cartpoles, actions, error, message):
    cartpoles.reset(seed=0)
    with pytest.raises(error, match=message):
        cartpoles.step(actions)
    assert_not_stepped(cartpoles, "CartPole-v1", np.array([1, 0, 1]))


@pytest.mark.parametrize("actions, error, message", [
    (np.zeros(3, np.float32), ValueError,
     r"actions must have shape \(3, 1\) \(num_envs, \*action_space.shape\) for "
     r"Box\(-2.0, 2.0, \(1,\), float32\), got \(3,\)"),
    (np.zeros((2, 1), np.float32), ValueError, r"shape \(3, 1\) .*, got \(2, 1\)"),
    (np.zeros((3, 2), np.float32), ValueError, r"shape \(3, 1\) .*, got \(3, 2\)"),
    (np.zeros((3, 1), np.complex128), TypeError,
     r"must be real numbers, got dtype complex128"),
    (np.array([[1.0], [None], [0.5]], dtype=object), TypeError,
     r"must be real numbers, got dtype object"),
    (np.array([[0.0], [np.nan], [0.5]]), ValueError,
     r"actions must be finite, got NaN or inf for envs \[1\]"),
    (np.array([[np.inf], [0.0], [-np.inf]], np.float32), ValueError,
     r"actions must be finite, got NaN or inf for envs \[0, 2\]"),
], ids=["flat", "short", "wide", "complex", "object", "nan", "inf"])
def test_bad_box_actions_are_rejected(pendulums, actions, error, message):
    pendulums.reset(seed=0)
    with pytest.raises(error, match=message):
        pendulums.step(actions)
    assert_not_stepped(pendulums, "Pendulum-v1", np.array([[0.5], [-1.0], [2.0]], np.float32))


class MultiDiscreteEnv(gym.Env):
    """Echoes its action as the observation."""
    observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 2], start=[-1, 5])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.asarray(action, np.float32), 0.0, False, False, {}


def test_multidiscrete_actions_respect_start_and_nvec():
    with BatchEnv([MultiDiscreteEnv(), MultiDiscreteEnv()]) as batch:
        batch.reset()
        obs = batch.step(np.array([[-1, 5], [1, 6]]))[0]
        np.testing.assert_array_equal(obs, [[-1, 5], [1, 6]])
        with pytest.raises(ValueError, match=r"out of range .* in envs \[0, 1\]"):
            batch.step(np.array([[2, 5], [0, 4]]))


def test_step_async_then_step_wait_equals_step(cartpoles):
    twin = BatchEnv([make_env("CartPole-v1", wrapped=False) for _ in range(NUM_ENVS)])
    with twin:
        cartpoles.reset(seed=7)
        twin.reset(seed=7)
        for step in range(5):
            actions = np.array([step % 2] * NUM_ENVS)
            cartpoles.step_async(actions)
            got = cartpoles.step_wait()
            expected = twin.step(actions)
            for a, b in zip(got[:4], expected[:4]):
                np.testing.assert_array_equal(a, b)
            done = np.flatnonzero(got[2] | got[3])
            cartpoles.reset(done)
            twin.reset(done)


def test_step_async_misuse_is_named(cartpoles):
    cartpoles.reset(seed=0)
    with pytest.raises(RuntimeError, match="needs a step_async"):
        cartpoles.step_wait()
    cartpoles.step_async(np.zeros(NUM_ENVS, np.int64))
    with pytest.raises(RuntimeError, match="called twice"):
        cartpoles.step_async(np.zeros(NUM_ENVS, np.int64))
    with pytest.raises(RuntimeError, match="reset.. during a step"):
        cartpoles.reset([0])
    obs = cartpoles.step_wait()[0]  # the step in flight is still collected
    assert obs.shape == (NUM_ENVS, 4)
    cartpoles.step(np.ones(NUM_ENVS, np.int64))


def make_pendulum():
    return gym.make("Pendulum-v1")


def make_rescaled_pendulum():
    return RescaleAction(gym.make("Pendulum-v1"), np.float32(-1), np.float32(1))


def test_a_worker_whose_envs_differ_only_in_actions_names_the_env():
    """The envs of one worker need equal action spaces too; the error names the env that
    differs by its index in the worker and both spaces."""
    with pytest.raises(EnvError, match="all envs of a worker need equal spaces") as info:
        BatchEnv([EnvWorker([make_pendulum, make_pendulum, make_rescaled_pendulum])])
    message = str(info.value)
    assert "but env 2 has" in message
    assert "and Box(-1.0, 1.0, (1,), float32) while env 0 has" in message
    assert message.endswith("and Box(-2.0, 2.0, (1,), float32)")
