"""Double DQN (batchrl/algos/dqn.py): the epsilon schedule, the target network's copies and the
double-Q target, an exact state round trip, and learning CartPole and, through a convolutional
torso, a pixel task (CI-sized)."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import pytest
import torch
from torch.nn import functional as F

from batchrl.algos import DQN
from batchrl.errors import UnsupportedSpaceError
from batchrl.simulation import simulate
from helpers import assert_continues_alike, assert_same, seeded_tensor_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def filled_dqn(steps: int, **options) -> tuple[DQN, object]:
    torch.manual_seed(0)
    env = seeded_tensor_env("CartPole-v1", 2, seed=0)
    algo = DQN(env.observation_space, env.action_space, 2,
               **{"hidden": (16,), "batch_size": 16, "learning_starts": 20, **options})
    for _ in range(steps):
        simulate(env, algo)
    return algo, env


def test_epsilon_falls_linearly_then_holds():
    algo, env = filled_dqn(0, exploration_steps=100, final_epsilon=0.1)
    assert algo.epsilon == 1.0
    for _ in range(25):  # 50 env steps: half way
        simulate(env, algo)
    assert algo.epsilon == pytest.approx(0.55)
    for _ in range(50):
        simulate(env, algo)
    assert algo.epsilon == pytest.approx(0.1)
    env.close()


def test_the_target_copies_the_q_network_every_few_gradient_steps_and_picks_by_it():
    algo, env = filled_dqn(10, target_update_every=3, updates_per_step=1.0)
    env.close()
    assert algo.updates == 0
    initial = copy.deepcopy(algo.target_q.state_dict())
    algo.gradient_step()
    algo.gradient_step()
    assert_same(algo.target_q.state_dict(), initial, "target")  # not yet
    algo.gradient_step()
    assert_same(algo.target_q.state_dict(), algo.q.state_dict(), "target")  # copied
    # The double-Q target: the online network picks the next action (here always action 0),
    # the target network values it (though it values action 1 far higher).
    with torch.no_grad():
        algo.q[-1].bias += torch.tensor([100.0, 0.0])
        algo.target_q[-1].bias += torch.tensor([0.0, 100.0])
    torch.manual_seed(5)
    batch = algo.buffer.sample(algo.batch_size)
    with torch.no_grad():
        next_q = algo.target_q(batch["next_observ"])
        q = algo.q(batch["observ"]).gather(-1, batch["action"][:, None]).squeeze(-1)
        double = F.smooth_l1_loss(q, batch["reward"] + batch["discount"] * next_q[:, 0])
        plain = F.smooth_l1_loss(q, batch["reward"] + batch["discount"] * next_q.max(-1).values)
    torch.manual_seed(5)
    loss = algo.gradient_step()["dqn/loss"]
    assert loss == pytest.approx(float(double), rel=1e-5)
    assert abs(float(plain) - float(double)) > 1.0


def test_a_loaded_state_continues_exactly():
    algo, env = filled_dqn(20, n_step=2)
    twin = DQN(env.observation_space, env.action_space, 2, hidden=(16,), batch_size=16,
               learning_starts=20, n_step=2)
    assert_continues_alike(algo, twin)
    env.close()


def test_an_evaluation_cuts_the_training_episodes_it_interrupts():
    """An evaluation resets the envs: n-step returns of the training steps before it must not
    run on into the evaluation's episodes."""
    from batchrl.simulation import evaluate_episodes

    algo, env = filled_dqn(6, n_step=3)
    newest = (algo.buffer.position - 1) % algo.buffer.rows
    assert not algo.buffer.tensors["done"][newest].all()  # (episodes still running)
    algo.eval()
    evaluate_episodes(env, algo, 1)
    assert algo.buffer.tensors["done"][newest].all()
    env.close()


