"""SAC (batchrl/algos/sac.py): the temperature and target updates, an exact state round trip,
learning Pendulum (CI-sized), and train.py with a config that names only the class."""

from __future__ import annotations

import copy
import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from batchrl.algos import SAC
from batchrl.errors import UnsupportedSpaceError
from batchrl.simulation import simulate
from helpers import (assert_continues_alike, assert_same, finish, seeded_tensor_env,
                     start_train_py)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"hidden": (32, 32), "batch_size": 32, "learning_starts": 40}


def filled_sac(steps: int = 30, **options) -> tuple[SAC, object]:
    torch.manual_seed(0)
    env = seeded_tensor_env("Pendulum-v1", 2, seed=0)
    algo = SAC(env.observation_space, env.action_space, 2, **{**SMALL, **options})
    for _ in range(steps):
        simulate(env, algo)
    return algo, env


def test_random_actions_until_learning_starts_then_the_policy_learns():
    algo, env = filled_sac(0)
    acted = []
    algo.policy.register_forward_hook(lambda *_: acted.append(algo.env_steps))
    for _ in range(20):
        simulate(env, algo)  # 40 env steps: uniform actions, no gradient step yet
    assert algo.updates == 0 and len(algo.buffer) == 40 and acted == []
    policy = copy.deepcopy(algo.policy.state_dict())
    simulate(env, algo)  # 42 steps: 2 gradient steps (one per env step past the first 40)
    assert algo.updates == 2 and acted[0] == 40  # the policy acts from then on
    assert any(not torch.equal(policy[k], v) for k, v in algo.policy.state_dict().items())
    env.close()


def test_targets_move_tau_of_the_way_and_the_temperature_follows_the_entropy():
    algo, env = filled_sac(21, tau=0.25, target_entropy=50.0)  # an entropy it cannot reach
    env.close()
    critics = copy.deepcopy(algo.critics)
    targets = [p.detach().clone() for p in algo.target_critics.parameters()]
    alpha = float(algo.alpha)
    algo.gradient_step()
    for target, before, old_online, new_online in zip(
            algo.target_critics.parameters(), targets, critics.parameters(),
            algo.critics.parameters()):
        assert not torch.equal(old_online, new_online)  # the critics took a step
        torch.testing.assert_close(target, before + 0.25 * (new_online - before))
    assert float(algo.alpha) > alpha  # entropy below the target: the temperature rises
    algo, env = filled_sac(21, target_entropy=-50.0)  # far below the entropy: it falls
    env.close()
    alpha = float(algo.alpha)
    algo.gradient_step()
    assert float(algo.alpha) < alpha


def test_the_critics_learn_the_soft_bellman_target_and_the_policy_the_soft_q_value():
    """The critics' loss against ``r + discount * (min Q_target - alpha log pi)`` at the next
    observation (the batch's discounts: with n_step 3 not gamma), then the policy's loss
    ``alpha log pi - min Q`` with the critics after their step."""
    algo, env = filled_sac(25, n_step=3, init_alpha=0.3)
    env.close()
    with torch.no_grad():  # (target critics far apart: which one bootstraps shows)
        algo.target_critics.biases[-1].add_(torch.tensor([3.0, -3.0]).view(2, 1, 1))
    policy, critics, alpha = copy.deepcopy(algo.policy), copy.deepcopy(algo.critics), algo.alpha
    torch.manual_seed(1)  # (the batch, then the next actions, then the actions)
    batch = algo.buffer.sample(algo.batch_size)
    observ, next_observ = batch["observ"], batch["next_observ"]
    with torch.no_grad():
        next_action, next_log_prob = policy(next_observ)
        next_q = algo.target_critics(torch.cat([next_observ, next_action], -1)).squeeze(-1)
        target = batch["reward"] + batch["discount"] * (next_q.min(0).values
                                                        - alpha * next_log_prob)
        q = critics(torch.cat([observ, batch["action"]], -1)).squeeze(-1)
        critic_loss = 0.5 * (F.mse_loss(q[0], target) + F.mse_loss(q[1], target))
        action, log_prob = policy(observ)
    assert not torch.allclose(batch["discount"], torch.tensor(0.99))
    torch.manual_seed(1)
    scalars = algo.gradient_step()
    with torch.no_grad():
        q_new = algo.critics(torch.cat([observ, action], -1)).squeeze(-1).min(0).values
    assert float(scalars["sac/critic_loss"]) == pytest.approx(float(critic_loss), rel=1e-5)
    assert float(scalars["sac/policy_loss"]) == pytest.approx(
        float((alpha * log_prob - q_new).mean()), rel=1e-5, abs=1e-6)
    assert float(scalars["sac/alpha"]) == float(alpha)


