"""A user's own Algorithm through every entry point: ``train.py`` with an
``[algorithm]`` config, exact resume, ``python -m batchrl.evaluate``, the
example Reinforce config, and the errors for a class that does not fit.

The user's algorithm lives in a module written into the run's working
directory (as a user's would), imported by ``train.py`` from there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos import Algorithm
from batchrl.checkpoint import list_checkpoints, load_checkpoint
from batchrl.config import ConfigError, build_config, load_config
from batchrl.metrics import read_metrics
from batchrl.trainer import phase_plan
from helpers import REPO, TRAIN_PY, Minimal

USER_MODULE = textwrap.dedent('''
    """A user's algorithm: a linear softmax policy on CartPole that moves its
    weights towards the actions of episodes that beat the running mean."""
    import torch
    from batchrl.algos import Algorithm


    class Hill(Algorithm):
        def __init__(self, observation_space, action_space, num_agents, max_length,
                     device="cpu", step_size: float = 0.1):
            super().__init__(device)
            self.step_size = step_size
            n, size = num_agents, observation_space.shape[0]
            self.weights = torch.zeros(size, action_space.n)
            self.baseline = torch.zeros(())
            self.episodes = torch.zeros((), dtype=torch.int64)
            self.returns = torch.zeros(n)
            self.trace = torch.zeros(n, size, action_space.n)

        def begin_episodes(self, agent_indices):
            self.returns[agent_indices] = 0.0
            self.trace[agent_indices] = 0.0
            return {}

        def perform(self, agent_indices, observ):
            logits = observ @ self.weights
            if not self.training:
                return logits.argmax(-1), {}
            action = torch.distributions.Categorical(logits=logits).sample()
            return action, {}

        def experience(self, agent_indices, observ, action, reward, done, next_observ,
                       terminated):
            self.returns[agent_indices] += reward
            onehot = torch.nn.functional.one_hot(action, self.weights.shape[1]).float()
            self.trace[agent_indices] += observ[:, :, None] * onehot[:, None, :]
            return {}

        def end_episodes(self, agent_indices):
            if not self.training:
                return {}
            advantage = self.returns[agent_indices] - self.baseline
            self.weights += self.step_size * (advantage[:, None, None]
                                              * self.trace[agent_indices]).mean(0) / 100
            self.baseline += 0.1 * (self.returns[agent_indices].mean() - self.baseline)
            self.episodes += len(agent_indices)
            return {"hill/baseline": float(self.baseline)}

        def state_dict(self):
            return {name: getattr(self, name).clone()
                    for name in ("weights", "baseline", "episodes", "returns", "trace")}

        def load_state_dict(self, state):
            for name, value in state.items():
                getattr(self, name).copy_(value)


    class Typo(Hill):
        def __init__(self, observation_space, action_space, num_agents, max_length,
                     device="cpu", step_size: float = 0.1):
            super().__init__(observation_space, action_space, num_agents, max_length, device,
                             step_size)
            self.layer = torch.nn.Linear(observation_space.shape, action_space.n)  # a bug


    class NoState(Hill):
        def state_dict(self):
            ...


    class MisnamedState(Hill):
        per_agent_state = ("episode_retrun",)


    class LateBoom(Hill):
        def end_episodes(self, agent_indices):
            if self.training and self.episodes >= 100:
                raise RuntimeError("boom in end_episodes")
            return super().end_episodes(agent_indices)


    class NotAnAlgorithm:
        pass
''')

CONFIG = textwrap.dedent('''
    [env]
    id = "CartPole-v1"
    num_agents = 4
    max_length = 200
    backend = "inline"

    [train]
    steps = 6_000
    phase_steps = 1_000
    eval_episodes = 4
    device = "cpu"

    [algorithm]
    class = "user_algos:Hill"
    step_size = 0.5
''')


def train_py(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN_PY), *args, "--no-progress"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's working directory: their algorithm module and a config."""
    (tmp_path / "user_algos.py").write_text(USER_MODULE)
    (tmp_path / "hill.toml").write_text(CONFIG)
    return tmp_path


def final_state(logdir: Path) -> dict:
    return load_checkpoint(list_checkpoints(logdir)[-1], "cpu")["algorithm"]


