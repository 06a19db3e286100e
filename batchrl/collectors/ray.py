"""Collectors as Ray actors spread over a cluster: rollouts through Ray's object store.

A small hub actor coordinates: the learner publishes versioned weights to it (an object ref, put
once, fetched by every collector from the store), collectors hand it each finished rollout (the
hub keeps it, so that it outlives a collector that fails before the learner takes it), and the
learner takes a round (the ``k``-th rollout of every collector) from it when all are there. The
rules are those of ``batchrl.collectors.local``: a collector keeps at most ``1 + queue_size``
rollouts unconsumed and starts round ``k`` only once version ``k - max_policy_lag`` is
published; a failed collector (an error, a killed actor, a lost node) is replaced and resumes at
its first round not yet delivered. A replacement that is still not placed after
``RayCollectors.placement_timeout`` seconds stops the run with a ``CollectorError`` if the
cluster lacks the resources for the collectors (a node was lost, say), instead of leaving the
learner waiting for it; otherwise it is reported and waited for (the cluster is busy).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from batchrl.collectors.collector import (CollectorError, CollectorSpec, Link, Replacements,
                                         collect)
from batchrl.envs.ray import cluster as ray_cluster
from batchrl.errors import error_line
from batchrl.parts.rollout import Rollout, RolloutBuffer

__all__ = ["RayCollectors", "check_placement", "check_room", "join_cluster",
           "leave_cluster"]


class _Hub:
    """The collectors' and the learner's meeting point (one Ray actor)."""

    def __init__(self, collectors: int, queue_size: int, max_lag: int | None):
        self.collectors, self.queue_size, self.max_lag = collectors, queue_size, max_lag
        self.version, self.weights = -1, None
        self.consumed = 0  # rounds the learner took
        self.delivered = [0] * collectors  # each collector's next round to deliver
        self.rollouts: dict[tuple[int, int], tuple[dict, dict]] = {}
        self.stopped = False

    def publish(self, version: int, weights: list) -> None:
        """The newest weights: ``[ref]`` of an ``acting_state`` of numpy arrays."""
        self.version, self.weights = version, weights

    def may_start(self, round_: int) -> str:
        """"stop", "go", or "wait" (the queue is full or the lag limit says so)."""
        if self.stopped:
            return "stop"
        if round_ - self.consumed > self.queue_size:
            return "wait"
        if self.max_lag is not None and self.version < round_ - self.max_lag:
            return "wait"
        return "go"

    def newest(self, known: int) -> tuple[int, list] | None:
        """``(version, [ref])`` of the newest weights if not ``known``, else ``None``."""
        return None if self.version == known else (self.version, self.weights)

    def next_round(self, index: int) -> int:
        """Collector ``index``'s first round not delivered (where a successor starts)."""
        return self.delivered[index]

    def deliver(self, round_: int, index: int, rollout: dict, meta: dict) -> None:
        """Keep a finished rollout; a late call of a replaced actor for a round its successor
        (or the learner) is past is ignored."""
        if round_ < max(self.delivered[index], self.consumed):
            return
        self.rollouts[round_, index] = (rollout, meta)
        self.delivered[index] = round_ + 1

    def take(self) -> list | None:
        """The next round, all collectors' rollouts, once complete."""
        keys = [(self.consumed, index) for index in range(self.collectors)]
        if not all(key in self.rollouts for key in keys):
            return None
        self.consumed += 1
        return [self.rollouts.pop(key) for key in keys]

    def queued(self) -> int:
        """Finished rollouts the learner has not taken."""
        return len(self.rollouts)

    def stop(self) -> None:
        """Collectors stop before their next rollout."""
        self.stopped = True