def test_log_probabilities_are_those_of_the_tanh_squashed_gaussian():
    from torch.distributions import Normal
    from torch.distributions.transforms import TanhTransform

    from batchrl.algos.sac import LOG_STD_RANGE, SquashedGaussian

    torch.manual_seed(0)
    policy = SquashedGaussian(3, [16], 2)
    with torch.no_grad():  # (log stds towards both ends of their range)
        policy.body.biases[-1][..., 2:] += torch.tensor([-2.0, 2.0])
    observ = torch.randn(64, 3)
    with torch.no_grad():
        mean, log_std = policy.body(observ)[0].chunk(2, dim=-1)
        low, high = LOG_STD_RANGE
        std = torch.exp(low + (high - low) * torch.sigmoid(2.0 * log_std))
        assert std.min() < 0.02 and std.max() > 5.0
        torch.manual_seed(1)
        action, log_prob = policy(observ)
        torch.manual_seed(1)
        raw = mean + torch.randn_like(mean) * std
        expected = (Normal(mean, std).log_prob(raw)
                    - TanhTransform().log_abs_det_jacobian(raw, torch.tanh(raw))).sum(-1)
        torch.testing.assert_close(action, torch.tanh(raw))
        torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(policy(observ, deterministic=True)[0], torch.tanh(mean))


def test_actions_fill_the_range_and_evaluation_acts_with_the_mean_unless_it_samples():
    box, thrust = gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Box(
        0.0, 4.0, (2,), np.float32)
    agents, observ = torch.arange(1000), torch.randn(1000, 3)
    torch.manual_seed(0)
    algo = SAC(box, thrust, 1000, hidden=(8,))  # (learning_starts 5,000: uniform actions)
    uniform, _ = algo.perform(agents, observ)
    assert 0.0 <= uniform.min() < 0.05 and 3.95 < uniform.max() <= 4.0
    assert float(uniform.mean()) == pytest.approx(2.0, abs=0.05)
    algo.eval()
    mean, _ = algo.perform(agents, observ)
    with torch.no_grad():
        torch.testing.assert_close(mean, (algo.policy(observ, deterministic=True)[0] + 1.0) * 2.0)
    assert torch.equal(algo.perform(agents, observ)[0], mean)
    torch.manual_seed(0)
    sampling = SAC(box, thrust, 1000, hidden=(8,), eval_actions="sample").eval()
    sampled, _ = sampling.perform(agents, observ)
    assert float((sampled - mean).abs().mean()) > 0.1


def test_the_temperature_starts_at_init_alpha_and_aims_at_minus_the_action_size():
    box = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    algo = SAC(box, box, 2, hidden=(8,), init_alpha=0.3)
    assert float(algo.alpha) == pytest.approx(0.3) and algo.target_entropy == -3.0
    assert_same(algo.target_critics.state_dict(), algo.critics.state_dict())  # (copies)


def test_the_gradient_steps_scalars_are_averaged_over_summary_every_env_steps():
    algo, env = filled_sac(25)  # 50 env steps (2 agents), learning from 40 on
    algo.summary_every = 8
    losses: list[list[float]] = []  # each batch step's gradient steps' critic losses
    gradient_step = algo.gradient_step

    def recorded() -> dict:
        scalars = gradient_step()
        losses[-1].append(float(scalars["sac/critic_loss"]))
        return scalars

    algo.gradient_step = recorded
    summaries = []
    for _ in range(12):
        losses.append([])
        summaries.append(simulate(env, algo)[2])
    assert [i for i, summary in enumerate(summaries) if "sac/critic_loss" in summary] == [
        0, 4, 8]  # at 52, 60 and 68 env steps
    since_last = [loss for step in losses[1:5] for loss in step]  # env steps 53-60
    assert len(since_last) == 8
    assert summaries[4]["sac/critic_loss"] == pytest.approx(sum(since_last) / 8, rel=1e-6)
    assert math.isfinite(summaries[4]["sac/alpha"])
    env.close()


