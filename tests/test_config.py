"""The config schema: configs/*.toml, --set overrides, validation errors, env ids."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from batchrl.config import (CONFIG_DIR, Config, ConfigError, available_configs, build_config,
                            load_config, load_saved_config, parse_override, strip_derived)
from batchrl.envs.errors import EnvSpecError
from batchrl.envs.factory import make_batch_env, resolve_constructor
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer

PPO_KEYS = ("network", "policy_layers", "update_every", "discount", "inference")


# --- the shipped configs ---------------------------------------------------------

def test_configs_dir_holds_the_documented_tasks():
    assert set(available_configs()) >= {"ant", "cartpole", "halfcheetah", "hopper", "humanoid",
                                        "pendulum", "reacher", "walker"}
    assert {f"paper/{name}" for name in ("ant", "halfcheetah", "hopper", "humanoid", "reacher",
                                          "walker")} <= set(available_configs())
    assert available_configs() == sorted(
        p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.toml"))


@pytest.mark.parametrize("name", available_configs())
def test_every_config_loads_validates_and_names_a_known_env(name):
    config = load_config(name)
    assert isinstance(config, Config)
    # BatchPPO's max_length is derived from the episode time limit.
    if config.algorithm.ppo is not None:
        assert config.ppo.max_length == config.env.max_length
    assert config.train.steps >= config.env.num_agents
    # The env id resolves (a registered Gymnasium id; MuJoCo need not be installed).
    assert callable(resolve_constructor(config.env.id, config.env.kwargs))
    # Loading the same file by path gives the same config.
    assert load_config(str(CONFIG_DIR / f"{name}.toml")) == config
    # The resolved config survives the JSON round trip a run's config.json makes.
    values = json.loads(json.dumps(config.to_dict()))
    assert build_config(strip_derived(values)) == config


def test_defaults_of_an_empty_config_file(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("# nothing set\n")
    assert load_config(str(path)) == build_config({}) == Config()


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


def test_unknown_section_lists_the_valid_sections():
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", ["optim.lr=3"])
    message = str(info.value)
    assert "[optim]" in message
    for section in ("env", "train", "ppo"):
        assert section in message


@pytest.mark.parametrize("section, key, sample_valid", [
    ("ppo", "learning_rate", "policy_lr"),
    ("env", "agents", "num_agents"),
    ("train", "step", "eval_every"),
])
def test_unknown_key_is_named_with_the_valid_keys(section, key, sample_valid):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [f"{section}.{key}=1"])
    message = str(info.value)
    assert f"{section}.{key}" in message
    assert sample_valid in message
    if section == "ppo":
        for valid in PPO_KEYS:
            assert valid in message
        # Derived from env.max_length: not offered as a key to set.
        assert "max_length" not in message


def test_unknown_key_in_a_toml_file(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[env]\nid = "CartPole-v1"\nnum_agent = 4\n')
    with pytest.raises(ConfigError, match=r"env\.num_agent\b.*num_agents"):
        load_config(str(path))


def test_a_section_that_is_not_a_table(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("ppo = 3\n")
    with pytest.raises(ConfigError, match=r"\[ppo\] must be a table"):
        load_config(str(path))


# --- types and ranges ---------------------------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("ppo.discount=high", "expected a number"),
    ('ppo.discount="0.9"', "expected a number"),
    ("ppo.discount=true", "expected a number"),
    ("env.num_agents=2.5", "expected an integer"),
    ("train.steps=true", "expected an integer"),
    ("train.steps=1e5", "expected an integer"),
    ("env.share_main=yes", "expected bool"),
    ("env.backend=threads", "env.backend must be one of"),
    ("env.workers=-1", "workers must be >= 0"),
    ("env.id=3", "expected str"),
    ("env.kwargs=[1, 2]", "expected dict"),
    ("env.ray_resources=2", "expected dict"),
    ("env.ray_resources={CPU=-1}", "env.ray_resources must map Ray resource names to "
                                   "amounts >= 0, e.g. {CPU = 1}"),
    ('env.ray_resources={CPU="one"}', "env.ray_resources must map Ray resource names"),
    ("ppo.policy_layers=64", "expected a list of int"),
    ("ppo.policy_layers=[64, 6.5]", "expected an integer"),
    ("ppo.gae_lambda=high", "expected"),
])
def test_wrong_type_names_the_key_and_the_type(override, expected):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    message = str(info.value)
    assert message.startswith(key) or f"{key}[" in message, message
    assert expected in message


@pytest.mark.parametrize("override, expected", [
    ("ppo.discount=1.5", "ppo.discount must be in [0, 1], got 1.5"),
    ("ppo.discount=-0.1", "ppo.discount must be in [0, 1]"),
    ("ppo.gae_lambda=2", "ppo.gae_lambda must be in [0, 1]"),
    ("ppo.policy_lr=0", "ppo.policy_lr must be > 0"),
    ("ppo.update_every=0", "ppo.update_every must be >= 1"),
    ("ppo.network=transformer", "ppo.network must be one of ('feed_forward', 'recurrent')"),
    ("ppo.inference=jit", "ppo.inference must be one of"),
    ("env.num_agents=0", "env.num_agents must be >= 1, got 0"),
    ("env.max_length=-5", "env.max_length must be >= 1"),
    ("train.steps=0", "train.steps must be >= 1"),
    ("train.eval_episodes=-1", "train.eval_episodes must be >= 0"),
    ("train.eval_every=0", "train.eval_every must be >= 1"),
    ("train.device=tpu", "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("train.device=cuda:x", "train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
])
def test_out_of_range_names_the_key_and_what_is_valid(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", [override])
    assert expected in str(info.value)


def test_errors_are_value_errors_for_callers():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(EnvSpecError, ValueError)


# --- override parsing -----------------------------------------------------------------

@pytest.mark.parametrize("text, path, value", [
    ("ppo.policy_lr=3e-4", ["ppo", "policy_lr"], 3e-4),
    ("train.steps=2_000", ["train", "steps"], 2000),
    ("env.share_main=false", ["env", "share_main"], False),
    ("ppo.policy_layers=[64, 64]", ["ppo", "policy_layers"], [64, 64]),
    ('env.id="Hopper-v5"', ["env", "id"], "Hopper-v5"),
    ("env.id=Hopper-v5", ["env", "id"], "Hopper-v5"),               # a bare word
    ("env.id=mypackage.envs:make_env", ["env", "id"], "mypackage.envs:make_env"),
    ("train.device=cuda:1", ["train", "device"], "cuda:1"),
    ("env.kwargs={g = 9.81, render_mode = \"rgb_array\"}", ["env", "kwargs"],
     {"g": 9.81, "render_mode": "rgb_array"}),
    ("  ppo.discount = 0.98  ", ["ppo", "discount"], 0.98),
    ("env.id=a=b", ["env", "id"], "a=b"),                           # split at the first "="
])
def test_parse_override(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["ppo.discount", "discount=0.9", "ppo.adam.lr=1", ".lr=1",
                                  "ppo.=1"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_overrides_are_converted_to_the_schema_types():
    config = load_config("cartpole", [
        "ppo.policy_layers=[64, 64]", "ppo.value_layers=[32]", "ppo.discount=1",
        "env.id=CartPole-v1", "env.num_agents=4", "train.device=cpu", "ppo.gae_lambda=0.95",
        "env.kwargs={sutton_barto_reward = true}"])
    assert config.ppo.policy_layers == (64, 64)           # lists become tuples
    assert config.ppo.value_layers == (32,)
    assert config.ppo.discount == 1.0 and isinstance(config.ppo.discount, float)
    assert config.env.id == "CartPole-v1"
    assert config.env.num_agents == 4
    assert config.train.device == "cpu"
    assert config.ppo.gae_lambda == 0.95
    assert config.env.kwargs == {"sutton_barto_reward": True}
    # Everything else keeps the file's values or the defaults.
    base = load_config("cartpole")
    assert config.env.max_length == base.env.max_length == 500
    assert config.ppo.update_every == base.ppo.update_every
    assert config.train.eval_every == Config().train.eval_every


def test_later_overrides_win():
    config = load_config("cartpole", ["train.seed=1", "train.seed=7"])
    assert config.train.seed == 7


def test_env_max_length_sets_the_ppo_buffer_length():
    config = load_config("pendulum", ["env.max_length=50"])
    assert config.env.max_length == config.ppo.max_length == 50


def test_ppo_max_length_points_to_env_max_length(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("cartpole", ["ppo.max_length=100"])
    assert "ppo.max_length" in str(info.value)
    assert "env.max_length" in str(info.value)
    path = tmp_path / "old.toml"
    path.write_text("[ppo]\nmax_length = 100\n")
    with pytest.raises(ConfigError, match="env.max_length"):
        load_config(str(path))


def test_saved_config_drops_the_derived_max_length(tmp_path):
    config = load_config("pendulum", ["env.max_length=77"])
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert load_saved_config(tmp_path) == config
    extended = load_saved_config(tmp_path, ["train.steps=5000"])
    # A new budget also moves the learning-rate schedule's horizon.
    assert extended.train.steps == extended.ppo.total_steps == 5000


def test_ppo_total_steps_follows_train_steps():
    config = load_config("pendulum", ["train.steps=12345", "ppo.lr_schedule=linear"])
    assert config.ppo.total_steps == 12345 and config.ppo.lr_schedule == "linear"
    with pytest.raises(ConfigError, match=r"ppo.total_steps follows train.steps .* set "
                                          r"train.steps instead"):
        load_config("pendulum", ["ppo.total_steps=100"])
    # Not offered as a key to set.
    with pytest.raises(ConfigError) as info:
        load_config("pendulum", ["ppo.nope=1"])
    assert "total_steps" not in str(info.value) and "lr_schedule" in str(info.value)


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
        "ppo.update_every=2", "ppo.update_epochs=2", "ppo.policy_layers=[16]",
        "ppo.value_layers=[16]", "train.steps=60", "train.eval_episodes=2",
        "train.device=cpu"])
    result = Trainer(config, tmp_path / "run", progress=False).run()
    records = read_metrics(tmp_path / "run")
    assert [r["phase"] for r in records][:2] == ["train", "eval"]
    assert records[-1]["step"] >= 60
    # Every episode of the custom env lasts `length` steps and scores at most 2 per step.
    assert {r["length"] for r in records} == {7.0}
    assert all(0.0 <= r["score"] <= 14.0 for r in records)
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


def test_ray_backend_keys_from_the_command_line():
    config = load_config("halfcheetah", ["env.backend=ray", "env.ray_address=auto",
                                         "env.ray_resources={CPU=1, env_node=0.5}",
                                         "env.restart_crashed_envs=true"])
    assert config.env.backend == "ray" and config.env.ray_address == "auto"
    assert config.env.ray_resources == {"CPU": 1, "env_node": 0.5}
    assert load_config("halfcheetah").env.ray_resources == {"CPU": 1}


def test_algorithm_section_and_its_old_name_ppo_read_the_same(tmp_path):
    new, old = tmp_path / "new.toml", tmp_path / "old.toml"
    new.write_text("[algorithm]\ndiscount = 0.98\nupdate_every = 7\n")
    old.write_text("[ppo]\ndiscount = 0.98\nupdate_every = 7\n")
    assert load_config(str(new)) == load_config(str(old))
    assert load_config(str(new)).ppo.update_every == 7
    # --set ppo.key (as the README's older commands write it) reaches [algorithm].
    assert load_config(str(new), ["ppo.discount=0.9"]).ppo.discount == 0.9
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('[algorithm]\nclass = "batchrl.algos.ppo:BatchPPO"\ndiscount = 0.98\n'
                        'update_every = 7\n')
    assert load_config(str(explicit)) == load_config(str(new))


def test_another_algorithm_keeps_its_keys_and_round_trips(tmp_path):
    config = load_config("cartpole_reinforce", ["algorithm.learning_rate=0.005"])
    assert config.algorithm.path == "batchrl.algos.reinforce:Reinforce"
    assert config.algorithm.kwargs == {"discount": 0.99, "learning_rate": 0.005,
                                       "update_every": 16, "hidden": [64, 64]}
    values = json.loads(json.dumps(config.to_dict()))
    assert build_config(strip_derived(values)) == config
    with pytest.raises(ConfigError, match="trains batchrl.algos.reinforce:Reinforce, not BatchPPO"):
        config.ppo  # noqa: B018
    with pytest.raises(ConfigError, match=r"\[ppo\] holds BatchPPO's keys, but \[algorithm\] "
                                          r"names batchrl.algos.reinforce:Reinforce"):
        load_config("cartpole_reinforce", ["ppo.discount=0.9"])


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
    values = {**dataclasses.asdict(config.algorithm.ppo), **dataclasses.asdict(config.env),
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
