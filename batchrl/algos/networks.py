"""Policy and value networks of BatchPPO, written to compile with TorchScript.

Networks take observations flattened to ``(..., obs_size)``: float32, or ``uint8`` pixels, which
a torso converts to float32 in ``[0, 1]`` itself (so images travel and are stored as bytes). A
torso (``TORSOS``) turns them into features: the flat input (``"mlp"``), the Nature DQN
convolutional network or the IMPALA ResNet for images; policy and value networks may share one.

A policy is a body (torso, MLP, or torso, MLP then GRU; state ``(B, H)``, ``H = 0`` for
feed-forward) and a head:
``policy(observ (B, T, *obs), state) -> (mean_or_logits, log_std, state)`` gives the mean and log
std ``(B, T, A)`` (Gaussian) or the logits ``(B, T, n)`` and an empty ``log_std`` (categorical).
"""

from __future__ import annotations

import copy
import math
from typing import Any, List, Sequence

import gymnasium as gym
import torch
from torch import nn

from batchrl.algos.ppo_config import SHARED_MLP, TORSOS
from batchrl.errors import UnsupportedSpaceError
from batchrl.nested import is_nested_space
from batchrl.parts.packing import PackedObservations
from batchrl.pixels import is_pixel_space

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}
PIXEL_SCALE = 1.0 / 255.0


def mlp(in_size: int, layers: Sequence[int], activation: str = "relu") -> nn.Sequential:
    """MLP with ``activation`` (a name of ``ACTIVATIONS``) after every layer; empty for none."""
    modules: list[nn.Module] = []
    for size in layers:
        modules += [nn.Linear(in_size, size), ACTIVATIONS[activation]()]
        in_size = size
    return nn.Sequential(*modules)


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights scaled by ``gain`` and zero biases for every ``nn.Linear`` and
    ``nn.Conv2d`` in ``module`` (Saxe et al., 2014): each layer keeps the scale of its input."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, gain)
            nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.Conv2d):  # (channels-last weights: not a view of a matrix)
            with torch.no_grad():
                layer.weight.copy_(nn.init.orthogonal_(torch.empty(layer.weight.shape), gain))
            nn.init.zeros_(layer.bias)


# -- torsos: (..., obs_size) observations -> (..., out_size) float32 features ------------------

class PixelInput(nn.Module):
    """The flat observation as features: ``uint8`` pixels scaled to ``[0, 1]`` (for an MLP)."""

    def __init__(self, obs_size: int):
        super().__init__()
        self.out_size = obs_size
        self.scale = PIXEL_SCALE

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        return observ.to(torch.float32) * self.scale


def image_layout(shape: Sequence[int]) -> tuple[list[int], bool]:
    """``([C, H, W], channels_last)`` of an image observation of ``shape``: ``(H, W)`` (one
    channel), ``(C, H, W)`` (frame stacks, as Gymnasium's ``FrameStackObservation`` gives) or
    ``(H, W, C)`` (images as envs render them, batchrl's Atari stacks): the channels are the
    axis at either end that is smaller than both others; a ``ValueError`` when neither is."""
    if len(shape) == 2:
        return [1, int(shape[0]), int(shape[1])], False
    if len(shape) == 3:
        first, second, last = (int(s) for s in shape)
        if last < min(first, second):
            return [last, first, second], True
        if first < min(second, last):
            return [first, second, last], False
        raise ValueError(f"cannot tell the channels of an image of shape {tuple(shape)}: "
                         f"they are the axis at either end smaller than both others")
    raise ValueError(f"an image is (H, W), (C, H, W) or (H, W, C), got shape {tuple(shape)}")


