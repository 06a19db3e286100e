"""BatchPPO on synthetic data: the loss against a hand computation, the KL penalty
and cutoff, masking of padded steps, inference modes, checkpoints, evaluation."""

from __future__ import annotations

import copy
import io
import math
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos import BatchPPO, KLPenalty, PPOConfig
from batchrl.algos.networks import Actor
from batchrl.algos.ppo import compile_actor
from batchrl.envs.errors import UnsupportedSpaceError
from batchrl.hardware import usable_cores
from batchrl.parts import losses

OBS_SIZE = 3
OBSERV = gym.spaces.Box(-np.inf, np.inf, (OBS_SIZE,), np.float32)
BOX = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
DISCRETE = gym.spaces.Discrete(4)
SPACES = {"box": BOX, "discrete": DISCRETE}


def make(action_space=BOX, num_agents=3, seed=0, max_length=8, total_steps=None,
         **overrides) -> BatchPPO:
    config = dict(policy_layers=(16,), value_layers=(16,), gru_size=8, update_every=3,
                  update_epochs=2, inference="eager")
    config.update(overrides)
    torch.manual_seed(seed)
    return BatchPPO(OBSERV, action_space, num_agents, PPOConfig(**config),
                    max_length=max_length, total_steps=total_steps)


def policy_terms(algo: BatchPPO, batch: dict, mask: torch.Tensor) -> tuple:
    """``(surrogate, kl, entropy, log_ratio)`` of the algorithm's policy at ``batch``."""
    new, old = algo._distributions(batch)
    surrogate, kl, log_ratio = losses.policy_terms(new, old, batch["action"],
                                                   batch["advantage"], mask)
    return surrogate, kl, losses.masked_mean(new.entropy(), mask), log_ratio


def valid_mask(length: torch.Tensor, steps: int) -> torch.Tensor:
    return torch.arange(steps)[None] < length[:, None]


def fill_memory(algo: BatchPPO, lengths, seed: int, mean_shift: float = 0.0,
                log_std_shift: float = 0.0) -> dict[str, torch.Tensor]:
    """Store ``len(lengths)`` synthetic episodes in the update memory through the
    memory API, as experience() would. The behaviour ("old") policy is the
    current policy, its parameters shifted by ``mean_shift`` / ``log_std_shift``
    (categorical: logits plus ``mean_shift`` times noise); actions are sampled
    from it. Uses its own generator, never the global RNG."""
    episodes, steps = len(lengths), algo.max_length
    generator = torch.Generator().manual_seed(seed)
    length = torch.tensor(lengths)
    observ = torch.randn(episodes, steps, OBS_SIZE, generator=generator)
    reward = torch.randn(episodes, steps, generator=generator)
    bootstrap_observ = torch.randn(episodes, OBS_SIZE, generator=generator)
    terminated = (torch.arange(episodes) % 2).float()
    state = torch.zeros(episodes, algo.state_size)
    states, means_or_logits, log_stds = [], [], []
    with torch.no_grad():
        for t in range(steps):  # step by step, as perform() does
            states.append(state)
            mean_or_logits, log_std, state = algo.policy(observ[:, t:t + 1], state)
            means_or_logits.append(mean_or_logits[:, 0])
            log_stds.append(log_std if algo.discrete else log_std[:, 0])
    state = torch.stack(states, 1)
    mean_or_logits = torch.stack(means_or_logits, 1)
    if algo.discrete:
        mean_or_logits = mean_or_logits + mean_shift * torch.randn(mean_or_logits.shape, generator=generator)
        log_std = torch.zeros(episodes, steps, 0)
        probs = torch.softmax(mean_or_logits, -1).reshape(-1, mean_or_logits.shape[-1])
        action = torch.multinomial(probs, 1, generator=generator).reshape(episodes, steps)
    else:
        mean_or_logits = mean_or_logits + mean_shift
        # The log std is a view of a parameter, so it requires grad even when made
        # under no_grad; store it without autograd history, as experience() does.
        log_std = torch.stack(log_stds, 1).detach() + log_std_shift
        action = mean_or_logits + log_std.exp() * torch.randn(mean_or_logits.shape, generator=generator)
    for t in range(steps):
        agents = torch.nonzero(length > t).squeeze(1)
        if agents.numel():
            algo.memory.append(agents, observ=observ[agents, t], action=action[agents, t],
                               mean_or_logits=mean_or_logits[agents, t], log_std=log_std[agents, t],
                               reward=reward[agents, t], state=state[agents, t])
    agents = torch.arange(episodes)
    algo.memory.set_episode(agents, bootstrap_observ=bootstrap_observ, terminated=terminated)
    assert algo.memory.finish(agents) == episodes
    return {"observ": observ, "reward": reward, "bootstrap_observ": bootstrap_observ,
            "terminated": terminated, "state": state, "mean_or_logits": mean_or_logits, "log_std": log_std,
            "action": action, "length": length}


def scribble_padding(algo: BatchPPO, seed: int, scale: float = 1.0) -> None:
    """Overwrite every stored step beyond its episode's length with noise."""
    generator = torch.Generator().manual_seed(seed)
    memory = algo.memory
    for episode in range(memory.count):
        start = int(memory.stored_length[episode])
        for name in ("observ", "action", "mean_or_logits", "log_std", "reward", "state"):
            pad = memory.stored[name][episode, start:]
            if pad.numel() == 0:
                continue
            if pad.dtype == torch.int64:
                pad.copy_(torch.randint(0, DISCRETE.n, pad.shape, generator=generator))
            else:
                pad.copy_(scale * torch.randn(pad.shape, generator=generator))


def drive(algo: BatchPPO, steps: int, seed: int, episode_length: int = 3) -> list[dict]:
    """Run the Algorithm protocol for ``steps`` steps on synthetic transitions;
    every agent's episode ends every ``episode_length`` steps."""
    generator = torch.Generator().manual_seed(seed)
    agents = torch.arange(algo.num_agents)
    summaries = []
    algo.begin_episodes(agents)
    for step in range(steps):
        observ = 2.0 + 3.0 * torch.randn(algo.num_agents, OBS_SIZE, generator=generator)
        action, _ = algo.perform(agents, observ)
        reward = torch.randn(algo.num_agents, generator=generator)
        done = torch.full((algo.num_agents,), float((step + 1) % episode_length == 0))
        next_observ = torch.randn(algo.num_agents, OBS_SIZE, generator=generator)
        terminated = done * (agents % 2).float()
        algo.experience(agents, observ, action, reward, done, next_observ, terminated)
        ended = agents[done.bool()]
        if ended.numel():
            summaries.append(algo.end_episodes(ended))
            algo.begin_episodes(ended)
    return summaries


def params_of(algo: BatchPPO) -> dict[str, torch.Tensor]:
    named = {f"policy.{k}": v for k, v in algo.policy.state_dict().items()}
    named.update({f"value.{k}": v for k, v in algo.value.state_dict().items()})
    return named


# -- numpy references for the loss -----------------------------------------------------


def np_log_prob(discrete, mean_or_logits, log_std, action):
    if discrete:
        logits = mean_or_logits - mean_or_logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return np.take_along_axis(log_p, action[..., None], -1)[..., 0]
    std = np.exp(log_std)
    return (-0.5 * ((action - mean_or_logits) / std) ** 2 - log_std - 0.5 * np.log(2 * np.pi)).sum(-1)


def np_kl(discrete, old_a, old_b, new_a, new_b):
    """KL(old || new) per step, closed form."""
    if discrete:
        def log_softmax(x):
            x = x - x.max(-1, keepdims=True)
            return x - np.log(np.exp(x).sum(-1, keepdims=True))
        old_log, new_log = log_softmax(old_a), log_softmax(new_a)
        return (np.exp(old_log) * (old_log - new_log)).sum(-1)
    old_var, new_var = np.exp(2 * old_b), np.exp(2 * new_b)
    return (new_b - old_b + (old_var + (old_a - new_a) ** 2) / (2 * new_var) - 0.5).sum(-1)


