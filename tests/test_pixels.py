"""Learning from pixels: uint8 observations end to end, convolutional torsos, the clipped
objective, the entropy bonus, value clipping, bfloat16 updates, and a pixel task learned through
train.py (Atari's own end-to-end run is in tests/test_atari.py)."""

from __future__ import annotations

import json
import math
import types

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import Categorical, Normal

from batchrl import TensorBatchEnv
from batchrl.algos import BatchPPO
from batchrl.algos.networks import Actor, CastWeights, build_torso, image_layout
from batchrl.config import ConfigError, load_config
from batchrl import BatchEnv, make_batch_env, wrap_env
from batchrl.errors import UnsupportedSpaceError
from batchrl.hardware import native_bfloat16, resolve_precision
from batchrl.pixels import is_pixel_space
from batchrl.parts.losses import (ClippedObjective, KLPenalizedObjective, actor_critic_loss,
                                  entropy_bonus, masked_mean, value_loss)
from batchrl.testing.envs import PixelSide
from batchrl.train import main as train_main

PIXELS = gym.spaces.Box(0, 255, (4, 36, 36), np.uint8)
CARTPOLE_SPACE = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)


# --- the env layer leaves pixels alone -----------------------------------------------------

class HWCImage(gym.Env):
    """A custom env with channels-last uint8 images, as a new user writes one."""

    observation_space = gym.spaces.Box(0, 255, (84, 84, 1), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.integers(0, 256, (84, 84, 1), dtype=np.uint8), {}

    def step(self, action):
        return self.reset()[0], 1.0, False, False, {}


def test_wrap_env_keeps_uint8_images_as_they_are():
    env = wrap_env(HWCImage())  # range normalisation on: it leaves uint8 spaces alone
    assert env.observation_space == HWCImage.observation_space
    observ, _ = env.reset(seed=0)
    assert observ.dtype == np.uint8 and observ.shape == (84, 84, 1)
    reference, _ = HWCImage().reset(seed=0)
    assert np.array_equal(observ, reference)
    # Float boxes are still rescaled, other integer boxes still become float32.
    box = wrap_env(gym.make("Pendulum-v1"))
    assert box.observation_space.dtype == np.float32
    assert np.all(box.observation_space.high == 1.0)


def test_tensor_batch_env_holds_uint8_observations():
    env = TensorBatchEnv(BatchEnv([wrap_env(PixelSide()) for _ in range(3)]))
    try:
        observ = env.reset(seed=1)
        assert env.observ.dtype == torch.uint8 and observ.dtype == torch.uint8
        expected = np.stack([PixelSide().reset(seed=1 + i)[0] for i in range(3)])
        assert np.array_equal(observ.numpy(), expected)
        observ, _, _ = env.step(torch.zeros(3, dtype=torch.int64))
        assert observ.dtype == torch.uint8 and int(observ.max()) == 255
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["inline", "workers", "process"])
def test_make_batch_env_ships_uint8_images(backend):
    env = make_batch_env("batchrl.testing.envs:pixel_side", 4, 10, backend=backend, workers=2)
    try:
        observ = env.reset(seed=3)
        assert env.observation_space == PixelSide().observation_space
        assert observ.dtype == np.uint8 and observ.shape == (4, 1, 36, 36)
        expected = np.stack([PixelSide().reset(seed=3 + i)[0] for i in range(4)])
        assert np.array_equal(observ, expected)
    finally:
        env.close()


# --- torsos --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nature_cnn", "impala_cnn"])
def test_conv_torsos_take_flat_uint8_images_with_any_leading_shape(kind):
    torch.manual_seed(0)
    torso = build_torso(kind, PIXELS)
    images = torch.randint(0, 256, (2, 3, 4 * 36 * 36), dtype=torch.uint8)
    features = torso(images)
    assert features.shape == (2, 3, torso.out_size) and features.dtype == torch.float32
    # The layers on the images scaled to [0, 1], one at a time.
    scaled = images[1, 2].reshape(1, 4, 36, 36).float() / 255.0
    expected = torso.head(torso.convs(scaled).flatten(1))
    assert torch.allclose(expected[0], features[1, 2], atol=1e-5)
    assert not torch.allclose(torso.head(torso.convs(scaled * 255.0).flatten(1))[0],
                              features[1, 2], atol=1e-3)


