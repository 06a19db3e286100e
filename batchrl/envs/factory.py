"""Build the trainer's batch env from an env id or an importable constructor."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import gymnasium as gym

from batchrl.envs.batch import BatchEnv
from batchrl.envs.external import ExternalProcess
from batchrl.envs.wrappers import wrap_env


class EnvSpecError(ValueError):
    """The env named in a config cannot be found or built."""


def resolve_constructor(env_id: str, kwargs: dict[str, Any] | None = None
                        ) -> Callable[[], gym.Env]:
    """Return a function that builds the raw env named ``env_id``.

    ``env_id`` is a registered Gymnasium id (``"HalfCheetah-v5"``) or an
    importable ``"package.module:function"`` that returns a ``gymnasium.Env``;
    ``kwargs`` are passed to ``gymnasium.make`` or to the function. Errors are
    raised here, in the parent, as ``EnvSpecError`` with what is valid.
    """
    kwargs = dict(kwargs or {})
    if ":" in env_id:
        module_name, _, attr = env_id.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EnvSpecError(f"env {env_id!r}: cannot import module {module_name!r} "
                               f"({exc}); it must be importable from the current directory "
                               f"or the Python path") from None
        function = getattr(module, attr, None)
        if not callable(function):
            raise EnvSpecError(f"env {env_id!r}: module {module_name!r} has no callable "
                               f"{attr!r}")
        return lambda: function(**kwargs)
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        raise EnvSpecError(f"env {env_id!r}: {exc}. Use a registered Gymnasium id such as "
                           f"'HalfCheetah-v5' or 'package.module:function'") from None
    return lambda: gym.make(env_id, **kwargs)


def make_batch_env(env_id: str, num_envs: int, max_length: int | None = None,
                   kwargs: dict[str, Any] | None = None, external: bool = True,
                   normalize_ranges: bool = True) -> BatchEnv:
    """``num_envs`` wrapped copies of the env, each in a worker process when
    ``external`` (else stepped in this process), as one ``BatchEnv``.

    Wrappers: ``wrap_env`` (time limit ``max_length``, range normalisation
    when ``normalize_ranges``, action clipping, 32-bit floats).
    """
    raw = resolve_constructor(env_id, kwargs)

    def constructor() -> gym.Env:
        return wrap_env(raw(), max_length, normalize_ranges=normalize_ranges)

    if external:
        envs = [ExternalProcess(constructor, label=env_id) for _ in range(num_envs)]
    else:
        envs = [constructor() for _ in range(num_envs)]
    try:
        return BatchEnv(envs)
    except BaseException:
        for env in envs:
            env.close()
        raise