def np_returns(reward, length, gamma, bootstrap):
    result = np.zeros_like(reward)
    for e, steps in enumerate(length):
        running = bootstrap[e]
        for t in reversed(range(steps)):
            running = reward[e, t] + gamma * running
            result[e, t] = running
    return result


def expected_first_step(algo: BatchPPO, data: dict[str, torch.Tensor]) -> dict[str, float]:
    """The losses of the first gradient step of update(), recomputed in numpy
    (float64) from the networks' outputs: plain discounted returns, raw
    rewards (config.normalize_reward=False)."""
    config = algo.config
    length = data["length"].numpy()
    valid = valid_mask(data["length"], algo.max_length).numpy()
    with torch.no_grad():
        value = algo.value(data["observ"]).double().numpy()
        bootstrap = algo.value(data["bootstrap_observ"]).double().numpy()
        new_a, new_b, _ = algo.policy(data["observ"], data["state"][:, 0])
    bootstrap = bootstrap * (1.0 - data["terminated"].double().numpy())
    returns = np_returns(data["reward"].double().numpy(), length, config.discount, bootstrap)
    advantage = (returns - value)[valid]
    advantage = (advantage - advantage.mean()) / (advantage.std(ddof=1) + 1e-8)
    new_a, new_b = new_a.detach().double().numpy()[valid], new_b.detach().double().numpy()
    old_a, old_b = data["mean_or_logits"].double().numpy()[valid], data["log_std"].double().numpy()
    if not algo.discrete:
        new_b, old_b = new_b[valid], old_b[valid]
    action = data["action"].numpy()[valid]
    ratio = np.exp(np_log_prob(algo.discrete, new_a, new_b, action)
                   - np_log_prob(algo.discrete, old_a, old_b, action))
    surrogate = -(ratio * advantage).mean()
    kl = np_kl(algo.discrete, old_a, old_b, new_a, new_b).mean()
    cutoff = config.kl_cutoff_coef * max(0.0, kl - config.kl_cutoff_factor * config.kl_target) ** 2
    value_loss = 0.5 * ((returns - value)[valid] ** 2).mean()
    if algo.discrete:
        log_p = new_a - new_a.max(-1, keepdims=True)
        log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
        entropy = -(np.exp(log_p) * log_p).sum(-1).mean()
    else:
        entropy = (0.5 * np.log(2 * np.pi * np.e) + new_b).sum(-1).mean()
    penalty = algo.penalty.value if isinstance(algo.objective, losses.KLPenalizedObjective) else 0
    return {"surrogate": surrogate, "kl": kl, "cutoff": cutoff,
            "policy_loss": surrogate + penalty * kl + cutoff,
            "value_loss": value_loss, "ratio": ratio, "advantage": advantage,
            "entropy": entropy, "returns": returns[valid]}


def capture_advantages(algo: BatchPPO) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Record copies of what ``algo._advantages`` returns at each update (the memory's
    buffers are cleared after it)."""
    captured = []
    original = algo._advantages

    def capture(*args):
        data, mask = original(*args)
        captured.append(({name: value.clone() for name, value in data.items()}, mask.clone()))
        return data, mask

    algo._advantages = capture
    return captured


class RecordingObjective:
    """``objective`` that records the advantages and mask of each gradient step."""

    def __init__(self, objective) -> None:
        self.objective = objective
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, new, old, action, advantage, mask):
        self.steps.append((advantage.detach().clone(), mask.clone()))
        return self.objective(new, old, action, advantage, mask)

    def __getattr__(self, name):
        return getattr(self.objective, name)


# -- KLPenalty -------------------------------------------------------------------------


def test_kl_penalty_adaptation():
    penalty = KLPenalty(target=0.01, initial=2.0)
    assert penalty.adapt(0.02) == pytest.approx(3.0)        # > 1.3 * target
    assert penalty.adapt(0.0131) == pytest.approx(4.5)
    assert penalty.adapt(0.001) == pytest.approx(3.0)       # < 0.7 * target
    assert penalty.adapt(0.0) == pytest.approx(2.0)
    assert penalty.adapt(0.0069) == pytest.approx(2.0 / 1.5)
    penalty.value = 2.0
    for kl in (0.7 * 0.01, 0.007, 0.008, 0.01, 0.012, 0.013, 1.3 * 0.01):  # dead band + edges
        assert penalty.adapt(kl) == 2.0
    assert penalty.value == 2.0


def test_kl_penalty_compounds():
    penalty = KLPenalty(target=1.0, initial=1.0)
    for _ in range(4):
        penalty.adapt(10.0)
    assert penalty.value == pytest.approx(1.5 ** 4)
    for _ in range(6):
        penalty.adapt(0.1)
    assert penalty.value == pytest.approx(1.5 ** -2)


# -- the loss --------------------------------------------------------------------------


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_policy_terms_match_hand_computation(space):
    algo = make(SPACES[space])
    data = fill_memory(algo, [8, 5, 2], seed=1, mean_shift=0.3, log_std_shift=-0.2)
    stored, length = algo.memory.data()
    batch = dict(stored)
    valid = valid_mask(length, 8)
    advantage = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    batch["advantage"] = advantage * valid
    surrogate, kl, entropy, log_ratio = policy_terms(algo, batch, valid.float())

    with torch.no_grad():
        new_a, new_b, _ = algo.policy(data["observ"], data["state"][:, 0])
    mask = valid.numpy()
    new_a, new_b = new_a.detach().double().numpy(), new_b.detach().double().numpy()
    old_a, old_b = data["mean_or_logits"].double().numpy(), data["log_std"].double().numpy()
    action = data["action"].numpy()
    expected_log_ratio = (np_log_prob(algo.discrete, new_a, new_b, action)
                          - np_log_prob(algo.discrete, old_a, old_b, action))
    np.testing.assert_allclose(log_ratio.detach().numpy()[mask], expected_log_ratio[mask],
                               rtol=1e-4, atol=1e-5)
    expected_surrogate = -(np.exp(expected_log_ratio) * advantage.numpy())[mask].mean()
    expected_kl = np_kl(algo.discrete, old_a, old_b, new_a, new_b)[mask].mean()
    if algo.discrete:
        log_p = np.log(torch.softmax(torch.from_numpy(new_a), -1).numpy())
        expected_entropy = -(np.exp(log_p) * log_p).sum(-1)[mask].mean()
    else:
        expected_entropy = (0.5 * np.log(2 * np.pi * np.e) + new_b).sum(-1)[mask].mean()
    surrogate, kl, entropy = (float(x.detach()) for x in (surrogate, kl, entropy))
    assert surrogate == pytest.approx(expected_surrogate, rel=1e-4)
    assert kl == pytest.approx(expected_kl, rel=1e-4)
    assert kl > 0.01
    assert entropy == pytest.approx(expected_entropy, rel=1e-4)


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_first_update_step_matches_hand_computation_with_cutoff(space):
    """A behaviour policy far from the current one: the cutoff is active and the
    first gradient step's losses equal the formula of the paper."""
    algo = make(SPACES[space], update_epochs=1, normalize_reward=False, kl_init_penalty=0.7,
                discount=0.9)
    # (box: shifts small enough that the cutoff does not dwarf the other two terms, whose
    # sum is checked on its own below)
    shifts = dict(mean_shift=0.15, log_std_shift=0.1) if space == "box" else dict(
        mean_shift=1.0, log_std_shift=0.5)
    data = fill_memory(algo, [8, 3, 6], seed=3, **shifts)
    expected = expected_first_step(algo, data)
    threshold = algo.config.kl_cutoff_factor * algo.config.kl_target
    assert expected["kl"] > threshold + 0.1
    assert expected["cutoff"] > 10.0
    summary = algo.update()
    assert summary["ppo/kl_cutoff"] == pytest.approx(expected["cutoff"], rel=1e-4)
    assert summary["ppo/policy_loss"] == pytest.approx(expected["policy_loss"], rel=1e-4)
    assert summary["ppo/policy_loss"] - summary["ppo/kl_cutoff"] == pytest.approx(
        expected["surrogate"] + 0.7 * expected["kl"], abs=2e-3)
    assert summary["ppo/value_loss"] == pytest.approx(expected["value_loss"], rel=1e-4)
    assert summary["ppo/beta"] == 0.7
    # The KL after the step is still far above 1.3 * target: beta grows.
    assert summary["ppo/kl"] > 1.3 * algo.config.kl_target
    assert summary["ppo/beta_next"] == pytest.approx(0.7 * 1.5)
    assert algo.penalty.value == pytest.approx(0.7 * 1.5)
    assert summary["ppo/updates"] == 1.0 and algo.updates == 1


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_cutoff_is_exactly_zero_below_threshold(space):
    """Behaviour policy == current policy: KL stays far below
    kl_cutoff_factor * kl_target, so the cutoff contributes exactly nothing."""
    algo = make(SPACES[space], update_epochs=3, normalize_reward=False, kl_init_penalty=0.7)
    data = fill_memory(algo, [8, 3, 6], seed=4)
    expected = expected_first_step(algo, data)
    assert expected["kl"] < 1e-6 and expected["cutoff"] == 0.0
    summary = algo.update()
    assert summary["ppo/kl_cutoff"] == 0.0
    assert 0.0 <= summary["ppo/kl"] < 0.7 * algo.config.kl_target
    # Small KL: beta shrinks.
    assert summary["ppo/beta"] == 0.7
    assert algo.penalty.value == pytest.approx(0.7 / 1.5)
    assert all(math.isfinite(v) for v in summary.values())


