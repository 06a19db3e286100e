"""Training configuration: one typed schema, TOML files in ``CONFIG_DIR``, overrides.

A config file sets any subset of the schema's keys; the rest keep their defaults.
``--set section.key=value`` values are parsed as TOML (a bare word is a string).
Every value is checked against its type and range; errors name the key and what is valid.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import inspect
import json
import math
import re
import sys
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from batchrl.algos.impala_config import IMPALAConfig
from batchrl.algos.ppo_config import EVAL_ACTIONS, PRECISIONS, PPOConfig
from batchrl.envs.errors import EnvSpecError
from batchrl.envs.factory import BACKENDS, check_resources, choose_backend, import_from
from batchrl.errors import UnsupportedSpaceError
from batchrl.files import atomic_write
from batchrl.hardware import resolve_precision

TRAIN_PRECISIONS = ("auto", *PRECISIONS)  # train.precision's, "auto" resolved per device


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


class _WrongType(ConfigError):
    """A value whose type the key does not take (another option of a union may)."""


@dataclass
class EnvConfig:
    """Which env to train on and how many copies to step."""

    id: str = "CartPole-v1"       # Gymnasium id, or "package.module:function" returning an env
    kwargs: dict = field(default_factory=dict)  # keyword arguments for gymnasium.make / function
    # Evaluation (and batchrl.evaluate, video) envs: kwargs updated with these; when set, the
    # trainer evaluates on envs of its own (Atari: whole games, raw scores).
    eval_kwargs: dict = field(default_factory=dict)
    num_agents: int = 30          # envs stepped in lockstep (the paper's batch of agents)
    max_length: int = 1000        # time limit of an episode, in env steps
    # "auto" ("native" where it steps env.id, else "workers"), "workers", "process" (one per
    # env), "inline", "ray", "vector", "native" (MuJoCo tasks stepped in batches:
    # batchrl.envs.mujoco_batch)
    backend: str = "auto"
    vector_id: str = ""           # "vector": "package.module:function" building the vector env
    workers: int = 0              # processes / Ray actors (0: one per usable core / cluster CPU)
    share_main: bool = False      # "workers": the main process steps a share of the envs too
    normalize_ranges: bool = True  # rescale finite Box observation/action ranges to [-1, 1]
    timeout: float = 10.0         # seconds a worker may take for a step or reset, and (1-2x) a
    #                               collector's step of envs in its own process (0: no limit)
    restart_crashed_envs: bool = False  # replace a failed worker instead of stopping the run
    max_restarts: int = 10        # with restart_crashed_envs: restarts allowed in the run
    ray_address: str = ""         # "ray": "" private Ray here, "auto" (ray start), "HOST:PORT"
    ray_resources: dict = field(default_factory=lambda: {"CPU": 1})  # "ray": per actor

    @property
    def chosen_backend(self) -> str:
        """The backend the envs step in: ``backend``, with ``"auto"`` resolved
        (``choose_backend``; the worker-only options ask for worker processes)."""
        return choose_backend(self.id, self.backend, self.kwargs,
                              self.restart_crashed_envs or self.share_main)

    def label(self, evaluation: bool = False) -> str:
        """The env as the console names it: ``id`` (``vector_id`` where the vector backend
        trains; evaluations build ``id``), followed by its keyword arguments (with
        ``eval_kwargs`` for ``evaluation``) where it is a ``"package.module:function"``
        factory, whose name alone does not say the task (Atari's ``make`` takes the game)."""
        built = self.vector_id if self.chosen_backend == "vector" and not evaluation else self.id
        kwargs = self.evaluation_kwargs if evaluation else self.kwargs
        if ":" not in built or not kwargs:
            return built
        return f"{built}({', '.join(f'{key}={value!r}' for key, value in kwargs.items())})"

    @property
    def evaluation_kwargs(self) -> dict:
        """The keyword arguments of evaluation envs: ``kwargs`` updated with ``eval_kwargs``."""
        return {**self.kwargs, **self.eval_kwargs}

    def __post_init__(self) -> None:
        _check_range(self, 1, "num_agents", "max_length")
        _check_range(self, 0, "workers", "timeout")
        if not self.timeout < 1e9:  # (inf: the watchdogs' timers overflow; 0 is no limit)
            raise ValueError(f"timeout must be a finite number of seconds below 1e9 (0: no "
                             f"limit), got {self.timeout}")
        _check_range(self, 1, "max_restarts")
        if self.restart_crashed_envs and self.backend == "inline":
            raise ValueError("env.restart_crashed_envs needs envs in worker processes: set "
                             "env.backend to 'workers', 'process' or 'ray', not 'inline'")
        check_resources(self.ray_resources)  # no Ray needed to check them
        if self.backend not in BACKENDS:
            raise ValueError(f"env.backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.backend == "vector" and not self.vector_id:
            raise ValueError("env.backend='vector' needs env.vector_id, the function building "
                             "the vector env ('package.module:function')")
        if self.backend in ("vector", "native") and self.restart_crashed_envs:
            raise ValueError(f"env.restart_crashed_envs needs envs in worker processes: "
                             f"env.backend={self.backend!r} steps its envs in this process")


@dataclass
class TrainConfig:
    """The training loop: budget, evaluation, seeds, device and checkpoints."""

    steps: int = 1_000_000        # env steps of training (evaluation steps not counted)
    eval_episodes: int = 30       # mean-action episodes per evaluation phase (0: never)
    eval_every: int = 1           # training phases between evaluations (see phase_steps)
    # Env steps of a training phase for an algorithm that names no update length (neither
    # episodes_per_phase nor steps_per_update); 0: max(50,000, 10 x eval_episodes x
    # env.max_length), so that evaluations cost at most about a tenth of the run.
    phase_steps: int = 0
    seed: int = 0
    device: str = "auto"          # "auto" (CUDA when available), "cpu", "cuda", "cuda:1"...
    threads: int = 1              # torch intra-op threads of the learner
    overlap: bool = True          # store a step's experience while the workers step the next
    checkpoint_every: int = 1     # evaluation phases between checkpoints
    keep_checkpoints: int = 3     # newest checkpoint files kept
    # Collector processes (Ray actors with env.ray_address) that step the envs while the
    # learner learns; env.num_agents is split over them. 0: the synchronous loop.
    collectors: int = 0
    # Learner processes, each stepping env.num_agents / learners envs with a full copy of the
    # algorithm; gradients are averaged over them after every backward pass. 1: one process.
    learners: int = 1
    # On a Ray cluster: what each learner but the first (the launching process) reserves.
    learner_resources: dict = field(default_factory=lambda: {"CPU": 1})
    # DD-PPO's preemption with several learners: once this fraction of them collected their
    # whole rollout, the others cut theirs short and all update. 0: off (runs reproducible).
    preemption_threshold: float = 0.0
    max_policy_lag: int | None = None  # collectors wait rather than exceed it ("none": no limit)
    queue_size: int = 2           # finished rollouts per collector that may wait for the learner
    # "bfloat16": the algorithm's networks compute in bfloat16 (pays on CPUs with AVX-512 BF16
    # or AMX, CUDA GPUs of compute capability 8.0+), for algorithms that take a precision
    # argument (BatchPPO, SAC); "auto": bfloat16 where the device computes it in hardware,
    # else float32 (batchrl.hardware).
    precision: str = "float32"
    # "sample": evaluations act with sampled actions rather than the mean (most likely) ones, as
    # the Atari papers report; for algorithms that take an eval_actions argument (all shipped).
    eval_actions: str = "mean"

    def __post_init__(self) -> None:
        _check_range(self, 1, "steps")
        _check_range(self, 0, "eval_episodes", "phase_steps", "collectors", "queue_size")
        if not 0 <= self.seed < 2**32:  # (numpy's and Gymnasium's seeds)
            raise ValueError(f"train.seed must be in [0, 2**32), got {self.seed}")
        if self.max_policy_lag is not None and self.max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0 (0: every rollout is learned by the "
                             f"weights that collected it) or 'none' (no limit), got "
                             f"{self.max_policy_lag}")
        _check_range(self, 1, "eval_every", "threads", "checkpoint_every", "keep_checkpoints",
                     "learners")
        if not 0 <= self.preemption_threshold < 1:
            raise ValueError(f"train.preemption_threshold must be in [0, 1) (the fraction of "
                             f"learners whose finished rollouts cut the others'; 0: off), got "
                             f"{self.preemption_threshold}")
        if self.precision not in TRAIN_PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(TRAIN_PRECISIONS)}, got "
                             f"{self.precision!r}")
        try:
            check_resources(self.learner_resources)
        except EnvSpecError as exc:  # (its message names env.ray_resources' rule)
            raise ValueError("train.learner_resources"
                             + str(exc).removeprefix("ray_resources")) from None
        if not any(amount > 0 for amount in {"CPU": 1, **self.learner_resources}.values()):
            raise ValueError(f"train.learner_resources must reserve some amount of a resource "
                             f"for each learner (Ray places learners in bundles, which cannot "
                             f"be empty), e.g. {{CPU = 1}}; got {self.learner_resources!r}")
        if self.eval_actions not in EVAL_ACTIONS:
            raise ValueError(f"train.eval_actions must be one of {', '.join(EVAL_ACTIONS)}, got "
                             f"{self.eval_actions!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                             f"got {self.device!r}")


BATCHPPO = "batchrl.algos.ppo:BatchPPO"
IMPALA = "batchrl.algos.impala:IMPALA"
SHIPPED_ALGORITHMS = (BATCHPPO, "batchrl.algos.reinforce:Reinforce", IMPALA)
# What the trainer tells every algorithm about the run, as keyword arguments its constructor
# takes by these names: the episode time limit, the training budget, the device and the
# precision of updates and what evaluations act with (these two passed only to a constructor
# that names them: an algorithm that cannot honour them must not take them silently through
# **kwargs).
RUN_FACTS = ("max_length", "total_steps", "device", "precision", "eval_actions")
# And their neutral values, the first the one to use instead ("auto" precision asks for
# bfloat16 only where an algorithm takes it).
_NAMED_ONLY = {"precision": ("float32", "auto"), "eval_actions": ("mean",)}
# Set by the trainer, not by an [algorithm] section: the positional arguments and the run facts.
TRAINER_ARGUMENTS = ("observation_space", "action_space", "num_agents", *RUN_FACTS)
_FACT_SOURCES = {"max_length": "env.max_length", "total_steps": "train.steps",
                 "device": "train.device", "precision": "train.precision",
                 "eval_actions": "train.eval_actions"}
# Hyperparameter classes of shipped algorithms, known without importing the algorithm (and so
# torch): train.py checks a config before it loads torch. Other classes may name theirs in a
# ``config_class`` attribute; without one, their constructor's signature is the schema.
_CONFIG_CLASSES = {BATCHPPO: PPOConfig, IMPALA: IMPALAConfig}


@dataclass
class AlgorithmConfig:
    """The ``[algorithm]`` section: ``path``, the ``"package.module:Class"`` of the
    ``Algorithm``, and ``keys``, its checked keyword arguments (for a class with a
    ``config_class``, all of that class's fields, defaults filled in)."""

    path: str = BATCHPPO
    keys: dict | None = None  # None: the defaults of a shipped class's config_class, else {}

    def __post_init__(self) -> None:
        if self.keys is None:
            schema = _CONFIG_CLASSES.get(self.path)
            self.keys = dataclasses.asdict(schema()) if schema is not None else {}

    @property
    def name(self) -> str:
        """``"package.module:Class"`` of the algorithm."""
        return self.path

    @property
    def cls(self) -> type:
        """The ``Algorithm`` subclass (imported)."""
        return algorithm_class(self.path)

    def to_dict(self) -> dict[str, Any]:
        """The ``[algorithm]`` table: ``class`` and the keys given."""
        return {"class": self.path, **self.keys}


@dataclass
class Config:
    """The whole configuration of a training run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as the TOML tables it was built from (``build_config`` inverts it)."""
        return {"env": dataclasses.asdict(self.env), "train": dataclasses.asdict(self.train),
                "algorithm": self.algorithm.to_dict()}

    def run_facts(self, device: Any) -> dict[str, Any]:
        """What the trainer passes every algorithm besides spaces and agent count:
        ``max_length`` (``env.max_length``), ``total_steps`` (``train.steps``), ``device``,
        ``precision`` (``train.precision``, ``"auto"`` resolved for ``device``),
        ``eval_actions`` (``train.eval_actions``)."""
        return {"max_length": self.env.max_length, "total_steps": self.train.steps,
                "device": device,
                "precision": resolve_precision(self.train.precision, device),
                "eval_actions": self.train.eval_actions}

    def algorithm_run_facts(self, device: Any) -> dict[str, Any]:
        """The run facts (``run_facts``) the configured algorithm's constructor takes: by
        name, or the first three (``RUN_FACTS``) through ``**kwargs``; ``ConfigError`` for a
        precision or evaluation mode other than the neutral one that it does not take."""
        parameters = inspect.signature(self.algorithm.cls).parameters
        open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        facts = {name: value for name, value in self.run_facts(device).items()
                 if name in parameters or (open_ended and name not in _NAMED_ONLY)}
        for name, neutral in _NAMED_ONLY.items():
            if name not in facts and getattr(self.train, name) not in neutral:
                raise ConfigError(f"train.{name}={getattr(self.train, name)!r} needs an "
                                  f"algorithm whose constructor takes {name}; "
                                  f"{self.algorithm.path} does not: use "
                                  f"train.{name}={neutral[0]!r}")
        return facts

    def make_algorithm(self, observation_space: Any, action_space: Any, num_agents: int,
                       device: Any) -> Any:
        """The configured ``Algorithm``: ``Class(observation_space, action_space, num_agents,
        **run facts it takes, **[algorithm] keys)`` (``algorithm_run_facts``)."""
        cls = self.algorithm.cls
        facts = self.algorithm_run_facts(device)
        try:
            return cls(observation_space, action_space, num_agents, **facts,
                       **self.algorithm.keys)
        except UnsupportedSpaceError:
            raise
        except (TypeError, ValueError) as exc:  # the constructor rejected a value
            raise ConfigError(f"[algorithm] {self.algorithm.path}(): {exc} "
                              f"({type(exc).__name__} at {_raised_at(exc, cls)}; the config's "
                              f"arguments: {self.algorithm.keys})") from None


def _raised_at(exc: BaseException, cls: type) -> str:
    """``file:line`` where ``exc`` was raised: the innermost frame in ``cls``'s own module (a
    bug in a user's constructor is then found at once), else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    try:
        own = inspect.getsourcefile(cls)
    except TypeError:  # (a class without a source file)
        own = None
    frame = next((f for f in reversed(frames) if f.filename == own), frames[-1])
    return f"{frame.filename}:{frame.lineno}"


def algorithm_class(path: str) -> type:
    """The ``Algorithm`` subclass named ``"package.module:Class"`` (importable
    from the current directory, as for ``env.id``); ``ConfigError`` otherwise."""
    from batchrl.algos.base import Algorithm
    if not isinstance(path, str) or not all(path.partition(":")[::2]):
        raise ConfigError(f"algorithm.class must be 'package.module:Class', got {path!r}")
    module_name, name, cls = import_from(path, f"algorithm.class = {path!r}", ConfigError)
    if isinstance(cls, type) and issubclass(cls, Algorithm):
        return cls
    module = sys.modules[module_name]
    # Its public names where it declares them (a package's, loaded on first use too), else
    # the classes it defines itself.
    exported = getattr(module, "__all__", None)
    names = exported if exported is not None else [
        key for key, value in vars(module).items()
        if getattr(value, "__module__", None) == module_name]
    found = sorted(key for key in names
                   if isinstance(value := getattr(module, key, None), type)
                   and issubclass(value, Algorithm) and value is not Algorithm)
    listed = (f"its algorithms: {', '.join(found)}" if found else
              "it defines no subclass of batchrl.algos.Algorithm")
    if cls is None:
        raise ConfigError(f"algorithm.class = {path!r}: module {module_name} has no name "
                          f"{name!r}; {listed}")
    what = "a class" if isinstance(cls, type) else f"a {type(cls).__name__}"
    raise ConfigError(f"algorithm.class = {path!r}: {module_name}.{name} is {what}, not a "
                      f"subclass of batchrl.algos.Algorithm; {listed}")


def config_class(path: str) -> Any:
    """The dataclass of the hyperparameters of the algorithm at ``path``, or ``None`` when
    its constructor's keyword arguments are its schema (imports the class unless shipped)."""
    if path in _CONFIG_CLASSES:
        return _CONFIG_CLASSES[path]
    return getattr(algorithm_class(path), "config_class", None)


def algorithm_keys(path: str) -> dict[str, Any]:
    """The keys ``[algorithm]`` may set for the class at ``path``, with their defaults
    (``inspect.Parameter.empty`` for a required one)."""
    schema = config_class(path)
    if schema is not None:
        defaults = schema()
        return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(schema)
                if f.name not in TRAINER_ARGUMENTS}
    parameters = inspect.signature(algorithm_class(path)).parameters.values()
    return {p.name: p.default for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in TRAINER_ARGUMENTS}


