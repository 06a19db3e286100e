"""Build the trainer's batch env from an env id or an importable constructor."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import traceback
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np

from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import EnvRaisedError, EnvSpecError
from batchrl.envs.mujoco_batch import TASKS as NATIVE_TASKS
from batchrl.envs.mujoco_batch import MODEL_ARGUMENTS, steps_natively, task_arguments
from batchrl.envs.process.external import ExternalProcess
from batchrl.envs.process.shared_memory import EnvWorker
from batchrl.envs.ray.cluster import check_resources
from batchrl.envs.vectorized import VectorWorker
from batchrl.envs.wrappers import TimeLimit, check_time_limit, wrap_env
from batchrl.hardware import pinnable_cores, usable_cores


def import_from(path: str, what: str, error: type[Exception]) -> tuple[str, str, Any]:
    """``(module name, name, the module's attribute or None)`` for ``path``
    ``"package.module:name"``; ``error`` (its message starting with ``what``) when the
    module cannot be imported from the current directory or the Python path."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name
                                    or module_name.startswith(f"{exc.name}.")):
            raise error(_failed_import(what, module_name, exc)) from None
        raise error(f"{what}: cannot import module {module_name!r} ({exc}); it must be "
                    f"importable from the current directory or the Python path") from None
    except Exception as exc:  # (the module's own code failed: its error and line)
        raise error(_failed_import(what, module_name, exc)) from None
    return module_name, name, getattr(module, name, None)


def _failed_import(what: str, module_name: str, exc: Exception) -> str:
    """The one line saying that importing ``module_name`` raised ``exc`` in its own code."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [frame for frame in frames if "importlib" not in frame.filename]
    where = (f"{exc.filename}:{exc.lineno}" if isinstance(exc, SyntaxError)
             else f"{user[-1].filename}:{user[-1].lineno}" if user else "")
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return (f"{what}: importing module {module_name!r} failed: {type(exc).__name__}: "
            f"{message}" + (f" (at {where})" if where else ""))


def resolve_constructor(env_id: str, kwargs: dict[str, Any] | None = None,
                        max_episode_steps: int | None = None) -> Callable[[], gym.Env]:
    """A function that builds the raw env named ``env_id``, a registered
    Gymnasium id (``"HalfCheetah-v5"``) or an importable
    ``"package.module:function"`` returning a ``gymnasium.Env``, with
    ``kwargs``. Errors are raised here, in the parent, as ``EnvSpecError``.

    ``max_episode_steps`` is the env's time limit: it replaces a registered
    id's own (a second ``TimeLimit`` would let a shorter registered limit
    still end episodes); a function's env gets a ``TimeLimit``.
    """
    kwargs = dict(kwargs or {})
    if max_episode_steps is not None:
        check_time_limit(max_episode_steps)
    if ":" in env_id:
        module_name, attr, function = import_from(env_id, f"env {env_id!r}", EnvSpecError)
        if not callable(function):
            raise EnvSpecError(f"env {env_id!r}: module {module_name!r} has no callable "
                               f"{attr!r}")

        def build() -> gym.Env:
            env = function(**kwargs)
            # Named here: later it would be an AttributeError deep in a worker's wrapper.
            if not isinstance(env, gym.Env):
                raise EnvSpecError(f"env {env_id!r}: {module_name}.{attr}() returned "
                                   f"{type(env).__name__} {env!r:.80}, not a gymnasium.Env")
            return env if max_episode_steps is None else TimeLimit(env, max_episode_steps)

        return build
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        # (Gymnasium's messages may end with their own full stop, or a '?')
        message = str(exc).rstrip(".")
        raise EnvSpecError(f"env {env_id!r}: {message}{'' if message.endswith('?') else '.'} "
                           f"Use a registered Gymnasium id such as 'HalfCheetah-v5' or "
                           f"'package.module:function'") from None
    if max_episode_steps is not None:
        if "max_episode_steps" in kwargs:
            raise EnvSpecError(f"env {env_id!r}: kwargs must not set max_episode_steps "
                               f"({kwargs['max_episode_steps']!r}); the time limit is "
                               f"max_length (env.max_length in a config), here "
                               f"{max_episode_steps}")
        kwargs["max_episode_steps"] = max_episode_steps
    return lambda: gym.make(env_id, **kwargs)


def build_in_process(constructor: Callable[[], gym.Env], label: str | None) -> gym.Env:
    """``constructor()`` in this process; an exception from the env's code
    becomes the ``EnvRaisedError`` a worker process would send."""
    try:
        return constructor()
    except EnvSpecError:
        raise
    except Exception as exc:
        raise EnvRaisedError(label or "env", "construct", type(exc).__name__, str(exc),
                             "".join(traceback.format_exception(exc)), "this process") from exc


BACKENDS = ("auto", "workers", "process", "inline", "ray", "vector", "native")
# Backend "native": the vector env of the MuJoCo tasks batchrl steps in batches itself.
NATIVE_VECTOR_ID = "batchrl.envs.mujoco_batch:make_vector"
# Seconds a worker may take to answer a step or reset (far above any real env's
# step), and to build its envs (imports, model compilation; slower on few cores).
DEFAULT_TIMEOUT = 10.0
CONSTRUCT_TIMEOUT = 120.0


def split_evenly(num_envs: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous groups of ``num_envs`` envs, differing by
    at most one (larger groups first); never an empty group."""
    parts = max(1, min(parts, num_envs))
    base, extra = divmod(num_envs, parts)
    return [base + (i < extra) for i in range(parts)]