def test_cutoff_coefficient_scales_the_term():
    """Same data, same seeds, kl_cutoff_coef 1000, 250 and 0: the term scales with the
    coefficient (the first step's KL is the same in each), and the reported policy loss
    differs exactly by it."""
    summaries = []
    for coef in (1000.0, 0.0, 250.0):
        algo = make(BOX, update_epochs=1, kl_cutoff_coef=coef, normalize_reward=False)
        fill_memory(algo, [8, 3, 6], seed=5, mean_shift=0.8)
        torch.manual_seed(0)
        summaries.append(algo.update())
    with_cutoff, without, quarter = summaries
    assert quarter["ppo/kl_cutoff"] == pytest.approx(with_cutoff["ppo/kl_cutoff"] / 4, rel=1e-5)
    assert without["ppo/kl_cutoff"] == 0.0
    assert with_cutoff["ppo/kl_cutoff"] > 1.0
    assert with_cutoff["ppo/policy_loss"] - without["ppo/policy_loss"] == pytest.approx(
        with_cutoff["ppo/kl_cutoff"], rel=1e-5)


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_first_clipped_step_takes_its_clip_range_entropy_bonus_and_value_coef(space):
    """objective="clip": the first gradient step's losses are PPO's clipped surrogate at
    clip_range, minus entropy_coef times the entropy, and value_coef times the value loss."""
    algo = make(SPACES[space], update_epochs=1, normalize_reward=False, discount=0.9,
                objective="clip", clip_range=0.1, entropy_coef=0.3, value_coef=0.5)
    shifts = dict(mean_shift=0.15, log_std_shift=0.1) if space == "box" else dict(
        mean_shift=1.0)
    data = fill_memory(algo, [8, 3, 6], seed=3, **shifts)
    expected = expected_first_step(algo, data)
    ratio, advantage = expected["ratio"], expected["advantage"]
    clipped = np.clip(ratio, 0.9, 1.1)
    surrogate = -np.minimum(ratio * advantage, clipped * advantage).mean()
    fraction = np.mean((ratio < 0.9) | (ratio > 1.1))
    assert 0.0 < fraction < 1.0
    summary = algo.update()
    assert summary["ppo/clip_fraction"] == pytest.approx(fraction, rel=1e-6)
    assert summary["ppo/entropy_bonus"] == pytest.approx(-0.3 * expected["entropy"], rel=1e-4)
    assert summary["ppo/policy_loss"] == pytest.approx(surrogate - 0.3 * expected["entropy"],
                                                       rel=1e-4, abs=1e-5)
    assert summary["ppo/value_loss"] == pytest.approx(0.5 * expected["value_loss"], rel=1e-4)
    assert summary["ppo/total_loss"] == pytest.approx(
        summary["ppo/policy_loss"] + summary["ppo/value_loss"], rel=1e-6)


def test_beta_adapts_to_the_kl_of_the_updated_policy_from_the_acting_one():
    """After the update: KL(acting || updated) over the real steps sets the next beta, and the
    explained variance is that of the updated value network against the update's returns."""
    algo = make(BOX, update_epochs=2, normalize_reward=False, kl_init_penalty=0.7)
    data = fill_memory(algo, [8, 3, 6], seed=6, mean_shift=0.1, log_std_shift=0.4)
    returns = expected_first_step(algo, data)["returns"]
    summary = algo.update()
    valid = valid_mask(data["length"], 8).numpy()
    with torch.no_grad():
        new_a, new_b, _ = algo.policy(data["observ"], data["state"][:, 0])
        value = algo.value(data["observ"]).double().numpy()[valid]
    kl = np_kl(False, data["mean_or_logits"].double().numpy()[valid],
               data["log_std"].double().numpy()[valid], new_a.detach().double().numpy()[valid],
               new_b.detach().double().numpy()[valid]).mean()
    assert summary["ppo/kl"] == pytest.approx(kl, rel=1e-4)
    assert summary["ppo/beta_next"] == pytest.approx(KLPenalty(0.01, 0.7).adapt(kl))
    assert summary["ppo/beta_next"] != 0.7  # (the KL lies outside the dead band)
    assert summary["ppo/explained_variance"] == pytest.approx(
        1.0 - np.var(returns - value) / np.var(returns), rel=1e-4)


# -- masking of padded steps -------------------------------------------------------------


@pytest.mark.parametrize("space,network,extra", [
    ("box", "feed_forward", {}),
    ("discrete", "feed_forward", {"gae_lambda": 0.95}),
    ("box", "feed_forward", {"batch_size": 2, "max_grad_norm": 0.5}),
    ("box", "recurrent", {}),
    ("discrete", "recurrent", {"chunk_length": 3, "batch_size": 2}),
])
def test_padding_does_not_change_the_update(space, network, extra):
    algos, summaries = [], []
    for scribble in (False, True):
        algo = make(SPACES[space], seed=7, network=network, update_epochs=3, **extra)
        fill_memory(algo, [8, 5, 2], seed=8, mean_shift=0.2)
        if scribble:
            scribble_padding(algo, seed=9, scale=3.0)
        torch.manual_seed(10)
        summaries.append(algo.update())
        algos.append(algo)
    clean, noisy = algos
    # The padding really differed.
    assert not torch.equal(clean.memory.stored["observ"], noisy.memory.stored["observ"])
    assert summaries[0] == summaries[1]
    assert all(math.isfinite(v) for v in summaries[0].values())
    clean_params, noisy_params = params_of(clean), params_of(noisy)
    for name, value in clean_params.items():
        assert torch.equal(value, noisy_params[name]), name
    # ... and the update did change the parameters.
    torch.manual_seed(7)
    fresh = make(SPACES[space], seed=7, network=network, update_epochs=3, **extra)
    assert not torch.equal(params_of(fresh)["value.out.weight"], clean_params["value.out.weight"])


# -- inference modes ---------------------------------------------------------------------