def test_channels_last_images_are_read_as_channels():
    space = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)
    assert image_layout(space.shape) == ([3, 36, 36], True)
    assert image_layout((4, 84, 84)) == ([4, 84, 84], False)
    assert image_layout((84, 84)) == ([1, 84, 84], False)
    # More than 4 channels last (8 stacked Atari frames, 4 stacked colour frames).
    assert image_layout((84, 84, 8)) == ([8, 84, 84], True)
    assert image_layout((84, 84, 12)) == ([12, 84, 84], True)
    assert image_layout((12, 84, 84)) == ([12, 84, 84], False)
    with pytest.raises(ValueError, match=r"cannot tell the channels of an image of shape "
                                         r"\(84, 84, 84\)"):
        image_layout((84, 84, 84))
    assert build_torso("impala_cnn", gym.spaces.Box(0, 255, (84, 84, 8), np.uint8)
                       ).convs[0].in_channels == 8
    torch.manual_seed(0)
    torso = build_torso("nature_cnn", space)
    hwc = torch.randint(0, 256, (2, 36, 36, 3), dtype=torch.uint8)
    chw = hwc.permute(0, 3, 1, 2)
    torch.manual_seed(0)
    twin = build_torso("nature_cnn", gym.spaces.Box(0, 255, (3, 36, 36), np.uint8))
    assert torch.allclose(torso(hwc.reshape(2, -1)), twin(chw.reshape(2, -1)), atol=1e-5)


@pytest.mark.parametrize("space, message", [
    (gym.spaces.Box(-1.0, 1.0, (17,), np.float32), "torso 'nature_cnn' needs image observations"),
    (gym.spaces.Box(0, 255, (1, 12, 12), np.uint8), "cannot take images of 12x12 pixels"),
])
def test_a_space_a_torso_cannot_take_is_named(space, message):
    with pytest.raises(UnsupportedSpaceError, match=message) as info:
        BatchPPO(space, gym.spaces.Discrete(2), 2, rollout_length=4, torso="nature_cnn")
    assert str(space) in str(info.value) and "\n" not in str(info.value)


def test_shared_torso_needs_a_torso_with_layers():
    with pytest.raises(ValueError, match="shared_torso needs a torso"):
        BatchPPO(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(2), 2,
                 rollout_length=4, shared_torso=True)


# --- BatchPPO on pixels --------------------------------------------------------------------

def pixel_ppo(seed: int = 0, agents: int = 4, space: gym.Space = PIXELS, **options) -> BatchPPO:
    torch.manual_seed(seed)
    keys = dict(torso="nature_cnn", shared_torso=True, policy_layers=(), value_layers=(),
                objective="clip", entropy_coef=0.01, value_clip=0.2, value_coef=0.5,
                advantage_normalization="minibatch", rollout_length=6, update_epochs=2,
                minibatch_size=8, inference="eager", init="orthogonal")
    keys.update(options)
    return BatchPPO(space, gym.spaces.Discrete(3), agents, **keys)


