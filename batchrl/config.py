"""Training configuration: one typed schema, TOML files in ``CONFIG_DIR``, overrides.

A config file sets any subset of the schema's keys; the rest keep their defaults.
``--set section.key=value`` values are parsed as TOML (a bare word is a string).
Every value is checked against its type and range; errors name the key and what is valid.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
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

from batchrl.algos.ppo_config import PPOConfig
from batchrl.envs.errors import UnsupportedSpaceError
from batchrl.envs.factory import BACKENDS, import_from
from batchrl.envs.ray.cluster import check_resources


def _config_dir() -> Path:
    """The task configs: in an installed package ``batchrl/configs/`` (the wheel
    puts the repository's top-level ``configs/`` there), in a checkout that
    ``configs/`` itself."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()
CONFIG_FILE = "config.json"  # a run's resolved config, in its log directory


class ConfigError(ValueError):
    """A user error in a configuration: unknown name or key, bad type or value."""


@dataclass
class EnvConfig:
    """Which env to train on and how many copies to step."""

    id: str = "CartPole-v1"       # Gymnasium id, or "package.module:function" returning an env
    kwargs: dict = field(default_factory=dict)  # keyword arguments for gymnasium.make / function
    num_agents: int = 30          # envs stepped in lockstep (the paper's batch of agents)
    max_length: int = 1000        # time limit of an episode, in env steps
    backend: str = "workers"      # "workers", "process" (one per env), "inline" or "ray"
    workers: int = 0              # processes / Ray actors (0: one per usable core / cluster CPU)
    share_main: bool = False      # "workers": the main process steps a share of the envs too
    normalize_ranges: bool = True  # rescale finite Box observation/action ranges to [-1, 1]
    timeout: float = 10.0         # seconds a worker may take for a step or reset (0: no limit)
    restart_crashed_envs: bool = False  # replace a failed worker instead of stopping the run
    max_restarts: int = 10        # with restart_crashed_envs: restarts allowed in the run
    ray_address: str = ""         # "ray": "" private Ray here, "auto" (ray start), "HOST:PORT"
    ray_resources: dict = field(default_factory=lambda: {"CPU": 1})  # "ray": per actor

    def __post_init__(self) -> None:
        _check_range(self, 1, "num_agents", "max_length")
        _check_range(self, 0, "workers", "timeout")
        _check_range(self, 1, "max_restarts")
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
        _check_range(self, 1, "steps")
        _check_range(self, 0, "eval_episodes")
        _check_range(self, 1, "eval_every", "threads", "checkpoint_every", "keep_checkpoints")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                             f"got {self.device!r}")


BATCHPPO = "batchrl.algos.ppo:BatchPPO"
# Set by the trainer, not by an [algorithm] section.
TRAINER_ARGUMENTS = ("observation_space", "action_space", "num_agents", "max_length", "device")


@dataclass
class AlgorithmConfig:
    """The ``[algorithm]`` section: ``path`` ``"package.module:Class"`` of the
    ``Algorithm`` (``""``: BatchPPO, configured by the typed ``ppo``), and
    ``kwargs`` for another class."""

    path: str = ""
    ppo: PPOConfig | None = field(default_factory=PPOConfig)
    kwargs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``"package.module:Class"`` of the algorithm."""
        return self.path or BATCHPPO

    @property
    def cls(self) -> type:
        """The ``Algorithm`` subclass (imported)."""
        return algorithm_class(self.name)

    def to_dict(self) -> dict[str, Any]:
        if self.ppo is not None:
            return dataclasses.asdict(self.ppo)
        return {"class": self.path, **self.kwargs}


@dataclass
class Config:
    """The whole configuration of a training run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)

    def __post_init__(self) -> None:
        # The keys of DERIVED_KEYS follow their sources in every Config.
        if self.algorithm.ppo is not None:
            ppo = dataclasses.replace(self.algorithm.ppo, max_length=self.env.max_length,
                                      total_steps=self.train.steps)
            self.algorithm = dataclasses.replace(self.algorithm, ppo=ppo)

    @property
    def ppo(self) -> PPOConfig:
        """BatchPPO's hyperparameters (``ConfigError`` for another algorithm)."""
        if self.algorithm.ppo is None:
            raise ConfigError(f"this config trains {self.algorithm.path}, not BatchPPO")
        return self.algorithm.ppo

    def to_dict(self) -> dict[str, Any]:
        return {"env": dataclasses.asdict(self.env), "train": dataclasses.asdict(self.train),
                "algorithm": self.algorithm.to_dict()}

    def make_algorithm(self, observation_space: Any, action_space: Any, num_agents: int,
                       device: Any) -> Any:
        """The configured ``Algorithm``: ``Class(observation_space, action_space,
        num_agents, max_length=env.max_length, device=device, **[algorithm] keys)``."""
        cls = self.algorithm.cls
        if self.algorithm.ppo is not None:
            return cls(observation_space, action_space, num_agents, self.algorithm.ppo, device)
        try:
            return cls(observation_space, action_space, num_agents,
                       max_length=self.env.max_length, device=device, **self.algorithm.kwargs)
        except UnsupportedSpaceError:
            raise
        except (TypeError, ValueError) as exc:  # the constructor rejected a value
            raise ConfigError(f"[algorithm] {self.algorithm.path}() rejected its arguments "
                              f"{self.algorithm.kwargs}: {type(exc).__name__}: {exc}") from None