def batch_env_from(constructor: Callable[[], gym.Env] | Sequence[Callable[[], gym.Env]],
                   num_envs: int | None = None, backend: str = "workers", workers: int = 0,
                   share_main: bool = False,
                   pin_workers: bool = True, infos: bool = True, prefetch_reset: bool = True,
                   timeout: float | None = DEFAULT_TIMEOUT, max_restarts: int = 0,
                   label: str | None = None, ray_address: str = "",
                   ray_resources: dict[str, float] | None = None) -> BatchEnv:
    """``num_envs`` envs built by ``constructor``, as one ``BatchEnv``; or, given a
    list of constructors, one env built by each, in that order.

    Args:
      backend: where the envs run: ``"workers"`` (also ``"auto"``), spread over ``EnvWorker``
        child processes; ``"process"``, one ``ExternalProcess`` per env;
        ``"inline"``, all in this process; ``"ray"``, spread over
        ``RayEnvWorker`` actors of a Ray cluster (``pip install 'batchrl[ray]'``),
        on different nodes where resources allow.
      workers: child processes for ``"workers"`` (0: one per usable core, less
        the one this process takes with ``share_main``), or Ray actors for
        ``"ray"`` (0: as many as the cluster holds, at most ``num_envs``).
      share_main: with ``"workers"``, this process steps an equal share of the
        envs instead of sleeping. Its envs are outside ``timeout`` and not
        isolated (a hang hangs this process, a crash in their native code ends
        it), so not with ``max_restarts``.
      pin_workers: pin each worker process to its own core of this process's
        affinity mask (Linux; not under a cgroup CPU quota below the mask, nor in a Ray
        actor or task: ``pinnable_cores``).
      infos: ship the step infos from worker processes and Ray actors (else
        empty dicts).
      prefetch_reset: worker processes and Ray actors reset an env as soon as
        its episode ends, so that a later ``reset`` without seed is free.
      timeout: seconds a child process may take to answer a step or reset
        before ``EnvTimeoutError`` (``None``: no limit).
      max_restarts: ``BatchEnv``'s ``max_restarts`` (also for a Ray actor lost
        with its node); not with ``"inline"``.
      label: names the envs in error messages.
      ray_address: the cluster for ``"ray"``: ``""`` starts a private Ray
        instance, ``"auto"`` joins the one started with ``ray start`` here,
        ``"HOST:PORT"`` the head there; unused when already connected to Ray.
      ray_resources: Ray resources each ``"ray"`` actor reserves (default
        ``{"CPU": 1}``).
    """
    if callable(constructor):
        if num_envs is None:
            raise TypeError("batch_env_from needs num_envs with a single constructor")
        constructors = [constructor] * num_envs
    else:
        constructors = list(constructor)
        if num_envs is not None and num_envs != len(constructors):
            raise ValueError(f"num_envs={num_envs} but {len(constructors)} constructors given")
    if not constructors:
        raise ValueError("batch_env_from needs at least one env")
    num_envs = len(constructors)
    if backend not in BACKENDS:
        raise EnvSpecError(f"unknown env backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "vector":
        raise EnvSpecError("backend 'vector' builds vector envs, not single ones: use "
                           "make_batch_env(..., backend='vector', vector_id=...)")
    if backend == "native":
        raise EnvSpecError("backend 'native' steps the env ids it knows, not constructors: "
                           "use make_batch_env(env_id, ..., backend='native')")
    if backend == "auto":  # (constructors have no native version)
        backend = "workers"
    if workers < 0:
        raise EnvSpecError(f"workers must be >= 0 (0: one per usable core), got {workers}")
    if max_restarts and backend == "inline":
        raise EnvSpecError("restarting crashed envs needs envs in worker processes: use "
                           "backend 'workers', 'process' or 'ray', not 'inline'")
    share_main = share_main and not max_restarts
    members: list[Any] = []
    construct_timeout = None if timeout is None else max(timeout, CONSTRUCT_TIMEOUT)
    try:
        if backend == "workers":
            cores = pinnable_cores() if pin_workers else []
            processes = workers or max(1, usable_cores() - share_main)
            groups = _split(constructors, processes + share_main)
            if share_main and len(groups) > 1:
                members.extend(build_in_process(make, label) for make in groups.pop(0))
            for index, group in enumerate(groups):
                # Leave the first core to this process when it steps envs too.
                cpu = cores[(index + share_main) % len(cores)] if cores else None
                members.append(EnvWorker(group, label=label, timeout=timeout, infos=infos,
                                         cpu=cpu, construct_timeout=construct_timeout,
                                         prefetch_reset=prefetch_reset))
        elif backend == "process":
            for make in constructors:  # (appended one by one: closed if a later one fails)
                members.append(ExternalProcess(make, label=label, timeout=timeout,
                                               construct_timeout=construct_timeout))
        elif backend == "ray":
            members = _ray_workers(constructors, workers, label, timeout, construct_timeout,
                                   infos, prefetch_reset, ray_address, ray_resources)
        else:
            members.extend(build_in_process(make, label) for make in constructors)
        return BatchEnv(members, max_restarts=max_restarts)
    except BaseException:
        for member in members:
            member.close()
        raise


def _split(constructors: list, parts: int) -> list[list]:
    """``constructors`` in ``parts`` contiguous groups (``split_evenly``'s sizes)."""
    starts = np.cumsum([0] + split_evenly(len(constructors), parts))
    return [constructors[a:b] for a, b in zip(starts[:-1], starts[1:])]


def _ray_workers(constructors: list, workers: int, label: str | None, timeout: float | None,
                 construct_timeout: float | None, infos: bool, prefetch_reset: bool,
                 address: str, resources: dict[str, float] | None) -> list[Any]:
    """The ``RayEnvWorker``s of the ``"ray"`` backend (Ray imported only here)."""
    from batchrl.envs.ray import cluster as ray_cluster
    from batchrl.envs.ray.worker import RayEnvWorker
    resources = {"CPU": 1} if resources is None else dict(resources)
    check_resources(resources)
    ray = ray_cluster.acquire(address)  # held while the workers connect, then theirs
    members: list[Any] = []
    try:
        count = ray_cluster.plan_workers(ray, workers, len(constructors), resources)
        for group in _split(constructors, count):
            members.append(RayEnvWorker(group, label, timeout, construct_timeout,
                                        prefetch_reset=prefetch_reset, infos=infos,
                                        resources=resources, address=address))
    except BaseException:
        for member in members:
            member.close()
        raise
    finally:
        ray_cluster.release()
    return members


def vector_members(vector_id: str, num_envs: int, max_length: int | None = None,
                   kwargs: dict[str, Any] | None = None, workers: int = 0,
                   infos: bool = True) -> list[VectorWorker]:
    """The members of the ``"vector"`` backend: ``workers`` (0: one) vector envs built by
    ``vector_id``, a ``"package.module:function"`` called as ``function(num_envs=n,
    max_episode_steps=max_length, **kwargs)`` (``max_episode_steps`` only when given) that
    returns a ``gymnasium.vector.VectorEnv`` stepping ``n`` envs (``VectorWorker``'s
    conditions), with ``num_envs`` split evenly among them. The vector env applies its own
    wrappers (``wrap_env``'s are for single envs)."""
    module_name, attr, function = import_from(vector_id, f"env.vector_id {vector_id!r}",
                                              EnvSpecError)
    if not callable(function):
        raise EnvSpecError(f"env.vector_id {vector_id!r}: module {module_name!r} has no "
                           f"callable {attr!r}")
    if max_length is not None:
        check_time_limit(max_length)
    extra = {} if max_length is None else {"max_episode_steps": max_length}
    reserved = sorted({"num_envs", *extra} & set(kwargs or {}))
    if reserved:
        raise EnvSpecError(f"env.vector_id {vector_id!r}: kwargs must not set {reserved}: "
                           f"num_envs comes from env.num_agents, the time limit from "
                           f"env.max_length")
    members: list[VectorWorker] = []
    try:
        for count in split_evenly(num_envs, workers or 1):
            members.append(VectorWorker(functools.partial(function, num_envs=count,
                                                          **extra, **(kwargs or {})),
                                        label=vector_id, infos=infos))
            if members[-1].num_envs != count:
                raise EnvSpecError(f"env.vector_id {vector_id!r} built "
                                   f"{members[-1].num_envs} envs when asked for {count}")
    except BaseException:
        for member in members:
            member.close()
        raise
    return members


def choose_backend(env_id: str, backend: str, kwargs: dict[str, Any] | None = None,
                   worker_layout: bool = False) -> str:
    """The backend that ``backend`` stands for: ``"auto"`` is ``"native"`` where batchrl steps
    ``env_id`` with ``kwargs`` natively (``mujoco_batch.steps_natively``: the same
    trajectories, faster) unless ``worker_layout`` (an option only worker processes have:
    restarting crashed envs, the main process's share), else ``"workers"``; any other
    backend is itself."""
    if backend != "auto":
        return backend
    return "native" if not worker_layout and steps_natively(env_id, kwargs) else "workers"


def make_batch_env(env_id: str, num_envs: int, max_length: int | None = None,
                   kwargs: dict[str, Any] | None = None, backend: str = "auto",
                   workers: int = 0, normalize_ranges: bool = True,
                   vector_id: str = "", **options: Any) -> BatchEnv:
    """``num_envs`` wrapped copies of the env named ``env_id`` as one ``BatchEnv``.

    Episodes end after ``max_length`` steps (``resolve_constructor``'s time
    limit); ``wrap_env`` then applies range normalisation (if
    ``normalize_ranges``), action clipping and 32-bit floats. ``backend``,
    ``workers`` and ``options`` are ``batch_env_from``'s; backend ``"vector"``
    steps them in vector envs built by ``vector_id`` instead (``vector_members``;
    of ``options`` only ``infos`` and ``max_restarts`` apply, the latter to vector envs with
    ``send``/``recv``: one stepping in this process is not restarted, its error is raised);
    backend ``"native"``
    steps the MuJoCo tasks of ``batchrl.envs.mujoco_batch`` in one such vector env, with
    ``workers`` threads (0: one per usable core);
    ``"auto"`` is ``"native"`` where that can step ``env_id``, else ``"workers"``
    (``choose_backend``).
    """
    backend = choose_backend(env_id, backend, kwargs, bool(options.get("max_restarts"))
                             or bool(options.get("share_main")))
    if backend == "native":
        if env_id not in NATIVE_TASKS:
            raise EnvSpecError(f"env backend 'native' steps {', '.join(NATIVE_TASKS)} in "
                               f"batches, not {env_id!r}: use backend 'workers' for it")
        if importlib.util.find_spec("mjbatch") is None:
            raise EnvSpecError("env backend 'native' steps MuJoCo with mjbatch, which is not "
                               "installed: pip install 'batchrl[native]' (or use backend "
                               "'workers')")
        known = task_arguments(env_id) | set(MODEL_ARGUMENTS)
        unknown = sorted(set(kwargs or {}) - known)
        if unknown:  # (env_id and num_threads too: the config sets those)
            raise EnvSpecError(f"env backend 'native' takes no env.kwargs {', '.join(unknown)} "
                               f"for {env_id}; it takes {', '.join(sorted(known))} (others: "
                               f"backend 'workers')")
        # One batch whose native threads (workers; 0: one per usable core) step every env:
        # several batches in this process would step one after another.
        backend, vector_id = "vector", NATIVE_VECTOR_ID
        kwargs = {**(kwargs or {}), "env_id": env_id, "num_threads": workers,
                  "normalize_ranges": normalize_ranges}
        workers = 1
    if backend == "vector":
        if not vector_id:
            raise EnvSpecError("env backend 'vector' needs vector_id, the function building "
                               "the vector env ('package.module:function')")
        members = vector_members(vector_id, num_envs, max_length, kwargs, workers,
                                 options.get("infos", True))
        try:
            return BatchEnv(members, max_restarts=options.get("max_restarts", 0))
        except BaseException:
            for member in members:
                member.close()
            raise
    raw = resolve_constructor(env_id, kwargs, max_length)

    def constructor() -> gym.Env:
        return wrap_env(raw(), normalize_ranges=normalize_ranges)

    return batch_env_from(constructor, num_envs, backend, workers, label=env_id, **options)
