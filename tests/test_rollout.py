"""The rollout layout shared by the synchronous loop, collectors and learners
(``batchrl.parts.rollout``), and BatchPPO's learning step on it."""

from __future__ import annotations

import copy as copy_module

import gymnasium as gym
import numpy as np
import pytest
import torch

import batchrl.algos.ppo as ppo_module
from batchrl.algos.ppo import BatchPPO
from batchrl.parts.rollout import Rollout, RolloutBuffer, rollout_tensors


def buffer(agents=3, length=4, dtype=torch.float32):
    return RolloutBuffer(rollout_tensors(agents, length, (2,), dtype, (), torch.int64,
                                         {"log_prob": ((), torch.float32)}))


def record(buf, steps, done_at=()):
    """Record ``steps`` steps; observation of agent i at step t is [t, i]; agents in
    ``done_at`` (pairs (t, i)) end their episode at step t."""
    n = buf.num_agents
    for t in range(steps):
        observ = torch.tensor([[t, i] for i in range(n)], dtype=torch.float32)
        buf.act(observ, torch.arange(n), {"log_prob": torch.full((n,), -float(t))})
        done = torch.tensor([float((t, i) in done_at) for i in range(n)])
        after = observ + torch.tensor([0.5, 0.0])  # the observation after the step
        buf.outcome(torch.full((n,), float(t)), done, done * 0, after)


def test_a_buffer_records_steps_in_the_rollout_layout():
    buf = buffer()
    buf.start(torch.tensor([5, 6, 7]), version=9)
    record(buf, 4, done_at={(1, 2)})
    assert buf.full
    rollout = buf.rollout()
    assert rollout.size == 3 and rollout.length == 4
    assert rollout.observ.shape == (3, 5, 2) and rollout.action.dtype == torch.int64
    assert rollout.agents.tolist() == [5, 6, 7] and rollout.version.tolist() == [9] * 3
    assert rollout.behaviour["log_prob"][0].tolist() == [0.0, -1.0, -2.0, -3.0]
    # observ[:, T] is the observation after the last step
    assert rollout.observ[1, 4].tolist() == [3.5, 1.0]
    # where a step ended the episode, final_observ holds its last observation; next_observ
    # takes it there and the next acted-on observation elsewhere
    assert rollout.final_observ[2, 1].tolist() == [1.5, 2.0]
    assert rollout.final_observ[2, 0].tolist() == [0.0, 0.0]
    after = rollout.next_observ()
    assert after[2, 1].tolist() == [1.5, 2.0] and after[0, 1].tolist() == [2.0, 0.0]
    # given a mask, only its steps (agent by agent), the ended one's last observation included
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[2, 1] = mask[0, 1] = mask[2, 3] = True
    assert torch.equal(rollout.next_observ(mask), after[mask])
    with pytest.raises(RuntimeError, match="already holds its 4 steps"):
        buf.act(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64),
                {"log_prob": torch.zeros(3)})


def test_an_episode_cut_by_a_reset_ends_at_its_last_step_without_a_terminal_state():
    buf = buffer()
    buf.start(torch.arange(3), 0)
    record(buf, 2, done_at={(1, 0)})
    # agent 0 ended its episode at step 1 (a natural start); agents 1, 2 were cut
    buf.begin_episodes(torch.tensor([0, 1]))
    rollout = buf.rollout()
    assert rollout.valid[:, 1].tolist() == [True, False, True]
    assert rollout.done[:, 1].tolist() == [1.0, 1.0, 0.0]
    assert rollout.terminated[:, 1].tolist() == [0.0, 0.0, 0.0]
    assert rollout.final_observ[1, 1].tolist() == rollout.observ[1, 1].tolist()
    # a new rollout starts clean (no last observation of an episode ended in the one before),
    # and has no step of an agent to cut yet
    buf.start(torch.arange(3), 1)
    buf.cut(torch.tensor([1]))
    assert buf.rollout().valid.all() and not buf.rollout().done.any()
    assert not buf.rollout().final_observ.any()