class _RayLink(Link):
    """A collector actor's end of the hub."""

    def __init__(self, ray: Any, hub: Any, index: int, tensors: dict[str, torch.Tensor]):
        self.ray, self.hub, self.index, self.tensors = ray, hub, index, tensors
        self.round = ray.get(hub.next_round.remote(index))

    def begin(self) -> tuple[dict[str, torch.Tensor], Any] | None:
        while (answer := self.ray.get(self.hub.may_start.remote(self.round))) == "wait":
            time.sleep(0.01)
        return None if answer == "stop" else (self.tensors, self.round)

    def weights(self, known: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        newest = self.ray.get(self.hub.newest.remote(known))
        if newest is None:
            return None
        version, (ref,) = newest
        return version, {name: torch.from_numpy(np.array(value))
                         for name, value in self.ray.get(ref).items()}

    def send(self, token: Any, meta: dict[str, Any]) -> None:
        arrays = {name: value.numpy() for name, value in self.tensors.items()}
        self.ray.get(self.hub.deliver.remote(token, self.index, arrays, meta))
        self.round = token + 1


class _RayCollector:
    """A Ray actor that runs ``collect`` until the hub says stop."""

    def run(self, spec: CollectorSpec, index: int, hub: Any, incarnation: int,
            slot: dict[str, tuple[tuple[int, ...], str]]) -> str:
        import ray
        tensors = {name: torch.zeros(shape, dtype=getattr(torch, dtype))
                   for name, (shape, dtype) in slot.items()}
        collect(spec, index, _RayLink(ray, hub, index, tensors), incarnation)
        return ray.get_runtime_context().get_node_id()

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()


@functools.cache
def _classes(ray: Any) -> tuple[Any, Any]:
    return ray.remote(_Hub), ray.remote(_RayCollector)


def check_placement(ray: Any, collectors: int, resources: dict[str, float]) -> None:
    """``CollectorError`` when the cluster cannot hold ``collectors`` actors of ``resources``
    each (they would wait for them forever)."""
    shortage = ray_cluster.missing_resources(ray, collectors, resources)
    if shortage:
        raise CollectorError(f"{collectors} collector{'s' * (collectors != 1)} with "
                             f"env.ray_resources={resources}: {shortage}; lower "
                             f"train.collectors or env.ray_resources, or add nodes")


def join_cluster(address: str = "") -> None:
    """Connect to the Ray cluster at ``address`` (``env.ray_address``; ``""``: a private
    instance) for a run of Ray collectors, which calls ``leave_cluster`` at its end: while it
    holds on, ``check_room`` and ``RayCollectors`` share this connection, and a private
    instance is started once, not once for each."""
    ray_cluster.acquire(address)


def leave_cluster() -> None:
    """Undo one ``join_cluster``; the last user of a connection batchrl made ends it."""
    ray_cluster.release()


def check_room(collectors: int, resources: dict[str, float], address: str = "") -> None:
    """``check_placement`` on the cluster at ``address`` (``env.ray_address``), connected to
    for the check only: before a run starts its collectors."""
    ray = ray_cluster.acquire(address)
    try:
        check_placement(ray, collectors, resources)
    finally:
        ray_cluster.release()


class RayCollectors:
    """``spec.collectors`` collector actors on a Ray cluster, spread over its nodes, and the
    learner's end of their rollouts: the interface of ``LocalCollectors`` (which see), with
    ``address`` the cluster to join (``env.ray_address``) and ``resources`` what each collector
    reserves (``env.ray_resources``). ``nodes`` lists the node each collector runs on.
    ``check`` is called while the collectors wait for room on the cluster (it raises to stop
    the wait: the trainer's check for Ctrl-C)."""

    #: Seconds after which a replacement not yet placed and started is checked against the
    #: cluster's resources.
    placement_timeout: float = 60.0

    def __init__(self, spec: CollectorSpec, observation_space: gym.Space,
                 action_space: gym.Space, behaviour: dict, acting_state: dict[str, torch.Tensor],
                 max_policy_lag: int | None = None, queue_size: int | None = None,
                 max_restarts: int = 0, report: Callable[[str], None] = print,
                 address: str = "", resources: dict[str, float] | None = None,
                 check: Callable[[], None] = lambda: None):
        self.spec = spec
        self._check = check
        self.replacements = Replacements(spec.collectors, max_restarts, report)
        self.resources = {"CPU": 1} if resources is None else dict(resources)
        options = ray_cluster.actor_options(self.resources)
        self._ray = ray = ray_cluster.acquire(address)
        self._closed = False
        try:
            check_placement(ray, spec.collectors, self.resources)
            self._slots = []  # each collector's rollout layout: name -> (shape, dtype name)
            for index in range(spec.collectors):
                template = spec.rollout_tensors(index, observation_space, action_space,
                                                behaviour, device="meta")
                self._slots.append({name: (tuple(value.shape),
                                           str(value.dtype).removeprefix("torch."))
                                    for name, value in template.items()})
            hub_class, self._actor_class = _classes(ray)
            self._options = {**options, "scheduling_strategy": "SPREAD", "max_restarts": 0,
                             "max_task_retries": 0}
            # On the driver's node: it holds the queue, which must outlive any other node.
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                  soft=False)
            self.hub = hub_class.options(num_cpus=0, scheduling_strategy=here).remote(
                spec.collectors, 2 if queue_size is None else queue_size, max_policy_lag)
            self.version = -1
            self.publish(acting_state)
            self._actors: list[Any] = [None] * spec.collectors
            self._runs: list[Any] = [None] * spec.collectors
            self._placing: dict[int, tuple[Any, float]] = {}  # replacements not yet placed
            self.nodes = self._placed([self._start(index) for index in range(spec.collectors)])
        except BaseException:
            self.close()
            raise

    def _start(self, index: int) -> Any:
        """Start collector ``index`` in a new actor; returns the ref of its node's id (asked
        before ``run``, which keeps the actor busy for good)."""
        actor = self._actors[index] = self._actor_class.options(**self._options).remote()
        node = actor.node.remote()
        self._runs[index] = actor.run.remote(self.spec, index, self.hub,
                                             self.replacements.incarnations[index],
                                             self._slots[index])
        return node

    def _placed(self, nodes: list[Any]) -> list[str]:
        """The node of each collector once all are placed (``_unplaced`` after every
        ``placement_timeout`` some are not)."""
        ray, count, timeout = self._ray, self.spec.collectors, self.placement_timeout
        while True:
            deadline, waiting = time.monotonic() + timeout, nodes
            while waiting and time.monotonic() < deadline:
                self._check()  # (a stop asked for while they wait)
                _, waiting = ray.wait(nodes, num_returns=len(nodes),
                                      timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            if not waiting:
                return ray.get(nodes)
            self._unplaced(
                f"{len(waiting)} of {count} collectors found no room on the Ray cluster within "
                f"{timeout:g} s with env.ray_resources={self.resources}",
                f"{len(waiting)} of {count} collectors still wait for room on the Ray cluster "
                f"after {timeout:g} s (each needs env.ray_resources={self.resources} on one "
                f"node)")

    def _overdue(self, index: int) -> None:
        """Collector ``index``'s replacement is not placed after ``placement_timeout``."""
        count = self.spec.collectors
        self._unplaced(
            f"collector {index}'s replacement found no room on the Ray cluster within "
            f"{self.placement_timeout:g} s: {count} collector{'s' * (count != 1)} with "
            f"env.ray_resources={self.resources}",
            f"collector {index}'s replacement is still waiting for the Ray cluster after "
            f"{self.placement_timeout:g} s")

    def _unplaced(self, failed: str, waiting: str) -> None:
        """Collectors not placed within ``placement_timeout``: ``CollectorError`` (``failed``
        and what the cluster lacks) if it lacks the resources for them all, else the report
        ``waiting`` (the cluster is busy, or its free CPUs are spread too thinly)."""
        shortage = ray_cluster.missing_resources(self._ray, self.spec.collectors,
                                                 self.resources)
        if shortage:
            raise CollectorError(f"{failed}: {shortage}; add nodes, or lower train.collectors "
                                 f"or env.ray_resources")
        self.replacements.report(waiting)

    @property
    def restarts(self) -> int:
        """Collectors replaced so far."""
        return self.replacements.count

    @property
    def queued(self) -> int:
        """Finished rollouts waiting for the learner."""
        return self._ask_hub("queued")

    def publish(self, acting_state: dict[str, torch.Tensor]) -> int:
        """Make ``acting_state`` the newest weights; returns its version."""
        ref = self._ray.put({name: value.detach().cpu().numpy()
                             for name, value in acting_state.items()})
        self.version += 1
        self._ask_hub("publish", self.version, [ref])
        return self.version

    def _ask_hub(self, method: str, *args: Any) -> Any:
        """The hub's answer to ``method(*args)``; ``CollectorError`` if the hub was lost (its
        actor or the learner's node died): the rollouts queued there are gone with it."""
        try:
            return self._ray.get(getattr(self.hub, method).remote(*args))
        except self._ray.exceptions.RayActorError as exc:
            raise CollectorError(f"the collectors' hub (a Ray actor on the learner's node) "
                                 f"was lost: {error_line(exc)}") from None

    def receive(self, check: Callable[[], None] = lambda: None
                ) -> tuple[Rollout, list[dict[str, Any]]]:
        """The next round, one rollout of every agent, and their ``meta`` (see
        ``LocalCollectors.receive``)."""
        while (taken := self._ask_hub("take")) is None:
            check()
            self._supervise()
            time.sleep(0.002)
        rollouts = []
        for index, (arrays, meta) in enumerate(taken):
            self.replacements.delivered[index] = True
            rollouts.append(RolloutBuffer({name: torch.from_numpy(np.array(value))
                                           for name, value in arrays.items()}).rollout())
        return Rollout.cat(rollouts), [meta for _, meta in taken]

    def _supervise(self) -> None:
        """Replace collectors whose actor ended (an error, a killed actor, a lost node);
        ``CollectorError`` when a replacement is not placed within ``placement_timeout`` and the
        cluster lacks the resources for it."""
        ray = self._ray
        for index, (node, deadline) in list(self._placing.items()):
            if ray.wait([node], timeout=0)[0]:
                del self._placing[index]
                try:
                    self.nodes[index] = ray.get(node)
                except ray.exceptions.RayError:  # it failed: its run says why
                    pass
            elif time.monotonic() > deadline:
                self._overdue(index)
                self._placing[index] = (node, float("inf"))  # reported once; wait on
        done, _ = ray.wait(list(self._runs), num_returns=len(self._runs), timeout=0)
        for index, run in enumerate(self._runs):
            if run not in done:
                continue
            try:
                ray.get(run)
                why = "stopped"
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                why = error_line(cause)
            except ray.exceptions.RayError as exc:
                why = error_line(exc)
            if not self.replacements.delivered[index]:  # (the hub knows rounds not yet taken)
                self.replacements.delivered[index] = self._ask_hub("next_round", index) > 0
            self.replacements.failed(index, why)
            ray.kill(self._actors[index], no_restart=True)
            self._placing[index] = (self._start(index),
                                    time.monotonic() + self.placement_timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every collector, kill the actors and leave Ray if batchrl joined it."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        try:
            runs = [run for run in getattr(self, "_runs", ()) if run is not None]
            if getattr(self, "hub", None) is not None:
                try:  # ask them to finish their rollout and close their envs
                    ray.get(self.hub.stop.remote(), timeout=timeout)
                    ray.wait(runs, num_returns=len(runs), timeout=timeout)
                except Exception:  # noqa: S110 - the hub is gone: kill them below
                    pass
            for actor in [*getattr(self, "_actors", ()), getattr(self, "hub", None)]:
                if actor is not None:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: S110 - already dead
                        pass
        finally:
            ray_cluster.release()

    def __enter__(self) -> "RayCollectors":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