def algorithm_class(path: str) -> type:
    """The ``Algorithm`` subclass named ``"package.module:Class"`` (importable
    from the current directory, as for ``env.id``); ``ConfigError`` otherwise."""
    from batchrl.algos.base import Algorithm
    if not all(path.partition(":")[::2]):
        raise ConfigError(f"algorithm.class must be 'package.module:Class', got {path!r}")
    module_name, name, cls = import_from(path, f"algorithm.class = {path!r}", ConfigError)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        found = "nothing" if cls is None else repr(cls)
        raise ConfigError(f"algorithm.class = {path!r}: {module_name}.{name} must be a "
                          f"subclass of batchrl.algos.Algorithm, found {found}")
    return cls


def _check_arguments(cls: type, path: str, kwargs: dict[str, Any]) -> None:
    """``ConfigError`` unless ``cls``'s constructor takes the trainer's
    arguments and the section's keys."""
    for key in kwargs:
        if key in TRAINER_ARGUMENTS:
            raise ConfigError(f"algorithm.{key} is the trainer's to pass (from "
                              f"{'env.max_length' if key == 'max_length' else 'the env'} "
                              f"and train.device); remove it from [algorithm]")
    signature = inspect.signature(cls)
    parameters = signature.parameters.values()
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    valid = [name for name in named if name not in TRAINER_ARGUMENTS]
    unknown = [key for key in kwargs if key not in named]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ConfigError(f"unknown key algorithm.{unknown[0]}: {path}() takes "
                          f"{', '.join(valid) or 'no keyword arguments'}")
    try:
        signature.bind(None, None, 1, max_length=1, device="cpu", **kwargs)
    except TypeError as exc:
        raise ConfigError(f"[algorithm] does not fit {path}(observation_space, action_space, "
                          f"num_agents, max_length=..., device=..., **keys): {exc}; its "
                          f"keys: {', '.join(valid)}") from None


def _check_range(obj: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


SECTIONS = {"env": EnvConfig, "train": TrainConfig, "algorithm": PPOConfig}
# Keys set from other keys, not by users: key -> (the key it follows, what that is).
DERIVED_KEYS = {"algorithm": {"max_length": ("env.max_length", "the episode time limit"),
                              "total_steps": ("train.steps", "the run's training budget")}}


def strip_derived(values: dict[str, Any]) -> dict[str, Any]:
    """Drop the derived keys from a nested dict (as a run's config.json holds
    them), so that ``build_config`` derives them again; returns ``values``."""
    _rename_ppo(values)
    for section, keys in DERIVED_KEYS.items():
        if isinstance(values.get(section), dict):
            for key in keys:
                values[section].pop(key, None)
    return values


def available_configs() -> list[str]:
    """Names of the config files in ``configs/`` (``halfcheetah``, ``paper/halfcheetah``)."""
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
            if option is not type(None):
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
    expected = {float: "a number", int: "an integer", bool: "bool", str: "str", dict: "dict"}
    if annotation not in expected:
        raise ConfigError(f"{key}: unsupported type {annotation}")  # a schema bug
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is an int, but not a valid value of an int, float, str or dict key.
    if not isinstance(value, annotation) or (isinstance(value, bool) and annotation is not bool):
        raise ConfigError(f"{key}: expected {expected[annotation]}, got {value!r}")
    return value


def _build(section: str, factory: Any, values: dict[str, Any], skip: Any = ()) -> Any:
    hints = typing.get_type_hints(factory)
    fields = {f.name for f in dataclasses.fields(factory)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown key {section}.{unknown[0]}; valid keys of [{section}]: "
                          f"{', '.join(sorted(fields - set(skip)))}")
    converted = {name: _convert(f"{section}.{name}", value, hints[name])
                 for name, value in values.items()}
    try:
        return factory(**converted)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if not message.startswith(f"{section}."):
            message = f"{section}.{message}"
        raise ConfigError(message) from None


def _table(values: dict[str, Any], name: str) -> dict[str, Any]:
    section = values.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{name}] must be a table of keys, got {section!r}")
    return section