def test_a_loaded_state_continues_exactly():
    algo, env = filled_sac(25, n_step=3)
    twin = SAC(env.observation_space, env.action_space, 2, **SMALL, n_step=3)
    assert_continues_alike(algo, twin)
    small = SAC(env.observation_space, env.action_space, 2, **SMALL, save_buffer=False)
    assert small.state_dict()["buffer"] is None
    env.close()


def test_a_loaded_state_summarizes_as_the_run_would_have(monkeypatch):
    monkeypatch.setattr(SAC, "summary_every", 8)
    algo, env = filled_sac(24)  # 48 env steps: a summary at 42, 6 gradient steps since
    env.close()
    twin = SAC(env.observation_space, env.action_space, 2, **SMALL)
    twin.load_state_dict(copy.deepcopy(algo.state_dict()))
    agents, observ = torch.arange(2), torch.zeros(2, 3)

    def step(each: SAC) -> dict:
        action, _ = each.perform(agents, observ)
        return each.experience(agents, observ, action, torch.ones(2), torch.zeros(2), observ,
                               torch.zeros(2))

    rng = torch.get_rng_state()
    summaries = []
    for each in (algo, twin):
        torch.set_rng_state(rng)
        summaries.append([step(each) for _ in range(6)])
    assert [bool(summary) for summary in summaries[0]] == [True, False, False, False, True,
                                                           False]  # at 50 and 58 env steps
    assert summaries[1] == summaries[0]


def test_resumed_without_its_buffer_it_learns_once_the_buffer_is_refilled():
    algo, env = filled_sac(25, save_buffer=False)  # 50 env steps, 10 gradient steps
    resumed = SAC(env.observation_space, env.action_space, 2, **SMALL, save_buffer=False)
    resumed.load_state_dict(algo.state_dict())
    assert (len(resumed.buffer), resumed.env_steps, resumed.updates) == (0, 50, 10)
    for _ in range(19):  # 38 transitions, fewer than learning_starts: no gradient step
        simulate(env, resumed)
    assert (len(resumed.buffer), resumed.updates) == (38, 10)
    simulate(env, resumed)  # 40: learning goes on, one gradient step per env step
    assert resumed.updates == 12
    env.close()


def test_a_buffer_saved_while_it_refilled_still_refills_when_loaded():
    # Resumed without its buffer, then (save_buffer turned on) saved with 20 transitions and
    # resumed again: learning still waits for learning_starts transitions.
    algo, env = filled_sac(25, save_buffer=False)  # 50 env steps, 10 gradient steps
    refilling = SAC(env.observation_space, env.action_space, 2, **SMALL)
    refilling.load_state_dict(algo.state_dict())
    for _ in range(10):
        simulate(env, refilling)
    resumed = SAC(env.observation_space, env.action_space, 2, **SMALL)
    resumed.load_state_dict(refilling.state_dict())
    for _ in range(9):  # 38 transitions
        simulate(env, resumed)
    assert (len(resumed.buffer), resumed.updates) == (38, 10)
    simulate(env, resumed)  # 40
    assert resumed.updates == 12
    env.close()


def test_bfloat16_layers_keep_float32_parameters_and_outputs():
    algo, env = filled_sac(25)
    algo.critics.compute_dtype = torch.bfloat16
    inputs = torch.randn(5, algo.obs_size + env.action_space.shape[0])
    out = algo.critics(inputs)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 1)
    algo.critics.compute_dtype = torch.float32
    exact = algo.critics(inputs)
    assert not torch.equal(out, exact) and torch.allclose(out, exact, atol=0.05)
    half = SAC(env.observation_space, env.action_space, 2, **SMALL, precision="bfloat16")
    half.load_state_dict(algo.state_dict())
    assert {network.compute_dtype for network in (half.policy.body, half.critics,
                                                  half.target_critics)} == {torch.bfloat16}
    before = [p.clone() for p in half.critics.parameters()]
    summary = half.gradient_step()
    assert all(p.dtype == torch.float32 for p in half.critics.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, half.critics.parameters()))
    assert all(math.isfinite(value) for value in summary.values())
    env.close()


