"""The example algorithm: REINFORCE with a value baseline learns, evaluates and checkpoints."""

from __future__ import annotations

import copy
import io
import math

import gymnasium as gym
import pytest
import torch

from batchrl.algos import Reinforce
from batchrl.parts import discounted_return
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import simulate
from helpers import assert_same, seeded_tensor_env


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(env: TensorBatchEnv, algo: Reinforce, steps: int) -> list[dict[str, float]]:
    algo.train()
    summaries = []
    for step in range(steps):
        _, _, summary = simulate(env, algo, reset=step == 0)
        summaries.append(summary)
    return summaries


def evaluate(env: TensorBatchEnv, algo: Reinforce) -> list[float]:
    """The return of the first episode of each env, acting with the mode."""
    algo.eval()
    returns: list[float | None] = [None] * len(env)
    reset = True
    while any(value is None for value in returns):
        done, score, _ = simulate(env, algo, reset=reset)
        reset = False
        for agent in done.nonzero().squeeze(1).tolist():
            if returns[agent] is None:
                returns[agent] = score[agent].item()
    return returns  # type: ignore[return-value]


def test_discounted_returns_with_padding_and_bootstrap():
    gamma = 0.5
    reward = torch.tensor([[1.0, 2.0, 4.0, 99.0],    # 3 steps, terminal; 99 is padding
                           [1.0, 1.0, 7.0, 7.0]])    # 2 steps, truncated
    length = torch.tensor([3, 2])
    bootstrap = torch.tensor([0.0, 8.0])
    expected = torch.tensor([[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4, 0],
                             [1 + 0.5 * 1 + 0.25 * 8, 1 + 0.5 * 8, 0, 0]])
    assert torch.allclose(discounted_return(reward, length, gamma, bootstrap), expected)


def test_learns_cartpole():
    """8 CartPole envs, 4000 steps (32000 env steps, about 15 updates of 16 episodes)."""
    seed = 0
    torch.manual_seed(seed)
    env = seeded_tensor_env("CartPole-v1", 8, seed)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=500,
                     learning_rate=1e-2, update_every=16, seed=seed)
    summaries = train(env, algo, 4000)
    losses = [s["reinforce/loss"] for s in summaries if "reinforce/loss" in s]
    assert len(losses) >= 10 and all(math.isfinite(loss) for loss in losses)
    assert all(set(s) == {"reinforce/loss", "reinforce/value_loss", "reinforce/episodes"}
               for s in summaries if s)
    returns = evaluate(env, algo)
    # A random policy averages about 22; the greedy policy after training
    # reaches 487-500 for seeds 0-9, so 200 leaves a wide margin.
    assert sum(returns) / len(returns) >= 200, returns
    env.close()


def test_eval_learns_nothing_and_is_deterministic():
    env = seeded_tensor_env("CartPole-v1", 4, seed=1)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=500,
                     update_every=2, seed=1)
    before = [p.detach().clone() for p in algo.policy.parameters()]
    algo.eval()
    for step in range(100):
        _, _, summary = simulate(env, algo, reset=step == 0)
        assert summary == {}  # no update, so nothing to report
    assert all(torch.equal(a, b) for a, b in zip(before, algo.policy.parameters()))
    observ = torch.randn(5, 4)
    first, _ = algo.perform(torch.arange(5), observ)
    second, _ = algo.perform(torch.arange(5), observ)
    assert torch.equal(first, second) and first.dtype == torch.int64
    env.close()


def test_sampled_evaluations_follow_their_seed_and_leave_the_training_draws_alone():
    from batchrl.simulation import evaluate_episodes

    env = seeded_tensor_env("CartPole-v1", 2, seed=1)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=500,
                     eval_actions="sample", seed=1)
    draws = algo._generator.get_state()
    first = evaluate_episodes(env, algo, 4, seed=7)
    assert evaluate_episodes(env, algo, 4, seed=7) == first
    assert evaluate_episodes(env, algo, 4, seed=8) != first
    assert torch.equal(algo._generator.get_state(), draws)
    env.close()