@pytest.mark.parametrize("space", ["box", "discrete"])
@pytest.mark.parametrize("network", ["feed_forward", "recurrent"])
def test_script_and_eager_actors_agree(space, network):
    algo = make(SPACES[space], network=network)
    eager = compile_actor(Actor(algo.policy), "eager")
    script = compile_actor(Actor(algo.policy), "script")
    assert isinstance(script, torch.jit.ScriptModule)
    generator = torch.Generator().manual_seed(0)
    observ = torch.randn(6, OBS_SIZE, generator=generator)
    state = torch.randn(6, algo.state_size, generator=generator)

    def both(deterministic, seed=11):
        torch.manual_seed(seed)
        out_script = script(observ, state, deterministic)
        torch.manual_seed(seed)
        out_eager = eager(observ, state, deterministic)
        for a, b in zip(out_script, out_eager):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return out_eager

    sampled, mean_or_logits, log_std, new_state = both(False)
    mean_action = both(True)[0]
    assert new_state.shape == (6, algo.state_size)
    if algo.discrete:
        assert sampled.dtype == torch.int64 and sampled.shape == (6,)
        assert torch.equal(mean_action, mean_or_logits.argmax(-1))
        assert log_std.numel() == 0
    else:
        assert sampled.shape == (6, 2)
        with torch.no_grad():
            expected, _, _ = algo.policy(observ.unsqueeze(1), state)
        assert torch.equal(mean_action, expected[:, 0])
        assert bool((mean_action.abs() < 1).all())
        assert not torch.equal(sampled, mean_action)
    # A different seed gives different samples (so the equality above means something).
    draws = torch.stack([both(False, seed)[0] for seed in range(12, 16)])
    assert not all(torch.equal(draws[0], row) for row in draws[1:])
    # The scripted actor shares the policy's parameters.
    with torch.no_grad():
        head = algo.policy.head
        (head.logits if algo.discrete else head.mean).bias.add_(0.7)
    both(False)
    both(True)


def test_algorithm_inference_modes_agree():
    """BatchPPO(inference="script") and BatchPPO(inference="eager") built with the
    same seed act identically for the same torch seed."""
    actions = []
    for inference in ("script", "eager"):
        algo = make(DISCRETE, seed=3, inference=inference)
        agents = torch.arange(3)
        algo.begin_episodes(agents)
        torch.manual_seed(4)
        actions.append(torch.stack([algo.perform(agents, torch.full((3, OBS_SIZE), float(i)))[0]
                                    for i in range(5)]))
    assert torch.equal(actions[0], actions[1])


def test_sampled_actions_spread_by_the_initial_std():
    algo = make(BOX, num_agents=2, init_std=0.6)
    torch.testing.assert_close(algo.policy.head.log_std.detach(),
                               torch.full((2,), math.log(0.6)))
    torch.manual_seed(0)
    action, record = algo.act(torch.zeros(4000, OBS_SIZE))
    spread = (action - record["mean_or_logits"]).std(0)
    torch.testing.assert_close(spread, torch.full((2,), 0.6), rtol=0.05, atol=0.0)


def test_script_deprecation_warning_does_not_escape():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        algo = make(BOX, inference="script", network="recurrent")
        algo.perform(torch.arange(3), torch.zeros(3, OBS_SIZE))
    assert isinstance(algo.actor, torch.jit.ScriptModule)
    leaked = [w for w in caught if issubclass(w.category, DeprecationWarning)
              and "jit" in str(w.message)]
    assert not leaked, [str(w.message) for w in leaked]
    # Outside BatchPPO the warning is still shown (the filter is local).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(Actor(algo.policy))
    if any(issubclass(w.category, DeprecationWarning) for w in caught):
        assert any("jit" in str(w.message) for w in caught)


# -- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("space,network", [("box", "feed_forward"), ("discrete", "recurrent")])
def test_state_dict_round_trip(space, network):
    source = make(SPACES[space], num_agents=2, seed=1, network=network, update_every=2,
                  update_epochs=3, max_length=5)
    summaries = [s for s in drive(source, steps=7, seed=2) if s]
    assert len(summaries) == 2 and source.updates == 2
    assert source.penalty.value != 1.0
    assert float(source.observ_normalizer.count) == 14

    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)

    target = make(SPACES[space], num_agents=2, seed=99, network=network, update_every=2,
                  update_epochs=3, max_length=5)
    observ = torch.randn(2, OBS_SIZE, generator=torch.Generator().manual_seed(3))
    agents = torch.arange(2)
    source.eval(), target.eval()
    source.begin_episodes(agents), target.begin_episodes(agents)
    assert not torch.equal(source.perform(agents, observ)[0], target.perform(agents, observ)[0])

    target.load_state_dict(state)
    assert target.penalty.value == source.penalty.value
    assert target.updates == 2
    for name in ("count", "mean", "sum_sq"):
        assert torch.equal(getattr(target.observ_normalizer, name),
                           getattr(source.observ_normalizer, name))
        assert torch.equal(getattr(target.reward_normalizer, name),
                           getattr(source.reward_normalizer, name))
    for name, value in params_of(source).items():
        assert torch.equal(value, params_of(target)[name]), name
    assert target.memory.count == source.memory.count == 0
    # Saved one step into the third episode; source has since begun new episodes.
    assert target.memory.running_length.tolist() == [1, 1]

    for mode in ("eval", "train"):
        getattr(source, mode)(), getattr(target, mode)()
        source.begin_episodes(agents), target.begin_episodes(agents)
        for step in range(3):  # recurrent: the state carries over steps
            torch.manual_seed(20 + step)
            action_source, _ = source.perform(agents, observ + step)
            torch.manual_seed(20 + step)
            action_target, _ = target.perform(agents, observ + step)
            assert torch.equal(action_source, action_target), (mode, step)

    # The optimisers were restored too: one more identical update gives identical weights.
    for algo in (source, target):
        algo.memory.clear()
        fill_memory(algo, [5, 3], seed=4)
        torch.manual_seed(5)
        algo.update()
    for name, value in params_of(source).items():
        assert torch.equal(value, params_of(target)[name]), name


# -- evaluation --------------------------------------------------------------------------


@pytest.mark.parametrize("space", ["box", "discrete"])
def test_eval_mode_acts_with_the_mean_and_learns_nothing(space):
    algo = make(SPACES[space], num_agents=3, update_every=3)
    drive(algo, steps=2, seed=1)  # normaliser statistics are not trivial
    agents = torch.arange(3)
    algo.begin_episodes(agents)
    algo.eval()
    count = float(algo.observ_normalizer.count)
    reward_count = float(algo.reward_normalizer.count)
    running = {k: v.clone() for k, v in algo.memory.running.items()}
    running_length = algo.memory.running_length.clone()
    policy_before = {k: v.clone() for k, v in algo.policy.state_dict().items()}

    observ = 2.0 + 3.0 * torch.randn(3, OBS_SIZE, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    action, _ = algo.perform(agents, observ)
    with torch.no_grad():
        normalized = algo.observ_normalizer.transform(observ)
        assert not torch.allclose(normalized, observ)
        mean_or_logits, _, _ = algo.policy(normalized.unsqueeze(1), torch.zeros(3, 0))
    expected = mean_or_logits[:, 0].argmax(-1) if algo.discrete else mean_or_logits[:, 0]
    assert torch.equal(action, expected)
    if not algo.discrete:
        assert bool((action.abs() < 1).all())
    torch.manual_seed(1)
    assert torch.equal(algo.perform(agents, observ)[0], action)  # deterministic

    for step in range(algo.max_length + 2):  # would overflow memory if stored
        algo.perform(agents, observ)
        done = torch.ones(3)
        assert algo.experience(agents, observ, action, torch.ones(3), done, observ, done) == {}
        assert algo.end_episodes(agents) == {}
    assert float(algo.observ_normalizer.count) == count
    assert float(algo.reward_normalizer.count) == reward_count
    assert torch.equal(algo.memory.running_length, running_length)
    assert algo.memory.count == 0 and algo.updates == 0
    for name, value in algo.memory.running.items():
        assert torch.equal(value, running[name]), name
    for name, value in algo.policy.state_dict().items():
        assert torch.equal(value, policy_before[name]), name

    # Back in training mode the same calls are recorded.
    algo.train()
    torch.manual_seed(0)
    sampled, _ = algo.perform(agents, observ)
    if not algo.discrete:
        assert not torch.equal(sampled, action)
    algo.experience(agents, observ, sampled, torch.ones(3), torch.zeros(3), observ, torch.zeros(3))
    assert algo.memory.running_length.tolist() == (running_length + 1).tolist()
    assert float(algo.observ_normalizer.count) == count + 3


@pytest.mark.parametrize("rollout_length", [None, 4])
def test_observations_are_not_counted_without_normalize_observ(rollout_length):
    # Acting and learning alike leave the statistics alone (they would cost a pass per step
    # and an all-gather per update with several learners, for statistics nothing reads).
    algo = make(BOX, num_agents=2, rollout_length=rollout_length, normalize_observ=False)
    initial = {name: value.clone() for name, value in algo.observ_normalizer.state_dict().items()}
    drive(algo, steps=9, seed=0)
    assert algo.updates > 0
    for name, value in algo.observ_normalizer.state_dict().items():
        assert torch.equal(value, initial[name]), name


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("network", "cnn"), ("inference", "fast"), ("discount", 1.5), ("discount", -0.1),
    ("update_every", 0), ("update_epochs", 0), ("gae_lambda", 1.5),
    ("kl_target", 0.0), ("policy_lr", -1.0), ("batch_size", 0), ("chunk_length", 0),
    ("rollout_length", 0), ("minibatch_size", 0), ("activation", "gelu"), ("init", "xavier"),
    ("reward_scale", "value"), ("lr_schedule", "cosine"), ("max_grad_norm", 0.0),
    ("max_grad_norm", -0.5), ("kl_init_penalty", 0.0), ("kl_cutoff_factor", -1.0),
    ("kl_cutoff_coef", -1.0), ("value_lr", 0.0), ("init_std", 0.0), ("value_coef", 0.0),
    ("update_threads", 0), ("policy_lr", float("inf")), ("entropy_coef", float("inf")),
    ("max_grad_norm", float("nan")), ("clip_range", float("inf")),
])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})


