"""This process's connection to Ray (optional: imported only when a Ray env
worker is built). batchrl connects on first use and counts the workers using
it; the last one's close disconnects (``ray.shutdown()``) if batchrl made the
connection: a Ray the user initialised is used as it is, never shut down."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from types import ModuleType
from typing import Any, Iterator

from batchrl.envs.errors import EnvSpecError
from batchrl.envs.ray.guard import RayGuard

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
        raise EnvSpecError(f"a Ray cluster (env.backend 'ray', or env.ray_address for "
                           f"collectors or learners) needs Ray, which cannot be imported here "
                           f"({exc}); install it with: pip install 'batchrl[ray]'") from None
    return ray


@contextlib.contextmanager
def _handlers_kept() -> Iterator[None]:
    """Around ``ray.init``, which replaces the SIGTERM handler of the main thread (with
    ``sys.exit``, or for a head it starts here, with killing Ray and exiting): the
    trainer's own handlers come back, so that a scheduler's SIGTERM stops the run with its
    checkpoint. (Ray's processes are stopped by ``release`` then, or by the guard.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # (None: not set from Python; nothing to put back)
                signal.signal(signum, handler)


def _check_listening(target: str, timeout: float = 10.0) -> None:
    """``ConnectionError`` if ``target`` is ``HOST:PORT`` and no Ray head answers there
    within ``timeout`` seconds: nothing listens, or a service that does not speak gRPC (a
    Ray head's GCS does). ``ray.init`` would wait for either for ever, retrying every few
    seconds, deaf to a first Ctrl-C."""
    host, colon, port = target.rpartition(":")
    if "://" in target or not colon or not port.isdigit():
        return  # "auto", "local", "ray://...", or a malformed address, which Ray rejects
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray head listens at {target} ({exc})") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # (the head wants TLS and the user's certificates: ray.init's own to check)
    if ":" in host and not host.startswith("["):
        return  # (an IPv6 address without brackets, which Ray rejects at once)
    import grpc  # (a dependency of Ray)

    # Not through an http_proxy of the environment, as Ray's own channels.
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        raise ConnectionError(f"the service at {target} is not a Ray head (it does not "
                              f"answer gRPC within {timeout:g} s)") from None
    finally:
        channel.close()


def acquire(address: str = "") -> ModuleType:
    """Connect this process to Ray unless it is already; count one user (every ``acquire`` needs one
    ``release``); returns the ``ray`` module. ``address``: ``""`` starts a private Ray instance here
    (or joins ``RAY_ADDRESS``'s), ``"auto"`` joins the cluster ``ray start`` began on this machine,
    and ``"HOST:PORT"`` the cluster whose head listens there. Ignored when connected."""
    global _users, _owned, _guard
    ray = require_ray()
    with _lock:
        if not ray.is_initialized():
            guard = RayGuard.start()  # Ray started here must not outlive this process
            # ("" is a private instance: Ray's default would join a cluster that 'ray start'
            # left running on this machine.)
            from_env = "" if address else os.environ.get("RAY_ADDRESS", "")
            target = address or from_env or "local"
            try:
                _check_listening(target)
                # Warnings only: Ray's banner would interleave with the trainer's output.
                with _handlers_kept():
                    ray.init(address=target, logging_level=logging.WARNING)
            except BaseException as exc:  # (a Ctrl-C while connecting too: no guard left)
                if guard:
                    guard.stop()
                if not isinstance(exc, (ConnectionError, RuntimeError, ValueError)):
                    raise
                where = (f"at env.ray_address={address!r}" if address
                         else f"at RAY_ADDRESS={from_env!r}" if from_env else "on this machine")
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
    """Raise ``EnvSpecError`` unless ``resources`` maps Ray resource names to amounts >= 0."""
    if not isinstance(resources, dict) or not all(
            isinstance(name, str) and isinstance(amount, (int, float))
            and not isinstance(amount, bool) and amount >= 0
            for name, amount in resources.items()):
        raise EnvSpecError(f"ray_resources must map Ray resource names to amounts >= 0, "
                           f"e.g. {{CPU = 1}} or {{CPU = 1, env_node = 0.5}}; got {resources!r}")


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """``ActorClass.options()`` arguments reserving ``resources`` per actor:
    ``CPU`` (1 when left out), ``GPU`` and ``memory`` (bytes) become Ray's own
    arguments; any other name is a custom resource (``ray start --resources``)."""
    check_resources(resources)
    options: dict[str, Any] = {"num_cpus": 1}
    options.update({_BUILTIN[name]: amount for name, amount in resources.items()
                    if name in _BUILTIN})
    custom = {name: amount for name, amount in resources.items() if name not in _BUILTIN}
    if custom:
        options["resources"] = custom
    return options


def plan_workers(ray: ModuleType, workers: int, num_envs: int,
                 resources: dict[str, float]) -> int:
    """How many Ray env workers to start (``workers`` 0: as many as the cluster's resources hold at
    ``resources`` each), at most ``num_envs``. ``EnvSpecError`` when the cluster lacks the resources
    for that many, as the actors would wait for them forever."""
    total = ray.cluster_resources()
    per_worker = {name: amount for name, amount in
                  {"CPU": 1, **resources}.items() if amount > 0}
    if not workers:
        fits = [int(total.get(name, 0) // amount) for name, amount in per_worker.items()]
        workers = max(1, min([num_envs, *fits]))
    workers = min(workers, num_envs)
    shortage = missing_resources(ray, workers, resources)
    if shortage:
        raise EnvSpecError(f"{workers} Ray env worker{'s' * (workers != 1)} with "
                           f"env.ray_resources={resources}: {shortage}; lower env.workers or "
                           f"env.ray_resources, or add nodes")
    return workers


def missing_resources(ray: ModuleType, actors: int, resources: dict[str, float]) -> str | None:
    """What the cluster lacks for ``actors`` actors of ``resources`` each (CPU 1 unless
    given), as ``"CPU=4 needed in all, but the Ray cluster has CPU=3"``; ``None`` if
    nothing."""
    total = ray.cluster_resources()
    need = {name: amount * actors for name, amount in {"CPU": 1, **resources}.items()
            if amount > 0}
    short = {name: amount for name, amount in need.items() if total.get(name, 0) < amount}
    if not short:
        return None
    wanted = ", ".join(f"{name}={amount:g}" for name, amount in short.items())
    have = ", ".join(f"{name}={total.get(name, 0):g}" for name in short)
    return f"{wanted} needed in all, but the Ray cluster has {have}"