def round_trip(state: dict) -> dict:
    """Through torch.save / torch.load, as a checkpoint on disk would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_state_dict_round_trip(name: str):
    env = seeded_tensor_env(name, 4, seed=2)
    kwargs = dict(max_length=500, update_every=4)
    algo = Reinforce(env.observation_space, env.action_space, len(env), seed=2, **kwargs)
    summaries = train(env, algo, 250)  # long enough for updates, so Adam has state
    assert any("reinforce/loss" in s for s in summaries)
    state = round_trip(algo.state_dict())
    fresh = Reinforce(env.observation_space, env.action_space, len(env), seed=3, **kwargs)
    observ = torch.randn(16, *env.observation_space.shape)
    agents = torch.arange(16)
    assert not torch.equal(fresh.eval().perform(agents, observ)[0],
                           algo.eval().perform(agents, observ)[0])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.perform(agents, observ)[0], algo.perform(agents, observ)[0])

    # Resuming is exact: both go on training on identically seeded envs and
    # end with equal weights (same sampled actions, updates and Adam moments).
    env.close()
    for resumed in (algo, fresh):
        resumed_env = seeded_tensor_env(name, 4, seed=5)
        train(resumed_env, resumed, 250)
        resumed_env.close()
    for ours, theirs in zip(algo.state_dict()["policy"].values(),
                            fresh.state_dict()["policy"].values()):
        assert torch.equal(ours, theirs)


def test_a_loaded_state_goes_on_with_the_episodes_in_progress():
    """Saved mid-episode and loaded into another instance: the steps recorded of the episodes
    in progress come along (``state_dict`` holds them to resume exactly), so that both end
    those episodes with the same update."""
    env = seeded_tensor_env("CartPole-v1", 2, seed=3)
    kwargs = dict(max_length=500, update_every=2)
    algo = Reinforce(env.observation_space, env.action_space, len(env), seed=3, **kwargs)
    algo.train()
    simulate(env, algo, reset=True)
    for _ in range(4):
        simulate(env, algo)
    env.close()
    assert algo.state_dict()["episodes"]["length"].tolist() == [5, 5]  # (no episode ended)
    fresh = Reinforce(env.observation_space, env.action_space, len(env), seed=4, **kwargs)
    fresh.load_state_dict(round_trip(algo.state_dict()))
    assert_same(fresh.state_dict(), algo.state_dict())
    agents = torch.arange(2)
    summaries = []
    for each in (algo, fresh):
        each.experience(agents, torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64),
                        torch.ones(2), torch.ones(2), torch.zeros(2, 4), torch.ones(2))
        summaries.append(each.end_episodes(agents))
    assert summaries[0]["reinforce/episodes"] == 2.0 and summaries[1] == summaries[0]


def test_a_state_saved_on_another_kind_of_device_loads():
    """A CUDA generator's state (16 bytes) does not fit a CPU generator (and back): a GPU run's
    checkpoint still loads on the CPU, with a fresh sampling stream."""
    space = gym.spaces.Box(-1, 1, (3,))
    algo = Reinforce(space, gym.spaces.Discrete(2), 2, max_length=10, seed=0)
    state = algo.state_dict()
    state["generator"] = torch.zeros(16, dtype=torch.uint8)
    state["memory_size"] = 1  # (a state that differs from the fresh one's beyond its weights)
    fresh = Reinforce(space, gym.spaces.Discrete(2), 2, max_length=10, seed=1)
    fresh.load_state_dict(state)
    loaded = fresh.state_dict()
    assert loaded["generator"].numel() != 16  # a CPU generator, freshly seeded
    del loaded["generator"], state["generator"]
    assert_same(loaded, state)
    action, _ = fresh.train().perform(torch.arange(2), torch.zeros(2, 3))  # it samples
    assert action.shape == (2,)


def test_box_actions_update_with_truncation(monkeypatch):
    """Pendulum: Gaussian policy, episodes always truncated at 200 steps, whose returns
    bootstrap from the value of their last observation (not from 0, as after a terminal
    state)."""
    from batchrl.algos import reinforce

    bootstraps = []

    def recording(reward, length, discount, bootstrap):
        bootstraps.append(bootstrap.clone())
        return discounted_return(reward, length, discount, bootstrap)

    monkeypatch.setattr(reinforce, "discounted_return", recording)
    env = seeded_tensor_env("Pendulum-v1", 2, seed=4)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=200,
                     update_every=2, seed=4)
    summaries = train(env, algo, 400)
    updates = [s for s in summaries if s]
    assert len(updates) == 2
    assert len(bootstraps) == 2 and all(bool((b != 0).all()) for b in bootstraps)
    assert all(math.isfinite(value) for s in updates for value in s.values())
    algo.eval()
    action, _ = algo.perform(torch.arange(2), env.observ)
    assert action.shape == (2, 1) and action.dtype == torch.float32
    env.close()


def test_episode_longer_than_max_length_raises():
    env = seeded_tensor_env("CartPole-v1", 2, seed=6)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=3, seed=6)
    with pytest.raises(ValueError, match="max_length"):
        train(env, algo, 10)  # CartPole episodes last at least 8 steps
    env.close()


def test_seed_fixes_weights_and_leaves_global_rng_alone():
    box, discrete = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2)

    def weights(algo: Reinforce) -> list[torch.Tensor]:
        return list(algo.policy.state_dict().values()) + list(algo.value.state_dict().values())

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first, second = (Reinforce(box, discrete, 1, 10, seed=7) for _ in range(2))
    assert torch.equal(torch.rand(3), expected)  # seeded construction drew nothing
    assert all(torch.equal(a, b) for a, b in zip(weights(first), weights(second)))
    # Without a seed, two instances are initialised differently.
    first, second = (Reinforce(box, discrete, 1, 10) for _ in range(2))
    assert not all(torch.equal(a, b) for a, b in zip(weights(first), weights(second)))


def test_rejects_unsupported_spaces():
    box = gym.spaces.Box(-1, 1, (3,))
    with pytest.raises(TypeError, match="action space"):
        Reinforce(box, gym.spaces.MultiDiscrete([2, 2]), 1, 10)
    with pytest.raises(TypeError, match="observation space"):
        Reinforce(gym.spaces.Discrete(3), gym.spaces.Discrete(2), 1, 10)


def test_one_update_is_the_textbook_reinforce_step():
    """Two hand-made episodes through the Algorithm calls: agent 1's truncated after 2 steps
    (its return bootstraps from the value of the observation after its last step), agent 0's
    terminal after 3 (no bootstrap). The reported losses and the gradients are those of
    -mean(log pi(a|s) * normalised(G - V(s))) + 0.5 * mean((G - V(s))^2) over the 5 recorded
    steps, G discounted by ``discount``, and the actions keep the space's ``start``."""
    gamma = 0.9
    observation_space = gym.spaces.Box(-1, 1, (3,))
    action_space = gym.spaces.Discrete(3, start=-1)  # actions -1, 0, 1
    kwargs = dict(max_length=4, update_every=2, discount=gamma, hidden=(8,), seed=0)
    algo = Reinforce(observation_space, action_space, 2, **kwargs)
    twin = Reinforce(observation_space, action_space, 2, **kwargs)  # (the same weights)
    generator = torch.Generator().manual_seed(0)
    observ = torch.randn(3, 2, 3, generator=generator)  # [step, agent]
    after = torch.randn(3, 2, 3, generator=generator)  # the next observations
    actions = torch.tensor([[-1, 1], [0, -1], [1, 0]])
    rewards = torch.tensor([[1.0, -2.0], [0.5, 3.0], [2.0, 0.0]])
    both, first = torch.arange(2), torch.tensor([0])
    # (``done`` and ``terminated`` are float32 flags, as the Algorithm contract has them)

    algo.train()
    algo.begin_episodes(both)
    algo.experience(both, observ[0], actions[0], rewards[0], torch.tensor([0.0, 0.0]),
                    after[0], torch.tensor([0.0, 0.0]))
    algo.experience(both, observ[1], actions[1], rewards[1], torch.tensor([0.0, 1.0]),
                    after[1], torch.tensor([0.0, 0.0]))  # agent 1: truncated
    assert algo.end_episodes(torch.tensor([1])) == {}  # 1 episode of 2: no update yet
    algo.experience(first, observ[2, :1], actions[2, :1], rewards[2, :1], torch.tensor([1.0]),
                    after[2, :1], torch.tensor([1.0]))  # agent 0: terminal
    summary = algo.end_episodes(first)
    assert summary["reinforce/episodes"] == 2.0

    # The reference, with the twin's networks (what the algorithm held before its step).
    with torch.no_grad():
        bootstrap1 = twin.value(after[1, 1]).item()
    episodes = [  # (agent, steps, bootstrap)
        (0, 3, 0.0),
        (1, 2, bootstrap1)]
    states, taken, returns = [], [], []
    for agent, steps, bootstrap in episodes:
        running = bootstrap
        episode_returns = []
        for t in reversed(range(steps)):
            running = rewards[t, agent].item() + gamma * running
            episode_returns.insert(0, running)
        returns += episode_returns
        states += [observ[t, agent] for t in range(steps)]
        taken += [int(actions[t, agent]) + 1 for t in range(steps)]  # index = action - start
    states, taken, returns = torch.stack(states), torch.tensor(taken), torch.tensor(returns)
    value = twin.value(states).squeeze(1)
    log_prob = torch.distributions.Categorical(logits=twin.policy(states)).log_prob(taken)
    advantage = (returns - value).detach()
    advantage = (advantage - advantage.mean()) / (advantage.std(unbiased=False) + 1e-8)
    policy_loss = -(log_prob * advantage).mean()
    value_loss = 0.5 * ((returns - value) ** 2).mean()
    (policy_loss + value_loss).backward()

    assert summary["reinforce/loss"] == pytest.approx(policy_loss.item(), rel=1e-5, abs=1e-6)
    assert summary["reinforce/value_loss"] == pytest.approx(value_loss.item(), rel=1e-5)
    for network in ("policy", "value"):
        for (name, ours), theirs in zip(getattr(algo, network).named_parameters(),
                                        getattr(twin, network).parameters()):
            assert torch.allclose(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6), \
                f"{network}.{name}"