@pytest.mark.slow
def test_a_user_algorithm_trains_resumes_exactly_and_evaluates(project):
    done = train_py(project, "--config", "hill.toml", "--logdir", "straight")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Training Hill on "), done.stdout  # (not BatchPPO, the default)
    records = read_metrics(project / "straight")
    # Phases of phase_steps env steps, each followed by an evaluation.
    assert [r["phase"] for r in records] == ["train", "eval"] * 6
    assert [r["step"] for r in records if r["phase"] == "train"] == [1000 * k
                                                                    for k in range(1, 7)]
    saved = json.loads((project / "straight" / "config.json").read_text())
    assert saved["algorithm"] == {"class": "user_algos:Hill", "step_size": 0.5}
    state = final_state(project / "straight")
    assert int(state["episodes"]) > 0 and state["weights"].abs().sum() > 0

    # The same run in two sessions ends in exactly the same state.
    first = train_py(project, "--config", "hill.toml", "--logdir", "resumed", "--steps", "3000")
    assert first.returncode == 0, first.stderr
    second = train_py(project, "--config", "hill.toml", "--logdir", "resumed", "--steps", "6000")
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stdout
    resumed = final_state(project / "resumed")
    assert set(resumed) == set(state)
    for name in state:
        assert torch.equal(resumed[name], state[name]), name
    assert ([r["score"] for r in read_metrics(project / "resumed")]
            == [r["score"] for r in records])

    evaluated = subprocess.run([sys.executable, "-m", "batchrl.evaluate", "straight",
                                "--episodes", "2"], cwd=project,
                               capture_output=True, text=True, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    # Without per_agent_state the run's 4 agents evaluate (2 episodes asked).
    assert "mean actions, 4 agents" in evaluated.stdout
    assert "over 2 episodes" in evaluated.stdout


@pytest.mark.parametrize("name,message", [
    ("NoState", "TypeError: NoState.state_dict() returned NoneType, not a dict: return "
                "everything a resume needs"),
    ("MisnamedState", "TypeError: MisnamedState.per_agent_state names 'episode_retrun', which "
                      "its state_dict() lacks (its keys: "),
])
def test_a_state_dict_that_does_not_fit_stops_the_run_at_its_first_boundary(project, name,
                                                                            message):
    """Found when the first checkpoint is taken, not when the run is resumed or evaluated."""
    (project / "bad.toml").write_text(CONFIG.replace("user_algos:Hill", f"user_algos:{name}"))
    done = train_py(project, "--config", "bad.toml", "--logdir", "bad")
    assert done.returncode == 1
    assert message in done.stderr, done.stderr
    assert [r["phase"] for r in read_metrics(project / "bad")] == ["train", "eval"]
    assert not list_checkpoints(project / "bad")


def test_an_error_in_the_algorithm_shows_its_traceback_and_how_to_resume(project):
    (project / "boom.toml").write_text(CONFIG.replace("user_algos:Hill", "user_algos:LateBoom"))
    done = train_py(project, "--config", "boom.toml", "--logdir", "boom")
    assert done.returncode == 1
    assert "RuntimeError: boom in end_episodes" in done.stderr, done.stderr
    assert "in end_episodes\n    raise RuntimeError" in done.stderr  # (the user's own line)
    checkpoint = Path("boom") / list_checkpoints(project / "boom")[-1].name
    assert done.stderr.rstrip().endswith(
        f"The run's latest checkpoint is {checkpoint}. Once the error is fixed, resume it "
        f"with: python train.py --config boom.toml --logdir boom"), done.stderr


def test_a_checkpoint_its_changed_algorithm_cannot_load_names_the_code_not_the_config(
        project):
    first = train_py(project, "--config", "hill.toml", "--logdir", "run", "--steps", "1000")
    assert first.returncode == 0, first.stderr
    module = project / "user_algos.py"
    module.write_text(USER_MODULE.replace("getattr(self, name).copy_(value)",
                                          "getattr(self, name).copy_(state['renamed'])"))
    second = train_py(project, "--config", "hill.toml", "--logdir", "run", "--steps", "2000")
    assert second.returncode == 2, second.stderr
    line = (USER_MODULE.splitlines().index(
        "            getattr(self, name).copy_(value)") + 1)
    assert second.stderr.strip() == (
        f"error: {Path('run') / 'ckpt-000000001000.pt'} does not fit the algorithm its run's "
        f"config.json builds (user_algos:Hill): KeyError: 'renamed'; the config is the one the "
        f"checkpoint was saved with, so did Hill's state_dict() or load_state_dict() change "
        f"since? (raised at {module}:{line})"), second.stderr


@pytest.mark.slow
def test_an_algorithm_naming_no_update_length_trains_in_default_phases(project):
    # No [train] phase settings: the default phases are env steps, so the algorithm trains
    # at full speed and the evaluations are a small share of the env steps.
    config = CONFIG.replace("steps = 6_000\nphase_steps = 1_000\neval_episodes = 4\n",
                            "steps = 100_000\n")
    (project / "defaults.toml").write_text(config)
    done = train_py(project, "--config", "defaults.toml", "--logdir", "defaults")
    assert done.returncode == 0, done.stderr
    records = read_metrics(project / "defaults")
    # Default phases: max(50,000, 10 x 30 evaluation episodes x 200 steps) = 60,000 env steps,
    # the last one stopping at the budget.
    assert [(r["phase"], r["step"]) for r in records] == [
        ("train", 60_000), ("eval", 60_000), ("train", 100_000), ("eval", 100_000)]
    assert [r["episodes"] for r in records if r["phase"] == "eval"] == [30, 30]
    counters = load_checkpoint(list_checkpoints(project / "defaults")[-1], "cpu")["counters"]
    assert counters["steps"] == 100_000
    assert counters["eval_steps"] <= 0.1 * counters["steps"], counters
    assert int(final_state(project / "defaults")["episodes"]) > 1000  # it learned from them


def test_help_lists_the_keys_of_a_user_algorithm_in_the_working_directory(project):
    shown = subprocess.run([sys.executable, str(TRAIN_PY), "--help", "--config", "hill.toml"],
                           cwd=project, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "[algorithm] keys of Hill (algorithm.class = \"user_algos:Hill\"):" in shown.stdout
    assert "  algorithm.step_size = 0.5  # default 0.1\n" in shown.stdout  # hill.toml's
    assert "cannot import" not in shown.stdout


def test_the_reinforce_config_trains_the_example_algorithm(tmp_path):
    done = train_py(REPO, "--config", "cartpole_reinforce", "--logdir", str(tmp_path / "run"),
                    "--steps", "16000")
    assert done.returncode == 0, done.stderr
    evals = [r["score"] for r in read_metrics(tmp_path / "run") if r["phase"] == "eval"]
    assert len(evals) == 2 and evals[-1] > 100  # CartPole's random policy scores about 20


@pytest.mark.parametrize("setting, message", [
    ('class = "no_such_module:Algo"',
     r"^error: algorithm.class = 'no_such_module:Algo': cannot import module 'no_such_module'"),
    ('class = "user_algos:NotAnAlgorithm"',
     r"^error: algorithm.class = 'user_algos:NotAnAlgorithm': user_algos.NotAnAlgorithm is a "
     r"class, not a subclass of batchrl.algos.Algorithm; its algorithms: Hill, LateBoom, "
     r"MisnamedState, NoState, Typo$"),
    ('class = "user_algos:Nope"',
     r"^error: algorithm.class = 'user_algos:Nope': module user_algos has no name 'Nope'; "
     r"its algorithms: Hill, LateBoom, MisnamedState, NoState, Typo$"),
    ('class = "user_algos:Hill"\nstep = 0.5',
     r"^error: Hill \(user_algos:Hill\) does not take algorithm.step; its keys: step_size$"),
    ('class = "user_algos:Hill"\nstep_size = "big"',
     r"^error: algorithm.step_size: expected a number, got 'big'$"),
    ('class = "batchrl.algos.reinforce:Reinforce"\nupdate_every = 16\npolicy_lr = 1e-3'
     '\nupdate_epochs = 3',
     r"^error: Reinforce \(batchrl.algos.reinforce:Reinforce\) does not take "
     r"algorithm.policy_lr, algorithm.update_epochs; its keys: discount, learning_rate, "
     r"update_every, hidden, seed$"),
    ('class = "user_algos:Hill"\nmax_length = 5',
     r"^error: algorithm.max_length is the trainer's to pass"),
    ('class = "Hill"', r"^error: algorithm.class must be 'package.module:Class', got 'Hill'"),
    ('class = "batchrl.algos.reinforce:Reinforce"\nupdate_every = 0',
     r"^error: \[algorithm\] batchrl.algos.reinforce:Reinforce\(\): max_length and "
     r"update_every must be positive \(ValueError at \S+/batchrl/algos/reinforce.py:\d+; "
     r"the config's arguments: \{'update_every': 0\}\)$"),
    # A bug in a user's constructor: the line that raised, in the user's own file.
    ('class = "user_algos:Typo"\nstep_size = 0.5',
     r"^error: \[algorithm\] user_algos:Typo\(\): .* \(TypeError at \S+/user_algos.py:\d+; "
     r"the config's arguments: \{'step_size': 0.5\}\)$"),
])
def test_an_algorithm_that_does_not_fit_is_a_user_error(project, setting, message):
    config = CONFIG.replace('class = "user_algos:Hill"\nstep_size = 0.5', setting)
    (project / "bad.toml").write_text(config)
    done = train_py(project, "--config", "bad.toml", "--logdir", "bad")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert re.search(message, done.stderr.strip()), done.stderr
    assert not (project / "bad").exists()


def test_the_algorithm_defaults_of_a_minimal_subclass():
    algo = Minimal()
    assert algo.training and not algo.acting_deterministically
    assert algo.eval() is algo and not algo.training and algo.acting_deterministically
    sampling = Minimal(eval_actions="sample").eval()
    assert not sampling.acting_deterministically  # evaluation samples
    with pytest.raises(ValueError, match="eval_actions must be one of"):
        Minimal(eval_actions="greedy")
    assert algo.rollout_length is None and not algo.experience_may_lag
    assert algo.collector_support() == (
        "Minimal does not implement behaviour_fields, act, acting_state, load_acting_state, "
        "learn, which an algorithm needs to act in collector processes (see Algorithm's "
        "docstring)")
    with pytest.raises(NotImplementedError, match="Minimal cannot run with collectors"):
        algo.act(torch.zeros(1, 4))


def test_an_algorithm_naming_no_update_length_gets_the_default_phase_plan():
    # phase_steps 0: max(50,000, 10 x eval_episodes x max_length) env steps, in batch steps
    # rounded up; eval_every is the config's.
    config = load_config("cartpole_reinforce", ["train.phase_steps=0", "train.eval_episodes=30",
                                                "env.max_length=200", "train.eval_every=3"])
    assert phase_plan(config, Minimal(), 4) == (None, 15_000, 3)
    assert phase_plan(config, Minimal(), 7) == (None, 8_572, 3)  # 60,000 / 7, rounded up
    config = load_config("cartpole_reinforce", ["train.phase_steps=1000"])
    assert phase_plan(config, Minimal(), 3) == (None, 334, 1)


class CollectingMinimal(Minimal):
    """Implements the five collection methods but names no rollout length."""

    def behaviour_fields(self):
        return {}

    def act(self, observ, deterministic=False):
        return torch.zeros(len(observ), dtype=torch.int64), {}

    def acting_state(self):
        return {}

    def load_acting_state(self, state):
        pass

    def learn(self, rollout):
        return {}


def test_an_algorithm_with_the_collection_methods_but_no_rollout_length_cannot_collect():
    """collector_support() names the missing rollout length; steps_per_update supplies it."""
    algo = CollectingMinimal()
    assert algo.collector_support() == ("CollectingMinimal names no rollout_length: "
                                        "collectors send fixed-length rollouts")
    algo.steps_per_update = 16
    assert algo.rollout_length == 16 and algo.collector_support() is None


class OpenEnded(Minimal):
    """An algorithm whose constructor takes any keyword argument; it records them."""

    def __init__(self, observation_space, action_space, num_agents, **kwargs):
        super().__init__()
        self.received = dict(kwargs)


def test_a_constructor_with_kwargs_gets_the_first_three_run_facts_and_any_key():
    """Through **kwargs a class gets max_length, total_steps and device, and any [algorithm]
    key; precision and eval_actions only by name, so non-neutral values are refused."""
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    values = {"algorithm": {"class": f"{__name__}:OpenEnded", "flavour": "x", "depth": 3},
              "env": {"max_length": 77}, "train": {"steps": 1234}}
    config = build_config(values)
    assert config.algorithm.keys == {"flavour": "x", "depth": 3}
    algo = config.make_algorithm(observation_space, gym.spaces.Discrete(2), 2, "cpu")
    assert algo.received == {"max_length": 77, "total_steps": 1234, "device": "cpu",
                             "flavour": "x", "depth": 3}
    for key, value in (("precision", "bfloat16"), ("eval_actions", "sample")):
        config = build_config({**values, "train": {key: value}})
        with pytest.raises(ConfigError, match=rf"train.{key}='{value}' needs an algorithm whose "
                                              rf"constructor takes {key}"):
            config.make_algorithm(observation_space, gym.spaces.Discrete(2), 2, "cpu")