class ConvTorso(nn.Module):
    """A convolutional network over flattened images: ``(..., C*H*W)`` (``uint8`` pixels or
    float) is reshaped to ``(-1, C, H, W)`` (from channels-last where the env gives that),
    ``uint8`` scaled to ``[0, 1]``, passed through ``convs`` and ``head`` (``(-1, out_size)``).

    Images and convolution weights are kept in the channels-last memory format, which
    oneDNN's CPU convolutions (and cuDNN's under bfloat16) run fastest in. ``input_dtype`` is
    what images are converted to: float32, or bfloat16 for an algorithm that runs the network
    under ``torch.autocast`` in bfloat16 (one conversion instead of two)."""

    def __init__(self, shape: Sequence[int], pixels: bool, convs: nn.Module, out_size: int):
        super().__init__()
        image, self.channels_last = image_layout(shape)
        self.image: List[int] = image
        self.scale = PIXEL_SCALE if pixels else 1.0
        self.input_dtype = torch.float32
        self.convs = convs.to(memory_format=torch.channels_last)
        with torch.no_grad():
            flat = int(convs(torch.zeros(1, *image)).reshape(-1).shape[0])
        self.head = nn.Sequential(nn.Linear(flat, out_size), nn.ReLU())
        self.out_size = out_size

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        lead = observ.shape[:-1]
        if self.channels_last:  # (-1, H, W, C) in memory: a channels-last view
            x = observ.reshape(-1, self.image[1], self.image[2], self.image[0]).permute(0, 3, 1, 2)
        else:  # copied to channels-last while it is still bytes
            x = observ.reshape([-1] + self.image).contiguous(memory_format=torch.channels_last)
        x = x.to(self.input_dtype)  # (keeps the memory format)
        if self.scale != 1.0:  # (in place on the new tensor to() made of bytes)
            x = x.mul_(self.scale) if observ.dtype == torch.uint8 else x * self.scale
        features = self.head(self.convs(x).flatten(1))
        return features.reshape(list(lead) + [self.out_size])


def nature_cnn(shape: Sequence[int], pixels: bool) -> ConvTorso:
    """The DQN network of Mnih et al. (2015): 32 8x8 filters (stride 4), 64 4x4 (stride 2),
    64 3x3, each with ReLU, then 512 ReLU units."""
    channels = image_layout(shape)[0][0]
    convs = nn.Sequential(nn.Conv2d(channels, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2),
                          nn.ReLU(), nn.Conv2d(64, 64, 3, 1), nn.ReLU())
    return ConvTorso(shape, pixels, convs, 512)


class ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with 3x3 convolutions keeping ``channels``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_cnn(shape: Sequence[int], pixels: bool,
               depths: Sequence[int] = (16, 32, 32)) -> ConvTorso:
    """The residual network of IMPALA (Espeholt et al., 2018, figure 3): per depth a 3x3
    convolution, 3x3 max-pooling with stride 2 and two residual blocks; then ReLU and 256
    ReLU units."""
    layers: list[nn.Module] = []
    channels = image_layout(shape)[0][0]
    for depth in depths:
        layers += [nn.Conv2d(channels, depth, 3, padding=1), nn.MaxPool2d(3, 2, padding=1),
                   ResidualBlock(depth), ResidualBlock(depth)]
        channels = depth
    layers.append(nn.ReLU())
    return ConvTorso(shape, pixels, nn.Sequential(*layers), 256)


class PackedTorso(nn.Module):
    """The torso of Dict and Tuple observations packed into ``uint8`` rows
    (``batchrl.parts.packing.PackedObservations``): ``(..., packed_size)`` -> the float parts
    ``(..., float_size)`` concatenated with the features of each image part (``torsos``, one per
    ``uint8`` part, reading bytes ``[offset, offset + size)``)."""

    def __init__(self, float_size: int, offsets: Sequence[int], sizes: Sequence[int],
                 torsos: Sequence[nn.Module]):
        super().__init__()
        self.float_bytes = 4 * float_size
        self.offsets: List[int] = list(offsets)
        self.ends: List[int] = [offset + size for offset, size in zip(offsets, sizes)]
        self.torsos = nn.ModuleList(torsos)
        self.out_size = float_size + sum(int(torso.out_size) for torso in torsos)

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        # A view of the bytes as float32 (which TorchScript cannot express: see BatchPPO).
        features = [observ[..., :self.float_bytes].view(torch.float32)]
        for index, torso in enumerate(self.torsos):
            features.append(torso(observ[..., self.offsets[index]:self.ends[index]]))
        return torch.cat(features, -1)