def test_actions_of_a_discrete_space_that_does_not_start_at_0():
    """Discrete(3, start=5) has actions 5, 6 and 7, sampled or most likely."""
    algo = Reinforce(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(3, start=5), 64,
                     max_length=10, seed=0)
    observ = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    for mode in (algo.train, algo.eval):
        mode()
        action, _ = algo.perform(torch.arange(64), observ)
        assert set(action.tolist()) <= {5, 6, 7}, action
    assert set(algo.train().perform(torch.arange(64), observ)[0].tolist()) == {5, 6, 7}


def test_evaluation_records_nothing():
    """In eval() the algorithm records nothing: its whole state is left as it was, and
    evaluation episodes longer than max_length (which bounds only what training records)
    run to their end."""
    env = seeded_tensor_env("CartPole-v1", 2, seed=3)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=5,
                     update_every=2, seed=3)
    before = algo.state_dict()
    algo.eval()
    finished = 0
    for step in range(60):  # CartPole episodes last at least 8 steps
        done, _, _ = simulate(env, algo, reset=step == 0)
        finished += int(done.sum())
    assert finished >= 1
    assert_same(algo.state_dict(), before)
    env.close()


def test_state_dict_is_a_snapshot_that_training_on_does_not_change():
    env = seeded_tensor_env("Pendulum-v1", 2, seed=4)
    algo = Reinforce(env.observation_space, env.action_space, len(env), max_length=200,
                     update_every=2, seed=4)
    assert torch.equal(algo.log_std.exp(), torch.ones(1))  # std starts at 1
    algo.train()
    for step in range(200):  # one update
        simulate(env, algo, reset=step == 0)
    state = algo.state_dict()
    kept = copy.deepcopy(state)
    for step in range(200):  # another one, and new episodes recorded
        _, _, summary = simulate(env, algo)
    assert "reinforce/loss" in summary
    assert_same(state, kept)
    env.close()
