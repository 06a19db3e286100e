"""This process's connection to Ray, for the ``ray`` env backend.

Ray is an optional dependency (``pip install 'batchrl[ray]'``): it is imported
here, and only when a Ray env worker is built, so the local backends never
need it. batchrl connects the driver (this process, where the learner runs)
to Ray on first use and counts the Ray env workers that use the connection.
When the last one is closed, batchrl disconnects again (``ray.shutdown()``,
which also stops a Ray instance batchrl started itself) -- but only if batchrl
made the connection: a Ray that the user initialised before is used as it is,
whatever ``address`` says, and is never shut down by batchrl.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

from batchrl.envs.errors import EnvSpecError
from batchrl.envs.ray.guard import RayGuard

INSTALL_HINT = "pip install 'batchrl[ray]'"
# Ray's resource names that ``.options()`` takes as their own arguments.
_BUILTIN = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}

_lock = threading.Lock()
_users = 0
_owned = False  # batchrl called ray.init, so it may call ray.shutdown
_guard: RayGuard | None = None  # kills what that ray.init started if this process dies


def require_ray() -> ModuleType:
    """The ``ray`` module, or ``EnvSpecError`` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise EnvSpecError(f"env backend 'ray' needs Ray, which cannot be imported here "
                           f"({exc}); install it with: {INSTALL_HINT}") from None
    return ray


def acquire(address: str = "") -> ModuleType:
    """Connect this process to Ray unless it already is; count one user.

    Args:
      address: ``""`` starts a private Ray instance on this machine (or joins
        the cluster in the ``RAY_ADDRESS`` environment variable), ``"auto"``
        joins the cluster started with ``ray start`` on this machine,
        ``"HOST:PORT"`` the cluster whose head listens there. Ignored when
        this process is connected to Ray already.
    Returns:
      the ``ray`` module. Every ``acquire`` needs one ``release``.
    """
    global _users, _owned, _guard
    ray = require_ray()
    with _lock:
        if not ray.is_initialized():
            # If ray.init starts Ray here, its processes must not outlive this one.
            guard = RayGuard.start()
            try:
                # Warnings only: Ray's start-up banner would interleave with the
                # trainer's console output.
                ray.init(address=address or None, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                if guard:
                    guard.stop()
                where = f"at env.ray_address={address!r}" if address else "on this machine"
                raise EnvSpecError(
                    f"cannot connect to a Ray cluster {where}: {exc}. Start the head node "
                    f"with 'ray start --head', then use env.ray_address=auto on it (or "
                    f"HOST:PORT of the head), or leave env.ray_address empty for a "
                    f"private Ray instance on this machine") from None
            _owned, _guard = True, guard
        _users += 1
    return ray


def release() -> None:
    """Undo one ``acquire``; the last one disconnects if batchrl connected."""
    global _users, _owned, _guard
    with _lock:
        _users = max(0, _users - 1)
        if _users or not _owned:
            return
        _owned = False
        import ray
        if ray.is_initialized():
            ray.shutdown()
        if _guard is not None:
            _guard.stop()
            _guard = None


def check_resources(resources: dict[str, float]) -> None:
    """Raise ``EnvSpecError`` unless ``resources`` maps Ray resource names to
    amounts >= 0."""
    if not isinstance(resources, dict) or not all(
            isinstance(name, str) and isinstance(amount, (int, float))
            and not isinstance(amount, bool) and amount >= 0
            for name, amount in resources.items()):
        raise EnvSpecError(f"ray_resources must map Ray resource names to amounts >= 0, "
                           f"e.g. {{CPU = 1}} or {{CPU = 1, env_node = 0.5}}; got "
                           f"{resources!r}")


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """``ActorClass.options()`` arguments reserving ``resources`` per actor:
    ``CPU``, ``GPU`` and ``memory`` (bytes) become ``num_cpus``, ``num_gpus``
    and ``memory``; any other name is a custom resource (``ray start
    --resources``). ``CPU`` is 1 when left out."""
    check_resources(resources)
    options: dict[str, Any] = {"num_cpus": 1}
    custom = {}
    for name, amount in resources.items():
        if name in _BUILTIN:
            options[_BUILTIN[name]] = amount
        else:
            custom[name] = amount
    if custom:
        options["resources"] = custom
    return options


def plan_workers(ray: ModuleType, workers: int, num_envs: int,
                 resources: dict[str, float]) -> int:
    """How many Ray env workers to start, checked against the cluster.

    ``workers`` 0 means as many as the cluster's resources hold at
    ``resources`` each (its CPUs divided by the CPUs per worker, at most
    ``num_envs``). Raises ``EnvSpecError`` when the cluster as a whole lacks
    the resources for that many workers, instead of letting the actors wait
    for resources that never come.
    """
    total = ray.cluster_resources()
    per_worker = {name: amount for name, amount in
                  {"CPU": 1, **resources}.items() if amount > 0}
    if not workers:
        fits = [int(total.get(name, 0) // amount) for name, amount in per_worker.items()]
        workers = max(1, min([num_envs, *fits]))
    workers = min(workers, num_envs)
    missing = {name: amount * workers for name, amount in per_worker.items()
               if total.get(name, 0) < amount * workers}
    if missing:
        have = ", ".join(f"{name}={total.get(name, 0):g}" for name in missing)
        need = ", ".join(f"{name}={amount:g}" for name, amount in missing.items())
        raise EnvSpecError(f"{workers} Ray env workers with env.ray_resources={resources} "
                           f"need {need} in all, but the Ray cluster has {have}; lower "
                           f"env.workers or env.ray_resources, or add nodes")
    return workers