def build_torso(kind: str, observation_space: gym.Space) -> nn.Module | None:
    """The torso ``kind`` (one of ``TORSOS``) for ``observation_space``, or ``None`` where the
    flat float observation itself is the input (``"mlp"`` on float observations). For a Dict or
    Tuple space, a ``PackedTorso`` whose image parts (``uint8`` Boxes of 2 or 3 dimensions) get a
    ``kind`` torso each; other ``uint8`` parts (a vector of counts, say), and every part under
    ``"mlp"``, are their scaled bytes. Raises ``UnsupportedSpaceError`` naming the space (and
    the part) when a convolutional torso cannot take it."""
    if is_nested_space(observation_space):
        packing = PackedObservations(observation_space)
        parts = packing.pixel_parts
        images = [path for path, _, _, space in parts if len(space.shape) in (2, 3)]
        if kind != "mlp" and not images:
            raise UnsupportedSpaceError(f"torso {kind!r} needs an image (a uint8 Box of 2 or 3 "
                                        f"dimensions) among the parts of {observation_space}; "
                                        f"use torso='mlp'")
        torsos = []
        for path, _, size, space in parts:
            if kind == "mlp" or path not in images:
                torsos.append(PixelInput(size))
                continue
            try:
                torsos.append(build_torso(kind, space))
            except UnsupportedSpaceError as exc:
                raise UnsupportedSpaceError(f"observation part {path!r}: {exc}") from None
        return PackedTorso(packing.float_size, [offset for _, offset, _, _ in parts],
                           [size for _, _, size, _ in parts], torsos)
    shape = tuple(observation_space.shape)
    pixels = is_pixel_space(observation_space)
    if kind == "mlp":
        return PixelInput(math.prod(shape)) if pixels else None
    if kind not in TORSOS:
        raise ValueError(f"torso must be one of {TORSOS}, got {kind!r}")
    try:
        image, _ = image_layout(shape)
    except ValueError as exc:
        raise UnsupportedSpaceError(f"torso {kind!r} needs image observations: {exc} "
                                    f"({observation_space}); use torso='mlp'") from None
    build = nature_cnn if kind == "nature_cnn" else impala_cnn
    try:
        return build(shape, pixels)
    except RuntimeError as exc:  # the convolutions shrank the image to nothing
        raise UnsupportedSpaceError(f"torso {kind!r} cannot take images of {image[1]}x"
                                    f"{image[2]} pixels ({observation_space}): "
                                    f"{str(exc).splitlines()[0]}") from None


def build_torsos(kind: str, observation_space: gym.Space, shared: bool
                 ) -> tuple[nn.Module | None, nn.Module | None]:
    """The policy's and the value network's torsos (``build_torso``): with ``shared`` one module
    for both, which must have parameters to share (``ValueError`` otherwise)."""
    torso = build_torso(kind, observation_space)
    if not shared:
        return torso, build_torso(kind, observation_space)
    if torso is None or not any(True for _ in torso.parameters()):
        raise ValueError(SHARED_MLP)
    return torso, torso


def torso_shared_by(policy: nn.Module, value: nn.Module) -> nn.Module | None:
    """The torso that ``policy`` (a ``Policy``) and ``value`` (a ``ValueNet``) share, whose
    features an update may compute once for both (``from_features``); ``None`` for networks
    that share none or are built otherwise."""
    torso = getattr(getattr(policy, "body", None), "torso", None)
    shares = (isinstance(torso, nn.Module) and not isinstance(torso, nn.Identity)
              and getattr(value, "torso", None) is torso)
    return torso if shares else None