def test_stored_actions_are_the_squashed_ones_perform_chose_or_the_callers_mapped_back():
    torque = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    torch.manual_seed(0)
    algo = SAC(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), torque, 2,
               **{**SMALL, "learning_starts": 0})  # (the policy's actions, not uniform ones)
    stored = algo.buffer.tensors["action"]
    observ = torch.zeros(2, 3)
    reward, flags = torch.zeros(2), torch.zeros(2, dtype=torch.bool)
    # Transitions perform() did not choose (a caller's own, after a training perform that
    # the next experience() used up): their env actions, mapped back into [-1, 1].
    algo.experience(torch.arange(2), observ, torch.tensor([[1.0], [-2.0]]), reward, flags,
                    observ, flags)
    assert stored[0].tolist() == [[0.5], [-1.0]]
    action, _ = algo.perform(torch.arange(2), observ)
    squashed = algo._last_action.clone()
    assert not torch.equal((action + 2.0) / 2.0 - 1.0, squashed)  # (mapping back rounds)
    algo.experience(torch.arange(2), observ, action, reward, flags, observ, flags)
    assert torch.equal(stored[1], squashed)  # exactly what perform chose


def test_bfloat16_hidden_layers_leave_large_q_values_their_float32_resolution():
    """bfloat16 keeps about 3 significant digits: Q-values near 1,000 would move in steps of
    8. The output layer computes in float32."""
    from batchrl.algos.sac import EnsembleMLP

    torch.manual_seed(0)
    network = EnsembleMLP(2, 8, [64, 64], 1)
    with torch.no_grad():
        network.biases[-1].add_(1000.0)
    inputs = torch.randn(256, 8)
    exact = network(inputs)
    network.compute_dtype = torch.bfloat16
    out = network(inputs)
    assert out.dtype == torch.float32 and out.shape == (2, 256, 1)
    assert len(torch.unique(out)) > 400  # (in bfloat16 they would all round to 1,000)
    assert (out - exact).abs().max() < 0.05


def test_bad_input_is_a_clear_error():
    box = gym.spaces.Box(-1, 1, (3,))
    with pytest.raises(UnsupportedSpaceError, match="SAC needs a 1-D Box action space, got "
                                                    r"Discrete\(2\) \(DQN takes Discrete"):
        SAC(box, gym.spaces.Discrete(2), 2)
    with pytest.raises(ValueError, match="updates_per_step must be a finite number > 0, got 0"):
        SAC(box, box, 2, updates_per_step=0)
    for key, value in (("updates_per_step", math.nan), ("updates_per_step", math.inf),
                       ("init_alpha", math.nan), ("learning_rate", math.inf)):
        with pytest.raises(ValueError, match=f"{key} must be a finite number > 0, got {value}"):
            SAC(box, box, 2, **{key: value})
    with pytest.raises(ValueError, match=r"hidden must be layer sizes >= 1, got \[0\]"):
        SAC(box, box, 2, hidden=[0])
    with pytest.raises(ValueError, match=r"buffer_size \(3\) must hold at least one transition "
                                         r"per agent \(4 agents: env.num_agents\)"):
        SAC(box, box, 4, buffer_size=3)
    with pytest.raises(ValueError, match="target_entropy must be finite, got nan"):
        SAC(box, box, 2, target_entropy=math.nan)
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\], got 2"):
        SAC(box, box, 2, tau=2)
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, got "
                                         "'float16'"):
        SAC(box, box, 2, precision="float16")
    with pytest.raises(UnsupportedSpaceError, match=r"SAC squashes its actions into the action "
                                                    r"space's range, which must be bounded; "
                                                    r"got Box\(-inf, inf"):
        SAC(box, gym.spaces.Box(-float("inf"), float("inf"), (2,)), 2)


