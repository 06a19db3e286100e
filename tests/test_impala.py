"""IMPALA (batchrl.algos.impala) and its loss: it learns CartPole, resumes exactly, acts from
its acting state as the learner does, learns from uint8 observations, scales rewards, bootstraps,
anneals and clips as configured, checks its config."""

from __future__ import annotations

import io
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import batchrl.algos.impala as impala_module
from batchrl.algos import IMPALA, BatchPPO, IMPALAConfig
from batchrl.checkpoint import list_checkpoints
from batchrl.config import IMPALA as IMPALA_PATH
from batchrl.config import ConfigError, load_config
from batchrl.errors import UnsupportedSpaceError
from batchrl.evaluate import evaluate
from batchrl.metrics import read_metrics
from batchrl.parts.losses import actor_critic_loss
from batchrl.parts.rollout import Rollout, RolloutBuffer, rollout_tensors
from batchrl.simulation import simulate
from batchrl.tensor_env import TensorBatchEnv
from batchrl.trainer import Trainer
from helpers import assert_same, scalar_events, seeded_tensor_env


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(env: TensorBatchEnv, algo: IMPALA, steps: int, reset: bool = True
          ) -> list[dict[str, float]]:
    """``steps`` batch steps of training; the summaries of the learning steps."""
    algo.train()
    summaries = []
    for step in range(steps):
        _, _, summary = simulate(env, algo, reset=reset and step == 0)
        if summary:
            summaries.append(summary)
    return summaries


def weights(algo: IMPALA) -> dict[str, torch.Tensor]:
    return {**{f"policy.{k}": v for k, v in algo.policy.state_dict().items()},
            **{f"value.{k}": v for k, v in algo.value.state_dict().items()}}