def _algorithm_keys(path: str, section: dict[str, Any]) -> dict[str, Any]:
    """The checked keyword arguments of ``[algorithm]`` for the class at ``path``:
    converted to the annotated types, ``ConfigError`` naming the first bad key."""
    for key in section:
        if key in TRAINER_ARGUMENTS:
            source = _FACT_SOURCES.get(key, "the env")
            raise ConfigError(f"algorithm.{key} is the trainer's to pass (from {source}); "
                              f"remove it from [algorithm]" + (
                                  f" and set {source} instead" if key in _FACT_SOURCES else ""))
    schema = config_class(path)
    if schema is not None:
        return dataclasses.asdict(_build("algorithm", schema, section, path=path))
    cls = algorithm_class(path)
    signature = inspect.signature(cls)
    parameters = signature.parameters.values()
    valid = list(algorithm_keys(path))
    unknown = [key for key in section if key not in valid]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ConfigError(_unknown_keys(path, unknown, valid))
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations that do not evaluate here: take the values as they are
        hints = {}
    keys = {key: _convert(f"algorithm.{key}", value, hints[key])
            if _checkable(hints.get(key)) else value for key, value in section.items()}
    try:
        signature.bind(None, None, 1, **{name: None for name in RUN_FACTS
                                         if name in signature.parameters}, **keys)
    except TypeError as exc:
        raise ConfigError(f"[algorithm] does not fit {path}(observation_space, action_space, "
                          f"num_agents, **keys): {exc}; its keys: {', '.join(valid)}") from None
    return keys