def test_rollouts_side_by_side_copy_and_move():
    first, second = buffer(agents=2), buffer(agents=1, dtype=torch.uint8)
    for buf, agents in ((first, [0, 1]), (second, [2])):
        buf.start(torch.tensor(agents), 3)
        record(buf, 4)
    both = Rollout.cat([first.rollout(), second.rollout().to(torch.device("cpu"))])
    assert both.agents.tolist() == [0, 1, 2] and both.behaviour["log_prob"].shape == (3, 4)
    copy = first.rollout().clone()
    first.start(torch.tensor([0, 1]), 4)
    first.tensors["observ"].zero_()
    first.tensors["behaviour.log_prob"].zero_()
    assert copy.observ.abs().sum() > 0 and copy.version.tolist() == [3, 3]
    assert copy.behaviour["log_prob"][0].tolist() == [0.0, -1.0, -2.0, -3.0]


def ppo(**options):
    return BatchPPO(gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                    gym.spaces.Box(-1, 1, (2,), np.float32), 4, rollout_length=6,
                    update_epochs=2, minibatch_size=8, inference="eager", update_threads=1,
                    **options)


def collect(actor, steps=6, cut=None, terminal=True):
    """A rollout of ``steps`` steps in which agent 2 reaches a terminal state at step 2 (with
    ``terminal=False`` a time limit ends its episode there); ``cut``: step -> agents whose env
    restarted after it (the step is lost)."""
    buf = RolloutBuffer(rollout_tensors(4, steps, (3,), torch.float32, (2,), torch.float32,
                                        actor.behaviour_fields()))
    buf.start(torch.arange(4), 0)
    generator = torch.Generator().manual_seed(0)
    for t in range(steps):
        observ = torch.randn(4, 3, generator=generator)
        action, behaviour = actor.act(observ)
        buf.act(observ, action, behaviour)
        done = torch.tensor([0.0, 0.0, float(t == 2), 0.0])
        buf.outcome(torch.randn(4, generator=generator), done, done if terminal else done * 0,
                    torch.randn(4, 3, generator=generator))
        if cut and t in cut:
            buf.cut(torch.tensor(cut[t]))
    return buf.rollout()


def test_ppo_learns_from_its_own_rollout_with_unit_importance_weights():
    torch.manual_seed(0)
    learner = ppo()
    before = copy_module.deepcopy(learner)
    summary = learner.learn(collect(learner))
    assert summary["ppo/importance_weight"] == pytest.approx(1.0)
    assert summary["ppo/updates"] == 1.0 and learner.env_steps == 24
    for network in ("policy", "value"):  # both took their steps
        assert any(not torch.equal(a, b) for a, b in zip(
            getattr(before, network).parameters(), getattr(learner, network).parameters()))