def test_config_rejects_combinations():
    with pytest.raises(ValueError, match="lr_schedule='linear' needs total_steps"):
        make(BOX, lr_schedule="linear")
    for name in ("max_length", "total_steps"):  # the run facts
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            make(BOX, **{name: 0})
    with pytest.raises(ValueError, match="batch_size .* and minibatch_size .* set one of them"):
        PPOConfig(batch_size=2, minibatch_size=64)
    for name in ("rollout_length", "minibatch_size"):
        with pytest.raises(ValueError, match=f"{name} needs network='feed_forward'"):
            PPOConfig(network="recurrent", **{name: 16})
    with pytest.raises(ValueError, match="gae_lambda .* is GAE's: V-trace's targets"):
        PPOConfig(value_targets="vtrace", rollout_length=16, gae_lambda=0.95)
    with pytest.raises(ValueError, match="chunk_length .* needs network='recurrent'"):
        PPOConfig(chunk_length=8)
    with pytest.raises(ValueError, match="with minibatch_size 1 all would be 0"):
        PPOConfig(minibatch_size=1, advantage_normalization="minibatch")
    PPOConfig(minibatch_size=1)  # (normalised over the update: has a spread)


class OneStepBandit(gym.Env):
    """Episodes of one step: action 1 earns 1."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), float(action), True, False, {}


def test_an_update_of_one_step_leaves_the_policy_finite():
    """One agent, one-step episodes, an update per episode: one advantage, whose normalisation
    has no spread to divide by (its std was NaN, and the policy with it)."""
    from batchrl.envs import BatchEnv
    from batchrl.simulation import simulate
    from batchrl.tensor_env import TensorBatchEnv

    torch.manual_seed(0)
    env = TensorBatchEnv(BatchEnv([OneStepBandit()]))
    env.reset(seed=0)
    algo = BatchPPO(env.observation_space, env.action_space, 1,
                    PPOConfig(update_every=1, update_epochs=2, inference="eager"))
    for _ in range(4):
        simulate(env, algo)
    assert algo.updates >= 3
    assert all(torch.isfinite(p).all() for p in algo.policy.parameters())
    env.close()


def test_config_accepts_valid_values():
    PPOConfig(network="recurrent", inference="compile", discount=1.0, gae_lambda=0.0,
              update_every=1, batch_size=1, chunk_length=1)


def test_constructor_rejects_unsupported_spaces():
    with pytest.raises(UnsupportedSpaceError, match="BatchPPO"):
        BatchPPO(gym.spaces.Discrete(3), BOX, 2, PPOConfig(inference="eager"))
    with pytest.raises(UnsupportedSpaceError, match="BatchPPO"):
        BatchPPO(OBSERV, gym.spaces.Box(-1, 1, (2, 2)), 2, PPOConfig(inference="eager"))
    with pytest.raises(UnsupportedSpaceError, match="BatchPPO"):
        BatchPPO(OBSERV, gym.spaces.MultiDiscrete([2, 2]), 2, PPOConfig(inference="eager"))


# -- recurrent policies ------------------------------------------------------------------


def test_recurrent_state_reset_for_given_agents_only():
    algo = make(BOX, num_agents=3, network="recurrent")
    agents = torch.arange(3)
    algo.begin_episodes(agents)
    assert torch.equal(algo.recurrent_state, torch.zeros(3, 8))
    observ = torch.randn(3, OBS_SIZE, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        action, _ = algo.perform(agents, observ)
        algo.experience(agents, observ, action, torch.ones(3), torch.zeros(3), observ,
                        torch.zeros(3))
    before = algo.recurrent_state.clone()
    assert bool((before != 0).all(1).all())
    algo.begin_episodes(torch.tensor([1]))
    assert torch.equal(algo.recurrent_state[1], torch.zeros(8))
    assert torch.equal(algo.recurrent_state[[0, 2]], before[[0, 2]])
    assert algo.memory.running_length.tolist() == [2, 0, 2]
    # Agent 1 now acts from a zero state, the others from their carried state.
    algo.eval()
    action, _ = algo.perform(agents, observ)
    with torch.no_grad():
        state = before.clone()
        state[1] = 0
        mean, _, new_state = algo.policy(algo.observ_normalizer.transform(observ).unsqueeze(1),
                                         state)
    torch.testing.assert_close(action, mean[:, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(algo.recurrent_state, new_state, rtol=1e-6, atol=1e-6)


def test_recurrent_chunks_match_whole_episodes():
    algo = make(BOX, network="recurrent", chunk_length=3)
    fill_memory(algo, [8, 5, 3], seed=12, mean_shift=0.2)
    data, length = algo.memory.data()
    data = {name: data[name] for name in algo.memory.step_fields}
    valid = valid_mask(length, 8)
    data["advantage"] = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)) * valid
    data["returns"] = torch.zeros(3, 8)
    chunks, mask = algo._layout(data, valid)
    # 8 steps -> chunks of 3 padded to 9; chunks holding no valid step are dropped:
    # 3 + 2 + 1 chunks.
    assert mask.shape == (6, 3)
    assert mask.sum(1).tolist() == [3, 3, 2, 3, 2, 3]
    assert chunks["observ"].shape == (6, 3, OBS_SIZE)
    assert torch.equal(chunks["observ"][1], data["observ"][0, 3:6])
    assert torch.equal(chunks["observ"][2, :2], data["observ"][0, 6:8])
    assert torch.equal(chunks["state"][4], data["state"][1, 3:6])
    # Every chunk starts from the state stored at its first step, so chunked and
    # whole-episode evaluation of the policy agree.
    with torch.no_grad():
        by_chunk = policy_terms(algo, chunks, mask.float())
        whole = policy_terms(algo, data, valid.float())
    for a, b in zip(by_chunk[:3], whole[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_chunk[3][mask], whole[3][valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_length", [None, 3])
def test_recurrent_update_runs(chunk_length):
    algo = make(DISCRETE, network="recurrent", chunk_length=chunk_length, update_epochs=3,
                batch_size=2, gae_lambda=0.95)
    fill_memory(algo, [8, 5, 3], seed=13, mean_shift=0.5)
    before = params_of(algo)["policy.body.gru.weight_hh_l0"].clone()
    summary = algo.update()
    expected_keys = {"ppo/policy_loss", "ppo/value_loss", "ppo/grad_norm", "ppo/kl_cutoff",
                     "ppo/total_loss", "ppo/kl", "ppo/beta", "ppo/beta_next", "ppo/entropy",
                     "ppo/explained_variance", "ppo/updates"}
    assert set(summary) == expected_keys
    assert all(math.isfinite(v) for v in summary.values()), summary
    assert summary["ppo/kl"] > 0 and summary["ppo/grad_norm"] > 0
    assert not torch.equal(params_of(algo)["policy.body.gru.weight_hh_l0"], before)


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
@pytest.mark.parametrize("space,network", [("box", "feed_forward"), ("discrete", "recurrent")])
def test_side_by_side_update_equals_one_thread_bit_for_bit(space, network):
    """By default the value step runs in a second thread beside the policy step; the
    result is that of update_threads=1 to the bit, and the summary too."""
    results = {}
    for threads in (None, 1):
        algo = make(SPACES[space], network=network, update_epochs=3, batch_size=2,
                    gae_lambda=0.95, update_threads=threads)
        fill_memory(algo, [8, 5, 3], seed=21, mean_shift=0.5)
        stepped_in = set()
        algo.value.out.weight.register_hook(
            lambda grad: stepped_in.add(threading.current_thread().name))
        before = torch.get_num_threads()
        summary = algo.update()
        assert torch.get_num_threads() == before
        results[threads] = (summary, params_of(algo), stepped_in)
    (summary, params, side), (one_summary, one_params, alone) = results[None], results[1]
    assert side == {"batchrl-value_0"} and alone == {"MainThread"}
    assert summary == one_summary
    for name, value in params.items():
        assert torch.equal(value, one_params[name]), name


def test_fused_adam_steps_in_one_kernel_and_repeats_itself():
    """``fused_adam``: both optimisers fused; the same seed gives the same update, side by
    side in two threads or in one."""
    results = []
    for threads in (None, 1, None):
        algo = make(BOX, update_epochs=2, batch_size=2, gae_lambda=0.95, fused_adam=True,
                    update_threads=threads)
        assert algo.policy_optimizer.defaults["fused"] and algo.value_optimizer.defaults["fused"]
        fill_memory(algo, [8, 5, 3], seed=4, mean_shift=0.5)
        before = {name: value.clone() for name, value in params_of(algo).items()}
        results.append((algo.update(), params_of(algo)))
        assert not torch.equal(results[-1][1]["value.out.weight"], before["value.out.weight"])
    for summary, params in results[1:]:
        assert summary == results[0][0]
        for name, value in params.items():
            assert torch.equal(value, results[0][1][name]), name
    assert not make(BOX).policy_optimizer.defaults["fused"]


def test_epsilon_is_adams_in_both_optimisers_and_changes_the_update():
    """``epsilon``: Adam's, in both optimisers; the default is torch's own, a larger one
    damps the steps of small gradients."""
    def updated(**overrides):
        algo = make(BOX, update_epochs=2, batch_size=2, update_threads=1, **overrides)
        fill_memory(algo, [8, 5, 3], seed=4, mean_shift=0.5)
        algo.update()
        return algo

    default, large = updated(), updated(epsilon=1e-2)
    assert [group["eps"] for optimizer in (default.policy_optimizer, default.value_optimizer)
            for group in optimizer.param_groups] == [torch.optim.Adam([torch.zeros(1)])
                                                     .defaults["eps"]] * 2
    assert [group["eps"] for optimizer in (large.policy_optimizer, large.value_optimizer)
            for group in optimizer.param_groups] == [1e-2, 1e-2]
    changed = {name for name, value in params_of(default).items()
               if not torch.equal(value, params_of(large)[name])}
    assert "value.out.weight" in changed and any(name.startswith("policy.") for name in changed)


def test_an_error_in_the_side_by_side_update_reaches_the_caller():
    algo = make(BOX, update_epochs=1)
    fill_memory(algo, [8, 5, 3], seed=3)
    def fail(grad):
        raise RuntimeError(f"value step failed in {threading.current_thread().name}")

    algo.value.out.weight.register_hook(fail)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="value step failed"):
        algo.update()
    assert torch.get_num_threads() == before


def test_update_happens_when_memory_is_full():
    algo = make(BOX, num_agents=2, update_every=4, max_length=5)
    summaries = drive(algo, steps=6, seed=0)
    # Episodes of 3 steps, 2 agents: the 4 episodes are complete after 6 steps.
    assert summaries[0] == {} and "ppo/kl" in summaries[1]
    assert algo.updates == 1 and algo.memory.count == 0


def test_max_grad_norm_clips_the_gradients_each_optimiser_steps_with():
    algo = make(BOX, update_epochs=2, batch_size=2, max_grad_norm=0.01, update_threads=1)
    fill_memory(algo, [8, 5, 3], seed=14, mean_shift=0.5)
    norms: dict[str, list[float]] = {"policy": [], "value": []}
    for name, optimizer in (("policy", algo.policy_optimizer), ("value", algo.value_optimizer)):
        def measure(optimizer, args, kwargs, name=name):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            norms[name].append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

        optimizer.register_step_pre_hook(measure)
    summary = algo.update()
    # 2 epochs of 3 episodes in batches of 2: 4 steps, each clipped down to the limit.
    for name, measured in norms.items():
        assert measured == pytest.approx([0.01] * 4, rel=1e-4), name
    assert summary["ppo/grad_norm"] > 0.01  # (the policy's norm before clipping)


# -- fixed-length rollouts and minibatches of time steps ----------------------------------


def rollout_steps(algo: BatchPPO, steps: int, seed: int, done_at: dict[int, list[int]],
                  terminal: set[int] = frozenset()) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Drive the Algorithm protocol as simulate() does for ``steps`` steps.
    ``done_at[t]`` lists the agents whose episode ends at step t (terminated
    when t is in ``terminal``, else cut by a time limit). Returns the
    summaries of experience() and what was fed in, by step."""
    generator = torch.Generator().manual_seed(seed)
    agents = torch.arange(algo.num_agents)
    summaries, fed = [], {"observ": [], "reward": [], "next_observ": [], "done": [],
                          "terminated": []}
    algo.begin_episodes(agents)
    observ = torch.randn(algo.num_agents, OBS_SIZE, generator=generator)
    for step in range(steps):
        action, _ = algo.perform(agents, observ)
        reward = torch.randn(algo.num_agents, generator=generator)
        done = torch.zeros(algo.num_agents)
        done[done_at.get(step, [])] = 1.0
        terminated = done * float(step in terminal)
        next_observ = torch.randn(algo.num_agents, OBS_SIZE, generator=generator)
        summaries.append(algo.experience(agents, observ, action, reward, done, next_observ,
                                         terminated))
        for name, value in (("observ", observ), ("reward", reward), ("done", done),
                            ("next_observ", next_observ), ("terminated", terminated)):
            fed[name].append(value)
        ended = agents[done.bool()]
        if ended.numel():
            assert algo.end_episodes(ended) == {}
            algo.begin_episodes(ended)
        # The env resets the agents that are done: their next observation is new.
        observ = torch.where(done.bool()[:, None],
                             torch.randn(algo.num_agents, OBS_SIZE, generator=generator),
                             next_observ)
    return summaries, {name: torch.stack(values, 1) for name, values in fed.items()}


