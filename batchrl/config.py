"""Training configuration: one typed schema, TOML files in ``configs/``, overrides.

A config file sets any subset of the schema's keys; everything else keeps its
default. ``--set section.key=value`` overrides are parsed as TOML values
(``ppo.policy_layers=[64,64]``, ``env.id="Hopper-v5"``; a bare word is taken
as a string). Every value is checked against its declared type and range, and
errors name the key and what is valid.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from batchrl.algos.ppo import PPOConfig
from batchrl.envs.factory import BACKENDS
from batchrl.envs.ray.cluster import check_resources

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A user error in a configuration: unknown name or key, bad type or value."""


@dataclass
class EnvConfig:
    """Which env to train on and how many copies to step."""

    id: str = "CartPole-v1"       # Gymnasium id, or "package.module:function" returning an env
    kwargs: dict = field(default_factory=dict)  # keyword arguments for gymnasium.make / the function
    num_agents: int = 30          # envs stepped in lockstep (the paper's batch of agents)
    max_length: int = 1000        # time limit of an episode, in env steps
    backend: str = "workers"      # "workers" (processes, shared memory), "process" (one per env), "inline", "ray"
    workers: int = 0              # processes of "workers" (0: one per usable core) / actors of "ray" (0: cluster CPUs)
    share_main: bool = True       # "workers": the main process steps a share of the envs too
    normalize_ranges: bool = True  # rescale finite Box observation/action ranges to [-1, 1]
    timeout: float = 10.0         # seconds a worker may take for a step or reset (0: no limit)
    restart_crashed_envs: bool = False  # replace a failed worker instead of stopping the run
    max_restarts: int = 10        # with restart_crashed_envs: restarts allowed in the run
    ray_address: str = ""         # "ray": "" private Ray on this machine, "auto" (ray start here), "HOST:PORT"
    ray_resources: dict = field(default_factory=lambda: {"CPU": 1})  # "ray": resources per actor

    def __post_init__(self) -> None:
        _check_range(self, "num_agents", 1)
        _check_range(self, "max_length", 1)
        _check_range(self, "workers", 0)
        _check_range(self, "timeout", 0)
        _check_range(self, "max_restarts", 1)
        if self.restart_crashed_envs and self.backend == "inline":
            raise ValueError("env.restart_crashed_envs needs envs in worker processes: set "
                             "env.backend to 'workers', 'process' or 'ray', not 'inline'")
        check_resources(self.ray_resources)  # no Ray needed to check them
        if self.backend not in BACKENDS:
            raise ValueError(f"env.backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")


@dataclass
class TrainConfig:
    """The training loop: budget, evaluation, seeds, device and checkpoints."""

    steps: int = 1_000_000        # env steps of training (evaluation steps not counted)
    eval_episodes: int = 30       # mean-action episodes per evaluation phase (0: never)
    eval_every: int = 1           # updates between evaluations
    seed: int = 0
    device: str = "auto"          # "auto" (CUDA when available), "cpu", "cuda", "cuda:1"...
    threads: int = 1              # torch intra-op threads of the learner
    overlap: bool = True          # store a step's experience while the workers step the next
    checkpoint_every: int = 1     # evaluation phases between checkpoints
    keep_checkpoints: int = 3     # newest checkpoint files kept

    def __post_init__(self) -> None:
        _check_range(self, "steps", 1)
        _check_range(self, "eval_episodes", 0)
        for name in ("eval_every", "threads", "checkpoint_every", "keep_checkpoints"):
            _check_range(self, name, 1)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                             f"got {self.device!r}")


@dataclass
class Config:
    """The whole configuration of a training run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)

    def __post_init__(self) -> None:
        # The keys of DERIVED_KEYS follow their sources in every Config.
        self.ppo = dataclasses.replace(self.ppo, max_length=self.env.max_length,
                                       total_steps=self.train.steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_range(obj: Any, name: str, minimum: int) -> None:
    value = getattr(obj, name)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
# Keys set from other keys, not by users: key -> (the key it follows, what that is).
DERIVED_KEYS = {"ppo": {"max_length": ("env.max_length", "the episode time limit"),
                        "total_steps": ("train.steps", "the run's training budget")}}


def strip_derived(values: dict[str, Any]) -> dict[str, Any]:
    """Drop the derived keys from a nested dict (as a run's config.json holds
    them), so that ``build_config`` derives them again; returns ``values``."""
    for section, keys in DERIVED_KEYS.items():
        if isinstance(values.get(section), dict):
            for key in keys:
                values[section].pop(key, None)
    return values


def available_configs() -> list[str]:
    """Names of the config files in ``configs/``: ``halfcheetah``, and
    ``paper/halfcheetah`` for one in a subdirectory."""
    return sorted(path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
                  for path in CONFIG_DIR.rglob("*.toml"))


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _convert(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's type annotation; return it converted
    (lists to tuples, ints to floats) or raise ``ConfigError``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        # TOML has no null: the string "none" stands for None in optional keys.
        if type(None) in options and (value is None or value == "none"):
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {value!r}")
    if origin is tuple:
        item_type = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {_type_name(item_type)}, got {value!r}")
        return tuple(_convert(f"{key}[{i}]", item, item_type) for i, item in enumerate(value))
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation in (bool, str, dict):
        if not isinstance(value, annotation):
            raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {annotation}")  # a schema bug


def _build(section: str, factory: Any, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(factory)
    fields = {f.name for f in dataclasses.fields(factory)}
    unknown = sorted(set(values) - fields)
    if unknown:
        valid = sorted(fields - set(DERIVED_KEYS.get(section, {})))
        raise ConfigError(f"unknown key {section}.{unknown[0]}; valid keys of [{section}]: "
                          f"{', '.join(valid)}")
    converted = {name: _convert(f"{section}.{name}", value, hints[name])
                 for name, value in values.items()}
    try:
        return factory(**converted)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not message.startswith(f"{section}."):
            message = f"{section}.{message}"
        raise ConfigError(message) from None


def build_config(values: dict[str, Any]) -> Config:
    """Validate a nested dict (as read from TOML) and build a ``Config``."""
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]; valid sections: "
                          f"{', '.join(SECTIONS)}")
    for section, keys in DERIVED_KEYS.items():
        for key, (source, meaning) in keys.items():
            if isinstance(values.get(section), dict) and key in values[section]:
                raise ConfigError(f"{section}.{key} follows {source} ({meaning}); "
                                  f"set {source} instead")
    sections = {}
    for name, factory in SECTIONS.items():
        section = values.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {section!r}")
        sections[name] = _build(name, factory, section)
    return Config(**sections)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value``; the value is TOML, or a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set needs section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"--set key must be section.key (e.g. ppo.discount), got {key!r}")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_config(name_or_path: str, overrides: list[str] = ()) -> Config:
    """Load ``configs/NAME.toml`` (or a path to a .toml file) and apply overrides."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(f"no config named {name_or_path!r}; available: "
                          f"{', '.join(available_configs())} (or a path to a .toml file)")
    return build_config(apply_overrides(read_toml(path), overrides))


def apply_overrides(values: dict[str, Any], overrides: list[str] = ()) -> dict[str, Any]:
    """Set the ``section.key=value`` overrides in the nested dict ``values``."""
    for text in overrides:
        (section, key), value = parse_override(text)
        values.setdefault(section, {})
        if not isinstance(values[section], dict):
            raise ConfigError(f"[{section}] must be a table")
        values[section][key] = value
    return values
