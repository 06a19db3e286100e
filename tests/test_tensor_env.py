"""TensorBatchEnv: the batch state as torch tensors, checked against a BatchEnv of
the same envs in this process."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.envs import BatchEnv, ExternalProcess, wrap_env
from batchrl.tensor_env import TensorBatchEnv

NUM_ENVS = 3

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array)).to(torch.float32)


def assert_rows_equal(tensor: torch.Tensor, expected: np.ndarray) -> None:
    assert tensor.dtype == torch.float32
    torch.testing.assert_close(tensor.cpu(), as_tensor(expected), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_discrete_env_matches_batch_env(device):
    # A short time limit: episodes end by termination and by truncation.
    make = lambda: gym.make("CartPole-v1", max_episode_steps=16)  # noqa: E731
    reference = BatchEnv([make() for _ in range(NUM_ENVS)])
    tensor_env = TensorBatchEnv(
        BatchEnv([ExternalProcess(make) for _ in range(NUM_ENVS)]), device=device)
    with tensor_env:
        assert len(tensor_env) == NUM_ENVS
        assert tensor_env.observation_space == reference.observation_space
        assert tensor_env.action_space == reference.action_space
        for name, shape in [("observ", (NUM_ENVS, 4)), ("reward", (NUM_ENVS,)),
                            ("done", (NUM_ENVS,)), ("terminated", (NUM_ENVS,))]:
            buffer = getattr(tensor_env, name)
            assert buffer.dtype == torch.float32 and buffer.shape == shape, name
            assert buffer.device.type == device
        assert tensor_env.action.dtype == torch.int64
        assert tensor_env.action.shape == (NUM_ENVS,)

        observ = tensor_env.reset(seed=4)
        assert observ.shape == (NUM_ENVS, 4) and observ.device.type == device
        assert_rows_equal(observ, reference.reset(seed=4))

        rng = np.random.default_rng(0)
        resets = terminations = truncations = 0
        for _ in range(40):
            action = torch.from_numpy(rng.integers(0, 2, NUM_ENVS)).to(device)
            observ, reward, done = tensor_env.step(action)
            assert observ is tensor_env.observ and reward is tensor_env.reward
            assert done is tensor_env.done
            obs, rewards, terminated, truncated, infos = reference.step(action.cpu().numpy())
            assert_rows_equal(observ, obs)
            assert_rows_equal(reward, rewards)
            assert_rows_equal(done, terminated | truncated)
            assert_rows_equal(tensor_env.terminated, terminated)
            assert tensor_env.infos == infos
            torch.testing.assert_close(tensor_env.action.cpu(), action.cpu())
            terminations += int(terminated.sum())
            truncations += int((truncated & ~terminated).sum())

            finished = torch.nonzero(done).flatten()
            if finished.numel():
                resets += 1
                before = {name: getattr(tensor_env, name).clone()
                          for name in ("observ", "reward", "done", "terminated")}
                new = tensor_env.reset(finished)
                rows = finished.cpu().numpy()
                assert new.shape == (len(rows), 4)
                assert_rows_equal(new, reference.reset(rows))
                kept = np.setdiff1d(np.arange(NUM_ENVS), rows)
                assert_rows_equal(tensor_env.observ[finished], new.cpu().numpy())
                for name in ("reward", "done", "terminated"):
                    assert (getattr(tensor_env, name)[rows] == 0).all(), name
                for name, value in before.items():
                    torch.testing.assert_close(getattr(tensor_env, name)[kept], value[kept],
                                               rtol=0, atol=0)
        assert resets > 0 and terminations > 0 and truncations > 0
    reference.close()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_reset_changes_only_those_rows_and_zeroes_their_reward(device):
    make = lambda: wrap_env(gym.make("Pendulum-v1"))  # noqa: E731
    reference = BatchEnv([make() for _ in range(NUM_ENVS)])
    with TensorBatchEnv(BatchEnv([ExternalProcess(make) for _ in range(NUM_ENVS)]),
                        device=device) as tensor_env:
        tensor_env.reset(seed=0)
        reference.reset(seed=0)
        action = torch.full((NUM_ENVS, 1), 0.5, device=device)
        for _ in range(3):
            tensor_env.step(action)
            reference.step(action.cpu().numpy())
        assert (tensor_env.reward != 0).all()  # Pendulum rewards are negative
        before_observ = tensor_env.observ.clone()
        before_reward = tensor_env.reward.clone()

        new = tensor_env.reset(torch.tensor([2], device=device))
        assert_rows_equal(new, reference.reset([2]))
        assert_rows_equal(tensor_env.observ[2:], new.cpu().numpy())
        assert not torch.equal(tensor_env.observ[2], before_observ[2])
        assert tensor_env.reward[2].item() == 0.0 and tensor_env.done[2].item() == 0.0
        torch.testing.assert_close(tensor_env.observ[:2], before_observ[:2], rtol=0, atol=0)
        torch.testing.assert_close(tensor_env.reward[:2], before_reward[:2], rtol=0, atol=0)

        # Plain lists and empty index sets work too.
        assert_rows_equal(tensor_env.reset([0]), reference.reset([0]))
        empty = tensor_env.reset(torch.tensor([], dtype=torch.int64))
        assert empty.shape == (0, 3) and empty.dtype == torch.float32
        # And the envs carry on in step with the reference.
        observ, reward, _ = tensor_env.step(action)
        obs, rewards, _, _, _ = reference.step(action.cpu().numpy())
        assert_rows_equal(observ, obs)
        assert_rows_equal(reward, rewards)
    reference.close()


@pytest.mark.parametrize("device", DEVICES)
def test_box_env_float64_observations_become_float32(device):
    reference = BatchEnv([gym.make("HalfCheetah-v5") for _ in range(2)])
    with TensorBatchEnv(BatchEnv([ExternalProcess("HalfCheetah-v5") for _ in range(2)]),
                        device=device) as tensor_env:
        assert tensor_env.action.dtype == torch.float32
        assert tensor_env.action.shape == (2, 6)
        assert_rows_equal(tensor_env.reset(seed=9), reference.reset(seed=9))
        rng = np.random.default_rng(3)
        for _ in range(5):
            action = torch.from_numpy(rng.uniform(-1, 1, (2, 6)).astype(np.float32))
            observ, reward, done = tensor_env.step(action.to(device))
            obs, rewards, terminated, truncated, _ = reference.step(action.numpy())
            assert obs.dtype == np.float64
            assert_rows_equal(observ, obs)
            assert_rows_equal(reward, rewards)
            assert_rows_equal(done, terminated | truncated)
    reference.close()


def test_step_rejects_a_wrong_action_shape():
    with TensorBatchEnv(BatchEnv([ExternalProcess("Pendulum-v1") for _ in range(2)])) as env:
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"action must have shape \(2, 1\) "
                                             r"\(num_envs, \*action_space.shape\), got \(2,\)"):
            env.step(torch.zeros(2))
        with pytest.raises(ValueError, match=r"shape \(2, 1\) .*, got \(3, 1\)"):
            env.step(torch.zeros(3, 1))
        # The BatchEnv's checks still apply to the values.
        with pytest.raises(ValueError, match=r"must be finite, got NaN or inf for envs \[1\]"):
            env.step(torch.tensor([[0.0], [float("nan")]]))
        assert env.step(torch.zeros(2, 1, requires_grad=True))[0].shape == (2, 3)


def test_reset_rejects_masks_and_bad_indices():
    with TensorBatchEnv(BatchEnv([ExternalProcess("CartPole-v1") for _ in range(2)])) as env:
        first = env.reset(seed=0).clone()
        # A done mask is not a list of indices (cast to int64, [0., 1.] would
        # name both envs).
        with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
            env.reset(torch.tensor([0.0, 1.0]))
        with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
            env.reset(torch.tensor([True, False]))
        with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
            env.reset([0.5])
        with pytest.raises(IndexError, match=r"env indices \[2\] out of range"):
            env.reset(torch.tensor([2]))
        with pytest.raises(ValueError, match=r"env indices must be unique, got \[1, 1\]"):
            env.reset([1, 1])
        torch.testing.assert_close(env.observ, first, rtol=0, atol=0)  # nothing was reset
        assert env.reset(np.array([1], np.int32)).shape == (1, 4)


def test_step_rejects_float_actions_for_a_discrete_space():
    # Copied into the int64 action buffer they would be truncated silently (0.9 -> 0).
    with TensorBatchEnv(BatchEnv([ExternalProcess("CartPole-v1") for _ in range(2)])) as env:
        env.reset(seed=0)
        with pytest.raises(TypeError, match=r"actions for Discrete\(2\) must be integers, "
                                            r"got torch.float32"):
            env.step(torch.tensor([0.9, 1.0]))
        assert env.step(torch.tensor([0, 1]))[0].shape == (2, 4)


def test_infos_are_the_last_steps_and_discrete_observations_become_float32():
    make = lambda: gym.make("FrozenLake-v1")  # noqa: E731  (its steps' infos hold "prob")
    reference = BatchEnv([make() for _ in range(3)])
    with TensorBatchEnv(BatchEnv([make() for _ in range(3)])) as env:
        observ = env.reset(seed=2)
        np.testing.assert_array_equal(observ.numpy(), reference.reset(seed=2))
        assert observ.shape == (3,) and observ.dtype == torch.float32
        action = torch.tensor([1, 2, 2])
        observ, reward, done = env.step(action)
        obs, _, _, _, infos = reference.step(action.numpy())
        np.testing.assert_array_equal(observ.numpy(), obs)
        assert all("prob" in info for info in infos) and env.infos == infos
    reference.close()


def test_the_action_buffer_keeps_no_autograd_graph():
    with TensorBatchEnv(BatchEnv([gym.make("Pendulum-v1") for _ in range(2)])) as env:
        env.reset(seed=0)
        weight = torch.ones(2, 1, requires_grad=True)
        env.step(weight * 0.5)
        assert not env.action.requires_grad and env.action.grad_fn is None
        assert env.action.numpy().tolist() == [[0.5], [0.5]]