def test_rollout_updates_every_rollout_length_steps_and_episodes_run_on():
    algo = make(BOX, num_agents=2, rollout_length=4, update_epochs=2, minibatch_size=3)
    summaries, _ = rollout_steps(algo, 9, seed=0, done_at={1: [0], 5: [0, 1]}, terminal={5})
    assert [bool(summary) for summary in summaries] == [False] * 3 + [True] + [False] * 3 + [
        True, False]
    assert "ppo/kl" in summaries[3] and algo.updates == 2
    # After the second update one step of the running episodes is stored.
    assert algo.memory.stored == 2 and algo.memory.steps.tolist() == [1, 1]


def test_rollout_advantages_bootstrap_at_time_limits_and_the_cut():
    gamma, lam = 0.9, 0.8
    algo = make(BOX, num_agents=2, rollout_length=5, discount=gamma, gae_lambda=lam,
                normalize_reward=False, normalize_observ=False, update_epochs=1)
    captured = {}
    original = algo._advantages

    def capture(*args):
        data, mask = original(*args)
        # (copies: the memory's buffers are cleared after the update)
        captured["data"] = {name: value.clone() for name, value in data.items()}
        captured["mask"] = mask.clone()
        captured["value"] = copy.deepcopy(algo.value)  # before the update changes it
        return data, mask

    algo._advantages = capture
    # Agent 0: a time limit after step 1, a terminal state after step 3, then
    # one step cut by the end of the rollout. Agent 1: one episode, cut.
    _, fed = rollout_steps(algo, 5, seed=1, done_at={1: [0], 3: [0]}, terminal={3})
    data = captured["data"]
    assert captured["mask"].all()
    with torch.no_grad():
        value = captured["value"](fed["observ"]).double().numpy()
        after = captured["value"](fed["next_observ"]).double().numpy()
    reward, done = fed["reward"].double().numpy(), fed["done"].numpy()
    terminated = fed["terminated"].numpy()
    # The loop every PPO implementation writes: the next value is the next
    # state's inside an episode, the final observation's at a time limit,
    # zero at a terminal state and the next observation's at the cut.
    expected = np.zeros((2, 5))
    for agent in range(2):
        advantage = 0.0
        for t in reversed(range(5)):
            if t == 4 or done[agent, t]:
                next_value, advantage = after[agent, t] * (1 - terminated[agent, t]), 0.0
            else:
                next_value = value[agent, t + 1]
            delta = reward[agent, t] + gamma * next_value - value[agent, t]
            advantage = delta + gamma * lam * advantage
            expected[agent, t] = advantage
    np.testing.assert_allclose(data["returns"].double().numpy(), expected + value, rtol=1e-5,
                               atol=1e-5)
    normalized = (expected - expected.mean()) / expected.std(ddof=1)
    np.testing.assert_allclose(data["advantage"].double().numpy(), normalized, rtol=1e-4,
                               atol=1e-4)