@pytest.mark.parametrize("normalize_ranges", [True, False])
def test_actions_span_the_range_the_wrapped_env_acts_in(normalize_ranges):
    """The trainer's wrappers clip actions, and keep the range visible: without
    normalize_ranges, Pendulum's torques span [-2, 2] (Gymnasium's ClipAction alone shows an
    unbounded space)."""
    from batchrl.envs import wrap_env

    env = wrap_env(gym.make("Pendulum-v1"), normalize_ranges=normalize_ranges)
    bound = 1.0 if normalize_ranges else 2.0
    assert env.action_space == gym.spaces.Box(-bound, bound, (1,), np.float32)
    torch.manual_seed(0)  # (the initial policy: what other tests drew before must not matter)
    algo = SAC(env.observation_space, env.action_space, 4, learning_starts=0)
    algo.train()
    actions = torch.cat([algo.perform(torch.arange(4), torch.full((4, 3), 5.0))[0]
                         for _ in range(200)])
    assert actions.abs().max() <= bound and actions.abs().max() > 0.6 * bound


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_sac_learns_pendulum(precision):
    torch.manual_seed(0)
    env = seeded_tensor_env("Pendulum-v1", 4, seed=0)
    algo = SAC(env.observation_space, env.action_space, 4, hidden=(64, 64), batch_size=128,
               learning_starts=1000, precision=precision)
    for _ in range(3200):  # 12,800 env steps
        simulate(env, algo)
    algo.eval()
    simulate(env, algo, reset=True)
    for _ in range(199):  # the whole 200-step episode: score is its return
        _, score, _ = simulate(env, algo)
    env.close()
    assert float(score.mean()) > -400, score  # random actions: about -1,200


@pytest.mark.slow
def test_train_py_runs_sac_from_a_config_that_names_only_the_class(tmp_path):
    config = tmp_path / "sac_pendulum.toml"
    config.write_text('[env]\nid = "Pendulum-v1"\nnum_agents = 2\nmax_length = 200\n'
                      'backend = "inline"\n\n[train]\nsteps = 6000\nphase_steps = 3000\n'
                      'eval_episodes = 2\n\n[algorithm]\nclass = "batchrl.algos:SAC"\n')
    logdir = tmp_path / "run"
    code, _, stderr = finish(start_train_py("--config", str(config), "--logdir", str(logdir),
                                            "--no-progress", "--set", "train.steps=3000"), 120)
    assert code == 0, stderr
    code, _, stderr = finish(start_train_py("--config", str(config), "--logdir", str(logdir),
                                            "--no-progress", "--steps", "6000"), 120)  # resumed
    assert code == 0, stderr
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "eval"] == [3000, 6000]
    checkpoint = torch.load(sorted(logdir.glob("ckpt-*.pt"))[-1], weights_only=False)
    assert checkpoint["algorithm"]["env_steps"] == 6000
    assert checkpoint["algorithm"]["updates"] == 6000 - 5000  # learning starts at 5,000


def test_a_truncated_step_is_stored_to_bootstrap_from_and_ends_the_n_step_return():
    box = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    algo = SAC(box, box, 2, hidden=(8,), learning_starts=100, discount=0.5, n_step=2)
    agents, no = torch.arange(2), torch.zeros(2)
    # agent 0 terminates and agent 1 is truncated (a time limit) in the first step
    for observ, done, terminated in ((0.0, torch.ones(2), torch.tensor([1.0, 0.0])),
                                     (1.0, no, no)):
        state = torch.tensor([[observ], [observ + 10]])
        algo.experience(agents, state, torch.zeros(2, 1), torch.ones(2), done, state + 0.5,
                        terminated)
    torch.manual_seed(0)
    batch = algo.buffer.sample(400)
    first = batch["observ"][:, 0] < 1.0
    terminated, truncated = first & (batch["observ"][:, 0] == 0.0), batch["observ"][:, 0] == 10.0
    assert terminated.any() and truncated.any()
    assert torch.all(batch["discount"][terminated] == 0.0)
    # the truncated step bootstraps from its own next observation, not from the next episode's
    assert torch.all(batch["discount"][truncated] == 0.5)
    assert torch.all(batch["next_observ"][truncated, 0] == 10.5)
    assert torch.all(batch["reward"][truncated] == 1.0)