def _rename_ppo(values: dict[str, Any]) -> str:
    """Merge ``[ppo]`` (``[algorithm]``'s old name, and what ``--set ppo.key=...``
    writes) into ``[algorithm]``; returns the section name to use in messages."""
    if "ppo" not in values:
        return "algorithm"
    ppo, algorithm = _table(values, "ppo"), _table(values, "algorithm")
    if algorithm.get("class", "") not in ("", BATCHPPO):
        raise ConfigError(f"[ppo] holds BatchPPO's keys, but [algorithm] names "
                          f"{algorithm['class']}: put that class's keys in [algorithm]")
    del values["ppo"]
    values["algorithm"] = {**algorithm, **ppo}
    return "ppo"


def build_config(values: dict[str, Any]) -> Config:
    """Validate a nested dict (as read from TOML) and build a ``Config``.

    ``[algorithm]`` (or ``[ppo]``) names the class in ``class`` (BatchPPO without it);
    its other keys are BatchPPO's typed hyperparameters or, for another class,
    keyword arguments checked against its constructor."""
    values = dict(values)
    label = _rename_ppo(values)
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]; valid sections: "
                          f"{', '.join(SECTIONS)} ([ppo] is read as [algorithm])")
    sections = {name: _build(name, SECTIONS[name], _table(values, name))
                for name in ("env", "train")}
    section = dict(_table(values, "algorithm"))
    path = section.pop("class", "")
    if not isinstance(path, str):
        raise ConfigError(f"algorithm.class must be a string 'package.module:Class', got "
                          f"{path!r}")
    if path in ("", BATCHPPO):
        for key, (source, meaning) in DERIVED_KEYS["algorithm"].items():
            if key in section:
                raise ConfigError(f"{label}.{key} follows {source} ({meaning}); "
                                  f"set {source} instead")
        algorithm = AlgorithmConfig(
            ppo=_build(label, PPOConfig, section, skip=DERIVED_KEYS["algorithm"]))
    else:
        _check_arguments(algorithm_class(path), path, section)
        algorithm = AlgorithmConfig(path=path, ppo=None, kwargs=section)
    return Config(**sections, algorithm=algorithm)


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


def load_config(name_or_path: str, overrides: list[str] = ()) -> Config:
    """Load ``configs/NAME.toml`` (or a path to a .toml file) and apply overrides."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(f"no config named {name_or_path!r}; available: "
                          f"{', '.join(available_configs())} (or a path to a .toml file)")
    try:
        with open(path, "rb") as file:
            values = tomllib.load(file)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return build_config(apply_overrides(values, overrides))


def apply_overrides(values: dict[str, Any], overrides: list[str] = ()) -> dict[str, Any]:
    """Set the ``section.key=value`` overrides in the nested dict ``values``."""
    for text in overrides:
        (section, key), value = parse_override(text)
        if not isinstance(values.setdefault(section, {}), dict):
            raise ConfigError(f"[{section}] must be a table")
        values[section][key] = value
    return values


def save_config(config: Config, logdir: Path) -> None:
    """Write the resolved config as ``config.json``, less the derived keys
    (such as BatchPPO's ``max_length``), which follow their sources when read back."""
    with open(Path(logdir) / CONFIG_FILE, "w") as file:
        json.dump(strip_derived(config.to_dict()), file, indent=2)
        file.write("\n")


def load_saved_config(logdir: Path, overrides: list[str] = ()) -> Config:
    """The config a run in ``logdir`` was started with, with ``section.key=value``
    ``overrides`` applied (``train.py`` only allows ``train.steps`` on resume)."""
    path = Path(logdir) / CONFIG_FILE
    try:
        with open(path) as file:
            values = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the saved config {path}: {exc}; restore the file "
                          f"or start a new run in another --logdir") from None
    if not isinstance(values, dict):
        raise ConfigError(f"the saved config {path} is not a JSON object; restore the file "
                          f"or start a new run in another --logdir")
    try:
        return build_config(apply_overrides(strip_derived(values), overrides))
    except ConfigError as exc:
        raise ConfigError(f"the saved config {path}: {exc}") from None