def test_rollout_drops_episodes_cut_by_a_reset():
    algo = make(BOX, num_agents=2, rollout_length=4, update_epochs=1)
    captured = capture_advantages(algo)
    rollout_steps(algo, 2, seed=2, done_at={0: [1]})
    # A reset of both envs (a new phase): agent 0's running episode has no
    # next state to bootstrap from, agent 1's episode began at step 1.
    algo.begin_episodes(torch.arange(2))
    rollout_steps(algo, 2, seed=3, done_at={})
    assert captured[0][1].tolist() == [[False, False, True, True], [True, False, True, True]]


def test_steps_lost_at_the_last_step_of_a_rollout_leave_the_update():
    """An env restart in the step that completes the rollout: experience() drops the restarted
    agent's running segment before the update, which no begin_episodes() could."""
    algo = make(BOX, num_agents=2, rollout_length=3, update_epochs=1)
    captured = capture_advantages(algo)
    agents = torch.arange(2)
    algo.begin_episodes(agents)
    observ = torch.randn(2, OBS_SIZE, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        action, _ = algo.perform(agents, observ)
        if step == 2:
            algo.steps_lost(torch.tensor([1]))
        algo.experience(agents, observ, action, torch.ones(2), torch.zeros(2), observ,
                        torch.zeros(2))
    assert algo.updates == 1
    assert captured[0][1].tolist() == [[True] * 3, [False] * 3]


def test_a_terminal_state_at_the_cut_bootstraps_nothing():
    algo = make(BOX, num_agents=2, rollout_length=3, discount=0.9, normalize_reward=False,
                update_epochs=1)
    with torch.no_grad():  # values far from zero: a bootstrap shows
        algo.value.out.bias.fill_(5.0)
    captured = capture_advantages(algo)
    # Agent 0 reaches a terminal state in the rollout's last step; agent 1 runs on.
    _, fed = rollout_steps(algo, 3, seed=15, done_at={2: [0]}, terminal={2})
    returns, reward = captured[0][0]["returns"], fed["reward"]
    assert float(returns[0, 2]) == pytest.approx(float(reward[0, 2]), abs=1e-5)
    assert float(returns[1, 2] - reward[1, 2]) > 1.0


def test_normalize_reward_divides_the_rewards_by_their_std_without_centering():
    # Discount 0: each step's return is its normalised reward.
    algo = make(BOX, num_agents=2, rollout_length=5, discount=0.0, update_epochs=1)
    captured = capture_advantages(algo)
    _, fed = rollout_steps(algo, 5, seed=16, done_at={})
    reward = fed["reward"]
    assert abs(float(reward.mean())) > 0.1  # (centering would show)
    torch.testing.assert_close(captured[0][0]["returns"], reward / reward.std(),
                               rtol=1e-5, atol=1e-6)


def test_minibatches_cover_every_step_once_per_epoch():
    algo = make(BOX, num_agents=3, rollout_length=7, update_epochs=3, minibatch_size=4)
    seen = []
    original = algo._policy_loss

    def record(batch, mask):
        assert batch["observ"].shape[1] == 1 and mask.shape[1] == 1
        seen.append(batch["observ"][:, 0].clone())
        return original(batch, mask)

    algo._policy_loss = record
    rollout_steps(algo, 7, seed=4, done_at={2: [1]})
    assert algo.updates == 1
    # 21 steps in minibatches of 4: 6 per epoch, the last one of 1 step.
    assert [len(batch) for batch in seen] == [4, 4, 4, 4, 4, 1] * 3
    for epoch in range(3):
        rows = torch.cat(seen[epoch * 6:(epoch + 1) * 6])
        assert len({tuple(row.tolist()) for row in rows}) == 21
    # Each epoch draws its own order.
    assert not torch.equal(torch.cat(seen[:6]), torch.cat(seen[6:12]))


def test_minibatch_advantage_normalization_standardises_each_gradient_steps_advantages():
    algo = make(BOX, num_agents=3, rollout_length=7, update_epochs=2, minibatch_size=7,
                advantage_normalization="minibatch")
    algo.objective = recording = RecordingObjective(algo.objective)
    rollout_steps(algo, 7, seed=17, done_at={3: [1]})
    assert algo.updates == 1 and len(recording.steps) == 6
    for advantage, mask in recording.steps:
        assert mask.shape == (7, 1) and bool(mask.all())
        assert float(advantage.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(advantage.std()) == pytest.approx(1.0, rel=1e-5)


def test_minibatch_advantage_normalization_of_padded_episodes_takes_their_real_steps():
    """A recurrent policy's minibatches are episodes padded to the longest: the padding
    (mask 0) takes no part in the mean and spread that standardise the real steps."""
    algo = make(BOX, network="recurrent", advantage_normalization="minibatch",
                update_epochs=1, batch_size=2)
    algo.objective = recording = RecordingObjective(algo.objective)
    fill_memory(algo, [8, 3, 6], seed=3)
    algo.update()
    assert any(not bool(mask.all()) for _, mask in recording.steps)  # (padding is there)
    for advantage, mask in recording.steps:
        real = advantage[mask > 0]
        assert float(real.mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(real.std()) == pytest.approx(1.0, rel=1e-4)


def test_experience_must_not_lag_at_the_end_of_a_rollout():
    algo = make(BOX, num_agents=2, rollout_length=3)
    agents = torch.arange(2)
    algo.begin_episodes(agents)
    observ = torch.zeros(2, OBS_SIZE)
    flags = []
    for step in range(6):
        flags.append(algo.experience_may_lag)
        action, _ = algo.perform(agents, observ)
        algo.experience(agents, observ, action, torch.zeros(2), torch.zeros(2), observ,
                        torch.zeros(2))
    assert flags == [True, True, False] * 2
    # One step stored and the experience of the next still due (it lagged):
    # the coming step is the last of the rollout.
    action, _ = algo.perform(agents, observ)
    algo.experience(agents, observ, action, torch.zeros(2), torch.zeros(2), observ,
                    torch.zeros(2))
    algo.perform(agents, observ)
    assert not algo.experience_may_lag
    algo.eval()
    assert algo.experience_may_lag
    assert make(BOX).experience_may_lag  # whole episodes update in end_episodes()


def test_rollout_state_dict_round_trip_mid_rollout():
    source = make(BOX, num_agents=2, rollout_length=4, update_epochs=2, minibatch_size=3)
    rollout_steps(source, 6, seed=5, done_at={4: [1]})
    target = make(BOX, num_agents=2, seed=3, rollout_length=4, update_epochs=2,
                  minibatch_size=3)
    target.load_state_dict(source.state_dict())
    assert target.memory.stored == source.memory.stored == 4
    for name, value in source.memory.data().items():
        assert torch.equal(target.memory.data()[name], value), name
    for algo in (source, target):
        torch.manual_seed(6)
        rollout_steps(algo, 2, seed=7, done_at={})
    for name, value in params_of(source).items():
        assert torch.equal(value, params_of(target)[name]), name
    assert source.updates == target.updates == 2


def test_reward_scale_return_keeps_statistics_of_discounted_returns():
    algo = make(BOX, num_agents=2, rollout_length=50, discount=0.5, reward_scale="return")
    _, fed = rollout_steps(algo, 5, seed=8, done_at={2: [0]})
    reward, done = fed["reward"].double().numpy(), fed["done"].numpy()
    returns, running = [], np.zeros(2)
    for t in range(5):
        running = running * 0.5 + reward[:, t]
        returns.append(running.copy())
        running[done[:, t] > 0] = 0.0  # a new episode starts
    returns = np.concatenate(returns)
    normalizer = algo.reward_normalizer
    assert float(normalizer.count) == 10
    np.testing.assert_allclose(float(normalizer.mean), returns.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(normalizer.variance), returns.var(ddof=1), rtol=1e-6)
    # The running returns are part of the state: a loaded copy goes on alike.
    copy_ = make(BOX, num_agents=2, rollout_length=50, discount=0.5, reward_scale="return")
    copy_.load_state_dict(algo.state_dict())
    assert torch.equal(copy_.running_return, algo.running_return)
    assert algo.running_return.abs().sum() > 0


def test_activation_and_orthogonal_init():
    algo = make(BOX, policy_layers=(16, 8), value_layers=(16,), activation="tanh",
                init="orthogonal", init_output_factor=0.01)
    layers = [m for m in algo.policy.body.net if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m, torch.nn.Tanh) for m in algo.policy.body.net
               if not isinstance(m, torch.nn.Linear))
    assert all(isinstance(m, torch.nn.Tanh) for m in algo.value.net
               if not isinstance(m, torch.nn.Linear))
    # Orthogonal rows (the smaller side) scaled by the gain; zero biases.
    value_hidden = [m for m in algo.value.net if isinstance(m, torch.nn.Linear)]
    assert len(layers) == 2 and len(value_hidden) == 1
    for layer, gain in [(layers[0], math.sqrt(2)), (layers[1], math.sqrt(2)),
                        (value_hidden[0], math.sqrt(2)),
                        (algo.policy.head.mean, 0.01), (algo.value.out, 1.0)]:
        weight = layer.weight.detach()
        small = weight if weight.shape[0] <= weight.shape[1] else weight.T
        torch.testing.assert_close(small @ small.T, gain ** 2 * torch.eye(small.shape[0]),
                                   rtol=1e-4, atol=1e-5)
        assert not layer.bias.any()
    # The default keeps PyTorch's initialisation with the output layer scaled.
    default = make(BOX, policy_layers=(16,))
    assert isinstance(default.policy.body.net[1], torch.nn.ReLU)
    assert default.policy.head.mean.weight.abs().max() < 0.1 * (1 / math.sqrt(16)) + 1e-6


def test_linear_lr_schedule_decays_to_zero_over_total_steps():
    # 2 agents, rollouts of 2 steps: an update every 4 env steps, 12 in all.
    algo = make(BOX, num_agents=2, rollout_length=2, update_epochs=1, policy_lr=0.3,
                value_lr=0.6, lr_schedule="linear", total_steps=8)
    rates = []
    original = algo._update

    def record(*args):
        summary = original(*args)
        rates.append((summary["ppo/lr_fraction"], algo.policy_optimizer.param_groups[0]["lr"],
                      algo.value_optimizer.param_groups[0]["lr"]))
        return summary

    algo._update = record
    rollout_steps(algo, 4, seed=9, done_at={})
    state = algo.state_dict()
    rollout_steps(algo, 4, seed=10, done_at={})
    # Each update uses 1 - (steps before its data) / total_steps of the rates, none past the
    # run's steps (a negative rate would climb the loss).
    expected = [(1.0, 0.3, 0.6), (0.5, 0.15, 0.3), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]
    assert [tuple(round(x, 9) for x in rate) for rate in rates] == expected
    assert algo.env_steps == 16 and algo.updated_steps == 16
    # The schedule's clock is part of the state: a loaded copy goes on alike.
    copy_ = make(BOX, num_agents=2, rollout_length=2, update_epochs=1, policy_lr=0.3,
                 value_lr=0.6, lr_schedule="linear", total_steps=8)
    copy_.load_state_dict(state)
    assert (copy_.env_steps, copy_.updated_steps) == (8, 8)
    # The constant schedule leaves the rates alone.
    constant = make(BOX, num_agents=2, rollout_length=2, update_epochs=1, policy_lr=0.3)
    rollout_steps(constant, 4, seed=9, done_at={})
    assert constant.policy_optimizer.param_groups[0]["lr"] == 0.3


# -- networks that share a torso -----------------------------------------------------------


class TorsoValue(torch.nn.Module):
    """A value head on the policy's own hidden layers."""

    def __init__(self, body: torch.nn.Module):
        super().__init__()
        self.body = body
        self.out = torch.nn.Linear(body.out_size, 1)

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        return self.out(self.body.net(observ)).squeeze(-1)


class SharedTorsoPPO(BatchPPO):
    def build_networks(self, obs_size, action_space):
        policy, _ = super().build_networks(obs_size, action_space)
        return policy, TorsoValue(policy.body)


@pytest.mark.parametrize("update_threads", [None, 1])
def test_networks_that_share_a_torso_take_one_joint_step(update_threads):
    torch.manual_seed(0)
    algo = SharedTorsoPPO(OBSERV, BOX, 3, PPOConfig(
        policy_layers=(16,), update_every=3, update_epochs=2, inference="eager",
        update_threads=update_threads), max_length=8)
    torso = algo.policy.body.net[0].weight
    assert algo.shared_torso
    # The torso learns with the policy's optimiser; the value's has its output layer only.
    assert {id(p) for p in algo.value_optimizer.param_groups[0]["params"]} == {
        id(p) for p in algo.value.out.parameters()}
    backward_passes = []
    torso.register_hook(lambda grad: backward_passes.append(grad.norm().item()))
    before = torso.detach().clone()
    value_out = algo.value.out.weight.detach().clone()
    summaries = [s for s in drive(algo, steps=3, seed=4) if s]
    assert len(summaries) == 1 and algo.updates == 1
    # Two epochs of one full batch: two gradient steps, each one backward pass through the
    # torso carrying both losses (a separate value step would add a second pass).
    assert len(backward_passes) == 2
    assert not torch.equal(torso, before) and not torch.equal(algo.value.out.weight, value_out)
    assert all(math.isfinite(summaries[0][f"ppo/{name}"])
               for name in ("policy_loss", "value_loss", "kl", "grad_norm"))


def test_a_value_network_without_parameters_of_its_own_is_refused():
    class NoHead(BatchPPO):
        def build_networks(self, obs_size, action_space):
            policy, _ = super().build_networks(obs_size, action_space)
            return policy, policy.body.net

    with pytest.raises(ValueError, match="no parameters of its own"):
        NoHead(OBSERV, BOX, 2, PPOConfig(policy_layers=(16,), inference="eager"))