class FeedForwardBody(nn.Module):
    """``torso`` (none: the flat observation) then an MLP over the last dimension; carries an
    empty ``(B, 0)`` state."""

    def __init__(self, obs_size: int, layers: Sequence[int], activation: str = "relu",
                 torso: nn.Module | None = None):
        super().__init__()
        self.torso = nn.Identity() if torso is None else torso
        in_size = obs_size if torso is None else int(torso.out_size)
        self.net = mlp(in_size, layers, activation)
        self.out_size = layers[-1] if layers else in_size
        self.state_size = 0

    def forward(self, observ: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(self.torso(observ)), state

    def from_features(self, features: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` after the torso: ``features`` are ``self.torso(observ)``."""
        return self.net(features), state


class RecurrentBody(FeedForwardBody):
    """``FeedForwardBody`` followed by a single-layer GRU over the time dimension."""

    def __init__(self, obs_size: int, layers: Sequence[int], gru_size: int,
                 activation: str = "relu", torso: nn.Module | None = None):
        super().__init__(obs_size, layers, activation, torso)
        self.gru = nn.GRU(self.out_size, gru_size, batch_first=True)
        self.out_size = self.state_size = gru_size

    def forward(self, observ: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.from_features(self.torso(observ), state)

    def from_features(self, features: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` after the torso: ``features`` are ``self.torso(observ)``."""
        features, final = self.gru(self.net(features), state.unsqueeze(0).contiguous())
        return features, final.squeeze(0)


class GaussianHead(nn.Module):
    """``tanh``-squashed mean and a learned state-independent log std, starting at
    ``log(init_std)``; ``init_output_factor`` scales the mean layer's initial weights."""

    def __init__(self, in_size: int, action_size: int, init_std: float,
                 init_output_factor: float):
        super().__init__()
        self.mean = nn.Linear(in_size, action_size)
        with torch.no_grad():
            self.mean.weight.mul_(init_output_factor)
            self.mean.bias.zero_()
        self.log_std = nn.Parameter(torch.full((action_size,), float(torch.tensor(init_std).log())))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tanh(self.mean(features))
        return mean, self.log_std.expand_as(mean)


class CategoricalHead(nn.Module):
    """Logits over ``num_actions`` actions; ``init_output_factor`` scales the initial weights."""

    def __init__(self, in_size: int, num_actions: int, init_output_factor: float):
        super().__init__()
        self.logits = nn.Linear(in_size, num_actions)
        with torch.no_grad():
            self.logits.weight.mul_(init_output_factor)
            self.logits.bias.zero_()

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(features)
        return logits, logits.new_zeros(0)


class Policy(nn.Module):
    """Body + head, with the calling convention of this module's docstring."""

    def __init__(self, body: nn.Module, head: nn.Module, discrete: bool):
        super().__init__()
        self.body, self.head, self.discrete = body, head, discrete
        self.state_size: int = body.state_size

    def forward(self, observ: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, state = self.body(observ, state)
        mean_or_logits, log_std = self.head(features)
        return mean_or_logits, log_std, state

    def from_features(self, features: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` after the body's torso: ``features`` are ``self.body.torso(observ)``
        (computed once for a policy and a value network that share the torso)."""
        features, state = self.body.from_features(features, state)
        mean_or_logits, log_std = self.head(features)
        return mean_or_logits, log_std, state


class CastWeights:
    """A copy of ``module`` for inference under ``torch.autocast`` whose ``nn.Linear`` and
    ``nn.Conv2d`` weights and biases are kept in ``dtype``, the precision autocast casts them
    to at every call; its other parameters and buffers are ``module``'s own.

    Autocast gives the same results with either module, but casts the weights of ``module``
    again at every call. The copy casts them only after they changed: ``current()`` copies
    them anew when an in-place change (an optimiser step, ``load_state_dict``) bumped a
    weight's version counter. It does not see writes through ``.data`` or ``set_()``, nor
    weights that ``module`` replaced (``module.to(...)``, ``load_state_dict(assign=True)``):
    build a new copy after those. Nor does it see the steps of a fused optimiser
    (``Adam(fused=True)`` writes the weights without bumping their versions): ``watch``
    such an optimiser. Run the copy under autocast (its inputs stay float32).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        # (a deep copy that shares every tensor, then new tensors for the cast weights)
        shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
        self.module = copy.deepcopy(module, shared)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for source, target in zip(module.modules(), self.module.modules()):
            if isinstance(source, (nn.Linear, nn.Conv2d)):
                for name in ("weight", "bias"):
                    weight = getattr(source, name)
                    if weight is not None:
                        cast = nn.Parameter(torch.empty_like(weight, dtype=dtype),
                                            requires_grad=False)
                        setattr(target, name, cast)
                        self._pairs.append((weight, cast))
        self._versions: list[int] = []
        self.current()

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy the weights anew after every step of ``optimizer`` too."""
        optimizer.register_step_post_hook(self._forget)

    def _forget(self, *_: Any) -> None:
        self._versions = []

    def current(self) -> nn.Module:
        """The copy, its cast weights those of ``module`` now."""
        versions = [weight._version for weight, _ in self._pairs]
        if versions != self._versions:
            with torch.no_grad():
                for weight, cast in self._pairs:
                    cast.copy_(weight)
            self._versions = versions
        return self.module


class Actor(nn.Module):
    """One inference step of a ``Policy``: ``forward(observ (B, *obs), state (B, H),
    deterministic)`` returns ``(action, mean_or_logits, log_std, state)``, parameters
    ``(B, ...)``. A deterministic action is the mean (Gaussian) or the most likely one
    (categorical); others are sampled with torch's global RNG, so a seed gives the
    same actions in eager and TorchScript modes."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy
        self.discrete: bool = policy.discrete
        self.recurrent: bool = policy.state_size > 0

    def forward(self, observ: torch.Tensor, state: torch.Tensor,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.recurrent:
            mean_or_logits, log_std, state = self.policy(observ.unsqueeze(1), state)
            mean_or_logits = mean_or_logits.squeeze(1)
            if not self.discrete:
                log_std = log_std.squeeze(1)
        else:  # no time axis: three fewer operations and 2-D matrix products
            mean_or_logits, log_std, state = self.policy(observ, state)
        if deterministic:
            action = mean_or_logits.argmax(-1) if self.discrete else mean_or_logits
        elif self.discrete:
            action = torch.multinomial(torch.softmax(mean_or_logits, -1), 1).squeeze(-1)
        else:
            action = mean_or_logits + log_std.exp() * torch.randn_like(mean_or_logits)
        return action, mean_or_logits, log_std, state


class ValueNet(nn.Module):
    """State value: ``torso`` (none: the flat observation), an MLP, then a linear output,
    ``(..., obs) -> (...)``, float32. Under ``torch.autocast`` the torso and the MLP compute
    in its dtype and the output layer in float32: bfloat16 keeps about 3 significant digits,
    so a value near 100 would move in steps of 0.5 and its TD residuals with it."""

    def __init__(self, obs_size: int, layers: Sequence[int], activation: str = "relu",
                 torso: nn.Module | None = None):
        super().__init__()
        self.torso = nn.Identity() if torso is None else torso
        in_size = obs_size if torso is None else int(torso.out_size)
        self.net = mlp(in_size, layers, activation)
        self.out = nn.Linear(layers[-1] if layers else in_size, 1)

    def forward(self, observ: torch.Tensor) -> torch.Tensor:
        return self.from_features(self.torso(observ))

    def from_features(self, features: torch.Tensor) -> torch.Tensor:
        """``forward`` after the torso: ``features`` are ``self.torso(observ)``."""
        hidden, device = self.net(features), features.device.type
        if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
            return self.out(hidden).squeeze(-1)
        with torch.autocast(device, enabled=False):
            return self.out(hidden.float()).squeeze(-1)


def actor_critic(body: nn.Module, obs_size: int, action_space: gym.Space,
                 value_layers: Sequence[int],
                 activation: str, init: str, init_std: float,
                 init_output_factor: float,
                 value_torso: nn.Module | None = None) -> tuple[Policy, ValueNet]:
    """A policy on ``body`` (a ``FeedForwardBody`` or ``RecurrentBody``) with a categorical
    head for a ``Discrete`` ``action_space`` or else a Gaussian one for a 1-D Box
    (``init_std``), and a value network of ``value_layers`` on ``value_torso`` (the body's
    own torso to share it). ``init="orthogonal"``: hidden layers keep their input's scale,
    the policy's output starts near zero (``init_output_factor``), the value's output at
    gain 1; else PyTorch's initialisation."""
    discrete = isinstance(action_space, gym.spaces.Discrete)
    if discrete and int(action_space.start) != 0:
        # (Its indices would reach the env unshifted: an action out of the space.)
        raise UnsupportedSpaceError(f"an actor-critic's categorical head acts with indices "
                                    f"0..n-1, so it needs Discrete(n) actions starting at 0, "
                                    f"got {action_space}")
    if discrete:
        head: nn.Module = CategoricalHead(body.out_size, int(action_space.n), init_output_factor)
        output = head.logits
    else:
        head = GaussianHead(body.out_size, action_space.shape[0], init_std, init_output_factor)
        output = head.mean
    policy = Policy(body, head, discrete)
    value = ValueNet(obs_size, value_layers, activation, value_torso)
    if init == "orthogonal":
        hidden = [body.torso, body.net, value.net]
        if value.torso is not body.torso:
            hidden.append(value.torso)
        for module in hidden:
            orthogonal_init(module, math.sqrt(2.0))
        orthogonal_init(output, init_output_factor)
        orthogonal_init(value.out, 1.0)
    return policy, value
