"""The replay buffer (batchrl/parts/replay.py): wrap-around, uniform sampling of the stored
part only, truncations that bootstrap and terminations that do not, n-step returns that stop at
episode ends and at the newest step, uint8 observations (in DQN and SAC too), and an exact
checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch

from batchrl.parts.replay import ReplayBuffer

FIELDS = {"observ": ((), torch.float32), "next_observ": ((), torch.float32),
          "action": ((2,), torch.float32)}


def add_step(buffer: ReplayBuffer, value: float, terminated=None, done=None) -> None:
    """One batch step whose observation and reward are ``value`` for every agent (the next
    observation ``value + 0.5``)."""
    n = buffer.num_agents
    full = torch.full((n,), float(value))
    buffer.add(reward=full, terminated=torch.zeros(n, dtype=torch.bool) if terminated is None
               else terminated, done=torch.zeros(n, dtype=torch.bool) if done is None else done,
               observ=full, next_observ=full + 0.5, action=torch.zeros(n, 2))


def test_the_buffer_wraps_around_and_samples_only_what_it_holds():
    buffer = ReplayBuffer(2, 7, FIELDS)  # 3 batch steps of 2 agents
    assert buffer.capacity == 6 and len(buffer) == 0
    add_step(buffer, 0)
    add_step(buffer, 1)
    assert len(buffer) == 4
    torch.manual_seed(0)
    seen = buffer.sample(2000)["observ"]
    assert set(seen.tolist()) == {0.0, 1.0}
    for value in range(2, 6):
        add_step(buffer, value)
    assert len(buffer) == 6 and buffer.position == 0
    batch = buffer.sample(3000)
    assert set(batch["observ"].tolist()) == {3.0, 4.0, 5.0}  # 0, 1 and 2 were overwritten
    counts = torch.bincount(batch["observ"].long())[3:]
    assert counts.min() > 850  # uniform over the three steps (1,000 each expected)
    torch.testing.assert_close(batch["next_observ"], batch["observ"] + 0.5)
    torch.testing.assert_close(batch["discount"], torch.full((3000,), 0.99))


def test_truncations_bootstrap_and_terminations_do_not():
    buffer = ReplayBuffer(2, 2, FIELDS, discount=0.9)
    observ = torch.tensor([1.0, 11.0])  # agent 0 terminates, agent 1 is cut by a time limit
    buffer.add(reward=observ, terminated=torch.tensor([True, False]),
               done=torch.tensor([True, True]), observ=observ, next_observ=observ + 0.5,
               action=torch.zeros(2, 2))
    torch.manual_seed(0)
    batch = buffer.sample(200)
    agent0 = batch["observ"] == 1.0
    assert 0 < int(agent0.sum()) < 200  # both agents drawn
    assert torch.all(batch["discount"][agent0] == 0.0)
    # the truncated agent bootstraps from its episode's last observation
    assert torch.all(batch["discount"][~agent0] == 0.9)
    torch.testing.assert_close(batch["next_observ"], batch["observ"] + 0.5)


def test_n_step_returns_stop_at_episode_ends_and_at_the_newest_step():
    gamma = 0.5
    buffer = ReplayBuffer(1, 10, FIELDS, discount=gamma, n_step=3)
    no, yes = torch.tensor([False]), torch.tensor([True])
    add_step(buffer, 1)
    add_step(buffer, 2, terminated=yes, done=yes)   # the episode terminates here
    add_step(buffer, 3)
    add_step(buffer, 4, terminated=no, done=yes)    # this one is truncated
    add_step(buffer, 5)
    add_step(buffer, 6)                             # the newest step
    torch.manual_seed(0)
    batch = buffer.sample(600)
    expected = {  # observ -> (return, bootstrap observation, discount)
        1.0: (1 + gamma * 2, 2.5, 0.0),
        2.0: (2.0, 2.5, 0.0),
        3.0: (3 + gamma * 4, 4.5, gamma ** 2),
        4.0: (4.0, 4.5, gamma),
        5.0: (5 + gamma * 6, 6.5, gamma ** 2),
        6.0: (6.0, 6.5, gamma),
    }
    assert_transitions(batch, expected)


def assert_transitions(batch: dict, expected: dict) -> None:
    """``batch`` holds exactly the transitions of ``expected``'s observations, each with its
    ``(return, bootstrap observation, discount)``."""
    assert set(batch["observ"].tolist()) == set(expected)
    for value, (ret, bootstrap, discount) in expected.items():
        rows = batch["observ"] == value
        assert torch.allclose(batch["reward"][rows], torch.tensor(ret)), value
        assert torch.all(batch["next_observ"][rows] == bootstrap), value
        assert torch.allclose(batch["discount"][rows], torch.tensor(discount)), value


def add_pair(buffer: ReplayBuffer, value: float, lost=None) -> None:
    """One batch step of two agents: agent 0 observes ``value``, agent 1 ``value + 10`` (the
    reward the same, the next observation that plus 0.5)."""
    observ = torch.tensor([value, value + 10.0])
    buffer.add(reward=observ, terminated=torch.zeros(2, dtype=torch.bool),
               done=torch.zeros(2, dtype=torch.bool), lost=lost, observ=observ,
               next_observ=observ + 0.5, action=torch.zeros(2, 2))


def test_a_lost_step_is_never_drawn_and_ends_its_episode_at_the_step_before():
    gamma = 0.5
    buffer = ReplayBuffer(2, 8, FIELDS, discount=gamma, n_step=3)  # 4 batch steps
    add_pair(buffer, 1)
    add_pair(buffer, 2)
    add_pair(buffer, 3, lost=torch.tensor([0]))  # agent 0's env was restarted instead
    torch.manual_seed(0)
    batch = buffer.sample(3000)
    assert set(batch["observ"].tolist()) == {1.0, 2.0, 11.0, 12.0, 13.0}
    first = batch["observ"] == 1.0  # its n-step return stops at step 2
    assert torch.allclose(batch["reward"][first], torch.tensor(1 + gamma * 2))
    assert torch.all(batch["next_observ"][first] == 2.5)
    assert torch.allclose(batch["discount"][first], torch.tensor(gamma ** 2))
    eleven = batch["observ"] == 11.0  # agent 1's runs on
    assert torch.allclose(batch["reward"][eleven], torch.tensor(11 + gamma * 12 + gamma**2 * 13))
    # A checkpoint keeps it; an add over its row makes that row's steps count again.
    copy = ReplayBuffer(2, 8, FIELDS, discount=gamma, n_step=3)
    copy.load_state_dict(buffer.state_dict())
    assert not copy.valid[2, 0] and int(copy.valid.sum()) == 7
    for value in (4, 5, 6):  # into the free row, then over steps 1 and 2
        add_pair(copy, value)
    assert not copy.valid[2, 0]
    add_pair(copy, 7)  # over step 3, the lost one
    assert bool(copy.valid.all())
    torch.manual_seed(1)
    assert set(copy.sample(3000)["observ"].tolist()) == {4.0, 5.0, 6.0, 7.0, 14.0, 15.0,
                                                         16.0, 17.0}
    only = ReplayBuffer(1, 1, FIELDS)
    only.add(reward=torch.ones(1), terminated=torch.zeros(1, dtype=torch.bool),
             done=torch.zeros(1, dtype=torch.bool), lost=torch.tensor([0]),
             observ=torch.ones(1), next_observ=torch.ones(1), action=torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="every stored transition was lost"):
        only.sample(1)


def test_uint8_observations_stay_uint8():
    fields = {"observ": ((4, 84, 84), torch.uint8), "next_observ": ((4, 84, 84), torch.uint8),
              "action": ((), torch.int64)}
    buffer = ReplayBuffer(3, 30, fields)
    frames = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    buffer.add(reward=torch.ones(3), terminated=torch.zeros(3, dtype=torch.bool),
               done=torch.zeros(3, dtype=torch.bool), observ=frames, next_observ=frames,
               action=torch.tensor([0, 1, 2]))
    assert buffer.tensors["observ"].dtype == torch.uint8
    stored = sum(tensor.nbytes for tensor in buffer.tensors.values())
    assert stored < 2 * 30 * 4 * 84 * 84 + 4096  # a byte per pixel in both fields
    batch = buffer.sample(5)
    assert batch["observ"].dtype == torch.uint8 and batch["action"].dtype == torch.int64
    # each sampled frame is its agent's, byte for byte (the action is the agent's index)
    assert torch.equal(batch["observ"], frames[batch["action"]])


@pytest.mark.parametrize("algorithm", ["DQN", "SAC"])
def test_off_policy_algorithms_store_pixels_as_bytes_and_learn_from_them_scaled(algorithm):
    """DQN and SAC on ``uint8`` image observations: a byte per pixel in the buffer, the
    networks read them scaled to [0, 1], and gradient steps run."""
    import gymnasium as gym
    import numpy as np

    from batchrl import algos
    from batchrl.envs import BatchEnv, wrap_env
    from batchrl.simulation import simulate
    from batchrl.tensor_env import TensorBatchEnv
    from batchrl.testing.envs import PixelSide

    def make() -> gym.Env:
        if algorithm == "DQN":
            return PixelSide(size=12)
        pendulum = gym.make("Pendulum-v1")  # (its observation as bytes)
        return gym.wrappers.TransformObservation(
            pendulum, lambda observ: np.round((observ / 8 + 1) * 127.5).astype(np.uint8),
            gym.spaces.Box(0, 255, (3,), np.uint8))

    torch.manual_seed(0)
    env = TensorBatchEnv(BatchEnv([wrap_env(make()) for _ in range(2)]))
    env.reset(seed=0)
    algo = getattr(algos, algorithm)(env.observation_space, env.action_space, 2,
                                     hidden=(16,), batch_size=8, learning_starts=8)
    seen = []
    network = algo.q if algorithm == "DQN" else algo.policy
    network.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    for _ in range(8):
        simulate(env, algo)
    assert algo.buffer.tensors["observ"].dtype == torch.uint8 and algo.updates > 0
    features = seen[-1]  # (what the network took: the scaled image, or for DQN the bytes
    if algorithm == "DQN":  # before its first layer scales them)
        features = algo.q[0](features)
    assert features.dtype == torch.float32 and 0 <= float(features.min())
    assert float(features.max()) <= 1 and float(features.max()) > 0.2
    if algorithm == "SAC":  # the critics too: their inputs are the observation, then actions
        critic_inputs = []
        algo.critics.register_forward_pre_hook(lambda _, inputs: critic_inputs.append(inputs[0]))
        algo.gradient_step()
        observ = torch.cat([batch[:, :algo.obs_size].detach() for batch in critic_inputs])
        assert 0 <= float(observ.min()) and 0.2 < float(observ.max()) <= 1
    env.close()


def test_a_checkpointed_buffer_samples_exactly_as_the_original():
    original = ReplayBuffer(2, 8, FIELDS, n_step=2)
    for value in range(7):
        add_step(original, value, done=torch.tensor([value % 3 == 2, False]),
                 terminated=torch.tensor([value % 3 == 2, False]))
    saved = io.BytesIO()
    torch.save(original.state_dict(), saved)
    restored = ReplayBuffer(2, 8, FIELDS, n_step=2)
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    torch.manual_seed(3)
    first = original.sample(64)
    torch.manual_seed(3)
    second = restored.sample(64)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    add_step(original, 9)
    add_step(restored, 9)
    assert original.position == restored.position and len(original) == len(restored)
    with pytest.raises(ValueError, match=r"saved \(4, 2\), this buffer \(3, 2\)"):
        ReplayBuffer(2, 6, FIELDS).load_state_dict(original.state_dict())
    # A buffer still filling saves the rows written so far, and nothing more.
    filling = ReplayBuffer(2, 20, FIELDS)
    for value in range(3):
        add_step(filling, value)
    saved = io.BytesIO()
    torch.save(filling.state_dict(), saved)
    assert torch.load(io.BytesIO(saved.getvalue()))["tensors"]["observ"].shape[0] == 3
    restored = ReplayBuffer(2, 20, FIELDS)
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    for name, tensor in filling.tensors.items():
        assert torch.equal(tensor, restored.tensors[name]), name


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"capacity \(1\) must hold at least one transition per "
                                         r"agent \(2 agents\)"):
        ReplayBuffer(2, 1, FIELDS)
    with pytest.raises(ValueError, match="must include 'next_observ'"):
        ReplayBuffer(2, 4, {"observ": ((), torch.float32)})
    with pytest.raises(TypeError, match=r"n_step must be an integer, got 2\.5"):
        ReplayBuffer(2, 4, FIELDS, n_step=2.5)
    with pytest.raises(TypeError, match=r"capacity must be an integer, got 1000000\.0"):
        ReplayBuffer(2, 1e6, FIELDS)
    with pytest.raises(ValueError, match=r"must not name \['reward'\]"):
        ReplayBuffer(2, 4, {**FIELDS, "reward": ((), torch.float32)})
    buffer = ReplayBuffer(2, 4, FIELDS)
    with pytest.raises(RuntimeError, match="empty replay buffer"):
        buffer.sample(1)
    with pytest.raises(KeyError, match="add needs the fields"):
        buffer.add(reward=torch.zeros(2), terminated=torch.zeros(2), done=torch.zeros(2),
                   observ=torch.zeros(2))
    with pytest.raises(ValueError, match=r"'action' must have shape \(2, 2\), got \(2, 3\)"):
        buffer.add(reward=torch.zeros(2), terminated=torch.zeros(2), done=torch.zeros(2),
                   observ=torch.zeros(2), next_observ=torch.zeros(2), action=torch.zeros(2, 3))


def test_a_rejected_add_writes_nothing():
    buffer = ReplayBuffer(1, 2, {"observ": ((2,), torch.uint8), "next_observ": ((2,), torch.uint8),
                                 "action": ((), torch.float32)})
    step = dict(observ=torch.full((1, 2), 7, dtype=torch.uint8),
                next_observ=torch.full((1, 2), 8, dtype=torch.uint8), action=torch.ones(1),
                terminated=torch.zeros(1), done=torch.zeros(1))
    buffer.add(reward=torch.ones(1), **step)
    buffer.add(reward=torch.ones(1), **step)  # full: the next add overwrites row 0
    with pytest.raises(ValueError, match=r"'reward' must have shape \(1,\), got \(2,\)"):
        buffer.add(reward=torch.ones(2), **{**step, "observ": torch.zeros(1, 2, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"'observ' is stored as torch.uint8, got torch.float32 "
                                         r"values \(pixels are stored as bytes\)"):
        buffer.add(reward=torch.ones(1), **{**step, "observ": torch.rand(1, 2)})
    assert buffer.tensors["observ"].tolist() == [[[7, 7]], [[7, 7]]]
    assert buffer.position == 0 and len(buffer) == 2


def test_the_storage_is_allocated_when_the_first_transitions_arrive():
    """An algorithm that only evaluates (batchrl.evaluate) never allocates its buffer: here
    one of 4 TB, which no machine here could hold, is built, saved and loaded empty."""
    huge = ReplayBuffer(1, 10**12, FIELDS)
    empty = huge.state_dict()
    assert empty["filled"] == 0 and empty["tensors"]["action"].shape == (0, 1, 2)
    huge.load_state_dict(empty)
    assert len(huge) == 0 and huge.capacity == 10**12
    small = ReplayBuffer(2, 4, FIELDS)
    small.load_state_dict(small.state_dict())
    small.add(reward=torch.ones(2), terminated=torch.zeros(2), done=torch.zeros(2),
              observ=torch.zeros(2), next_observ=torch.ones(2), action=torch.ones(2, 2))
    assert small.tensors["reward"].shape == (2, 2) and len(small) == 2
    with pytest.raises(ValueError, match=r"replay buffer 'observ': saved \(1000000000000, 1\), "
                                         r"this buffer \(2, 2\) \(another capacity"):
        small.load_state_dict(empty)


def test_n_step_returns_stop_at_the_newest_step_after_the_buffer_wraps_around():
    gamma = 0.5
    buffer = ReplayBuffer(1, 3, FIELDS, discount=gamma, n_step=3)
    for value in range(1, 6):  # rows now hold 4, 5, 3 (3 the oldest, 5 the newest)
        add_step(buffer, value)
    torch.manual_seed(0)
    batch = buffer.sample(300)
    expected = {  # observ -> (return, bootstrap observation, discount)
        3.0: (3 + gamma * 4 + gamma ** 2 * 5, 5.5, gamma ** 3),
        4.0: (4 + gamma * 5, 5.5, gamma ** 2),
        5.0: (5.0, 5.5, gamma),  # not run on into the oldest row
    }
    assert_transitions(batch, expected)


def test_draws_stay_uniform_over_the_steps_that_were_not_lost():
    buffer = ReplayBuffer(2, 6, FIELDS)  # 3 batch steps
    add_pair(buffer, 1)
    add_pair(buffer, 2)
    add_pair(buffer, 3, lost=torch.tensor([0]))
    torch.manual_seed(0)
    counts = torch.bincount(buffer.sample(5000)["observ"].long())
    # 5 stored transitions, 1,000 draws each expected (not more for agent 0's or row 3's)
    for value in (1, 2, 11, 12, 13):
        assert 900 < int(counts[value]) < 1100, value


def test_a_cleared_buffer_forgets_its_lost_steps():
    buffer = ReplayBuffer(2, 4, FIELDS)  # 2 batch steps
    add_pair(buffer, 1, lost=torch.tensor([0]))
    buffer.clear()
    add_pair(buffer, 5)  # over the lost step's row: agent 0's step is a transition again
    add_pair(buffer, 6, lost=torch.tensor([1]))
    torch.manual_seed(0)
    assert set(buffer.sample(500)["observ"].tolist()) == {5.0, 6.0, 15.0}


def test_a_discount_outside_0_1_or_an_n_step_below_1_is_a_clear_error():
    for discount in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"discount must be in \[0, 1\]"):
            ReplayBuffer(2, 4, FIELDS, discount=discount)
    with pytest.raises(ValueError, match="n_step must be >= 1, got 0"):
        ReplayBuffer(2, 4, FIELDS, n_step=0)
