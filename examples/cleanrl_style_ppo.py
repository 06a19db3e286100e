"""PPO on a Gymnasium vector env, written the way Gymnasium users write it (one
file, read top to bottom), running on batchrl's ``BatchVectorEnv``.

The only batchrl line is the one that builds the vector env; swap it for
``gym.vector.AsyncVectorEnv(env_fns)`` and the script runs unchanged.

    python examples/cleanrl_style_ppo.py                    # CartPole-v1 to 500
    python examples/cleanrl_style_ppo.py --total-steps 200000 --num-envs 16

It prints the mean return of recent episodes after every update and, at the
end, the return of one greedy (argmax) episode per env.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from batchrl.envs import BatchVectorEnv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--total-steps", type=int, default=120_000)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=128, help="steps per env per rollout")
    parser.add_argument("--learning-rate", type=float, default=2.5e-3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--value-coef", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    return parser.parse_args(argv)


def layer(inputs: int, outputs: int, scale: float = np.sqrt(2)) -> nn.Linear:
    linear = nn.Linear(inputs, outputs)
    nn.init.orthogonal_(linear.weight, scale)
    nn.init.zeros_(linear.bias)
    return linear


class Agent(nn.Module):
    """Separate actor and critic MLPs for a discrete action space."""

    def __init__(self, observation_size: int, actions: int):
        super().__init__()
        self.critic = nn.Sequential(layer(observation_size, 64), nn.Tanh(), layer(64, 64),
                                    nn.Tanh(), layer(64, 1, 1.0))
        self.actor = nn.Sequential(layer(observation_size, 64), nn.Tanh(), layer(64, 64),
                                   nn.Tanh(), layer(64, actions, 0.01))

    def value(self, observ: torch.Tensor) -> torch.Tensor:
        return self.critic(observ).squeeze(-1)

    def policy(self, observ: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.actor(observ))


def main(argv: list[str] | None = None) -> float:
    """Train, print progress, and return the mean greedy-episode return."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    make = lambda: gym.make(args.env_id)  # noqa: E731
    # The one-line swap: gym.vector.AsyncVectorEnv([make] * args.num_envs) works here too.
    envs = gym.wrappers.vector.RecordEpisodeStatistics(BatchVectorEnv([make] * args.num_envs))
    try:
        return train(args, envs)
    finally:
        envs.close()  # stops the worker processes


def train(args: argparse.Namespace, envs: gym.vector.VectorEnv) -> float:
    """The PPO loop on ``envs``; returns the mean greedy-episode return."""
    agent = Agent(int(np.prod(envs.single_observation_space.shape)),
                  int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    shape = (args.num_steps, args.num_envs)
    observations = torch.zeros(shape + envs.single_observation_space.shape)
    actions = torch.zeros(shape, dtype=torch.long)
    log_probs, rewards, values = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    # With next-step autoreset a step after an episode's end only resets the env:
    # that transition is no experience (its reward is 0 and its action ignored).
    valid, dones = torch.zeros(shape), torch.zeros(shape)

    observ, _ = envs.reset(seed=args.seed)
    observ = torch.as_tensor(observ)
    resetting = torch.zeros(args.num_envs)  # the next step of these envs only resets them
    updates = args.total_steps // (args.num_envs * args.num_steps)
    recent: list[float] = []
    start = time.perf_counter()
    for update in range(1, updates + 1):
        for g in optimizer.param_groups:  # linear learning-rate decay
            g["lr"] = args.learning_rate * (1.0 - (update - 1) / updates)
        for t in range(args.num_steps):
            observations[t] = observ
            valid[t] = 1.0 - resetting
            with torch.no_grad():
                policy = agent.policy(observ)
                actions[t] = policy.sample()
                log_probs[t] = policy.log_prob(actions[t])
                values[t] = agent.value(observ)
            next_observ, reward, terminated, truncated, infos = envs.step(actions[t].numpy())
            rewards[t] = torch.as_tensor(reward, dtype=torch.float32)
            # A truncated episode would go on: bootstrap from the value of its last state.
            cut = truncated & ~terminated
            if cut.any():
                with torch.no_grad():
                    last = agent.value(torch.as_tensor(next_observ[cut]))
                rewards[t, torch.as_tensor(cut)] += args.gamma * last
            dones[t] = torch.as_tensor(terminated | truncated, dtype=torch.float32)
            resetting = dones[t]
            observ = torch.as_tensor(next_observ)
            if "episode" in infos:
                recent.extend(infos["episode"]["r"][infos["_episode"]].tolist())
                recent = recent[-20:]

        # Generalised advantage estimation, backwards over the rollout.
        with torch.no_grad():
            next_value = agent.value(observ) * (1.0 - resetting)
        advantages = torch.zeros(shape)
        running = torch.zeros(args.num_envs)
        for t in reversed(range(args.num_steps)):
            # A reset-only step (valid 0) neither carries nor receives credit.
            delta = rewards[t] + args.gamma * next_value * (1.0 - dones[t]) - values[t]
            running = delta + args.gamma * args.gae_lambda * (1.0 - dones[t]) * running
            running = running * valid[t]
            advantages[t] = running
            next_value = torch.where(valid[t].bool(), values[t], next_value)
        returns = advantages + values

        keep = valid.flatten().bool()
        batch = {name: tensor.flatten(0, 1)[keep] for name, tensor in (
            ("observ", observations), ("action", actions), ("log_prob", log_probs),
            ("advantage", advantages), ("return", returns))}
        size = len(batch["action"])
        for _ in range(args.epochs):
            for index in torch.randperm(size).chunk(args.minibatches):
                policy = agent.policy(batch["observ"][index])
                ratio = torch.exp(policy.log_prob(batch["action"][index])
                                  - batch["log_prob"][index])
                advantage = batch["advantage"][index]
                advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
                policy_loss = -torch.min(
                    ratio * advantage,
                    ratio.clamp(1 - args.clip, 1 + args.clip) * advantage).mean()
                value_loss = (agent.value(batch["observ"][index])
                              - batch["return"][index]).pow(2).mean()
                loss = (policy_loss + args.value_coef * value_loss
                        - args.entropy_coef * policy.entropy().mean())
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
        steps = update * args.num_envs * args.num_steps
        mean = np.mean(recent) if recent else float("nan")
        print(f"update {update}/{updates}  steps {steps}  recent return {mean:.1f}  "
              f"{steps / (time.perf_counter() - start):,.0f} steps/s", flush=True)

    greedy = evaluate(agent, envs, args.seed + 1000)
    print(f"greedy episode returns: {greedy.tolist()}  mean {greedy.mean():.1f}")
    return float(greedy.mean())


def evaluate(agent: Agent, envs: gym.vector.VectorEnv, seed: int) -> np.ndarray:
    """One greedy episode per env: the return of each."""
    observ, _ = envs.reset(seed=seed)
    totals = np.zeros(envs.num_envs)
    running = np.ones(envs.num_envs, bool)
    while running.any():
        with torch.no_grad():
            action = agent.actor(torch.as_tensor(observ)).argmax(-1)
        observ, reward, terminated, truncated, _ = envs.step(action.numpy())
        totals += reward * running
        running &= ~(terminated | truncated)
    return totals


if __name__ == "__main__":
    main()