def assert_same_weights(first: IMPALA, second: IMPALA) -> None:
    ours, theirs = weights(first), weights(second)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def round_trip(state: dict) -> dict:
    """Through torch.save / torch.load, as a checkpoint on disk would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# -- the loss ---------------------------------------------------------------------------

def test_actor_critic_loss_terms_and_gradients():
    log_prob = torch.tensor([[-0.5, -1.0, -float("inf")]], requires_grad=True)
    entropy = torch.tensor([[0.6, 0.4, 0.2]], requires_grad=True)
    value = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    targets = torch.tensor([[2.0, 1.0, 9.0]], requires_grad=True)
    advantage = torch.tensor([[1.0, -2.0, 5.0]], requires_grad=True)
    valid = torch.tensor([[True, True, False]])  # the last step is left out, -inf and all
    loss, terms = actor_critic_loss(log_prob, entropy, value, targets, advantage, valid,
                                    baseline_cost=0.5, entropy_cost=0.1)
    policy = -(-0.5 * 1.0 + -1.0 * -2.0) / 2
    baseline = 0.5 * ((2.0 - 1.0) ** 2 + (1.0 - 2.0) ** 2) / 2
    assert terms["policy_loss"].item() == pytest.approx(policy)
    assert terms["value_loss"].item() == pytest.approx(baseline)
    assert terms["entropy"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(policy + 0.5 * baseline - 0.1 * 0.5)
    loss.backward()
    assert log_prob.grad.tolist() == [[-0.5, 1.0, 0.0]]
    assert entropy.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])
    assert value.grad[0].tolist() == pytest.approx([0.5 * (1.0 - 2.0) / 2,
                                                    0.5 * (2.0 - 1.0) / 2, 0.0])
    # Targets and advantages are constants of the loss.
    assert targets.grad is None and advantage.grad is None


# -- learning ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cartpole_config_learns(tmp_path):
    """configs/impala/cartpole.toml as train.py runs it: the final evaluation (16 mean-action
    episodes) scores at least 475 of 500."""
    config = load_config("impala/cartpole", ["train.device=cpu"])
    assert config.algorithm.path == IMPALA_PATH
    Trainer(config, tmp_path / "run", progress=False).run()
    records = read_metrics(tmp_path / "run")
    final = records[-1]
    assert final["phase"] == "eval" and final["step"] == config.train.steps
    assert final["score"] >= 475, [r["score"] for r in records if r["phase"] == "eval"]
    events = scalar_events(tmp_path / "run")
    for tag in ("impala/policy_loss", "impala/value_loss", "impala/entropy", "impala/grad_norm",
                "impala/rho_mean", "impala/rho_clipped", "impala/lr"):
        assert tag in events, sorted(events)
    # Two gradient steps per rollout: the second is off-policy and V-trace clips some ratios.
    assert any(value > 0 for _, value in events["impala/rho_clipped"])
    assert events["impala/lr"][-1][1] < events["impala/lr"][0][1]  # the linear decay


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_box_and_discrete_actions_act_and_learn_on_policy(name):
    env = seeded_tensor_env(name, 4, seed=1)
    torch.manual_seed(1)
    algo = IMPALA(env.observation_space, env.action_space, len(env), rollout_length=8)
    assert algo.collector_support() is None and algo.rollout_length == 8
    initial = {k: v.clone() for k, v in weights(algo).items()}
    summaries = train(env, algo, 8 * 30)  # Pendulum: its 200-step episodes are truncated
    assert len(summaries) == 30
    for network in ("policy.", "value."):  # both learned
        assert any(not torch.equal(value, initial[name]) for name, value in weights(algo).items()
                   if name.startswith(network)), network
    assert all(math.isfinite(value) for s in summaries for value in s.values())
    assert set(summaries[0]) == {f"impala/{name}" for name in (
        "policy_loss", "value_loss", "entropy", "loss", "grad_norm", "value_grad_norm",
        "rho_mean", "rho_clipped", "lr")}
    # One gradient step per rollout of the learner's own policy: the log-probabilities act()
    # recorded are the learner's, up to rounding, so nothing is truncated.
    for summary in summaries:
        assert summary["impala/rho_mean"] == pytest.approx(1.0, abs=1e-4)
        assert summary["impala/rho_clipped"] == 0.0
    observ = env.observ
    action, behaviour = algo.act(observ)
    if name == "CartPole-v1":
        assert action.shape == (4,) and action.dtype == torch.int64
    else:
        assert action.shape == (4, 1) and action.dtype == torch.float32
    assert behaviour["log_prob"].shape == (4,) and behaviour["log_prob"].dtype == torch.float32
    # Evaluation: the mean (most likely) action, the same every time, and nothing learned.
    algo.eval()
    before = {k: v.clone() for k, v in weights(algo).items()}
    first, _ = algo.perform(torch.arange(4), observ)
    second, _ = algo.perform(torch.arange(4), observ)
    assert torch.equal(first, second)
    for step in range(20):
        _, _, summary = simulate(env, algo, reset=step == 0)
        assert summary == {}
    assert all(torch.equal(before[k], v) for k, v in weights(algo).items())
    env.close()


def test_deterministic_actions_are_the_most_likely_and_the_mean():
    torch.manual_seed(0)
    observ = torch.randn(16, 3)
    discrete = IMPALA(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(4), 16,
                      normalize_observ=False, init_output_factor=1.0)  # (no ties)
    action, behaviour = discrete.act(observ, deterministic=True)
    logits = discrete.policy(observ, torch.zeros(0))[0]
    assert torch.equal(action, logits.argmax(-1))
    assert torch.equal(behaviour["log_prob"],
                       torch.log_softmax(logits, -1).gather(-1, action[:, None])[:, 0])
    box = IMPALA(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)), 16,
                 normalize_observ=False, init_std=0.3)
    action, behaviour = box.act(observ, deterministic=True)
    mean = box.policy(observ, torch.zeros(0))[0]
    assert torch.equal(action, mean)
    # The density of the mean: -sum(log std + log sqrt(2 pi)) over the action's dimensions.
    torch.testing.assert_close(behaviour["log_prob"], torch.full(
        (16,), -2 * (math.log(0.3) + 0.5 * math.log(2 * math.pi))))


def test_an_evaluation_in_the_middle_of_a_rollout_leaves_it_to_training():
    """The trainer evaluates between phases wherever a rollout is, then resets the training
    envs: the evaluation's steps, new episodes and restarted envs neither record nor cut a step
    of the rollout; only that reset cuts the step before it."""
    env, eval_env = seeded_tensor_env("CartPole-v1", 4, seed=3), seeded_tensor_env(
        "CartPole-v1", 4, seed=4)
    torch.manual_seed(3)
    algo = IMPALA(env.observation_space, env.action_space, len(env), rollout_length=8)
    train(env, algo, 3)
    recorded = {name: tensor.clone() for name, tensor in algo.buffer.tensors.items()}
    algo.eval()
    for step in range(4):
        if step == 2:
            algo.steps_lost(torch.tensor([1]))  # (as a restarted evaluation env gives it)
        simulate(eval_env, algo, reset=step == 0)
    algo.train()
    assert algo.buffer.step == 3
    for name, tensor in algo.buffer.tensors.items():
        assert torch.equal(tensor, recorded[name]), name
    train(env, algo, 2)  # (a new phase: its first step resets every env)
    valid = algo.buffer.rollout().valid[:, :5]
    assert valid[:, [0, 1, 3, 4]].all() and not valid[:, 2].any()
    env.close()
    eval_env.close()


def test_a_reset_between_rollouts_ends_the_running_return_of_the_reward_scale():
    env = seeded_tensor_env("CartPole-v1", 4, seed=1)
    torch.manual_seed(1)
    algo = IMPALA(env.observation_space, env.action_space, len(env), rollout_length=8)
    train(env, algo, 8)  # one rollout: CartPole's episodes run on past it
    carried = algo.state_dict()["running_return"].clone()
    assert (carried > 5).all()
    train(env, algo, 1, reset=False)  # one step into the next rollout
    algo.begin_episodes(torch.tensor([0]))  # a cut inside it: marked on its last step
    assert torch.equal(algo.state_dict()["running_return"], carried)
    train(env, algo, 7, reset=False)
    algo.begin_episodes(torch.tensor([0, 1, 2, 3]))  # a reset between rollouts
    assert not algo.state_dict()["running_return"].any()
    env.close()


def test_the_reward_scale_learns_discounted_returns_carried_across_rollouts():
    """The returns that scale the rewards, computed by hand: they run on from one rollout to
    the next, restart after an episode's end (a cut one included) and count the valid steps
    only."""
    gamma = 0.5
    algo = IMPALA(gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2), 2, rollout_length=4,
                  discount=gamma)
    # Agent 0 terminates at step 1 and runs on; agent 1's episode is cut at the last step.
    first = (torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]]),
             torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
             torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
             torch.tensor([[True] * 4, [True, True, True, False]]))
    second = (torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]),
              torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))
    carried, returns = [0.0, 0.0], []
    for reward, done, terminated, valid in (first, second):
        tensors = rollout_tensors(2, 4, (2,), torch.float32, (), torch.int64,
                                  algo.behaviour_fields())
        tensors.update(reward=reward, done=done, terminated=terminated, valid=valid,
                       agents=torch.tensor([0, 1]))
        tensors["behaviour.log_prob"].fill_(math.log(0.5))
        algo.learn(RolloutBuffer(tensors).rollout())
        for agent in range(2):
            running = carried[agent]
            for t in range(4):
                running = reward[agent, t].item() + gamma * running
                if valid[agent, t]:
                    returns.append(running)
                running *= 1.0 - done[agent, t].item()
            carried[agent] = running
        assert algo.running_return.tolist() == pytest.approx(carried)
    assert carried[0] > 0 and carried[1] > 0  # (the second rollout carried something over)
    assert float(algo.return_normalizer.count) == len(returns) == 15
    assert float(algo.return_normalizer.mean) == pytest.approx(sum(returns) / len(returns))


# -- acting state -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_a_copy_with_the_acting_state_acts_as_the_learner(name):
    env = seeded_tensor_env(name, 4, seed=2)
    torch.manual_seed(2)
    learner = IMPALA(env.observation_space, env.action_space, len(env), rollout_length=5)
    train(env, learner, 50)  # weights and observation statistics away from their start
    assert learner.observ_normalizer.count > 0
    torch.manual_seed(3)
    copy = IMPALA(env.observation_space, env.action_space, len(env), rollout_length=5)
    observ = torch.randn(64, *env.observation_space.shape) * 3
    torch.manual_seed(0)
    expected = learner.act(observ)
    torch.manual_seed(0)
    assert not torch.equal(copy.act(observ)[1]["log_prob"], expected[1]["log_prob"])
    state = learner.acting_state()
    assert all(isinstance(tensor, torch.Tensor) for tensor in state.values())
    copy.load_acting_state(round_trip(state))
    for deterministic in (False, True):
        torch.manual_seed(0)
        ours = learner.act(observ, deterministic)
        torch.manual_seed(0)
        theirs = copy.act(observ, deterministic)
        assert torch.equal(ours[0], theirs[0])
        assert torch.equal(ours[1]["log_prob"], theirs[1]["log_prob"])
    # The acting state is a snapshot: the learner learning on does not change the copy.
    train(env, learner, 20, reset=False)
    torch.manual_seed(0)
    assert torch.equal(copy.act(observ)[1]["log_prob"], expected[1]["log_prob"])
    env.close()


# -- learn() on rollouts built by hand ----------------------------------------------------

def hand_rollout(algo: IMPALA, observ_dtype: torch.dtype, seed: int, rows: int = 3,
                 steps: int = 6) -> Rollout:
    """A rollout of random uint8-valued observations acted by ``algo``, with episodes that
    terminate and episodes that a time limit ends inside it, and one cut step."""
    generator = torch.Generator().manual_seed(seed)
    shape = algo.observation_space.shape
    tensors = rollout_tensors(rows, steps, shape, observ_dtype, (), torch.int64,
                              algo.behaviour_fields())
    buffer = RolloutBuffer(tensors)
    buffer.start(torch.arange(rows), version=0)
    for t in range(steps):
        observ = torch.randint(0, 256, (rows, *shape), generator=generator)
        action, behaviour = algo.act(observ.float())
        buffer.act(observ.to(observ_dtype), action, behaviour)
        done = torch.tensor([t == 2, t == 3, False]).float()
        terminated = torch.tensor([t == 2, False, False]).float()
        next_observ = torch.randint(0, 256, (rows, *shape), generator=generator)
        buffer.outcome(torch.rand(rows, generator=generator), done, terminated,
                       next_observ.to(observ_dtype))
    buffer.cut(torch.tensor([2]))  # the third agent's episode was cut (a reset)
    return buffer.rollout().clone()


def image_algorithm(seed: int, **options) -> IMPALA:
    torch.manual_seed(seed)
    observation_space = gym.spaces.Box(0, 255, (2, 3), np.uint8)
    return IMPALA(observation_space, gym.spaces.Discrete(3), 3, rollout_length=6,
                  update_steps=2, **options)


def test_a_pixel_algorithm_learns_the_same_from_uint8_rollouts_and_their_float32_copies():
    first, second = image_algorithm(4), image_algorithm(4)
    assert_same_weights(first, second)
    rollout = hand_rollout(first, torch.uint8, seed=5)
    assert rollout.observ.dtype == torch.uint8 and not rollout.valid.all()
    # (the synchronous loop's rollout keeps pixels as bytes too: a quarter of float32's memory)
    assert first.buffer.rollout().observ.dtype == first.buffer.rollout().final_observ.dtype \
        == torch.uint8
    floats = Rollout(**{**vars(rollout), "observ": rollout.observ.float(),
                        "final_observ": rollout.final_observ.float()})
    for _ in range(3):
        summary = first.learn(rollout)
        assert second.learn(floats) == summary
    assert all(math.isfinite(value) for value in summary.values())
    assert_same_weights(first, second)
    assert torch.equal(first.observ_normalizer.mean, second.observ_normalizer.mean)
    assert not torch.equal(weights(first)["value.out.weight"],
                           weights(image_algorithm(4))["value.out.weight"])


def test_learn_bootstraps_after_a_time_limit_but_not_after_a_terminal_state():
    rollout = hand_rollout(image_algorithm(6), torch.uint8, seed=7)
    # Row 0 terminates at step 2, row 1 is truncated at step 3.

    def learned(changed: Rollout) -> dict[str, torch.Tensor]:
        algo = image_algorithm(6)
        algo.learn(rollout)  # observation statistics: before, 0-255 would be clipped to 5
        algo.learn(changed)
        return weights(algo)

    def with_final(row: int, step: int) -> Rollout:
        changed = rollout.clone()
        changed.final_observ[row, step] = 255 - changed.final_observ[row, step]
        return changed

    reference = learned(rollout)
    terminal, truncated = learned(with_final(0, 2)), learned(with_final(1, 3))
    assert all(torch.equal(reference[k], terminal[k]) for k in reference)
    assert not all(torch.equal(reference[k], truncated[k]) for k in reference)


def test_vtrace_false_ignores_the_behaviour_policy():
    rollout = hand_rollout(image_algorithm(8), torch.float32, seed=9)
    other_behaviour = Rollout(**{**vars(rollout),
                                 "behaviour": {"log_prob": rollout.behaviour["log_prob"] - 1.0}})
    results, clipped = {}, {}
    for vtrace in (True, False):
        for name, data in (("same", rollout), ("other", other_behaviour)):
            algo = image_algorithm(8, vtrace=vtrace)
            clipped[vtrace, name] = algo.learn(data)["impala/rho_clipped"]
            results[vtrace, name] = weights(algo)
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert same(results[False, "same"], results[False, "other"])
    # With V-trace the other behaviour's ratios (e times larger) are truncated otherwise.
    assert not same(results[True, "same"], results[True, "other"])
    # The summary counts truncated ratios only where V-trace truncates them.
    assert clipped[True, "other"] > 0 and clipped[False, "other"] == 0.0


def test_vtrace_gets_the_log_ratio_to_the_behaviour_both_truncations_and_the_cut_steps(
        monkeypatch):
    calls = []
    real = impala_module.vtrace
    monkeypatch.setattr(impala_module, "vtrace", lambda *args, **kwargs: calls.append(
        (args, kwargs)) or real(*args, **kwargs))
    algo = image_algorithm(8, rho_bar=2.0, c_bar=0.5)
    rollout = hand_rollout(algo, torch.float32, seed=9)
    behind = Rollout(**{**vars(rollout),  # mu = pi / e: the learner's ratio is e everywhere
                        "behaviour": {"log_prob": rollout.behaviour["log_prob"] - 1.0}})
    algo.learn(behind)
    (log_rho, *_, rho_bar, c_bar), options = calls[0]  # (the first gradient step's)
    torch.testing.assert_close(log_rho, torch.ones_like(log_rho), atol=1e-4, rtol=0)
    assert (rho_bar, c_bar) == (2.0, 0.5)
    # The cut step adds nothing to the targets before it.
    assert not behind.valid.all()
    assert options.get("valid") is not None and torch.equal(options["valid"], behind.valid)


def test_vtrace_bootstraps_from_zero_after_a_terminal_state_and_else_from_the_next_state(
        monkeypatch):
    calls = []
    real = impala_module.vtrace
    monkeypatch.setattr(impala_module, "vtrace", lambda *args, **kwargs: calls.append(
        args) or real(*args, **kwargs))
    algo = image_algorithm(6)
    rollout = hand_rollout(algo, torch.uint8, seed=7)
    with torch.no_grad():  # (the first gradient step's, made with these weights)
        value = algo.value(rollout.observ.reshape(3, 7, 6))  # (pixels: the torso scales them)
        final = algo.value(rollout.final_observ.reshape(3, 6, 6))
    algo.learn(rollout)
    _, _, values, next_value, ends, *_ = calls[0]
    terminal = rollout.terminated.bool()
    # Row 0 terminates at step 2; row 1 is truncated at step 3; row 2 is cut at step 5 (its
    # final observation is the one it acted on there).
    assert terminal.sum() == 1 and (rollout.done.bool() & ~terminal).sum() == 2
    expected = torch.where(terminal, 0.0, torch.where(rollout.done.bool(), final, value[:, 1:]))
    torch.testing.assert_close(values, value[:, :-1])
    torch.testing.assert_close(next_value, expected)
    assert torch.equal(ends, rollout.done.bool())


def test_a_linear_schedule_decays_by_the_steps_learned_before_each_rollout():
    algo = image_algorithm(3, lr_schedule="linear", learning_rate=1e-3, total_steps=4 * 3 * 6)
    rollout = hand_rollout(algo, torch.uint8, seed=4)  # 3 agents, 6 steps
    rates = [algo.learn(rollout)["impala/lr"] for _ in range(5)]
    assert rates == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3, 0.0])
    assert algo.optimizer.param_groups[0]["lr"] == rates[-1]


def test_the_summary_is_the_mean_of_the_gradient_steps_and_the_loss_weighs_its_terms(
        monkeypatch):
    algo = image_algorithm(5, baseline_cost=0.25, entropy_cost=0.125)  # 2 gradient steps
    steps = []
    real = algo._step
    monkeypatch.setattr(algo, "_step", lambda *args: steps.append(real(*args)) or steps[-1])
    summary = algo.learn(hand_rollout(algo, torch.uint8, seed=6))
    assert len(steps) == 2 and steps[0] != steps[1]
    for name in steps[0]:
        assert summary[f"impala/{name}"] == pytest.approx((steps[0][name] + steps[1][name]) / 2)
    for step in steps:
        assert step["loss"] == pytest.approx(
            step["policy_loss"] + 0.25 * step["value_loss"] - 0.125 * step["entropy"])


@pytest.mark.parametrize("shared_torso", [False, True])
def test_max_grad_norm_clips_each_network_or_both_together_on_a_shared_torso(shared_torso):
    if shared_torso:
        torch.manual_seed(7)
        algo = IMPALA(gym.spaces.Box(0, 255, (1, 36, 36), np.uint8), gym.spaces.Discrete(3), 3,
                      rollout_length=6, torso="nature_cnn", shared_torso=True,
                      policy_layers=(), value_layers=(), max_grad_norm=1e-3)
    else:
        algo = image_algorithm(7, max_grad_norm=1e-3)
    summary = algo.learn(hand_rollout(algo, torch.uint8, seed=8))
    # (the norms before clipping)
    assert summary["impala/grad_norm"] > 1e-2 and summary["impala/value_grad_norm"] > 1e-2

    def norm(parameters) -> float:  # the last gradient step's gradients, as clipped
        return float(torch.cat([p.grad.flatten() for p in parameters]).norm())

    if shared_torso:  # one gradient through the torso: one norm
        assert summary["impala/grad_norm"] == summary["impala/value_grad_norm"]
        assert norm(algo._parameters) == pytest.approx(1e-3, rel=1e-3)
    else:
        for network in (algo.policy, algo.value):
            assert norm(network.parameters()) == pytest.approx(1e-3, rel=1e-3)


def test_the_optimizer_is_the_configured_one():
    box, discrete = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2)
    adam = IMPALA(box, discrete, 2, learning_rate=2e-4, epsilon=1e-3).optimizer
    assert type(adam) is torch.optim.Adam
    assert (adam.defaults["lr"], adam.defaults["eps"]) == (2e-4, 1e-3)
    rmsprop = IMPALA(box, discrete, 2, optimizer="rmsprop", learning_rate=2e-4,
                     epsilon=0.01).optimizer
    assert type(rmsprop) is torch.optim.RMSprop
    assert (rmsprop.defaults["lr"], rmsprop.defaults["eps"], rmsprop.defaults["alpha"],
            rmsprop.defaults["momentum"]) == (2e-4, 0.01, 0.99, 0)


# -- checkpoints ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_state_dict_resumes_exactly_in_the_middle_of_a_rollout(name):
    env = seeded_tensor_env(name, 4, seed=10)
    torch.manual_seed(10)
    options = dict(rollout_length=7, update_steps=2, lr_schedule="linear", total_steps=2000)
    algo = IMPALA(env.observation_space, env.action_space, len(env), **options)
    train(env, algo, 7 * 5 + 3)  # 5 rollouts and 3 steps of the next one
    assert algo.buffer.step == 3 and algo.learned_steps == 4 * 7 * 5
    state = round_trip(algo.state_dict())
    torch.manual_seed(11)
    fresh = IMPALA(env.observation_space, env.action_space, len(env), **options)
    fresh.load_state_dict(state)
    assert fresh.buffer.step == 3 and fresh.updates == algo.updates == 5
    env.close()
    # Both go on from the same envs and the same random numbers: the same updates.
    for resumed in (algo, fresh):
        torch.manual_seed(12)
        resumed_env = seeded_tensor_env(name, 4, seed=13)
        train(resumed_env, resumed, 7 * 4)
        resumed_env.close()
    assert_same_weights(algo, fresh)
    assert_same(algo.state_dict(), fresh.state_dict())


RESUME = ["env.num_agents=4", "train.eval_every=2", "train.eval_episodes=2", "train.device=cpu",
          "algorithm.rollout_length=10", "train.keep_checkpoints=50",
          # (a smaller budget would decay a linear schedule sooner: not the same run)
          "algorithm.lr_schedule=constant"]
PHASE = 4 * 10 * 2  # env steps of a training phase


def test_a_resumed_trainer_run_equals_a_straight_one(tmp_path):
    def comparable(logdir):
        return [(r["step"], r["phase"], r["score"], r["length"], r["episodes"])
                for r in read_metrics(logdir)]

    full = load_config("impala/cartpole", RESUME + [f"train.steps={6 * PHASE}"])
    Trainer(full, tmp_path / "straight", progress=False).run()
    half = load_config("impala/cartpole", RESUME + [f"train.steps={3 * PHASE}"])
    Trainer(half, tmp_path / "resumed", progress=False).run()
    assert read_metrics(tmp_path / "resumed")[-1]["step"] == 3 * PHASE
    Trainer(full, tmp_path / "resumed", progress=False).run()
    assert comparable(tmp_path / "resumed") == comparable(tmp_path / "straight")
    assert len(comparable(tmp_path / "straight")) == 12
    straight, resumed = (torch.load(list_checkpoints(tmp_path / run)[-1], weights_only=False)
                         for run in ("straight", "resumed"))
    assert_same(straight["algorithm"], resumed["algorithm"])
    # Another number of agents evaluates the checkpoint (fresh per-agent state).
    result = evaluate(tmp_path / "resumed", episodes=3, agents=3, device="cpu")
    assert result["episodes"] == 3 and result["agents"] == 3


# -- configuration ----------------------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("activation", "sigmoid", "activation must be one of ('relu', 'tanh'), got 'sigmoid'"),
    ("optimizer", "sgd", "optimizer must be one of ('adam', 'rmsprop'), got 'sgd'"),
    ("lr_schedule", "cosine", "lr_schedule must be one of"),
    ("policy_layers", (64, 0), "policy_layers must be layer sizes >= 1, got (64, 0)"),
    ("rollout_length", 0, "rollout_length must be >= 1, got 0"),
    ("update_steps", 0, "update_steps must be >= 1, got 0"),
    ("learning_rate", 0.0, "learning_rate must be > 0, got 0.0"),
    ("rho_bar", -1.0, "rho_bar must be > 0, got -1.0"),
    ("c_bar", float("nan"), "c_bar must be a finite number, got nan"),
    ("learning_rate", float("inf"), "learning_rate must be a finite number, got inf"),
    ("entropy_cost", float("inf"), "entropy_cost must be a finite number, got inf"),
    ("discount", 1.5, "discount must be in [0, 1], got 1.5"),
    ("entropy_cost", -0.1, "entropy_cost must be >= 0, got -0.1"),
    ("max_grad_norm", 0.0, "max_grad_norm must be > 0 or None, got 0.0"),
])
def test_bad_config_values_are_one_line_errors(key, value, message):
    with pytest.raises(ValueError) as info:
        IMPALAConfig(**{key: value})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_bad_values_in_a_config_file_name_the_key():
    with pytest.raises(ConfigError) as info:
        load_config("impala/cartpole", ["algorithm.c_bar=0"])
    assert str(info.value) == "algorithm.c_bar must be > 0, got 0.0"
    with pytest.raises(ConfigError, match=r"IMPALA \(batchrl.algos.impala:IMPALA\) does not "
                                          r"take algorithm.update_epochs; its keys: "):
        load_config("impala/cartpole", ["algorithm.update_epochs=3"])
    with pytest.raises(ConfigError, match="algorithm.rollout_length: expected an integer"):
        load_config("impala/cartpole", ["algorithm.rollout_length=ten"])


def test_constructor_errors():
    box, discrete = gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2)
    with pytest.raises(TypeError, match="IMPALAConfig or keyword arguments, not both"):
        IMPALA(box, discrete, 2, IMPALAConfig(), learning_rate=1e-3)
    with pytest.raises(ValueError, match="lr_schedule='linear' needs total_steps"):
        IMPALA(box, discrete, 2, lr_schedule="linear")
    with pytest.raises(UnsupportedSpaceError, match="Box observation space"):
        IMPALA(discrete, discrete, 2)
    with pytest.raises(UnsupportedSpaceError, match="Discrete and 1-D Box action spaces"):
        IMPALA(box, gym.spaces.MultiDiscrete([2, 2]), 2)
    with pytest.raises(UnsupportedSpaceError, match="Discrete and 1-D Box action spaces"):
        IMPALA(box, gym.spaces.Box(-1, 1, (2, 2)), 2)
    # Its indices 0..n-1 would reach the env unshifted (BatchPPO's head is the same).
    for algorithm in (IMPALA, BatchPPO):
        with pytest.raises(UnsupportedSpaceError, match=r"needs Discrete\(n\) actions "
                                                        r"starting at 0, got Discrete\(3, "
                                                        r"start=-1\)"):
            algorithm(box, gym.spaces.Discrete(3, start=-1), 2)