def test_a_resume_without_the_buffer_learns_again_once_it_is_full():
    """``learning_starts`` above the buffer's capacity (rounded down to whole batch steps):
    after a resume without the buffer, learning waits for a full buffer, not for ever."""
    env = seeded_tensor_env("CartPole-v1", 3, seed=0)
    options = dict(hidden=(16,), batch_size=4, buffer_size=10, learning_starts=10,
                   save_buffer=False)
    algo = DQN(env.observation_space, env.action_space, 3, **options)
    for _ in range(5):
        simulate(env, algo)
    assert algo.buffer.capacity == 9 and algo.updates > 0
    resumed = DQN(env.observation_space, env.action_space, 3, **options)
    resumed.load_state_dict(algo.state_dict())
    for _ in range(2):
        simulate(env, resumed)
    assert resumed.updates == algo.updates  # 6 of 9 transitions: it waits
    simulate(env, resumed)
    assert resumed.updates > algo.updates
    env.close()


def test_bad_input_is_a_clear_error():
    box = gym.spaces.Box(-1, 1, (3,))
    with pytest.raises(UnsupportedSpaceError, match=r"DQN needs a Discrete action space, got "
                                                    r"Box.* \(SAC takes Box actions\)"):
        DQN(box, box, 2)
    with pytest.raises(ValueError, match="final_epsilon must be in"):
        DQN(box, gym.spaces.Discrete(2), 2, final_epsilon=2)
    with pytest.raises(ValueError, match=r"buffer_size \(1\) must hold at least one transition"):
        DQN(box, gym.spaces.Discrete(2), 2, buffer_size=1)
    with pytest.raises(ValueError, match="target_update_every must be >= 1, got 0"):
        DQN(box, gym.spaces.Discrete(2), 2, target_update_every=0)
    with pytest.raises(UnsupportedSpaceError, match="torso 'nature_cnn' needs image "
                                                    "observations"):
        DQN(box, gym.spaces.Discrete(2), 2, torso="nature_cnn")
    with pytest.raises(ValueError, match="torso must be one of"):
        DQN(box, gym.spaces.Discrete(2), 2, torso="cnn")
    for key, value in (("max_grad_norm", -1.0), ("max_grad_norm", math.nan),
                       ("learning_rate", math.inf), ("updates_per_step", math.nan)):
        with pytest.raises(ValueError, match=f"{key} must be a finite number > 0, got {value}"):
            DQN(box, gym.spaces.Discrete(2), 2, **{key: value})
    with pytest.raises(ValueError, match=r"hidden must be layer sizes >= 1, got \[0\]"):
        DQN(box, gym.spaces.Discrete(2), 2, hidden=[0])


@pytest.mark.slow
def test_dqn_with_a_convolutional_torso_learns_from_pixels():
    """``torso = "nature_cnn"``: the Q-network reads the images through the Nature CNN and
    learns PixelSide (the bright square's side) from bytes stored as bytes."""
    from batchrl.algos.networks import ConvTorso
    from batchrl.envs import BatchEnv, wrap_env
    from batchrl.simulation import evaluate_episodes
    from batchrl.tensor_env import TensorBatchEnv
    from batchrl.testing.envs import PixelSide

    torch.manual_seed(0)
    env = TensorBatchEnv(BatchEnv([wrap_env(PixelSide()) for _ in range(4)]))
    env.reset(seed=0)
    algo = DQN(env.observation_space, env.action_space, 4, torso="nature_cnn", hidden=(64,),
               batch_size=32, learning_starts=500, exploration_steps=2000,
               target_update_every=100)
    assert isinstance(algo.q[0], ConvTorso)
    for _ in range(1000):  # 4,000 env steps
        simulate(env, algo)
    assert algo.buffer.tensors["observ"].dtype == torch.uint8
    algo.eval()
    returns, _ = evaluate_episodes(env, algo, 20)
    assert sum(returns) / len(returns) >= 9.0  # (a random policy: 5)
    env.close()


@pytest.mark.slow
def test_dqn_learns_cartpole():
    torch.manual_seed(0)
    env = seeded_tensor_env("CartPole-v1", 4, seed=0)
    algo = DQN(env.observation_space, env.action_space, 4, updates_per_step=0.5,
               exploration_steps=8000)
    for _ in range(5000):  # 20,000 env steps
        simulate(env, algo)
    algo.eval()
    simulate(env, algo, reset=True)
    returns: list[float] = []
    while len(returns) < 8:
        done, score, _ = simulate(env, algo)
        returns += score[done.bool()].tolist()
    env.close()
    assert sum(returns[:8]) / 8 > 100, returns  # random actions: about 22