def test_ppo_counts_a_rollout_whose_every_step_was_lost_and_learns_nothing_from_it():
    """Env restarts at a rollout's last step cut every agent's running segment: with
    minibatches, no step is left to take a gradient step on."""
    torch.manual_seed(0)
    learner = ppo()
    rollout = collect(learner)
    rollout.valid[:] = False
    weights = [p.clone() for p in learner.policy.parameters()]
    summary = learner.learn(rollout)
    assert summary["ppo/updates"] == 1.0 and learner.env_steps == 24
    assert "ppo/policy_loss" not in summary and "ppo/importance_weight" not in summary
    assert all(torch.equal(a, b) for a, b in zip(weights, learner.policy.parameters()))
    assert learner.learn(collect(learner))["ppo/updates"] == 2.0


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "time_limit"])
def test_learn_bootstraps_at_the_cut_and_not_after_a_terminal_state(monkeypatch, terminal):
    """An episode that a time limit ends bootstraps from its last observation, not from the
    next episode's first (the next one acted on)."""
    gamma, lam = 0.9, 0.8
    torch.manual_seed(0)
    learner = ppo(discount=gamma, gae_lambda=lam, normalize_reward=False,
                  normalize_observ=False)
    with torch.no_grad():  # values far from zero: a missing bootstrap shows
        learner.value.out.bias.fill_(5.0)
    value_net = copy_module.deepcopy(learner.value)  # before the update changes it
    found = {}
    real_advantages = BatchPPO._advantages

    def advantages(self, *args, **kwargs):
        found["data"], found["mask"] = result = real_advantages(self, *args, **kwargs)
        return result

    monkeypatch.setattr(BatchPPO, "_advantages", advantages)
    rollout = collect(learner, terminal=terminal)
    learner.learn(rollout)
    with torch.no_grad():
        value = value_net(rollout.observ[:, :-1]).double().numpy()
        after = value_net(rollout.next_observ()).double().numpy()
    reward, done = rollout.reward.double().numpy(), rollout.done.numpy()
    terminated = rollout.terminated.numpy()
    expected = np.zeros((4, 6))
    for agent in range(4):
        advantage = 0.0
        for t in reversed(range(6)):
            if t == 5 or done[agent, t]:  # (after the last step: the observation after it)
                advantage = 0.0
            delta = reward[agent, t] + gamma * after[agent, t] * (1 - terminated[agent, t]) \
                - value[agent, t]
            advantage = delta + gamma * lam * advantage
            expected[agent, t] = advantage
    assert terminated[2, 2] == float(terminal) and done[2, 2] == 1.0
    np.testing.assert_allclose(found["data"]["returns"].double().numpy(), expected + value,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("targets", ["gae", "vtrace"])
def test_learn_takes_nothing_from_a_step_a_restart_lost(targets):
    """The lost step's reward reaches neither the advantages of the steps before it nor the
    observation statistics, with GAE's targets or V-trace's."""
    torch.manual_seed(0)
    learner = ppo(value_targets=targets)
    rollout = collect(learner, cut={3: [1]})
    assert rollout.valid.sum() == 23 and not rollout.valid[1, 3]
    other = rollout.clone()
    other.reward[1, 3] += 100.0
    results = []
    for data in (rollout, other):
        copy = copy_module.deepcopy(learner)
        torch.manual_seed(1)
        results.append((copy.learn(data), copy))
    (summary, first), (other_summary, second) = results
    assert summary == other_summary
    for a, b in zip(first.value.parameters(), second.value.parameters()):
        assert torch.equal(a, b)
    assert float(first.observ_normalizer.count) == 23


def test_learn_keeps_statistics_of_discounted_returns_across_rollouts():
    """reward_scale="return": the running discounted return restarts after an episode's end,
    also at a rollout's last step, and carries into the next rollout."""
    torch.manual_seed(0)
    learner = ppo(reward_scale="return", discount=0.5)
    # Agent 2's episode ends mid-rollout in the first, at the last step in the second.
    rollouts = [collect(learner), collect(learner, steps=3)]
    running, returns = np.zeros(4), []
    for rollout in rollouts:
        learner.learn(rollout)
        reward, done = rollout.reward.double().numpy(), rollout.done.numpy()
        for t in range(rollout.length):
            running = running * 0.5 + reward[:, t]
            returns.append(running.copy())
            running[done[:, t] > 0] = 0.0
    returns = np.concatenate(returns)
    normalizer = learner.reward_normalizer
    assert float(normalizer.count) == 36
    np.testing.assert_allclose(float(normalizer.mean), returns.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(normalizer.variance), returns.var(ddof=1), rtol=1e-6)
    np.testing.assert_allclose(learner.running_return.numpy(), running, rtol=1e-6)


def lagged_and_on_policy(learner: BatchPPO) -> tuple[Rollout, Rollout]:
    """A rollout of a policy behind ``learner``'s, and the same steps with the learner's own
    distributions as behaviour (as if it had acted them)."""
    actor = ppo()
    actor.load_acting_state(learner.acting_state())
    with torch.no_grad():  # the behaviour policy differs from the learner's
        for parameter in actor.policy.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    lagged = collect(actor)
    _, own = learner.act(lagged.observ[:, :-1].reshape(-1, 3))
    return lagged, Rollout(**{**vars(lagged), "behaviour": {
        name: value.reshape(4, 6, *value.shape[1:]) for name, value in own.items()}})


@pytest.mark.parametrize("normalization", ["update", "minibatch"])
def test_ppo_weights_a_lagged_rollout_by_its_truncated_importance_ratio(normalization):
    torch.manual_seed(0)
    learner = ppo(advantage_normalization=normalization)
    before = [p.clone() for p in learner.policy.parameters()]
    lagged, on_policy = lagged_and_on_policy(learner)
    copy = copy_module.deepcopy(learner)
    torch.manual_seed(1)
    summary = learner.learn(lagged)
    assert 0.0 < summary["ppo/importance_weight"] < 0.5
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters()))
    torch.manual_seed(1)  # (the same minibatches)
    assert copy.learn(on_policy)["ppo/importance_weight"] == pytest.approx(1.0, abs=1e-3)
    # Only the weights differ: the value steps are the same, the policy steps are not.
    assert all(torch.equal(a, b) for a, b in zip(copy.value.parameters(),
                                                 learner.value.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(copy.policy.parameters(),
                                                     learner.policy.parameters()))


def test_acting_state_round_trip_acts_alike():
    learner, copy = ppo(), ppo()
    learner.observ_normalizer.update(torch.randn(64, 3) * 5 + 2)
    copy.load_acting_state(learner.acting_state())
    observ = torch.randn(5, 3)
    torch.manual_seed(1)
    first = learner.act(observ)
    torch.manual_seed(1)
    second = copy.act(observ)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1]["mean_or_logits"], second[1]["mean_or_logits"])