def _unknown_keys(path: str, unknown: list[str], valid: list[str]) -> str:
    names = ", ".join(f"algorithm.{key}" for key in unknown)
    return (f"{path.rpartition(':')[2]} ({path}) does not take {names}; its keys: "
            f"{', '.join(valid) or 'none'}")


def _checkable(annotation: Any) -> bool:
    """Whether ``_convert`` can check a value against ``annotation``."""
    if annotation is None:
        return False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(option is type(None) or _checkable(option)
                   for option in typing.get_args(annotation))
    if origin in (tuple, list, typing.Sequence, collections.abc.Sequence):
        args = typing.get_args(annotation)
        return bool(args) and _checkable(args[0])
    if origin is typing.Literal:
        return all(type(choice) in (float, int, bool, str) for choice in
                   typing.get_args(annotation))
    return origin is dict or annotation in (float, int, bool, str, dict)


def _check_range(obj: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value >= minimum:  # (also NaN, which no comparison holds for)
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


SECTIONS = {"env": EnvConfig, "train": TrainConfig}
# Keys earlier versions saved in a run's config.json: read (and dropped) only to resume such runs.
_OLD_SAVED_KEYS = {"algorithm": ("max_length", "total_steps")}


def _upgrade_saved(values: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config as earlier versions wrote it, in today's form: BatchPPO's keys
    were saved as ``[ppo]`` or as ``[algorithm]`` without ``class``, with the keys that followed
    ``env.max_length`` and ``train.steps``."""
    if "ppo" in values:
        values["algorithm"] = {**_table(values, "ppo"), **_table(values, "algorithm")}
        del values["ppo"]
    algorithm = values.get("algorithm")
    if isinstance(algorithm, dict):
        algorithm.setdefault("class", BATCHPPO)
        if algorithm["class"] in ("", BATCHPPO):
            algorithm["class"] = BATCHPPO
            for key in _OLD_SAVED_KEYS["algorithm"]:
                algorithm.pop(key, None)
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
        if type(None) in options and (value is None or (isinstance(value, str)
                                                        and value.lower() == "none")):
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _convert(key, value, option)
                except _WrongType:
                    pass  # (an option whose type fits but whose check fails: its message)
        raise _WrongType(f"{key}: expected {_type_name(annotation)}, got {value!r}")
    if origin in (tuple, list, collections.abc.Sequence):
        item_type = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise _WrongType(f"{key}: expected a list of {_type_name(item_type)}, got {value!r}")
        items = [_convert(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        if not any(type(value) is type(choice) and value == choice for choice in choices):
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got "
                              f"{value!r}")
        return value
    if origin is dict:  # (dict[str, float]: the keys and values are the class's to check)
        annotation = dict
    expected = {float: "a number", int: "an integer", bool: "bool", str: "str", dict: "dict"}
    if annotation not in expected:
        raise ConfigError(f"{key}: unsupported type {annotation}")  # a schema bug
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if annotation is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e6 steps
    # bool is an int, but not a valid value of an int, float, str or dict key.
    if not isinstance(value, annotation) or (isinstance(value, bool) and annotation is not bool):
        raise _WrongType(f"{key}: expected {expected[annotation]}, got {value!r}")
    if annotation is float and not math.isfinite(value):  # (a run would train on NaNs)
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if annotation is int and not -2**63 <= value < 2**63:  # (counters and seeds are int64)
        raise ConfigError(f"{key}: {value:.3g} is out of range; integers must fit in 64 bits "
                          f"(at most {2**63 - 1:,})")
    return value


def _build(section: str, factory: Any, values: dict[str, Any], path: str = "") -> Any:
    """``factory(**values)`` with each value checked against the field's type; ``path``
    names the algorithm whose hyperparameters ``factory`` holds (for messages)."""
    hints = typing.get_type_hints(factory)
    fields = [f.name for f in dataclasses.fields(factory)]
    unknown = [key for key in values if key not in fields]
    if unknown:
        if path:
            raise ConfigError(_unknown_keys(path, unknown, fields))
        raise ConfigError(f"unknown key {section}.{unknown[0]}; valid keys of [{section}]: "
                          f"{', '.join(sorted(fields))}")
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


def build_config(values: dict[str, Any]) -> Config:
    """Validate a nested dict (as read from TOML) and build a ``Config``.

    ``[algorithm]`` names the class in ``class`` (BatchPPO without it); its other keys are
    that class's: the fields of its hyperparameter class (``config_class``, such as BatchPPO's
    ``PPOConfig``), or else its constructor's keyword arguments, checked against the
    signature and converted to their annotated types."""
    values = dict(values)
    unknown = sorted(set(values) - {*SECTIONS, "algorithm"})
    if unknown:
        hint = " (BatchPPO's keys go in [algorithm])" if unknown[0] == "ppo" else ""
        raise ConfigError(f"unknown section [{unknown[0]}]; valid sections: "
                          f"{', '.join([*SECTIONS, 'algorithm'])}{hint}")
    sections = {name: _build(name, factory, _table(values, name))
                for name, factory in SECTIONS.items()}
    section = dict(_table(values, "algorithm"))
    path = section.pop("class", "") or BATCHPPO
    if not isinstance(path, str):
        raise ConfigError(f"algorithm.class must be a string 'package.module:Class', got "
                          f"{path!r}")
    algorithm = AlgorithmConfig(path=path, keys=_algorithm_keys(path, section))
    env, train = sections["env"], sections["train"]
    if env.ray_address and env.backend != "ray" and not train.collectors and train.learners == 1:
        raise ConfigError(f"env.ray_address = {env.ray_address!r} but nothing in this run uses "
                          f"Ray: it is the cluster of env.backend = 'ray', of train.collectors "
                          f"and of train.learners > 1; set one of them, or leave "
                          f"env.ray_address empty")
    return Config(**sections, algorithm=algorithm)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value``; the value is TOML, or a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set needs section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set key must be section.key (e.g. algorithm.discount), or "
                          f"section.table.key for a key of a table (env.kwargs.env_id), got "
                          f"{key!r}")
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
        if path.suffix == ".toml" and path == Path(name_or_path):
            raise ConfigError(f"config file {name_or_path} not found (a path is relative to "
                              f"the current directory, {Path.cwd()}); or name a shipped "
                              f"config: {', '.join(available_configs())}")
        raise ConfigError(f"no config named {name_or_path!r}; available: "
                          f"{', '.join(available_configs())} (or a path to a .toml file)")
    try:
        with open(path, "rb") as file:
            values = tomllib.load(file)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # (TOML is UTF-8)
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config {path}: {exc.strerror or exc}") from None
    return build_config(apply_overrides(values, overrides))


def apply_overrides(values: dict[str, Any], overrides: list[str] = ()) -> dict[str, Any]:
    """Set the ``section.key=value`` overrides in the nested dict ``values``; a longer path
    (``env.kwargs.env_id=...``) sets one key of a table and keeps its others."""
    for text in overrides:
        path, value = parse_override(text)
        table = values
        for depth, name in enumerate(path[:-1]):
            if not isinstance(table.setdefault(name, {}), dict):
                raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[:depth + 1])} is "
                                  f"not a table")
            table = table[name]
        table[path[-1]] = value
    return values


def save_config(config: Config, logdir: Path) -> None:
    """Write the resolved config as ``config.json``."""
    with atomic_write(Path(logdir) / CONFIG_FILE) as file:
        json.dump(config.to_dict(), file, indent=2)
        file.write("\n")


def load_saved_config(logdir: Path, overrides: list[str] = ()) -> Config:
    """The config a run in ``logdir`` was started with, with ``section.key=value``
    ``overrides`` applied (on resume ``train.py`` allows only the keys of where a run goes
    on: ``train.device``, ``train.threads``, ``env.workers``, ``env.timeout``; its
    budget changes with ``--steps``)."""
    path = Path(logdir) / CONFIG_FILE
    try:
        with open(path) as file:
            values = json.load(file)
    except (OSError, ValueError) as exc:  # (ValueError: not JSON, or not UTF-8)
        raise ConfigError(f"cannot read the saved config {path}: {exc}; restore the file "
                          f"or start a new run in another --logdir") from None
    if not isinstance(values, dict):
        raise ConfigError(f"the saved config {path} is not a JSON object; restore the file "
                          f"or start a new run in another --logdir")
    upgraded = _upgrade_saved(values)
    try:
        saved = build_config(copy.deepcopy(upgraded))
    except ConfigError as exc:
        raise ConfigError(f"the saved config {path}: {exc}") from None
    # (an override's error is the override's, not the saved file's)
    return build_config(apply_overrides(upgraded, overrides)) if overrides else saved
