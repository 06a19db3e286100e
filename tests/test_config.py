"""The config schema: configs/*.toml, --set overrides, validation errors, env ids."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from batchrl.algos.ppo_config import PPOConfig
from batchrl.config import (BATCHPPO, CONFIG_DIR, RUN_FACTS, AlgorithmConfig, Config,
                            ConfigError, algorithm_keys, available_configs, build_config,
                            load_config, load_saved_config, parse_override, save_config)
from batchrl.envs.errors import EnvRaisedError, EnvSpecError
from batchrl.envs.factory import make_batch_env, resolve_constructor
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer

PPO_KEYS = ("network", "policy_layers", "update_every", "discount", "inference")
REINFORCE = "batchrl.algos.reinforce:Reinforce"


# --- the shipped configs ---------------------------------------------------------

def test_configs_dir_holds_the_documented_tasks():
    assert set(available_configs()) >= {"ant", "cartpole", "halfcheetah", "hopper", "humanoid",
                                        "pendulum", "reacher", "walker"}
    assert {f"paper/{name}" for name in ("ant", "halfcheetah", "hopper", "humanoid", "reacher",
                                          "walker")} <= set(available_configs())
    assert {"atari/pong", "sac/halfcheetah", "impala/cartpole", "fast/halfcheetah"} <= set(
        available_configs())  # (configs in folders, by their paths)
    assert available_configs() == sorted(available_configs())


@pytest.mark.parametrize("name", available_configs())
def test_every_config_loads_validates_and_names_a_known_env(name):
    config = load_config(name)
    assert isinstance(config, Config)
    # BatchPPO's keys are all of PPOConfig's fields, defaults filled in; the run facts
    # (max_length, total_steps, device) are the trainer's to pass, not keys.
    if config.algorithm.path == BATCHPPO:
        assert config.algorithm.keys == dataclasses.asdict(PPOConfig(**config.algorithm.keys))
        assert list(config.algorithm.keys) == list(algorithm_keys(BATCHPPO))
    assert not set(RUN_FACTS) & set(config.algorithm.keys)
    assert config.to_dict()["algorithm"] == {"class": config.algorithm.path,
                                             **config.algorithm.keys}
    assert config.train.steps >= config.env.num_agents
    # The env id resolves (a registered Gymnasium id; MuJoCo need not be installed).
    assert callable(resolve_constructor(config.env.id, config.env.kwargs))
    # Loading the same file by path gives the same config.
    assert load_config(str(CONFIG_DIR / f"{name}.toml")) == config
    # The resolved config survives the JSON round trip a run's config.json makes.
    values = json.loads(json.dumps(config.to_dict()))
    assert build_config(values) == config


def test_defaults_of_an_empty_config_file(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("# nothing set\n")
    assert load_config(str(path)) == build_config({}) == Config()
    # The default algorithm is BatchPPO with PPOConfig's defaults.
    assert Config().algorithm == AlgorithmConfig(BATCHPPO, dataclasses.asdict(PPOConfig()))
    assert Config().to_dict()["algorithm"] == {"class": BATCHPPO,
                                               **dataclasses.asdict(PPOConfig())}


# --- unknown names, sections and keys ----------------------------------------------

def test_unknown_config_name_lists_the_available_ones():
    with pytest.raises(ConfigError) as info:
        load_config("no-such-task")
    message = str(info.value)
    assert "no-such-task" in message
    for name in available_configs():
        assert name in message


def test_missing_toml_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(str(tmp_path / "missing.toml"))


def test_invalid_toml_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[env\nid = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path))
    path.write_bytes(b'[env]\nid = "\xff"\n')  # (TOML is UTF-8)
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path))


def test_unknown_section_lists_the_valid_sections():
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", ["optim.lr=3"])
    message = str(info.value)
    assert "[optim]" in message
    for section in ("env", "train", "algorithm"):
        assert section in message


@pytest.mark.parametrize("section, key, sample_valid", [
    ("algorithm", "learning_rate", "policy_lr"),
    ("env", "agents", "num_agents"),
    ("train", "step", "eval_every"),
])
def test_unknown_key_is_named_with_the_valid_keys(section, key, sample_valid):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [f"{section}.{key}=1"])
    message = str(info.value)
    assert f"{section}.{key}" in message
    assert sample_valid in message
    if section == "algorithm":
        assert message.startswith(f"BatchPPO ({BATCHPPO}) does not take algorithm.{key}; "
                                  f"its keys: network, policy_layers, "), message
        for valid in PPO_KEYS:
            assert valid in message
        # The trainer's to pass (from env.max_length, train.steps): not offered as keys.
        assert "max_length" not in message and "total_steps" not in message


def test_every_unknown_algorithm_key_is_named_in_one_line(tmp_path):
    path = tmp_path / "typos.toml"
    path.write_text("[algorithm]\nbogus = 1\ndiscount = 0.9\nnope = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message == (f"BatchPPO ({BATCHPPO}) does not take algorithm.bogus, algorithm.nope; "
                       f"its keys: {', '.join(algorithm_keys(BATCHPPO))}")
    # The same for another class: its constructor's keywords.
    with pytest.raises(ConfigError) as info:
        load_config("cartpole_reinforce", ["algorithm.bogus=1", "algorithm.nope=2"])
    assert str(info.value) == (f"Reinforce ({REINFORCE}) does not take algorithm.bogus, "
                               f"algorithm.nope; its keys: discount, learning_rate, "
                               f"update_every, hidden, seed")


def test_unknown_key_in_a_toml_file(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[env]\nid = "CartPole-v1"\nnum_agent = 4\n')
    with pytest.raises(ConfigError, match=r"env\.num_agent\b.*num_agents"):
        load_config(str(path))


@pytest.mark.parametrize("section", ["env", "train", "algorithm"])
def test_a_section_that_is_not_a_table(tmp_path, section):
    path = tmp_path / "flat.toml"
    path.write_text(f"{section} = 3\n")
    with pytest.raises(ConfigError, match=rf"\[{section}\] must be a table"):
        load_config(str(path))


# --- types and ranges ---------------------------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("algorithm.discount=high", "expected a number"),
    ('algorithm.discount="0.9"', "expected a number"),
    ("algorithm.discount=true", "expected a number"),
    ("env.num_agents=2.5", "expected an integer"),
    ("train.steps=true", "expected an integer"),
    ("train.steps=1.5", "expected an integer"),          # integral floats only
    ("train.steps=1e30", "1e+30 is out of range; integers must fit in 64 bits"),
    ("train.seed=-9223372036854775809", "out of range"),
    ("algorithm.update_every=2.5", "expected an integer"),
    ("algorithm.rollout_length=2.5", "expected"),
    ("env.share_main=yes", "expected bool"),
    ("env.backend=threads", "env.backend must be one of"),
    ("env.workers=-1", "workers must be >= 0"),
    ("env.timeout=nan", "env.timeout: expected a finite number, got nan"),
    ("env.timeout=inf", "env.timeout: expected a finite number, got inf"),
    ("env.timeout=1e10", "timeout must be a finite number of seconds below 1e9 (0: no limit), "
                         "got 10000000000.0"),
    ("algorithm.policy_lr=inf", "algorithm.policy_lr: expected a finite number, got inf"),
    ("algorithm.entropy_coef=-inf", "algorithm.entropy_coef: expected a finite number"),
    ("algorithm.max_grad_norm=nan", "algorithm.max_grad_norm: expected a finite number"),
    ("train.preemption_threshold=nan", "train.preemption_threshold: expected a finite number"),
    ("env.id=3", "expected str"),
    ("env.kwargs=[1, 2]", "expected dict"),
    ("env.ray_resources=2", "expected dict"),
    ("env.ray_resources={CPU=-1}", "env.ray_resources must map Ray resource names to "
                                   "amounts >= 0, e.g. {CPU = 1}"),
    ('env.ray_resources={CPU="one"}', "env.ray_resources must map Ray resource names"),
    ("algorithm.policy_layers=64", "expected a list of int"),
    ("algorithm.policy_layers=[64, 6.5]", "expected an integer"),
    ("algorithm.gae_lambda=high", "expected"),
])
def test_wrong_type_names_the_key_and_the_type(override, expected):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    message = str(info.value)
    assert message.startswith(key) or f"{key}[" in message, message
    assert expected in message


@pytest.mark.parametrize("override, expected", [
    ("algorithm.discount=1.5", "algorithm.discount must be in [0, 1], got 1.5"),
    ("algorithm.discount=-0.1", "algorithm.discount must be in [0, 1]"),
    ("algorithm.gae_lambda=2", "algorithm.gae_lambda must be in [0, 1]"),
    ("algorithm.policy_lr=0", "algorithm.policy_lr must be > 0"),
    ("algorithm.epsilon=0", "algorithm.epsilon must be > 0, got 0"),
    ("algorithm.update_every=0", "algorithm.update_every must be >= 1"),
    ("algorithm.network=transformer",
     "algorithm.network must be one of ('feed_forward', 'recurrent')"),
    ("algorithm.inference=jit", "algorithm.inference must be one of"),
    ("env.num_agents=0", "env.num_agents must be >= 1, got 0"),
    ("env.max_length=-5", "env.max_length must be >= 1"),
    ("train.steps=0", "train.steps must be >= 1"),
    ("train.eval_episodes=-1", "train.eval_episodes must be >= 0"),
    ("train.eval_every=0", "train.eval_every must be >= 1"),
    ("train.device=tpu", "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("train.device=cuda:x", "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
    ("train.seed=-1", "train.seed must be in [0, 2**32), got -1"),
    ("train.seed=4294967296", "train.seed must be in [0, 2**32)"),
    ("train.learner_resources={CPU=-1}", "train.learner_resources must map Ray resource names"),
    ("train.learner_resources={CPU=0}", "train.learner_resources must reserve some amount of "
                                        "a resource for each learner (Ray places learners in "
                                        "bundles, which cannot be empty), e.g. {CPU = 1}; got "
                                        "{'CPU': 0}"),
    ("train.learner_resources={CPU=0, GPU=0}", "train.learner_resources must reserve some"),
    ("algorithm.policy_layers=[-1]", "algorithm.policy_layers must be layer sizes >= 1"),
    ("algorithm.value_layers=[64, 0]", "algorithm.value_layers must be layer sizes >= 1"),
    ("train.phase_steps=-1", "train.phase_steps must be >= 0, got -1"),
    ("train.collectors=-1", "train.collectors must be >= 0, got -1"),
    ("train.queue_size=-1", "train.queue_size must be >= 0, got -1"),
    ("train.threads=0", "train.threads must be >= 1, got 0"),
    ("train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("env.max_restarts=0", "env.max_restarts must be >= 1, got 0"),
    ("env.timeout=1e9", "env.timeout must be a finite number of seconds below 1e9"),
    ("train.device=cuda:", "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:'"),
    ("train.steps=9223372036854775808", "train.steps: 9.22e+18 is out of range"),
])
def test_out_of_range_names_the_key_and_what_is_valid(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    assert expected in str(info.value)


def test_the_largest_64_bit_integer_is_in_range():
    assert load_config("cartpole", ["train.steps=9223372036854775807"]).train.steps == 2**63 - 1


def test_integer_keys_take_integral_floats():
    config = load_config("cartpole", [
        "train.steps=1e5", "env.num_agents=4.0", "algorithm.update_every=2e1",
        "algorithm.rollout_length=5e1", "algorithm.policy_layers=[64.0, 32]"])
    assert config.train.steps == 100_000 and type(config.train.steps) is int
    assert config.env.num_agents == 4 and type(config.env.num_agents) is int
    keys = config.algorithm.keys
    assert keys["update_every"] == 20 and type(keys["update_every"]) is int
    assert keys["rollout_length"] == 50 and type(keys["rollout_length"]) is int
    assert keys["policy_layers"] == (64, 32)
    assert all(type(size) is int for size in keys["policy_layers"])
    # Another class's int keywords too; float keys stay floats.
    reinforce = load_config("cartpole_reinforce", ["algorithm.update_every=3e1",
                                                   "algorithm.learning_rate=1"])
    assert type(reinforce.algorithm.keys["update_every"]) is int
    assert reinforce.algorithm.keys["update_every"] == 30
    assert type(reinforce.algorithm.keys["learning_rate"]) is float
    # The same value in a file; it round-trips as an int.
    assert json.loads(json.dumps(config.to_dict()))["train"]["steps"] == 100_000
    assert build_config(json.loads(json.dumps(config.to_dict()))) == config


def test_errors_are_value_errors_for_callers():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(EnvSpecError, ValueError)


# --- override parsing -----------------------------------------------------------------

@pytest.mark.parametrize("text, path, value", [
    ("algorithm.policy_lr=3e-4", ["algorithm", "policy_lr"], 3e-4),
    ("train.steps=2_000", ["train", "steps"], 2000),
    ("env.share_main=false", ["env", "share_main"], False),
    ("algorithm.policy_layers=[64, 64]", ["algorithm", "policy_layers"], [64, 64]),
    ("train.steps=1e5", ["train", "steps"], 1e5),      # TOML's float; the schema makes it int
    ('env.id="Hopper-v5"', ["env", "id"], "Hopper-v5"),
    ("env.id=Hopper-v5", ["env", "id"], "Hopper-v5"),               # a bare word
    ("env.id=mypackage.envs:make_env", ["env", "id"], "mypackage.envs:make_env"),
    ("train.device=cuda:1", ["train", "device"], "cuda:1"),
    ("env.kwargs={g = 9.81, render_mode = \"rgb_array\"}", ["env", "kwargs"],
     {"g": 9.81, "render_mode": "rgb_array"}),
    ("  algorithm.discount = 0.98  ", ["algorithm", "discount"], 0.98),
    ("env.id=a=b", ["env", "id"], "a=b"),                           # split at the first "="
    ("env.kwargs.env_id=ALE/Breakout-v5", ["env", "kwargs", "env_id"], "ALE/Breakout-v5"),
])
def test_parse_override(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["algorithm.discount", "discount=0.9", "env..id=1",
                                  ".lr=1", "algorithm.=1"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_overrides_are_converted_to_the_schema_types():
    config = load_config("cartpole", [
        "algorithm.policy_layers=[64, 64]", "algorithm.value_layers=[32]",
        "algorithm.discount=1", "env.id=CartPole-v1", "env.num_agents=4", "train.device=cpu",
        "algorithm.gae_lambda=0.95", "env.kwargs={sutton_barto_reward = true}"])
    keys = config.algorithm.keys
    assert keys["policy_layers"] == (64, 64)           # lists become tuples
    assert keys["value_layers"] == (32,)
    assert keys["discount"] == 1.0 and isinstance(keys["discount"], float)
    assert config.env.id == "CartPole-v1"
    assert config.env.num_agents == 4
    assert config.train.device == "cpu"
    assert keys["gae_lambda"] == 0.95
    assert config.env.kwargs == {"sutton_barto_reward": True}
    # Everything else keeps the file's values or the defaults.
    base = load_config("cartpole")
    assert config.env.max_length == base.env.max_length == 500
    assert keys["update_every"] == base.algorithm.keys["update_every"] == 20
    assert keys["init_std"] == PPOConfig().init_std   # neither file nor override: the default
    assert config.train.eval_every == Config().train.eval_every


def test_an_override_of_a_tables_key_keeps_its_other_keys():
    config = load_config("atari/pong", ["env.kwargs.env_id=ALE/Breakout-v5"])
    assert config.env.kwargs == {"env_id": "ALE/Breakout-v5", "sticky_actions": 0.0}
    whole = load_config("atari/pong", ['env.kwargs={env_id = "ALE/Breakout-v5"}'])
    assert whole.env.kwargs == {"env_id": "ALE/Breakout-v5"}  # (the table replaced)
    with pytest.raises(ConfigError, match="--set env.id.x: env.id is not a table"):
        load_config("cartpole", ["env.id.x=1"])
    with pytest.raises(ConfigError, match="adam"):  # (no such algorithm key)
        load_config("cartpole", ["algorithm.adam.lr=1"])


def test_none_unsets_an_optional_key_in_any_case():
    assert load_config("halfcheetah").algorithm.keys["gae_lambda"] == 0.95  # (keys that are set)
    for word in ("none", "None", "NONE"):
        config = load_config("halfcheetah", ["train.max_policy_lag=2",
                                             f"train.max_policy_lag={word}",
                                             f"algorithm.gae_lambda={word}"])
        assert config.train.max_policy_lag is None
        assert config.algorithm.keys["gae_lambda"] is None


def test_later_overrides_win():
    config = load_config("cartpole", ["train.seed=1", "train.seed=7"])
    assert config.train.seed == 7


def test_the_trainer_passes_the_run_facts_to_the_algorithm():
    config = load_config("pendulum", ["env.max_length=50", "train.steps=12345",
                                      "algorithm.inference=eager"])
    assert config.run_facts("cpu") == {"max_length": 50, "total_steps": 12345, "device": "cpu",
                                       "precision": "float32", "eval_actions": "mean"}
    assert tuple(config.run_facts("cpu")) == RUN_FACTS
    assert not set(RUN_FACTS) & set(config.algorithm.keys)
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    algo = config.make_algorithm(observation_space, action_space, 2, "cpu")
    assert type(algo).__name__ == "BatchPPO"
    assert algo.max_length == 50 and algo.total_steps == 12345  # BatchPPO's buffer, schedule
    # A class whose constructor takes only some of them gets only those (Reinforce: no
    # total_steps).
    reinforce = load_config("cartpole_reinforce", ["env.max_length=40"])
    algo = reinforce.make_algorithm(observation_space, gym.spaces.Discrete(2), 2, "cpu")
    assert type(algo).__name__ == "Reinforce" and algo.max_length == 40


@pytest.mark.parametrize("fact, source", [("max_length", "env.max_length"),
                                          ("total_steps", "train.steps"),
                                          ("device", "train.device")])
@pytest.mark.parametrize("name", ["cartpole", "cartpole_reinforce"])
def test_run_facts_in_algorithm_point_to_their_source(tmp_path, fact, source, name):
    expected = (f"algorithm.{fact} is the trainer's to pass (from {source}); remove it from "
                f"[algorithm] and set {source} instead")
    with pytest.raises(ConfigError) as info:
        load_config(name, [f"algorithm.{fact}=100"])
    assert str(info.value) == expected
    path = tmp_path / "file.toml"
    path.write_text(f"[algorithm]\n{fact} = 100\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == expected


def test_saved_config_round_trips_and_a_new_budget_reaches_the_algorithm(tmp_path):
    config = load_config("pendulum", ["env.max_length=77", "algorithm.lr_schedule=linear"])
    save_config(config, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved == json.loads(json.dumps(config.to_dict()))
    assert saved["algorithm"]["class"] == BATCHPPO
    assert not set(RUN_FACTS) & set(saved["algorithm"])  # the trainer's, not keys
    assert load_saved_config(tmp_path) == config
    extended = load_saved_config(tmp_path, ["train.steps=5000"])
    # A new budget also moves the learning-rate schedule's horizon (the run fact).
    assert extended.train.steps == extended.run_facts("cpu")["total_steps"] == 5000
    assert extended.algorithm == config.algorithm


def test_run_facts_are_not_offered_as_keys():
    config = load_config("pendulum", ["train.steps=12345", "algorithm.lr_schedule=linear"])
    assert config.algorithm.keys["lr_schedule"] == "linear"
    for path in (BATCHPPO, REINFORCE):
        assert not set(RUN_FACTS) & set(algorithm_keys(path))
    with pytest.raises(ConfigError) as info:
        load_config("pendulum", ["algorithm.nope=1"])
    assert "total_steps" not in str(info.value) and "lr_schedule" in str(info.value)
    assert "max_length" not in str(info.value) and "device" not in str(info.value)


# --- [ppo]: no longer a section; old runs' saved configs still resume ---------------------

PPO_SECTION_ERROR = ("unknown section [ppo]; valid sections: env, train, algorithm "
                     "(BatchPPO's keys go in [algorithm])")


def test_a_ppo_section_is_an_error_naming_algorithm(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[ppo]\ndiscount = 0.98\nupdate_every = 7\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(old))
    assert str(info.value) == PPO_SECTION_ERROR
    for name in ("cartpole", "cartpole_reinforce"):
        with pytest.raises(ConfigError) as info:
            load_config(name, ["ppo.discount=0.9"])
        assert str(info.value) == PPO_SECTION_ERROR
    with pytest.raises(ConfigError) as info:
        build_config({"ppo": {"discount": 0.9}})
    assert str(info.value) == PPO_SECTION_ERROR


OLD_PPO_KEYS = {"discount": 0.98, "update_every": 7, "policy_layers": [64, 64],
                "max_length": 123, "total_steps": 4000}


@pytest.mark.parametrize("form", ["ppo", "algorithm without class", "stripped"])
def test_an_old_runs_saved_config_still_loads(tmp_path, form):
    """Earlier versions saved BatchPPO's keys as [ppo] with max_length and total_steps (which
    followed env.max_length and train.steps), later as [algorithm] without class and without
    those two."""
    env = {"id": "Pendulum-v1", "num_agents": 2, "max_length": 123}
    keys = dict(OLD_PPO_KEYS)
    if form == "stripped":
        del keys["max_length"], keys["total_steps"]
    section = "ppo" if form == "ppo" else "algorithm"
    (tmp_path / "config.json").write_text(json.dumps(
        {"env": env, "train": {"steps": 4000}, section: keys}))
    config = load_saved_config(tmp_path)
    assert config.algorithm.path == BATCHPPO
    assert config.algorithm.keys == {**dataclasses.asdict(PPOConfig()), "discount": 0.98,
                                     "update_every": 7, "policy_layers": (64, 64)}
    assert config.env == dataclasses.replace(Config().env, **env)
    assert config.train == dataclasses.replace(Config().train, steps=4000)
    assert config.run_facts("cpu")["max_length"] == 123
    # Resuming with a larger budget: train.steps moves, the old total_steps does not linger.
    extended = load_saved_config(tmp_path, ["train.steps=8000"])
    assert extended.run_facts("cpu")["total_steps"] == 8000
    assert extended.algorithm == config.algorithm
    # Once loaded, it saves in today's form.
    assert build_config(json.loads(json.dumps(config.to_dict()))) == config


def test_unreadable_saved_config_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_saved_config(tmp_path)


# --- env ids ------------------------------------------------------------------------

ENV_MODULE = '''
"""A tiny env for the tests: the observation counts up, episodes end after `length` steps."""
import gymnasium as gym
import numpy as np


class Countdown(gym.Env):
    def __init__(self, length=5, scale=1.0):
        self.length, self.scale = length, scale
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        reward = self.scale * (1.0 - abs(float(np.asarray(action).reshape(-1)[0])))
        observ = np.array([self.t, self.length - self.t], np.float32)
        return observ, reward, self.t >= self.length, False, {}


def make_env(length=5, scale=1.0):
    return Countdown(length, scale)


not_callable = 3
'''


@pytest.fixture
def env_package(tmp_path, monkeypatch):
    """A package ``tinyenvs_<n>`` in tmp_path with ``tinyenvs_<n>.countdown:make_env``."""
    name = f"tinyenvs_{tmp_path.name.replace('-', '_')}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "countdown.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def test_env_id_as_module_function(env_package):
    constructor = resolve_constructor(f"{env_package}.countdown:make_env", {"length": 3})
    env = constructor()
    assert type(env).__name__ == "Countdown" and env.length == 3
    batch = make_batch_env(f"{env_package}.countdown:make_env", 2, 10, {"length": 3},
                           backend="inline")
    try:
        assert len(batch) == 2
    finally:
        batch.close()


def test_env_id_as_module_function_trains_end_to_end(env_package, tmp_path):
    config = load_config("pendulum", [
        f'env.id="{env_package}.countdown:make_env"', "env.kwargs={length = 7, scale = 2.0}",
        "env.num_agents=2", "env.max_length=20", "env.backend=inline",
        "algorithm.update_every=2", "algorithm.update_epochs=2",
        "algorithm.policy_layers=[16]", "algorithm.value_layers=[16]", "train.steps=60",
        "train.eval_episodes=2", "train.device=cpu"])
    result = Trainer(config, tmp_path / "run", progress=False).run()
    records = read_metrics(tmp_path / "run")
    assert [r["phase"] for r in records][:2] == ["train", "eval"]
    assert records[-1]["step"] == 60  # the last training phase stops at the budget
    # Every episode of the custom env lasts `length` steps and scores at most 2 per step
    # (the last training phase, cut at the budget after 2 of its 7 steps, ends none).
    ended = [r for r in records if r["episodes"]]
    assert [r for r in records if r not in ended] == [
        r for r in records if r["phase"] == "train" and r["step"] == 60]
    assert {r["length"] for r in ended} == {7.0}
    assert all(0.0 <= r["score"] <= 14.0 for r in ended)
    assert result["episodes"] == 2 and result["length"] == 7.0
    assert load_saved_config(tmp_path / "run") == config


@pytest.mark.parametrize("env_id, expected", [
    ("NoSuchEnv-v0", "NoSuchEnv"),
    ("CartPole-v99", "CartPole"),
    ("no_such_module_for_batchrl.envs:make_env", "cannot import module"),
    ("json:no_such_function", "no callable 'no_such_function'"),
])
def test_unknown_env_id_is_an_env_spec_error(env_id, expected):
    with pytest.raises(EnvSpecError) as info:
        resolve_constructor(env_id)
    assert expected in str(info.value)
    assert env_id in str(info.value)
    with pytest.raises(EnvSpecError):
        make_batch_env(env_id, 2, backend="process")  # before any worker is started


def _episode_length(batch_env, limit: int) -> int:
    """Steps until the first env of ``batch_env`` is done (at most ``limit``)."""
    batch_env.reset(seed=0)
    action = np.zeros((len(batch_env), *batch_env.action_space.shape), np.float32)
    for step in range(1, limit + 1):
        _, _, terminated, truncated, _ = batch_env.step(action)
        if terminated[0] or truncated[0]:
            return step
    return limit + 1


@pytest.mark.parametrize("max_length", [50, 250])
def test_max_length_replaces_the_registered_time_limit(max_length):
    # Pendulum-v1 is registered with a limit of 200 steps: a longer
    # max_length must not be cut at 200 by a TimeLimit left beneath ours.
    batch = make_batch_env("Pendulum-v1", 1, max_length, backend="inline")
    try:
        assert _episode_length(batch, 300) == max_length
        assert _episode_length(batch, 300) == max_length
    finally:
        batch.close()
    env = resolve_constructor("Pendulum-v1", max_episode_steps=max_length)()
    limits = []
    while isinstance(env, gym.Wrapper):
        if isinstance(env, gym.wrappers.TimeLimit):
            limits.append(env._max_episode_steps)
        env = env.env
    assert limits == [max_length]


def test_max_length_limits_a_function_env(env_package):
    batch = make_batch_env(f"{env_package}.countdown:make_env", 1, 4, {"length": 9},
                           backend="inline")
    try:
        assert _episode_length(batch, 20) == 4
    finally:
        batch.close()


def test_time_limit_in_kwargs_and_max_length_conflict():
    with pytest.raises(EnvSpecError, match="kwargs must not set max_episode_steps"):
        resolve_constructor("Pendulum-v1", {"max_episode_steps": 30}, 40)
    with pytest.raises(ValueError, match="max_episode_steps must be positive, got 0"):
        resolve_constructor("Pendulum-v1", max_episode_steps=0)


def test_module_attribute_that_is_not_callable(env_package):
    with pytest.raises(EnvSpecError, match="no callable 'not_callable'"):
        resolve_constructor(f"{env_package}.countdown:not_callable")


def test_bad_env_id_writes_nothing_to_the_logdir(tmp_path):
    config = load_config("cartpole", ["env.id=NoSuchEnv-v0"])
    with pytest.raises(EnvSpecError):
        Trainer(config, tmp_path / "run", progress=False).run()
    # No config.json: the directory does not become a run that train.py would resume.
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("overrides", [["env.backend=ray"], ["train.collectors=2"],
                                       ["train.learners=2"]])
def test_ray_address_is_for_a_run_that_uses_ray(overrides):
    with pytest.raises(ConfigError, match=r"^env.ray_address = 'auto' but nothing in this run "
                                          r"uses Ray: .*or leave env.ray_address empty$"):
        load_config("halfcheetah", ["env.ray_address=auto"])
    config = load_config("halfcheetah", ["env.ray_address=auto", *overrides])
    assert config.env.ray_address == "auto"


def test_ray_backend_keys_from_the_command_line():
    config = load_config("halfcheetah", ["env.backend=ray", "env.ray_address=auto",
                                         "env.ray_resources={CPU=1, env_node=0.5}",
                                         "env.restart_crashed_envs=true"])
    assert config.env.backend == "ray" and config.env.ray_address == "auto"
    assert config.env.ray_resources == {"CPU": 1, "env_node": 0.5}
    assert load_config("halfcheetah").env.ray_resources == {"CPU": 1}


def test_algorithm_section_with_and_without_class_read_the_same(tmp_path):
    new = tmp_path / "new.toml"
    new.write_text("[algorithm]\ndiscount = 0.98\nupdate_every = 7\n")
    config = load_config(str(new))
    assert config.algorithm.path == BATCHPPO
    assert config.algorithm.keys["update_every"] == 7
    # --set algorithm.key reaches BatchPPO's keys.
    assert load_config(str(new), ["algorithm.discount=0.9"]).algorithm.keys["discount"] == 0.9
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('[algorithm]\nclass = "batchrl.algos.ppo:BatchPPO"\ndiscount = 0.98\n'
                        'update_every = 7\n')
    assert load_config(str(explicit)) == config
    empty = tmp_path / "empty_class.toml"
    empty.write_text('[algorithm]\nclass = ""\ndiscount = 0.98\nupdate_every = 7\n')
    assert load_config(str(empty)) == config
    # The old name of the section is an error that says where the keys go.
    old = tmp_path / "old.toml"
    old.write_text("[ppo]\ndiscount = 0.98\nupdate_every = 7\n")
    with pytest.raises(ConfigError, match=r"unknown section \[ppo\].*BatchPPO's keys go in "
                                          r"\[algorithm\]"):
        load_config(str(old))


def test_another_algorithm_keeps_its_keys_and_round_trips(tmp_path):
    config = load_config("cartpole_reinforce", ["algorithm.learning_rate=0.005"])
    assert config.algorithm.path == REINFORCE
    # The keys set (converted to the constructor's annotated types), not its defaults.
    assert config.algorithm.keys == {"discount": 0.99, "learning_rate": 0.005,
                                     "update_every": 16, "hidden": (64, 64)}
    assert config.to_dict()["algorithm"] == {"class": REINFORCE, **config.algorithm.keys}
    values = json.loads(json.dumps(config.to_dict()))
    assert build_config(values) == config
    save_config(config, tmp_path)
    assert load_saved_config(tmp_path) == config
    assert not hasattr(config, "ppo")
    # Its keys are set as algorithm.key, like BatchPPO's.
    assert load_config("cartpole_reinforce",
                       ["algorithm.discount=0.9"]).algorithm.keys["discount"] == 0.9
    with pytest.raises(ConfigError, match=r"unknown section \[ppo\]"):
        load_config("cartpole_reinforce", ["ppo.discount=0.9"])


def test_swapping_the_class_names_the_keys_the_new_class_does_not_take(tmp_path):
    # cartpole's [algorithm] sets BatchPPO's discount, update_every and policy_lr.
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [f"algorithm.class={REINFORCE}"])
    assert str(info.value) == (f"Reinforce ({REINFORCE}) does not take algorithm.policy_lr; "
                               f"its keys: discount, learning_rate, update_every, hidden, seed")
    # The other way: Reinforce's learning_rate and hidden are not BatchPPO's.
    with pytest.raises(ConfigError) as info:
        load_config("cartpole_reinforce", [f"algorithm.class={BATCHPPO}"])
    assert str(info.value) == (f"BatchPPO ({BATCHPPO}) does not take algorithm.learning_rate, "
                               f"algorithm.hidden; its keys: "
                               f"{', '.join(algorithm_keys(BATCHPPO))}")
    # Keys both classes take carry over.
    shared = tmp_path / "shared.toml"
    shared.write_text("[algorithm]\ndiscount = 0.9\nupdate_every = 4\n")
    config = load_config(str(shared), [f"algorithm.class={REINFORCE}"])
    assert config.algorithm == AlgorithmConfig(REINFORCE, {"discount": 0.9, "update_every": 4})


# BatchPPO as released (github.com/google-research/batch-ppo, agents/scripts/configs.py:
# default() and the per-task functions; the value network shares the policy's Adam
# optimizer in agents/algorithms/ppo/ppo.py, and init_logstd = -1 is a std of exp(-1)).
# Keys per task: discount, update_every (episodes per update), train.steps, max_length.
RELEASED_DEFAULTS = {"num_agents": 30, "eval_episodes": 30, "policy_layers": (200, 100),
                     "value_layers": (200, 100), "activation": "relu",
                     "init_output_factor": 0.1, "init_std": math.exp(-1), "update_epochs": 25,
                     "policy_lr": 1e-4, "value_lr": 1e-4, "gae_lambda": None,
                     "kl_target": 1e-2, "kl_cutoff_factor": 2.0, "kl_cutoff_coef": 1000.0,
                     "kl_init_penalty": 1.0, "normalize_observ": True, "normalize_reward": True,
                     "normalize_ranges": True, "network": "feed_forward",
                     "rollout_length": None, "max_grad_norm": None, "reward_scale": "reward"}
RELEASED_TASKS = {
    "reacher": (0.985, 60, 5_000_000, 50),  # Gymnasium's Reacher-v5 ends at 50 steps
    "halfcheetah": (0.99, 30, 10_000_000, 1000),
    "walker": (0.995, 30, 10_000_000, 1000),
    "hopper": (0.995, 60, 10_000_000, 1000),
    "ant": (0.995, 30, 20_000_000, 1000),
    "humanoid": (0.995, 60, 50_000_000, 1000),
}


@pytest.mark.parametrize("task", sorted(RELEASED_TASKS))
def test_paper_configs_match_the_released_batchppo_code(task):
    config = load_config(f"paper/{task}")
    values = {**config.algorithm.keys, **dataclasses.asdict(config.env),
              "eval_episodes": config.train.eval_episodes}
    for key, expected in RELEASED_DEFAULTS.items():
        actual = tuple(values[key]) if isinstance(values[key], list) else values[key]
        if isinstance(expected, float):
            assert actual == pytest.approx(expected, rel=1e-3), (task, key)
        else:
            assert actual == expected, (task, key)
    discount, update_every, steps, max_length = RELEASED_TASKS[task]
    assert (values["discount"], values["update_every"], config.train.steps,
            config.env.max_length) == (discount, update_every, steps, max_length)


@pytest.mark.parametrize("backend", ["native", "vector"])
def test_restarting_envs_that_step_in_this_process_names_the_backend(backend):
    with pytest.raises(ConfigError, match=f"env.restart_crashed_envs needs envs in worker "
                                          f"processes: env.backend='{backend}' steps its envs "
                                          f"in this process"):
        load_config("halfcheetah", [f"env.backend={backend}", "env.restart_crashed_envs=true",
                                    "env.vector_id=batchrl.envs.mujoco_batch:make_vector"])


# --- bare words, saved configs, build_config ----------------------------------------------

@pytest.mark.parametrize("text", ["env.id = Hopper-v5 ", "env.id=  Hopper-v5", "env.id=Hopper-v5\t"])
def test_a_bare_word_is_stripped_like_a_toml_value(text):
    """Spaces around a bare-word value are not part of the string."""
    assert parse_override(text) == (["env", "id"], "Hopper-v5")
    assert load_config("cartpole", [text.replace("Hopper-v5", "Acrobot-v1")]).env.id == "Acrobot-v1"


@pytest.mark.parametrize("content", ["[]", "null", '"config"', "3"])
def test_a_saved_config_that_is_not_an_object_is_a_config_error(tmp_path, content):
    """A config.json holding valid JSON that is not an object is a one-line ConfigError."""
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=r"config\.json is not a JSON object; restore the file"):
        load_saved_config(tmp_path)


def test_a_missing_or_invalid_saved_config_is_a_config_error_naming_the_file(tmp_path):
    """No config.json, or one with a bad value: ConfigError naming the file (and the key)."""
    with pytest.raises(ConfigError, match=r"cannot read the saved config .*config\.json"):
        load_saved_config(tmp_path / "nothing-here")
    (tmp_path / "config.json").write_text(json.dumps({"env": {"num_agents": 0}}))
    with pytest.raises(ConfigError) as info:
        load_saved_config(tmp_path)
    assert str(info.value) == (f"the saved config {tmp_path / 'config.json'}: "
                               f"env.num_agents must be >= 1, got 0")


def test_build_config_leaves_its_argument_as_it_was():
    """build_config reads the nested dict without changing it: the same dict builds the same
    config again."""
    values = {"algorithm": {"class": REINFORCE, "learning_rate": 0.005},
              "env": {"num_agents": 4}}
    copy = json.loads(json.dumps(values))
    first = build_config(values)
    assert values == copy
    assert build_config(values) == first
    assert first.algorithm.path == REINFORCE


def test_resolving_an_env_leaves_the_callers_kwargs_alone():
    # A config's env.kwargs serve every batch env built from it (collectors, evaluation).
    kwargs = {"g": 9.0}
    resolve_constructor("Pendulum-v1", kwargs, 50)
    assert kwargs == {"g": 9.0}
    env = resolve_constructor("Pendulum-v1", kwargs, 60)()  # a second env from the same dict
    try:
        assert env.spec.max_episode_steps == 60
    finally:
        env.close()


def test_make_batch_env_keeps_the_env_ranges_when_asked():
    raw = make_batch_env("Pendulum-v1", 1, backend="inline", normalize_ranges=False)
    scaled = make_batch_env("Pendulum-v1", 1, backend="inline")
    try:
        assert raw.action_space.high.tolist() == [2.0]
        assert scaled.action_space.high.tolist() == [1.0]
    finally:
        raw.close()
        scaled.close()


def test_an_env_that_fails_to_build_is_named_by_its_id():
    with pytest.raises(EnvRaisedError, match=r"^batchrl\.testing\.faults:make failed in "
                                             r"construct\(\)"):
        make_batch_env("batchrl.testing.faults:make", 1, kwargs={"env_id": "NoSuchEnv-v0"},
                       backend="inline")


ANNOTATED_MODULE = '''
from typing import Literal

from batchrl.algos import Algorithm


class Annotated(Algorithm):
    def __init__(self, observation_space, action_space, num_agents, device="cpu",
                 layers: list[int] = (64,), optimizer: Literal["adam", "sgd"] = "adam",
                 weights: dict[str, float] | None = None):
        super().__init__(device)
'''


@pytest.mark.parametrize("keys,error", [
    ({"layers": [32, 32], "optimizer": "sgd", "weights": {"a": 1.0}}, None),
    ({"layers": 64}, "algorithm.layers: expected a list of int, got 64"),
    ({"layers": [32, "wide"]}, "algorithm.layers[1]: expected an integer, got 'wide'"),
    ({"optimizer": "rmsprop"}, "algorithm.optimizer must be one of 'adam', 'sgd', got "
                               "'rmsprop'"),
    ({"weights": 3}, "algorithm.weights: expected dict[str, float] | None, got 3"),
])
def test_a_user_algorithms_list_literal_and_dict_annotations_check_its_keys(
        tmp_path, monkeypatch, keys, error):
    (tmp_path / "annotated_algos.py").write_text(ANNOTATED_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "annotated_algos", raising=False)
    values = {"algorithm": {"class": "annotated_algos:Annotated", **keys}}
    if error is None:
        assert build_config(values).algorithm.keys == keys
    else:
        with pytest.raises(ConfigError, match=f"^{re.escape(error)}$"):
            build_config(values)


@pytest.mark.parametrize("source,error", [
    (None, "algorithm.class = 'user_mod:Algo': cannot import module 'user_mod' (No module "
           "named 'user_mod'); it must be importable from the current directory or the "
           "Python path"),
    ("import nonexistent_pkg\n", "algorithm.class = 'user_mod:Algo': importing module "
                                 "'user_mod' failed: ModuleNotFoundError: No module named "
                                 "'nonexistent_pkg' (at {path}:1)"),
    ("x = 1\ndef broken(:\n", "algorithm.class = 'user_mod:Algo': importing module 'user_mod' "
                              "failed: SyntaxError: invalid syntax (at {path}:2)"),
    ("x = 1\ny = undefined_name\n", "algorithm.class = 'user_mod:Algo': importing module "
                                    "'user_mod' failed: NameError: name 'undefined_name' is "
                                    "not defined (at {path}:2)"),
])
def test_a_module_that_fails_to_import_is_a_one_line_error_at_its_line(
        tmp_path, monkeypatch, source, error):
    """A module that is not there is a path problem; one that is there but fails in its own
    code says so, with the error and the line (not importlib's traceback)."""
    path = tmp_path / "user_mod.py"
    if source is not None:
        path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_mod", raising=False)
    with pytest.raises(ConfigError) as raised:
        build_config({"algorithm": {"class": "user_mod:Algo"}})
    assert str(raised.value) == error.format(path=path)


def test_a_name_a_package_lacks_lists_the_algorithms_it_exports():
    """batchrl.algos loads its algorithms on first use: they are listed all the same."""
    with pytest.raises(ConfigError, match=r"^algorithm.class = 'batchrl.algos:A2C': module "
                                          r"batchrl.algos has no name 'A2C'; its algorithms: "
                                          r"BatchPPO, DQN, IMPALA, Reinforce, RolloutAlgorithm, "
                                          r"SAC$"):
        build_config({"algorithm": {"class": "batchrl.algos:A2C"}})