def drive(algo: BatchPPO, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` batch steps of random images and rewards through the paper's methods."""
    generator = torch.Generator().manual_seed(seed)
    agents = torch.arange(algo.num_agents)
    summaries = []
    algo.train()
    for _ in range(steps):
        observ = torch.randint(0, 256, (algo.num_agents, *PIXELS.shape), dtype=torch.uint8,
                               generator=generator)
        action, _ = algo.perform(agents, observ)
        reward = torch.randn(algo.num_agents, generator=generator)
        done = torch.zeros(algo.num_agents)
        summary = algo.experience(agents, observ, action, reward, done, observ, done)
        if summary:
            summaries.append(summary)
    return summaries


def test_without_shared_torso_each_network_gets_a_conv_torso_of_its_own():
    algo = pixel_ppo(shared_torso=False)  # (init="orthogonal")
    policy_torso, value_torso = algo.policy.body.torso, algo.value.torso
    assert policy_torso is not value_torso and not algo.shared_torso
    assert not {id(p) for p in policy_torso.parameters()} & {
        id(p) for p in value_torso.parameters()}
    for torso in (policy_torso, value_torso):  # orthogonal rows scaled by sqrt(2), no bias
        conv = torso.convs[0]
        weight = conv.weight.detach().reshape(conv.out_channels, -1)
        torch.testing.assert_close(weight @ weight.T, 2.0 * torch.eye(conv.out_channels),
                                   rtol=1e-4, atol=1e-4)
        assert not conv.bias.any()


def test_pixels_stay_bytes_in_memory_and_skip_the_observation_statistics():
    algo = pixel_ppo()
    assert algo.memory.buffers["observ"].dtype == torch.uint8
    assert algo.memory.data()["bootstrap_observ"].dtype == torch.uint8
    mean = algo.observ_normalizer.mean.clone()
    summaries = drive(algo, 12)
    assert len(summaries) == 2 and all(math.isfinite(v) for v in summaries[-1].values())
    assert torch.equal(algo.observ_normalizer.mean, mean)
    assert {"ppo/clip_fraction", "ppo/entropy", "ppo/kl"} <= set(summaries[-1])


def test_a_shared_torso_runs_once_per_step_with_the_same_result():
    """The joint step takes the torso's features once for both networks: the same losses and
    weights as running the full networks (a subclass's networks take that path)."""
    fast, full = pixel_ppo(3), pixel_ppo(3)
    full._torso = None
    assert fast._torso is fast.policy.body.torso is fast.value.torso
    calls = {"fast": 0, "full": 0}
    for name, algo in (("fast", fast), ("full", full)):
        algo.policy.body.torso.register_forward_hook(
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    torch.manual_seed(1)  # (actions and minibatches are drawn from torch's generator)
    first = drive(fast, 12)
    torch.manual_seed(1)
    calls_during = dict(calls)
    for a, b in zip(first, drive(full, 12)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # Two updates of 2 epochs x 3 minibatches, one torso pass per step saved; and one saved
    # in each update's summary (the updated networks on the whole rollout).
    steps, updates = 2 * 2 * 3, 2
    assert calls["full"] - calls_during["full"] == calls_during["fast"] + steps + updates
    for (name, p), q in zip(fast.policy.named_parameters(), full.policy.parameters()):
        assert torch.allclose(p, q, atol=1e-5), (name, float((p - q).abs().max()))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_same_seed_gives_the_same_pixel_run(precision):
    first, second = pixel_ppo(5, precision=precision), pixel_ppo(5, precision=precision)
    torch.manual_seed(1)
    summaries = drive(first, 12, seed=1)
    torch.manual_seed(1)
    assert drive(second, 12, seed=1) == summaries
    for p, q in zip(first.policy.parameters(), second.policy.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.slow
def test_frames_on_the_last_axis_learn_exactly_as_frames_on_the_first(precision):
    """A frame stack ``(C, H, W)`` and the same frames as ``(H, W, C)`` (the Atari envs' layout,
    which the torso reads without rearranging) give the same networks, actions and updates."""
    hwc = gym.spaces.Box(0, 255, (*PIXELS.shape[1:], PIXELS.shape[0]), np.uint8)
    first = pixel_ppo(6, precision=precision)
    last = pixel_ppo(6, space=hwc, precision=precision)
    generator = torch.Generator().manual_seed(3)
    agents = torch.arange(first.num_agents)
    summaries: dict[str, list] = {"first": [], "last": []}
    for _ in range(12):
        frames = torch.randint(0, 256, (first.num_agents, *PIXELS.shape), dtype=torch.uint8,
                               generator=generator)
        reward = torch.randn(first.num_agents, generator=generator)
        done = torch.zeros(first.num_agents)
        for name, algo, observ in (("first", first, frames),
                                   ("last", last, frames.permute(0, 2, 3, 1).contiguous())):
            torch.manual_seed(7)
            action, _ = algo.perform(agents, observ)
            summaries[name].append(algo.experience(agents, observ, action, reward, done,
                                                   observ, done))
    assert summaries["first"] == summaries["last"] and any(summaries["first"])
    for p, q in zip(first.policy.parameters(), last.policy.parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_round_trip_keeps_a_pixel_run_exact():
    first = pixel_ppo(7)
    drive(first, 9, seed=2)  # mid-rollout: the memory holds 3 of 6 steps
    state = first.state_dict()
    second = pixel_ppo(8)
    second.load_state_dict(state)
    torch.manual_seed(11)
    a = drive(first, 9, seed=4)
    torch.manual_seed(11)
    b = drive(second, 9, seed=4)
    assert a == b
    for p, q in zip(first.policy.parameters(), second.policy.parameters()):
        assert torch.equal(p, q)


def test_bfloat16_updates_learn_close_to_float32_ones():
    exact, low = pixel_ppo(9), pixel_ppo(9, precision="bfloat16")
    initial = torch.cat([p.detach().flatten() for p in exact.policy.parameters()])
    torch.manual_seed(1)
    a = drive(exact, 12)
    torch.manual_seed(1)
    b = drive(low, 12)
    assert low.policy.body.torso.input_dtype == torch.bfloat16
    # Recorded distributions and losses stay float32; the values are close, not equal.
    assert low.memory.buffers["mean_or_logits"].dtype == torch.float32
    assert b[-1]["ppo/value_loss"] == pytest.approx(a[-1]["ppo/value_loss"], rel=0.1)
    assert all(p.dtype == torch.float32 for p in low.policy.parameters())
    moved = [torch.cat([p.detach().flatten() for p in algo.policy.parameters()]) - initial
             for algo in (exact, low)]
    assert not torch.equal(moved[0], moved[1])  # (bfloat16 did run)
    # Both updates took the weights the same way, about as far.
    assert float(torch.nn.functional.cosine_similarity(*moved, dim=0)) > 0.9
    assert float(moved[1].norm() / moved[0].norm()) == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="precision must be one of"):
        pixel_ppo(precision="float16")


def test_bfloat16_leaves_large_values_their_float32_resolution():
    """bfloat16 keeps about 3 significant digits: values near 100 would move in steps of
    0.5. The torso and hidden layers compute in bfloat16, the value's output layer in float32."""
    exact, low = pixel_ppo(3), pixel_ppo(3, precision="bfloat16")
    with torch.no_grad():
        for algo in (exact, low):
            algo.value.out.bias.add_(100.0)
        observ = torch.randint(0, 256, (256, math.prod(PIXELS.shape)), dtype=torch.uint8)
        exact = exact.value(observ)
        with torch.autocast("cpu", torch.bfloat16):
            low = low.value(observ)
    assert exact.dtype == low.dtype == torch.float32
    assert len(torch.unique(low)) > 200  # (in bfloat16 a handful: 100 +- 0.5)
    assert (low - exact).abs().max() < 0.05


def autocast_actor(algo: BatchPPO, observ: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The deterministic actor over ``algo.policy`` itself under autocast (its float32
    weights cast at the call), on observations the policy takes as they are."""
    state = torch.zeros(observ.shape[0], 0)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        _, mean_or_logits, log_std, _ = Actor(algo.policy)(observ.reshape(len(observ), -1),
                                                           state, True)
    return mean_or_logits.float(), log_std.float()


def test_cast_weights_are_copied_only_after_they_change():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    module.register_parameter("log_std", torch.nn.Parameter(torch.zeros(2)))
    cast = CastWeights(module, torch.bfloat16)
    copy = cast.module
    assert copy.log_std is module.log_std  # (not cast: shared)
    assert copy[0].weight.dtype == torch.bfloat16 and module[0].weight.dtype == torch.float32
    assert torch.equal(copy[0].weight, module[0].weight.to(torch.bfloat16))  # (from the start)
    version = copy[0].weight._version
    cast.current()
    cast.current()
    assert copy[0].weight._version == version  # nothing changed: nothing copied
    with torch.no_grad():
        module[2].bias.add_(1.0)
    assert cast.current() is copy and copy[0].weight._version > version
    assert torch.equal(copy[2].bias, module[2].bias.to(torch.bfloat16))


@pytest.mark.parametrize("pixels,fused", [(True, False), (False, False), (True, True)])
def test_bfloat16_acting_keeps_weights_cast_only_when_they_change(pixels, fused):
    """Acting in bfloat16 runs a copy of the policy with weights cast once per change: the
    same numbers as autocast over the policy, after updates and loads too, also after the
    steps of a fused Adam (which leave the weights' version counters as they were)."""
    if pixels:
        algo, other = (pixel_ppo(seed, precision="bfloat16", fused_adam=fused)
                       for seed in (2, 3))
        observ = torch.randint(0, 256, (4, *PIXELS.shape), dtype=torch.uint8)
    else:  # a Gaussian policy over vectors (its log std is not cast)
        space = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
        algo, other = (BatchPPO(space, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), 4,
                                rollout_length=4, normalize_observ=False, init_std=0.7,
                                precision="bfloat16", inference=mode)
                       for mode in ("eager", "script"))
        observ = torch.randn(4, 5)

    def check(algo: BatchPPO) -> torch.Tensor:
        _, record = algo.act(observ, deterministic=True)
        expected = autocast_actor(algo, observ)
        assert torch.equal(record["mean_or_logits"], expected[0])
        assert torch.equal(record["log_std"], expected[1])
        return record["mean_or_logits"]

    before = check(algo)
    with torch.no_grad():  # an in-place change of the policy's weights, as Adam makes
        for p in algo.policy.parameters():
            p.mul_(1.5)
    assert not torch.equal(check(algo), before)
    other.load_state_dict(algo.state_dict())
    assert torch.equal(check(other), check(algo))
    if pixels:
        drive(algo, 12)  # two updates
        check(algo)
        other.load_acting_state(algo.acting_state())
        assert torch.equal(check(other), check(algo))
    assert all(p.dtype == torch.float32 for p in algo.policy.parameters())
    assert "policy" in algo.state_dict() and all(
        v.dtype == torch.float32 for v in algo.state_dict()["policy"].values())


def test_learning_rollouts_of_pixels_in_bfloat16():
    """The collectors' path (``learn``): uint8 rollouts, the proximal policy under autocast."""
    from batchrl.parts.rollout import RolloutBuffer, rollout_tensors

    algo = pixel_ppo(4, agents=2, precision="bfloat16")
    buffer = RolloutBuffer(rollout_tensors(2, 6, PIXELS.shape, torch.uint8, (), torch.int64,
                                           algo.behaviour_fields()))
    buffer.start(torch.arange(2), version=0)
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (2, 7, *PIXELS.shape), dtype=torch.uint8, generator=generator)
    for t in range(6):
        action, record = algo.act(frames[:, t])
        buffer.act(frames[:, t], action, record)
        done = torch.tensor([float(t == 2), 0.0])
        buffer.outcome(torch.randn(2, generator=generator), done, done, frames[:, t + 1])
    rollout = buffer.rollout()
    assert rollout.observ.dtype == torch.uint8
    assert rollout.behaviour["mean_or_logits"].dtype == torch.float32
    before = [p.detach().clone() for p in algo.policy.parameters()]
    summary = algo.learn(rollout)
    assert all(math.isfinite(value) for value in summary.values())
    assert summary["ppo/importance_weight"] == pytest.approx(1.0, abs=0.05)
    assert any(not torch.equal(p, q) for p, q in zip(algo.policy.parameters(), before))


def test_reinforce_takes_uint8_observations():
    from batchrl import Reinforce
    from batchrl.testing.envs import uint8_cartpole

    env = TensorBatchEnv(BatchEnv([wrap_env(uint8_cartpole()) for _ in range(2)]))
    try:
        algo = Reinforce(env.observation_space, env.action_space, 2, max_length=500)
        observ = env.reset(seed=0)
        assert observ.dtype == torch.uint8
        action, _ = algo.perform(torch.arange(2), observ)
        assert action.shape == (2,)
    finally:
        env.close()


def test_train_precision_needs_an_algorithm_that_takes_it():
    config = load_config("cartpole_reinforce", ["train.precision=bfloat16"])
    with pytest.raises(ConfigError, match="train.precision='bfloat16' needs an algorithm"):
        config.make_algorithm(CARTPOLE_SPACE, gym.spaces.Discrete(2), 2, "cpu")
    with pytest.raises(ConfigError, match="train.precision must be one of auto, float32, "
                                          "bfloat16, got 'half'"):
        load_config("cartpole", ["train.precision=half"])
    # "auto" asks for bfloat16 only of an algorithm that takes a precision.
    config = load_config("cartpole_reinforce", ["train.precision=auto"])
    assert config.make_algorithm(CARTPOLE_SPACE, gym.spaces.Discrete(2), 2, "cpu")


@pytest.mark.parametrize("flags, native", [
    ({"avx2": True, "avx512_f": True}, False),  # AVX-512 without its BF16 extension
    ({"avx2": True, "avx512_f": True, "avx512_bf16": True}, True),
    ({"avx2": True, "amx_bf16": True}, True),
    ({"neon": True}, False), ({"neon": True, "bf16": True}, True),
    ({"neon": True, "sve_bf16": True}, True),
    (None, None)])  # a torch without torch.cpu.get_capabilities
def test_auto_precision_is_bfloat16_only_on_a_cpu_that_computes_it(monkeypatch, flags, native):
    """Other CPUs than this one: the capabilities torch reports for them stand in."""
    if flags is None:
        monkeypatch.delattr(torch.cpu, "get_capabilities")
    else:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert native_bfloat16("cpu") is native
    precision = "bfloat16" if native else "float32"
    assert [resolve_precision(name, torch.device("cpu"))
            for name in ("auto", "float32", "bfloat16")] == [precision, "float32", "bfloat16"]
    config = load_config("cartpole", ["train.precision=auto"])
    assert config.run_facts("cpu")["precision"] == precision
    assert config.make_algorithm(CARTPOLE_SPACE, gym.spaces.Discrete(2), 2,
                                 torch.device("cpu")).precision == precision


def _short_run(logdir, config: str, precision: str) -> int:
    """train.py's exit code for 100 steps of ``config`` in ``precision``, no evaluations."""
    return train_main(["--config", config, "--logdir", str(logdir), "--no-progress", "--steps",
                       "100", "--set", "train.eval_episodes=0",
                       "--set", f"train.precision={precision}"])


@pytest.mark.parametrize("precision, native, noted", [
    ("bfloat16", False, True), ("bfloat16", True, False), ("auto", False, False)])
def test_train_py_notes_bfloat16_asked_of_a_cpu_that_emulates_it(tmp_path, capsys, monkeypatch,
                                                                 precision, native, noted):
    flags = {"avx2": True, "avx512_bf16": native}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert _short_run(tmp_path / "run", "cartpole", precision) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == (["note: train.precision = 'bfloat16', but this cpu has no bfloat16 "
                      "arithmetic in hardware (CPUs with AVX-512 BF16, AMX or Arm BF16; CUDA "
                      "GPUs of compute capability 8.0+): it is emulated, several times slower "
                      "than float32; train.precision = 'auto' picks float32 here"]
                     if noted else []), notes
    chosen = [line for line in out.splitlines() if line.startswith("train.precision")]
    assert chosen == (["train.precision = 'auto': float32 on this cpu"] if precision == "auto"
                      else []), chosen


@pytest.mark.parametrize("major, native", [(7, False), (8, True), (9, True)])
def test_a_cuda_device_computes_bfloat16_from_compute_capability_8(monkeypatch, major, native):
    """(No GPU here: the device's properties, as torch reports them, stand in.)"""
    asked = []

    def properties(device):
        asked.append(device)
        return types.SimpleNamespace(major=major)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.version, "hip", None)
    assert native_bfloat16("cuda:1") is native
    assert resolve_precision("auto", torch.device("cuda", 1)) == (
        "bfloat16" if native else "float32")
    assert asked == [torch.device("cuda", 1)] * 2  # (that GPU's, not the current one's)


def test_train_py_says_what_auto_precision_chose_only_for_an_algorithm_that_takes_one(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    for config, said in (("cartpole", ["train.precision = 'auto': bfloat16 on this cpu"]),
                         ("cartpole_reinforce", [])):
        assert _short_run(tmp_path / config, config, "auto") == 0
        out = capsys.readouterr().out.splitlines()
        assert [line for line in out if line.startswith("train.precision")] == said, out


# --- the losses ----------------------------------------------------------------------------

def test_the_clipped_objective_is_the_smaller_of_the_two_surrogates():
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    old = Categorical(logits=logits)
    shift = torch.tensor([[[1.0, 0.0], [-1.0, 0.0], [0.05, 0.0]]], requires_grad=True)
    new = Categorical(logits=logits + shift)
    action = torch.zeros(1, 3, dtype=torch.int64)
    advantage = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, terms = ClippedObjective(0.2)(new, old, action, advantage, mask)
    ratio = (new.log_prob(action) - old.log_prob(action)).exp().detach()
    # Step 0: ratio 1.46 > 1.2 with a positive advantage: clipped at 1.2 (no gradient).
    # Step 1: ratio 0.54 < 0.8 with a negative advantage: clipped at 0.8 (no gradient).
    # Step 2: ratio 1.025 inside the range: ratio * advantage.
    expected = -(1.2 * 1.0 + 0.8 * -1.0 + float(ratio[0, 2]) * 2.0) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert float(terms["clip_fraction"]) == pytest.approx(2 / 3)
    loss.backward()
    assert torch.all(shift.grad[0, :2] == 0) and shift.grad[0, 2, 0] < 0
    # Padding (mask 0) counts for nothing, not even when its ratio is inf.
    loss2, _ = ClippedObjective(0.2)(new, old, action, advantage, torch.tensor([[0., 0., 1.]]))
    assert float(loss2.detach()) == pytest.approx(-float(ratio[0, 2]) * 2.0, rel=1e-6)
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        ClippedObjective(0.0)


def test_the_entropy_bonus_rewards_spread_out_policies():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]], requires_grad=True)
    new = Categorical(logits=logits)
    bonus, terms = entropy_bonus(new, torch.ones(1, 1), 0.1)
    entropy = float(new.entropy().detach())
    assert float(bonus.detach()) == pytest.approx(-0.1 * entropy, rel=1e-6)
    assert float(terms["entropy"].detach()) == pytest.approx(entropy)
    bonus.backward()  # descending the bonus lowers the dominant logit
    assert logits.grad[0, 0, 0] > 0 > logits.grad[0, 0, 1]


def test_value_clipping_takes_the_larger_error():
    returns = torch.tensor([[1.0, 1.0]])
    old = torch.tensor([[0.0, 0.9]])
    value = torch.tensor([[0.8, 1.3]])
    mask = torch.ones(1, 2)
    # Step 0: moved 0.8 from 0.0, clipped to 0.2: error 0.8 > 0.2. Step 1: clipped to 1.1:
    # error 0.1 < 0.3, so the unclipped 0.3 counts.
    got = value_loss(value, returns, mask, old, clip=0.2)
    assert float(got) == pytest.approx(0.5 * (0.8 ** 2 + 0.3 ** 2) / 2, rel=1e-6)
    assert float(value_loss(value, returns, mask)) == pytest.approx(
        0.5 * (0.2 ** 2 + 0.3 ** 2) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="needs old_value"):
        value_loss(value, returns, mask, clip=0.2)


def test_ppo_config_checks_the_new_keys():
    for key, value, message in (("objective", "trust", "objective must be one of"),
                                ("torso", "resnet", "torso must be one of"),
                                ("clip_range", 0.0, "clip_range must be > 0"),
                                ("value_clip", -1.0, "value_clip must be > 0"),
                                ("entropy_coef", -0.1, "entropy_coef must be >= 0"),
                                ("advantage_normalization", "batch",
                                 "advantage_normalization must be one of")):
        with pytest.raises(ConfigError, match=message):
            load_config("cartpole", [f"algorithm.{key}={json.dumps(value)}"])


# --- a pixel task learned through train.py -------------------------------------------------

# One torch thread for the update: the test suite runs two tests at a time on two cores.
PIXEL_TASK = ["--set", "env.id=batchrl.testing.envs:pixel_side",
              "--set", "env.kwargs={length=10}", "--set", "env.max_length=20",
              "--set", "algorithm.update_threads=1",
              "--set", "env.backend=inline", "--set", "env.eval_kwargs={length=20}",
              "--set", "train.steps=4000", "--set", "train.eval_every=2",
              "--set", "train.eval_episodes=16", "--set", "algorithm.rollout_length=32",
              "--set", "algorithm.minibatch_size=64", "--set", "algorithm.policy_lr=1e-3",
              "--set", "algorithm.value_lr=1e-3", "--set", "algorithm.discount=0.9",
              "--set", "algorithm.lr_schedule=constant"]


def test_ppo_learns_a_pixel_task_through_train_py(tmp_path):
    """The Atari config's network and objective on a task a random policy scores 5 of 10 on:
    reading the image scores 10 (20 in the evaluation envs, whose episodes env.eval_kwargs
    makes twice as long)."""
    logdir = tmp_path / "run"
    code = train_main(["--config", "atari/pong", *PIXEL_TASK, "--logdir", str(logdir),
                       "--no-progress"])
    assert code == 0
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train" and r["score"] is not None]
    evals = [r for r in records if r["phase"] == "eval"]
    assert train[0]["score"] < 8.0 and train[-1]["score"] >= 9.5, train
    assert evals[-1]["score"] >= 19.0 and evals[-1]["length"] == 20, evals
    assert all(r["length"] == 10 for r in train)


def test_a_recurrent_policy_on_a_conv_torso_trains_through_train_py(tmp_path):
    """The GRU on top of the Nature CNN, on whole episodes (no learning bar: a short run)."""
    logdir = tmp_path / "recurrent"
    code = train_main(["--config", "atari/pong", *PIXEL_TASK, "--logdir", str(logdir),
                       "--no-progress", "--steps", "480", "--set", "algorithm.network=recurrent",
                       "--set", "algorithm.rollout_length=none",
                       "--set", "algorithm.minibatch_size=none",
                       "--set", "algorithm.update_every=8", "--set", "algorithm.batch_size=4",
                       "--set", "algorithm.gru_size=32"])
    assert code == 0
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["phase"] == "eval" and records[-1]["step"] >= 480


def test_impala_learns_the_pixel_task_on_a_shared_cnn(tmp_path):
    """IMPALA (TorchBeast's algorithm) takes the same torsos: the pixel task from pixels."""
    logdir = tmp_path / "impala"
    code = train_main([
        "--config", "impala/cartpole", "--logdir", str(logdir), "--no-progress",
        "--set", "env.id=batchrl.testing.envs:pixel_side", "--set", "env.kwargs={length=10}",
        "--set", "env.eval_kwargs={length=20}", "--set", "env.max_length=20",
        "--set", "env.num_agents=8", "--set", "train.steps=6000", "--set", "train.eval_every=8",
        "--set", "algorithm.torso=nature_cnn", "--set", "algorithm.shared_torso=true",
        "--set", "algorithm.policy_layers=[]", "--set", "algorithm.value_layers=[]",
        "--set", "algorithm.rollout_length=16", "--set", "algorithm.learning_rate=1e-3",
        "--set", "algorithm.discount=0.9", "--set", "algorithm.lr_schedule=constant"])
    assert code == 0
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["phase"] == "eval"]
    assert evals[-1]["score"] >= 19.0, evals


def test_only_uint8_boxes_are_pixels():
    """Any uint8 Box, of any shape; no other dtype or space."""
    assert is_pixel_space(gym.spaces.Box(0, 255, (84, 84, 4), np.uint8))
    assert is_pixel_space(gym.spaces.Box(0, 255, (3,), np.uint8))
    for space in (gym.spaces.Box(-128, 127, (84, 84), np.int8),
                  gym.spaces.Box(0, 255, (84, 84), np.int16),
                  gym.spaces.Box(0.0, 1.0, (84, 84), np.float32),
                  gym.spaces.MultiDiscrete([4, 4], dtype=np.uint8),
                  gym.spaces.MultiBinary(4), gym.spaces.Discrete(4)):
        assert not is_pixel_space(space), space


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_value_clipping_matches_the_per_step_formula_in_both_directions():
    rng = np.random.default_rng(22)
    returns, old = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    value = old + rng.normal(scale=0.6, size=(4, 6))  # moves up and down, often past the clip
    mask = (rng.uniform(size=(4, 6)) < 0.7).astype(np.float64)
    clip = 0.2
    total = 0.0
    for b in range(4):
        for t in range(6):
            moved = old[b, t] + min(max(value[b, t] - old[b, t], -clip), clip)
            total += mask[b, t] * max((returns[b, t] - value[b, t]) ** 2,
                                      (returns[b, t] - moved) ** 2)
    expected = 0.5 * total / mask.sum()
    assert ((value - old) < -clip).any() and ((value - old) > clip).any()
    got = value_loss(*map(torch.from_numpy, (value, returns, mask, old)), clip=clip)
    assert float(got) == pytest.approx(expected, rel=1e-12)


def test_the_entropy_bonus_is_a_mean_over_the_real_steps_only():
    logits = np.array([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, -3.0, 1.0]],
                       [[1.0, 1.0, -1.0], [0.3, 0.1, 0.0], [-2.0, 4.0, 0.0]]])
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    log_p = np_log_softmax(logits)
    entropy = -(np.exp(log_p) * log_p).sum(-1)
    expected = (entropy * mask).sum() / mask.sum()
    bonus, terms = entropy_bonus(Categorical(logits=torch.from_numpy(logits)),
                                 torch.from_numpy(mask), 0.1)
    assert float(terms["entropy"]) == pytest.approx(expected, rel=1e-12)
    assert float(bonus) == pytest.approx(-0.1 * expected, rel=1e-12)


def test_padded_steps_with_infinite_entropy_leave_the_logged_means_finite():
    """A padded step's distribution may be degenerate (a zero-filled observation, an
    unbounded scale): its entropy must not reach the means, not even as inf * 0."""
    scale = torch.tensor([[1.0, float("inf")]])  # the second step is padding
    new = Normal(torch.zeros(1, 2), scale)
    old = Normal(torch.zeros(1, 2), torch.ones(1, 2))
    mask = torch.tensor([[1.0, 0.0]])
    bonus, terms = entropy_bonus(new, mask, 0.01)
    expected = float(Normal(0.0, 1.0).entropy())
    assert float(terms["entropy"]) == pytest.approx(expected) and torch.isfinite(bonus)
    for objective in (ClippedObjective(0.2), KLPenalizedObjective(0.01)):
        logged = objective.end_update(new, old, torch.zeros(1, 2), torch.ones(1, 2), mask)
        assert logged["entropy"] == pytest.approx(expected) and math.isfinite(logged["kl"])


def test_losses_of_a_batch_without_real_steps_are_zero():
    assert float(masked_mean(torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2))) == 0.0
    logits = torch.tensor([[[0.5, -0.5], [1.0, 0.0]]], requires_grad=True)
    new, old = Categorical(logits=logits), Categorical(logits=torch.zeros(1, 2, 2))
    action, mask = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2)
    loss, terms = ClippedObjective(0.2)(new, old, action, torch.tensor([[1.0, -1.0]]), mask)
    bonus, entropy = entropy_bonus(new, mask, 0.01)
    total = loss + bonus
    assert float(loss.detach()) == 0.0 and float(terms["clip_fraction"]) == 0.0
    assert float(bonus.detach()) == 0.0 and float(entropy["entropy"].detach()) == 0.0
    total.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    value = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, terms = actor_critic_loss(new.log_prob(action), new.entropy(), value,
                                    torch.zeros(1, 2), torch.ones(1, 2), mask.bool())
    assert float(loss.detach()) == 0.0
    assert all(float(v.detach()) == 0.0 for v in terms.values())


def test_the_clipped_objective_reports_the_kl_and_entropy_of_the_updated_policy():
    rng = np.random.default_rng(23)
    old_logits, new_logits = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 4, 3))
    mask = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    old_log, new_log = np_log_softmax(old_logits), np_log_softmax(new_logits)
    kl = (np.exp(old_log) * (old_log - new_log)).sum(-1)
    entropy = -(np.exp(new_log) * new_log).sum(-1)
    expected_kl = (kl * mask).sum() / mask.sum()
    expected_entropy = (entropy * mask).sum() / mask.sum()
    new = Categorical(logits=torch.from_numpy(new_logits))
    old = Categorical(logits=torch.from_numpy(old_logits))
    args = (new, old, torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, 4),
            torch.from_numpy(mask))
    summary = ClippedObjective(0.2).end_update(*args)
    assert summary["kl"] == pytest.approx(expected_kl, rel=1e-12)
    assert summary["entropy"] == pytest.approx(expected_entropy, rel=1e-12)
    # With another learner's (kl, entropy) = (1, 2): the mean of the two learners.
    other = torch.tensor([1.0, 2.0], dtype=torch.float64)
    summary = ClippedObjective(0.2).end_update(*args, average=lambda t: (t + other) / 2)
    assert summary["kl"] == pytest.approx((expected_kl + 1.0) / 2, rel=1e-12)
    assert summary["entropy"] == pytest.approx((expected_entropy + 2.0) / 2, rel=1e-12)


def test_a_run_resumed_where_auto_computes_in_another_precision_says_so(tmp_path, capsys,
                                                                         monkeypatch):
    logdir = str(tmp_path / "run")
    for flags, steps in (({"amx_bf16": True}, "100"), ({"avx2": True}, "200"),
                         ({"avx2": True}, "300")):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
        settings = (["--set", "train.eval_episodes=0", "--set", "train.precision=auto"]
                    if steps == "100" else [])  # (a resumed run keeps its saved config)
        assert train_main(["--config", "cartpole", "--logdir", logdir, "--no-progress",
                           "--steps", steps, *settings]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines()
                 if line.startswith("note:")]
        assert notes == ([] if steps != "200" else [
            "note: the run computed in bfloat16 up to this checkpoint and computes in float32 "
            "on this cpu (train.precision = 'auto'): it goes on, but not exactly as it would "
            "have"]), (steps, notes)


def test_auto_precision_says_when_torch_cannot_tell(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert _short_run(tmp_path / "run", "cartpole", "auto") == 0
    assert ("train.precision = 'auto': float32 on this cpu (this torch cannot tell whether it "
            "computes bfloat16 in hardware)") in capsys.readouterr().out.splitlines()
