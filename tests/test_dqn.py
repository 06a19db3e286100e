"""Double DQN (batchrl/algos/dqn.py): the epsilon schedule, the target network's copies and the
double-Q target, an exact state round trip, and learning CartPole and, through a convolutional
torso, a pixel task (CI-sized)."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from batchrl.algos import DQN
from batchrl.errors import UnsupportedSpaceError
from batchrl.interrupt import Interrupted
from batchrl.simulation import simulate
from helpers import (assert_continues_alike, assert_same, interrupting_after,
                     seeded_tensor_env)

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


def explored(algo: DQN, observ: torch.Tensor) -> float:
    """The share of ``algo``'s actions for ``observ`` (one agent each) that are not its
    Q-network's best."""
    action, _ = algo.perform(torch.arange(len(observ)), observ)
    with torch.no_grad():
        return float((action != algo.q(observ).argmax(-1)).float().mean())


def test_training_explores_with_epsilon_and_evaluation_with_final_epsilon_or_none():
    torch.manual_seed(0)
    box, four = gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(4)
    observ = torch.randn(4000, 3)
    fresh = DQN(box, four, 4000, hidden=(8,), final_epsilon=0.2)
    # epsilon 1: uniform actions, 3 in 4 of them not the best
    assert explored(fresh, observ) == pytest.approx(0.75, abs=0.03)
    fresh.eval()
    assert explored(fresh, observ) == 0.0  # greedy
    sampling = DQN(box, four, 4000, hidden=(8,), final_epsilon=0.2, eval_actions="sample")
    sampling.eval()  # (in training its epsilon would still be 1)
    assert explored(sampling, observ) == pytest.approx(0.2 * 0.75, abs=0.03)
    settled = DQN(box, four, 4000, hidden=(8,), final_epsilon=0.2, exploration_steps=0)
    assert explored(settled, observ) == pytest.approx(0.2 * 0.75, abs=0.03)


def test_a_discrete_space_that_starts_elsewhere_acts_in_its_range_and_stores_indices():
    torch.manual_seed(0)
    algo = DQN(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(3, start=-1),
               300, hidden=(8,))
    agents, observ = torch.arange(300), torch.randn(300, 3)
    action, _ = algo.perform(agents, observ)  # (epsilon 1: uniform)
    assert set(action.tolist()) == {-1, 0, 1}
    flags = torch.zeros(300, dtype=torch.bool)
    algo.experience(agents, observ, action, torch.zeros(300), flags, observ, flags)
    assert torch.equal(algo.buffer.tensors["action"][0], action + 1)  # the Q-network's index
    algo.eval()
    with torch.no_grad():
        assert torch.equal(algo.perform(agents, observ)[0], algo.q(observ).argmax(-1) - 1)


def test_a_terminated_step_is_worth_its_reward_alone():
    box = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    algo = DQN(box, gym.spaces.Discrete(2), 2, hidden=(), batch_size=8)  # Q(s) = bias
    with torch.no_grad():
        algo.target_q[-1].bias += 100.0  # (a bootstrap would be far off)
    agents, observ, ones = torch.arange(2), torch.zeros(2, 1), torch.ones(2)
    algo.experience(agents, observ, torch.zeros(2, dtype=torch.int64), ones, ones, observ, ones)
    q = algo.q[-1].bias[0].detach().clone()
    loss = algo.gradient_step()["dqn/loss"]
    assert float(loss) == pytest.approx(float(F.smooth_l1_loss(q, torch.tensor(1.0))))


def test_the_gradient_is_clipped_to_max_grad_norm():
    """Adam's first step moves each weight by about its learning rate whatever the gradient's
    size, unless the gradient is far below Adam's epsilon (1e-8): clipped to a norm of 1e-12,
    it barely moves them."""
    moved = {}
    for norm in (10.0, 1e-12):
        algo, env = filled_dqn(10, max_grad_norm=norm)  # 20 env steps: no gradient step yet
        env.close()
        before = copy.deepcopy(algo.q.state_dict())
        algo.gradient_step()
        moved[norm] = max(float((algo.q.state_dict()[key] - value).abs().max())
                          for key, value in before.items())
    assert moved[10.0] > 0.8 * 5e-4 and moved[1e-12] < 1e-6  # (learning_rate 5e-4)


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


def test_a_batch_steps_gradient_steps_stop_between_them_when_interrupted():
    """Ctrl-C while a batch step owes many gradient steps (``updates_per_step``, a few agents):
    the trainer's check runs before each, so the run stops after the one under way."""
    algo, env = filled_dqn(10, updates_per_step=4.0)  # 20 env steps: none taken yet
    algo.interrupt_check, calls = interrupting_after(3)
    with pytest.raises(Interrupted):
        simulate(env, algo)  # owes 8 gradient steps
    assert len(calls) == 4 and algo.updates == 3
    env.close()


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
