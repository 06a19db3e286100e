"""Learners on a Ray cluster: learners 1 to M-1 as Ray actors, one per bundle of a placement
group spread over the cluster's nodes, each running a function given by the launcher (learner 0
is the launching process). Ray ends the actors with the process that made them."""

from __future__ import annotations

from typing import Any, Callable

from batchrl.envs.errors import EnvSpecError
from batchrl.envs.ray import cluster as ray_cluster
from batchrl.errors import error_line

# How long the cluster may take to reserve the learners' bundles.
PLACEMENT_TIMEOUT_S = 60.0


class _RemoteLearner:
    """A Ray actor that runs one learner: ``run(main)`` calls ``main()``."""

    def node(self) -> tuple[str, str]:
        """This actor's node id and IP address."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def run(self, main: Callable[[], None]) -> None:
        main()


class RayLearners:
    """``count`` learner actors of ``resources`` each (``train.learner_resources``: CPU, GPU,
    memory or custom resources) in a placement group of one bundle per learner, spread over
    the nodes of the cluster at ``address`` (``env.ray_address``).

    Raises ``EnvSpecError`` when the cluster cannot hold them (before any starts)."""

    def __init__(self, count: int, resources: dict[str, float], address: str = ""):
        self._ray = ray = ray_cluster.acquire(address)
        self._group = None
        self.actors: list[Any] = []
        self._runs: list[Any] = []
        try:
            shortage = ray_cluster.missing_resources(ray, count, resources)
            if shortage:
                raise EnvSpecError(f"{count} more learner{'s' * (count != 1)} with "
                                   f"train.learner_resources={resources}: {shortage}; lower "
                                   f"train.learners or train.learner_resources, or add nodes")
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            bundle = {"CPU": 1, **resources}
            self._group = placement_group([dict(bundle) for _ in range(count)],
                                          strategy="SPREAD")
            ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise EnvSpecError(f"the Ray cluster did not place {count} learners of "
                                   f"{bundle} within {PLACEMENT_TIMEOUT_S:.0f} s")
            options = ray_cluster.actor_options(resources)
            remote = ray.remote(_RemoteLearner)
            for index in range(count):
                strategy = PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=index)
                self.actors.append(remote.options(**options, max_restarts=0,
                                                  scheduling_strategy=strategy).remote())
            self.nodes = ray.get([actor.node.remote() for actor in self.actors])
        except BaseException:
            self.close()
            raise

    def start(self, mains: list[Callable[[], None]]) -> None:
        """Run ``mains[i]`` in actor ``i``."""
        self._runs = [actor.run.remote(main) for actor, main in zip(self.actors, mains)]

    def failure(self, wait: float = 2.0) -> str | None:
        """A line on the first learner whose actor or node died (when it dies, the others'
        collectives fail and their runs end with those errors), else on the first whose run
        ended with an error, waiting up to ``wait`` seconds for one; ``None`` if none did."""
        ray = self._ray
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=wait)
        failed = None
        for index, run in enumerate(self._runs):
            if run not in done:
                continue
            learner = f"learner {index + 1} on node {self.nodes[index][0][:8]}"
            try:
                ray.get(run)
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                failed = failed or f"{learner} failed: {error_line(cause)}"
            except ray.exceptions.RayError as exc:
                return f"{learner} died: {error_line(exc)}"
        return failed

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the learners to finish their runs."""
        if self._runs:
            self._ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)

    def close(self) -> None:
        """Kill the actors, remove the placement group and leave Ray if batchrl joined it."""
        ray = self._ray
        try:
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: S110 - already dead
                    pass
            if self._group is not None:
                from ray.util.placement_group import remove_placement_group
                try:
                    remove_placement_group(self._group)
                except Exception:  # noqa: S110 - gone with the cluster
                    pass
        finally:
            self.actors, self._group = [], None
            ray_cluster.release()
