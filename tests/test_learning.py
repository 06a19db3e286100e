"""BatchPPO learns CartPole-v1 and Pendulum-v1 (fixed seeds, CI-sized budgets).

Each test trains with sampled actions through ``simulate()`` and then scores
the mean action (evaluation mode) on fresh episodes of every agent.
"""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from batchrl.algos import BatchPPO, PPOConfig
from batchrl.envs import BatchEnv, wrap_env
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import simulate

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def train_and_evaluate(env_id: str, agents: int, steps: int, config: PPOConfig,
                       max_length: int) -> list[float]:
    """Train for ``steps`` env steps, then return one mean-action return per agent."""
    torch.manual_seed(0)
    env = TensorBatchEnv(BatchEnv([wrap_env(gym.make(env_id), max_length)
                                   for _ in range(agents)]))
    env.reset(seed=0)
    algo = BatchPPO(env.observation_space, env.action_space, agents, config,
                    max_length=max_length)
    updates = 0
    for _ in range(steps // agents):
        _, _, summary = simulate(env, algo)
        updates += "ppo/kl" in summary
    assert updates >= 3, "the budget must allow several updates"
    algo.eval()
    returns = torch.full((agents,), float("nan"))
    done, score, _ = simulate(env, algo, reset=True)
    while True:
        returns = torch.where(done & returns.isnan(), score, returns)
        if not returns.isnan().any():
            return returns.tolist()
        done, score, _ = simulate(env, algo)


# Learning runs take 20-90 s on 2 cores; far longer on a loaded machine, so
# their hang guard is wider than the suite's 300 s.
@pytest.mark.timeout(900)
def test_ppo_learns_cartpole():
    config = PPOConfig(discount=0.99, update_every=20, policy_lr=3e-4)
    returns = train_and_evaluate("CartPole-v1", 10, 60_000, config, 500)
    assert sum(returns) / len(returns) >= 450, returns


@pytest.mark.timeout(900)
def test_ppo_learns_pendulum():
    config = PPOConfig(discount=0.95, update_every=20, policy_lr=3e-4)
    returns = train_and_evaluate("Pendulum-v1", 10, 150_000, config, 200)
    assert sum(returns) / len(returns) >= -400, returns


@pytest.mark.timeout(900)
def test_ppo_learns_pendulum_on_rollouts():
    # The MuJoCo configs' path: fixed-length rollouts that cut episodes and
    # bootstrap there (Pendulum's episodes end only by the time limit, so
    # every return is bootstrapped), minibatches of time steps, orthogonal
    # tanh networks, reward statistics of discounted returns.
    config = PPOConfig(discount=0.95, gae_lambda=0.95, rollout_length=50,
                       update_epochs=5, minibatch_size=100, policy_layers=(64, 64),
                       value_layers=(64, 64), activation="tanh", init="orthogonal",
                       init_output_factor=0.01, init_std=0.5, policy_lr=1e-3, value_lr=1e-3,
                       max_grad_norm=0.5, reward_scale="return")
    returns = train_and_evaluate("Pendulum-v1", 10, 100_000, config, 200)
    assert sum(returns) / len(returns) >= -400, returns
