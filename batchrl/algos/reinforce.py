"""REINFORCE with a learned value baseline: the example of a new ``Algorithm``.

Read this file to learn how to implement an algorithm for ``simulate()``. It uses only public API:
``torch``, ``batchrl.algos.base.Algorithm`` and the vectorised ``batchrl.parts.discounted_return``.

Every ``simulate()`` call steps all ``N`` envs once and calls, in this order (see ``Algorithm`` for
the contract):

1. ``begin_episodes(agent_indices)``: forget what we recorded for these agents;
2. ``perform(agent_indices, observ)``: return one action per agent;
3. ``experience(...)``: record the transition of every agent;
4. ``end_episodes(agent_indices)``: move these agents' finished episodes into the update memory, and
   learn once it holds ``update_every`` episodes.

The central design choice is to keep all per-agent state in preallocated tensors whose first
dimension is the agent index. Each method then reads and writes the rows ``agent_indices`` with one
indexing operation, however many agents there are: no Python loop over agents, no host round trip on
a GPU.

The algorithm is the classic Monte-Carlo policy gradient: the policy takes a gradient step on
``log pi(a_t | s_t) * (G_t - V(s_t))``, where ``G_t`` is the discounted return from step ``t`` and
the value network ``V``, trained to predict it, lowers the variance of the gradient.

The README's "Writing an algorithm" runs it on CartPole-v1 with ``Simulation(env).step`` (returns
near 500 after about 4000 calls), and ``configs/cartpole_reinforce.toml`` trains it with
``train.py``.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import gymnasium as gym
import torch
from torch import nn

from batchrl.algos.base import Algorithm, Summary
from batchrl.errors import UnsupportedSpaceError
from batchrl.parts import discounted_return

__all__ = ["Reinforce"]


def _mlp(inputs: int, hidden: Sequence[int], outputs: int) -> nn.Sequential:
    """A tanh MLP ``inputs -> *hidden -> outputs`` with a linear output layer."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(inputs, size), nn.Tanh()]
        inputs = size
    layers.append(nn.Linear(inputs, outputs))
    return nn.Sequential(*layers)


