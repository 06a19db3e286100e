"""V-trace targets (batchrl.parts.vtrace) against the paper's recursion written as a loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from batchrl.parts import discounted_return, gae, vtrace


def reference_vtrace(log_rho, reward, value, next_value, ends, gamma, rho_bar, c_bar):
    """Espeholt et al. (2018), section 4.1, one row and one step at a time, backwards:
    ``v_t = V(x_t) + delta_t + gamma c_t (v_{t+1} - V(x_{t+1}))`` with the correction zero
    where step ``t`` ends the episode or the rollout, and the advantage
    ``rho_t (r_t + gamma v_{t+1} - V(x_t))`` with ``v_{t+1}`` the next value there."""
    rows, steps = reward.shape
    vs = np.zeros((rows, steps))
    advantage = np.zeros((rows, steps))
    for b in range(rows):
        for t in reversed(range(steps)):
            ratio = math.exp(log_rho[b, t])
            rho, c = min(rho_bar, ratio), min(c_bar, ratio)
            last = bool(ends[b, t]) or t == steps - 1
            delta = rho * (reward[b, t] + gamma * next_value[b, t] - value[b, t])
            correction = 0.0 if last else vs[b, t + 1] - value[b, t + 1]
            vs[b, t] = value[b, t] + delta + gamma * c * correction
            after = next_value[b, t] if last else vs[b, t + 1]
            advantage[b, t] = rho * (reward[b, t] + gamma * after - value[b, t])
    return vs, advantage


def random_rollout(seed: int, rows: int = 5, steps: int = 17, end_rate: float = 0.15,
                   log_rho_scale: float = 1.0):
    """Random float64 inputs as a learner sees them: ``next_value`` is the next step's value
    inside an episode, 0 after a terminal state, another value after a truncation."""
    rng = np.random.default_rng(seed)
    value = rng.normal(size=(rows, steps))
    after_last = rng.normal(size=(rows, 1))
    next_value = np.concatenate([value[:, 1:], after_last], axis=1)
    ends = rng.uniform(size=(rows, steps)) < end_rate
    terminated = ends & (rng.uniform(size=(rows, steps)) < 0.5)
    truncated_value = rng.normal(size=(rows, steps))
    next_value = np.where(terminated, 0.0, np.where(ends, truncated_value, next_value))
    return {"log_rho": rng.normal(scale=log_rho_scale, size=(rows, steps)),
            "reward": rng.normal(size=(rows, steps)), "value": value,
            "next_value": next_value, "ends": ends}


def run(inputs: dict, gamma: float, rho_bar: float = 1.0, c_bar: float = 1.0):
    tensors = {name: torch.from_numpy(np.asarray(array)) for name, array in inputs.items()}
    return vtrace(**tensors, discount=gamma, rho_bar=rho_bar, c_bar=c_bar)


def check_against_reference(inputs: dict, gamma: float, rho_bar: float, c_bar: float) -> None:
    vs, advantage = run(inputs, gamma, rho_bar, c_bar)
    expected_vs, expected_advantage = reference_vtrace(
        *(inputs[name] for name in ("log_rho", "reward", "value", "next_value", "ends")),
        gamma, rho_bar, c_bar)
    np.testing.assert_allclose(vs.numpy(), expected_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(advantage.numpy(), expected_advantage, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho_bar, c_bar", [(1.0, 1.0), (2.0, 0.5), (0.7, 0.7), (5.0, 3.0)])
def test_matches_the_recursion_with_episode_ends_inside_rollouts(seed, rho_bar, c_bar):
    inputs = random_rollout(seed)
    assert inputs["ends"][:, :-1].any()  # episodes end inside the rollouts
    check_against_reference(inputs, 0.9, rho_bar, c_bar)


@pytest.mark.parametrize("steps", [1, 2, 3, 64, 200])
def test_matches_the_recursion_for_any_length(steps):
    # Long rollouts without ends: traces reach over every step (log_rho near 0, so the
    # products of c do not vanish), which the doubling steps of discounted_cumsum must get.
    inputs = random_rollout(steps, rows=3, steps=steps, end_rate=0.0, log_rho_scale=0.1)
    check_against_reference(inputs, 0.99, 1.0, 1.0)


@pytest.mark.parametrize("scale", [0.01, 3.0, 30.0])
def test_matches_the_recursion_for_small_and_large_ratios(scale):
    # Ratios from far below to far above the truncation levels.
    inputs = random_rollout(7, log_rho_scale=scale)
    check_against_reference(inputs, 0.95, 1.0, 1.0)
    check_against_reference(inputs, 0.95, 2.0, 0.9)


def test_on_policy_targets_are_n_step_bootstrapped_returns():
    # rho = 1 (log_rho = 0) with rho_bar = c_bar = 1: v_t is the discounted sum of the rewards
    # to the end of the episode or rollout, plus the discounted value after it; the advantage
    # is r_t + gamma v_{t+1} - V(x_t).
    gamma = 0.9
    inputs = random_rollout(11, rows=4, steps=13)
    inputs["log_rho"] = np.zeros_like(inputs["reward"])
    reward, next_value, ends = inputs["reward"], inputs["next_value"], inputs["ends"]
    rows, steps = reward.shape
    expected = np.zeros((rows, steps))
    for b in range(rows):
        for t in range(steps):
            end = t
            while end < steps - 1 and not ends[b, end]:
                end += 1
            expected[b, t] = (sum(gamma ** (k - t) * reward[b, k] for k in range(t, end + 1))
                              + gamma ** (end - t + 1) * next_value[b, end])
    vs, advantage = run(inputs, gamma)
    np.testing.assert_allclose(vs.numpy(), expected, rtol=1e-10, atol=1e-10)
    later = np.where(ends | (np.arange(steps) == steps - 1), next_value,
                     np.concatenate([expected[:, 1:], np.zeros((rows, 1))], axis=1))
    np.testing.assert_allclose(advantage.numpy(),
                               reward + gamma * later - inputs["value"], rtol=1e-10, atol=1e-10)
    # The same targets from the padded-episode estimator, one episode at a time: the first
    # row's first episode, bootstrapped from the value after its last step.
    first_end = int(np.argmax(ends[0] | (np.arange(steps) == steps - 1)))
    returns = discounted_return(torch.from_numpy(reward[:1]),
                                torch.tensor([first_end + 1]), gamma,
                                torch.from_numpy(next_value[0, first_end:first_end + 1]))
    np.testing.assert_allclose(vs.numpy()[0, :first_end + 1],
                               returns.numpy()[0, :first_end + 1], rtol=1e-10)


def test_ratios_above_the_truncation_act_as_on_policy():
    # Every ratio > 1 and rho_bar = c_bar = 1: all are truncated to 1.
    inputs = random_rollout(3)
    on_policy = {**inputs, "log_rho": np.zeros_like(inputs["reward"])}
    inputs["log_rho"] = np.abs(inputs["log_rho"]) + 0.01
    for ours, theirs in zip(run(inputs, 0.9), run(on_policy, 0.9)):
        assert torch.equal(ours, theirs)
    # Above rho_bar = 1 the ratios count up to rho_bar, and with c_bar -> 0 the targets are
    # one-step: V + rho (r + gamma next_value - V); the advantages bootstrap from the next
    # step's target inside an episode, from next_value where a step ends one or the rollout.
    vs, advantage = run(inputs, 0.9, rho_bar=3.0, c_bar=1e-12)
    rho = np.minimum(3.0, np.exp(inputs["log_rho"]))
    one_step = rho * (inputs["reward"] + 0.9 * inputs["next_value"] - inputs["value"])
    np.testing.assert_allclose(vs.numpy(), inputs["value"] + one_step, rtol=1e-9, atol=1e-9)
    going_on = ~inputs["ends"]
    going_on[:, -1] = False
    after = np.where(going_on, np.roll(inputs["value"] + one_step, -1, axis=1),
                     inputs["next_value"])
    expected = rho * (inputs["reward"] + 0.9 * after - inputs["value"])
    np.testing.assert_allclose(advantage.numpy(), expected, rtol=1e-9, atol=1e-9)
    assert (rho > 1).any()


def test_a_policy_that_never_takes_the_actions_learns_nothing_from_them():
    # pi(a) = 0: rho = c = 0, so the targets are the values and the advantages zero.
    inputs = random_rollout(5)
    inputs["log_rho"] = np.full_like(inputs["reward"], -np.inf)
    vs, advantage = run(inputs, 0.9)
    np.testing.assert_array_equal(vs.numpy(), inputs["value"])
    assert not advantage.any()


def test_truncation_bootstraps_and_termination_does_not():
    # One row, 6 steps; its first episode ends at step 2. Terminated: nothing after it
    # (next value 0); truncated by a time limit: the value 5 of the final observation.
    gamma = 0.5
    inputs = random_rollout(9, rows=1, steps=6, end_rate=0.0)
    inputs["ends"][0, 2] = True
    terminated = {**inputs, "next_value": inputs["next_value"].copy()}
    terminated["next_value"][0, 2] = 0.0
    truncated = {**inputs, "next_value": inputs["next_value"].copy()}
    truncated["next_value"][0, 2] = 5.0
    vs_term, adv_term = run(terminated, gamma)
    vs_trunc, adv_trunc = run(truncated, gamma)
    check_against_reference(terminated, gamma, 1.0, 1.0)
    check_against_reference(truncated, gamma, 1.0, 1.0)
    # The ending step differs by rho_2 * gamma * 5, earlier steps by that times the traces;
    # the next episode (steps 3-5) not at all.
    ratio = np.exp(inputs["log_rho"][0])
    rho, c = np.minimum(1.0, ratio), np.minimum(1.0, ratio)
    difference = (vs_trunc - vs_term)[0].numpy()
    expected = np.zeros(6)
    expected[2] = rho[2] * gamma * 5.0
    expected[1] = gamma * c[1] * expected[2]
    expected[0] = gamma * c[0] * expected[1]
    np.testing.assert_allclose(difference, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((adv_trunc - adv_term)[0].numpy(),
                               [rho[0] * gamma * expected[1], rho[1] * gamma * expected[2],
                                expected[2], 0.0, 0.0, 0.0], rtol=1e-10, atol=1e-12)


def test_shapes_dtypes_and_no_gradient():
    inputs = random_rollout(2, rows=3, steps=8)
    tensors = {name: torch.from_numpy(array) for name, array in inputs.items()}
    vs64, advantage64 = vtrace(**tensors, discount=0.9)
    assert vs64.shape == advantage64.shape == (3, 8) and vs64.dtype == torch.float64
    # float32 in, float32 out (computed in float64); ends as bool or 0/1 floats
    floats = {name: t.float().requires_grad_(name in ("value", "next_value", "log_rho"))
              if name != "ends" else t.float() for name, t in tensors.items()}
    vs, advantage = vtrace(**floats, discount=0.9)
    assert vs.dtype == advantage.dtype == torch.float32
    assert not vs.requires_grad and not advantage.requires_grad
    torch.testing.assert_close(vs, vs64.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(advantage, advantage64.float(), rtol=1e-5, atol=1e-5)
    # Computed in float64 and rounded once: exactly the float64 result of the same inputs
    # (float32 arithmetic would round at every step and differ in the last bits).
    doubles = {name: t.detach().double() for name, t in floats.items()}
    exact = vtrace(**doubles, discount=0.9)
    assert torch.equal(vs, exact.vs.float()) and torch.equal(advantage,
                                                             exact.pg_advantage.float())
    with pytest.raises(ValueError, match=r"\(B, T\) tensors of one shape"):
        vtrace(**{**tensors, "value": tensors["value"][:, :-1]}, discount=0.9)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        vtrace(**{name: t[0] for name, t in tensors.items()}, discount=0.9)
    with pytest.raises(ValueError, match="discount must be in"):
        vtrace(**tensors, discount=1.5)
    with pytest.raises(ValueError, match="rho_bar and c_bar must be > 0"):
        vtrace(**tensors, discount=0.9, c_bar=0.0)


def test_an_invalid_step_adds_nothing_to_the_steps_before_it():
    """An episode cut by an env restart: its last recorded step (invalid) ends it; the step
    before bootstraps from the invalid step's value instead of taking in its reward."""
    reward = torch.tensor([[1.0, 5.0, 1.0]])
    value = torch.tensor([[0.5, 2.0, 0.3]])
    next_value = torch.tensor([[2.0, 9.0, 0.0]])  # the cut step's "next value" is junk
    ends = torch.tensor([[False, True, True]])
    valid = torch.tensor([[True, False, True]])
    targets = vtrace(torch.zeros(1, 3), reward, value, next_value, ends, 0.9, valid=valid)
    assert targets.vs[0, 0] == pytest.approx(1.0 + 0.9 * 2.0)
    assert targets.pg_advantage[0, 0] == pytest.approx(1.0 + 0.9 * 2.0 - 0.5)
    advantage = gae(reward, value, next_value, ends, 0.9, 0.95, valid=valid)
    assert advantage[0, 0] == pytest.approx(1.0 + 0.9 * 2.0 - 0.5)


def test_default_truncations_are_those_of_the_paper():
    # (BatchPPO's value_targets = "vtrace" relies on the defaults rho_bar = c_bar = 1)
    rng = np.random.default_rng(21)
    rows, steps = 3, 12
    log_rho = rng.normal(scale=1.5, size=(rows, steps))  # ratios well above and below 1
    reward, value = rng.normal(size=(rows, steps)), rng.normal(size=(rows, steps))
    next_value = np.concatenate([value[:, 1:], rng.normal(size=(rows, 1))], axis=1)
    ends = np.zeros((rows, steps), dtype=bool)
    ends[0, 4] = True
    next_value[0, 4] = 0.0
    gamma = 0.9
    vs, advantage = reference_vtrace(log_rho, reward, value, next_value, ends, gamma, 1.0, 1.0)
    assert (np.exp(log_rho) > 1.2).sum() > 5
    got = vtrace(*map(torch.from_numpy, (log_rho, reward, value, next_value, ends)), gamma)
    np.testing.assert_allclose(got.vs.numpy(), vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got.pg_advantage.numpy(), advantage, rtol=1e-10, atol=1e-10)