def test_ppo_with_vtrace_targets_learns_from_a_lagged_rollout():
    torch.manual_seed(0)
    actor = ppo()
    with torch.no_grad():
        for parameter in actor.policy.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    rollout = collect(actor)
    learned = {}
    for targets in ("vtrace", "gae"):
        torch.manual_seed(1)
        learner = ppo(value_targets=targets, gae_lambda=1.0)
        summary = learner.learn(rollout)
        assert np.isfinite(summary["ppo/total_loss"])
        learned[targets] = torch.cat([p.detach().flatten() for p in learner.value.parameters()])
    # V-trace's targets differ from the uncorrected returns where the policies differ
    assert not torch.allclose(learned["vtrace"], learned["gae"])


def test_vtrace_advantages_are_weighted_once(monkeypatch):
    """V-trace's policy-gradient advantages carry their truncated ratio already: the learner
    takes them as they are, not weighted by the behaviour ratio again."""
    found = {}

    def vtrace(*args, **kwargs):
        found["vtrace"] = result = real_vtrace(*args, **kwargs)
        return result

    def advantages(self, *args, **kwargs):
        found["data"], found["mask"] = result = real_advantages(self, *args, **kwargs)
        return result

    real_vtrace, real_advantages = ppo_module.vtrace, BatchPPO._advantages
    monkeypatch.setattr(ppo_module, "vtrace", vtrace)
    monkeypatch.setattr(BatchPPO, "_advantages", advantages)
    torch.manual_seed(0)
    learner = ppo(value_targets="vtrace", advantage_normalization="none")
    lagged, _ = lagged_and_on_policy(learner)
    assert learner.learn(lagged)["ppo/importance_weight"] < 0.5  # (weighting twice shows)
    assert torch.equal(found["data"]["advantage"], found["vtrace"].pg_advantage * found["mask"])


def test_vtrace_targets_without_lag_are_the_returns_of_gae_with_lambda_one():
    from batchrl.simulation import Simulation
    from batchrl.tensor_env import TensorBatchEnv
    from batchrl.envs import BatchEnv

    def one_update(**options):
        torch.manual_seed(0)
        env = TensorBatchEnv(BatchEnv([gym.make("CartPole-v1") for _ in range(4)],
                                      blocking=True))
        algo = BatchPPO(env.observation_space, env.action_space, 4, rollout_length=16,
                        update_epochs=1, inference="eager", update_threads=1, **options)
        simulation = Simulation(env)
        for step in range(16):
            simulation.step(algo, reset=step == 0, seed=0 if step == 0 else None)
        env.close()
        return [p.detach().clone() for p in (*algo.policy.parameters(),
                                             *algo.value.parameters())]

    for a, b in zip(one_update(value_targets="vtrace"), one_update(gae_lambda=1.0)):
        assert torch.allclose(a, b, atol=1e-5)


def test_vtrace_targets_need_rollouts():
    with pytest.raises(ValueError, match="value_targets='vtrace' needs fixed-length rollouts"):
        BatchPPO(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2), 2, value_targets="vtrace")