class Reinforce(Algorithm):
    """REINFORCE with a value baseline for ``Discrete`` or ``Box`` action spaces.

    The policy is categorical for ``Discrete`` actions and a diagonal Gaussian with a learned,
    state-independent log std for ``Box`` actions (not clipped: ``wrap_env`` clips them in the env).
    Observations must be a ``Box``; they are flattened, not normalised. In evaluation (``eval()``)
    it acts with the most likely action (Discrete) or the mean (Box) and records nothing. Episodes
    are only recorded whole, so after switching between ``train()`` and ``eval()`` start new
    episodes with ``simulate(..., reset=True)``.

    Args:
      observation_space: the (wrapped) env's observation space, a ``Box``.
      action_space: ``Discrete`` or ``Box``.
      num_agents: ``N``, the number of envs in the batch.
      max_length: the longest episode to expect, ``T``; ``experience`` raises when an episode gets
        longer (wrap the env in a ``TimeLimit``).
      device: where the networks and all buffers live.
      discount: the discount factor ``gamma`` of the returns.
      learning_rate: Adam's learning rate, for both networks.
      update_every: take one gradient step once this many episodes have ended.
      hidden: hidden layer sizes of the policy and of the value network.
      seed: seeds the network initialisation and the action sampling (with a private generator, so
        the global torch RNG is left alone); ``None`` uses the global RNG for the weights and a
        random seed for sampling.
      eval_actions: ``"mean"`` (evaluation takes the most likely or mean action) or
        ``"sample"`` (``train.eval_actions``).
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 num_agents: int, max_length: int, device: str | torch.device = "cpu",
                 discount: float = 0.99, learning_rate: float = 1e-2,
                 update_every: int = 16, hidden: Sequence[int] = (64, 64),
                 seed: int | None = None, eval_actions: str = "mean"):
        super().__init__(device, eval_actions)
        if not isinstance(observation_space, gym.spaces.Box):
            raise UnsupportedSpaceError(f"Reinforce needs a Box observation space, got "
                                        f"{observation_space} (BatchPPO takes Dict and Tuple "
                                        f"observations)")
        if isinstance(action_space, gym.spaces.Discrete):
            self._discrete = True
            # Discrete(n, start) has actions start, ..., start + n - 1.
            self._action_start = int(action_space.start)
            action_shape: tuple[int, ...] = ()
            policy_outputs = int(action_space.n)  # one logit per action
        elif isinstance(action_space, gym.spaces.Box):
            self._discrete = False
            action_shape = tuple(action_space.shape)
            policy_outputs = int(torch.Size(action_shape).numel())  # the Gaussian's mean
        else:
            raise TypeError(f"Reinforce supports Discrete and Box action spaces, "
                            f"got {action_space}")
        if max_length < 1 or update_every < 1:
            raise ValueError("max_length and update_every must be positive")
        self.observation_shape = tuple(observation_space.shape)
        self.action_shape = action_shape
        self.num_agents = num_agents
        self.max_length = max_length
        self.discount = discount
        self.update_every = update_every

        # With a seed, build the networks under a forked RNG: ``seed`` fixes
        # the initial weights and the caller's global RNG is left unchanged.
        observ_size = int(torch.Size(self.observation_shape).numel())
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.policy = _mlp(observ_size, hidden, policy_outputs).to(self.device)
            self.value = _mlp(observ_size, hidden, 1).to(self.device)
        parameters = list(self.policy.parameters()) + list(self.value.parameters())
        if not self._discrete:
            # State-independent log std, one per action dimension; std starts at 1.
            self.log_std = nn.Parameter(torch.zeros(policy_outputs, device=self.device))
            parameters.append(self.log_std)
        # One optimiser suffices: each loss reaches only its own network's weights,
        # and Adam scales each weight's step by its own gradient statistics.
        self.optimizer = torch.optim.Adam(parameters, lr=learning_rate)
        # Without a seed, draw one from torch's global RNG (reproducible under manual_seed).
        sample_seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self._generator = torch.Generator(device=self.device).manual_seed(sample_seed)

        # Episodes in progress, one row per agent: step t of agent i's current
        # episode is stored at [i, t]; ``final_observ`` and ``terminated`` hold
        # the last transition's, to bootstrap truncated episodes.
        action_dtype = torch.int64 if self._discrete else torch.float32

        def episode_buffers(rows: int) -> dict[str, torch.Tensor]:
            shapes = {"observ": ((rows, max_length, *self.observation_shape), torch.float32),
                      "action": ((rows, max_length, *action_shape), action_dtype),
                      "reward": ((rows, max_length), torch.float32),
                      "length": ((rows,), torch.int64),  # steps recorded
                      "final_observ": ((rows, *self.observation_shape), torch.float32),
                      "terminated": ((rows,), torch.float32)}  # 1.0 if terminal
            return {name: torch.zeros(shape, dtype=dtype, device=self.device)
                    for name, (shape, dtype) in shapes.items()}
        self._episodes = episode_buffers(num_agents)
        # Finished episodes waiting for the next update. At most N episodes end
        # per step and we update as soon as ``update_every`` are stored, so
        # ``update_every + N - 1`` rows always suffice and no episode is dropped.
        self._memory = episode_buffers(update_every + num_agents - 1)
        self._memory_size = 0  # rows of ``_memory`` in use, kept on the host

    # ----------------------------------------------------------------- policy

    def _distribution(self, observ: torch.Tensor) -> torch.distributions.Distribution:
        """The action distribution for ``observ`` ``(B, *obs_shape)``; ``log_prob`` is ``(B,)``."""
        # (B, n) logits for Discrete, (B, action size) means for Box.
        # (uint8 observations arrive as bytes: this example takes their values as floats)
        output = self.policy(observ.reshape(len(observ), -1).to(torch.float32))
        if self._discrete:
            return torch.distributions.Categorical(logits=output)
        mean = output.view(-1, *self.action_shape)
        std = self.log_std.exp().view(self.action_shape).expand_as(mean)
        # Independent sums the log-probabilities over the action dimensions.
        return torch.distributions.Independent(torch.distributions.Normal(mean, std),
                                               len(self.action_shape))

    def _value(self, observ: torch.Tensor) -> torch.Tensor:
        """The baseline's estimate of the return, ``(B,)``, for ``observ`` ``(B, *obs_shape)``."""
        return self.value(observ.reshape(len(observ), -1).to(torch.float32)).squeeze(1)

    def _sample(self, distribution: torch.distributions.Distribution) -> torch.Tensor:
        """Sample with our own generator in training (``Distribution.sample`` has no generator
        argument); an evaluation samples from torch's generators, which it seeds itself (the
        training draws stay untouched)."""
        generator = self._generator if self.training else None
        if self._discrete:
            return torch.multinomial(distribution.probs, 1, generator=generator).squeeze(1)
        noise = torch.randn(distribution.mean.shape, generator=generator, device=self.device)
        return distribution.mean + distribution.stddev * noise

    # ------------------------------------------------------ Algorithm methods

    def begin_episodes(self, agent_indices: torch.Tensor) -> Summary:
        """Forget the (finished or discontinued) previous episodes of these agents."""
        self._episodes["length"][agent_indices] = 0
        return {}

    @torch.no_grad()
    def perform(self, agent_indices: torch.Tensor,
                observ: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        """Sample actions, or take the mode of the policy in evaluation (unless
        ``eval_actions="sample"``): ``(K,)`` int64
        for ``Discrete``, ``(K, *act_shape)`` float32 for ``Box``."""
        distribution = self._distribution(observ)
        if not self.acting_deterministically:
            action = self._sample(distribution)
        elif self._discrete:
            action = distribution.probs.argmax(-1)  # the most likely action
        else:
            action = distribution.mean
        if self._discrete:
            action = action + self._action_start
        return action, {}

    @torch.no_grad()
    def experience(self, agent_indices: torch.Tensor, observ: torch.Tensor,
                   action: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   next_observ: torch.Tensor, terminated: torch.Tensor) -> Summary:
        """Append one transition per agent to its episode in progress. The tensors may
        be the env's own buffers, which the next step overwrites, so we copy them."""
        if not self.training:
            return {}  # evaluation learns nothing, so it records nothing
        episodes = self._episodes
        step = episodes["length"][agent_indices]  # (K,) where each agent writes now
        # (Reading this flag back waits for the device; simulate() syncs every
        # step anyway to find the finished episodes.)
        if bool((step >= self.max_length).any()):
            raise ValueError(f"an episode is longer than max_length={self.max_length}; "
                             "raise max_length or limit the episodes with a TimeLimit")
        episodes["observ"][agent_indices, step] = observ
        if self._discrete:
            action = action - self._action_start  # store the action's index in [0, n)
        episodes["action"][agent_indices, step] = action
        episodes["reward"][agent_indices, step] = reward
        episodes["length"][agent_indices] = step + 1
        # Overwritten on every step, so they hold the last step's values. ``done``
        # is not needed: ``end_episodes`` tells us which episodes ended.
        episodes["final_observ"][agent_indices] = next_observ
        episodes["terminated"][agent_indices] = terminated
        return {}

    def end_episodes(self, agent_indices: torch.Tensor) -> Summary:
        """Move the finished episodes into the memory; update once it is full enough."""
        if not self.training:
            return {}
        rows = slice(self._memory_size, self._memory_size + len(agent_indices))
        for name, buffer in self._memory.items():
            buffer[rows] = self._episodes[name][agent_indices]
        self._memory_size += len(agent_indices)
        if self._memory_size < self.update_every:
            return {}
        summary = self._update({name: buffer[:self._memory_size]
                                for name, buffer in self._memory.items()})
        self._memory_size = 0
        return summary

    # ----------------------------------------------------------------- update

    def _update(self, batch: dict[str, torch.Tensor]) -> Summary:
        """One gradient step on a batch of ``E`` finished episodes (rows of ``_memory``)."""
        length = batch["length"]  # (E,)
        # Cut the time axis to the longest episode: the steps after it are all
        # padding, and early in training episodes are much shorter than T.
        longest = int(length.max())
        observ = batch["observ"][:, :longest]  # (E, T', *obs_shape), T' = longest
        action = batch["action"][:, :longest]  # (E, T', *act_shape)
        reward = batch["reward"][:, :longest]  # (E, T')
        steps = torch.arange(longest, device=self.device)
        mask = (steps[None, :] < length[:, None]).float()  # (E, T'), 1.0 on recorded steps

        # Flatten (E, T') to one batch dimension for the networks; the padding
        # steps past each episode's end are computed too but masked out.
        flat_observ = observ.flatten(0, 1)  # (E * T', *obs_shape)
        value = self._value(flat_observ).view(mask.shape)  # (E, T')
        log_prob = self._distribution(flat_observ).log_prob(action.flatten(0, 1)).view(mask.shape)

        with torch.no_grad():
            # A truncated episode (time limit, not a terminal state) would have gone on:
            # bootstrap from the value of the observation after its last step (terminal: 0).
            bootstrap = (1.0 - batch["terminated"]) * self._value(batch["final_observ"])  # (E,)
            returns = discounted_return(reward, length, self.discount, bootstrap)
            # The baseline removes the part of the return the state predicts; normalising
            # the advantages keeps the step size independent of the reward scale.
            advantage = returns - value
            count = mask.sum()
            mean = (advantage * mask).sum() / count
            std = (((advantage - mean) ** 2 * mask).sum() / count).sqrt()
            advantage = (advantage - mean) / (std + 1e-8)

        # Average over all recorded steps of all episodes.
        policy_loss = -(log_prob * advantage * mask).sum() / count
        value_loss = 0.5 * ((returns - value) ** 2 * mask).sum() / count
        self.optimizer.zero_grad()
        (policy_loss + value_loss).backward()
        self.optimizer.step()
        return {"reinforce/loss": policy_loss.item(), "reinforce/value_loss": value_loss.item(),
                "reinforce/episodes": float(len(length))}

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimiser, sampling RNG and every buffer, to resume exactly:
        a snapshot (deep copy) that training on does not change."""
        state: dict[str, Any] = {
            "policy": self.policy.state_dict(), "value": self.value.state_dict(),
            "optimizer": self.optimizer.state_dict(), "generator": self._generator.get_state(),
            "episodes": self._episodes, "memory": self._memory, "memory_size": self._memory_size}
        if not self._discrete:
            state["log_std"] = self.log_std.detach()
        # state_dict()s return references to the live tensors; copy them.
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s result into an instance built with the same arguments."""
        self.policy.load_state_dict(state["policy"])
        self.value.load_state_dict(state["value"])
        if not self._discrete:
            with torch.no_grad():
                self.log_std.copy_(state["log_std"])
        # Adam keeps the moment tensors it is given: copy, so two instances never share them.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        generator = state["generator"].cpu()  # (set_state takes CPU bytes, whatever the device)
        if generator.numel() == self._generator.get_state().numel():
            self._generator.set_state(generator)
        else:  # saved on another kind of device (a CPU run evaluated on a GPU, or back)
            self._generator.manual_seed(int(torch.randint(0, 2**62, ()).item()))
        for ours, theirs in ((self._episodes, state["episodes"]), (self._memory, state["memory"])):
            for name, buffer in ours.items():
                buffer.copy_(theirs[name])
        self._memory_size = int(state["memory_size"])
