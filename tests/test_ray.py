"""The Ray env backend on a real two-node Ray cluster on 127.0.0.1.

The ``cluster`` fixture gives a head node and a second node started with ``ray start`` (each in
its own session, with its own temp dir and a custom resource that tells them
apart), with this process connected as the driver; the module checks: trajectories of envs
on both nodes equal in-process ones; placement over the nodes; an env raising
in an actor; a killed actor; a timeout; the loss of a whole node (a third
node started for the purpose and killed), with and without restarts; the
driver's connection; bad resources. Every process of the cluster is killed
when its last test ends and none may be left. Skipped when Ray is not installed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time

import cloudpickle
import gymnasium as gym
import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")

from batchrl.envs import BatchEnv, EnvCrashedError, EnvRaisedError, EnvTimeoutError  # noqa: E402
from batchrl.envs.errors import EnvSpecError, RayWorkerCrashedError  # noqa: E402
from batchrl.envs.factory import batch_env_from  # noqa: E402
from batchrl.envs.ray.cluster import actor_options  # noqa: E402
from batchrl.envs.ray.worker import RayEnvWorker  # noqa: E402
from batchrl.hardware import in_ray_worker, pinnable_cores  # noqa: E402
from ray_nodes import PATIENCE, ROOT  # noqa: E402
from helpers import (CountingEnv, assert_same_log, fails_at, make_cartpole,  # noqa: E402
                     make_cheetah, raise_site, ray_pickles_by_value, rollout, sleeps_at)

# The actors unpickle this module's (and helpers') envs by value: the
# Ray workers cannot import the test modules.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

@pytest.fixture
def closing(cluster):
    """``closing(obj)`` closes ``obj`` when the test ends; then checks that
    the test's actors are gone (their CPUs free again)."""
    created = []
    yield lambda obj: created.append(obj) or obj
    for obj in reversed(created):
        obj.close()
    if not ray.is_initialized():
        ray.init(address=cluster.address, logging_level="warning")
    cluster.wait_idle()


def on(name: str, cpus: float = 1) -> dict[str, float]:
    """Resources that place an actor on node ``name`` (a share of its marker)."""
    return {"CPU": cpus, f"{name}_node": 0.1}


def kill_actor(worker: RayEnvWorker) -> None:
    """``ray.kill`` the worker's actor and wait until it is dead: the kill is
    asynchronous, so a call right after it might still be served."""
    ray.kill(worker.actor)
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            ray.get(worker.actor.__ray_ready__.remote(), timeout=PATIENCE)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def step_until_error(batch: BatchEnv, action) -> Exception:
    """Step until an ``EnvError`` is raised (a lost node is noticed within
    about a second here); returns it."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            batch.step(np.full(len(batch), action))
        except EnvCrashedError as exc:
            return exc
        time.sleep(0.02)
    raise AssertionError("the lost node was not noticed")


# -- trajectories and placement -----------------------------------------------------


@pytest.mark.parametrize("make, dtype", [(make_cartpole, None), (make_cheetah, np.float32)],
                         ids=["CartPole", "HalfCheetah"])
def test_workers_on_two_nodes_give_the_trajectories_of_in_process_envs(
        cluster, closing, make, dtype):
    reference = closing(BatchEnv([make() for _ in range(4)]))
    expected = rollout(reference, dtype)

    workers = [closing(RayEnvWorker([make] * 2, resources=on("head"), timeout=30)),
               closing(RayEnvWorker([make] * 2, resources=on("second"), timeout=30))]
    batch = closing(BatchEnv(workers))
    assert [w.node_id for w in batch.workers] == [cluster.node_id("head"),
                                                  cluster.node_id("second")]
    assert batch.observation_space == reference.observation_space
    assert_same_log(rollout(batch, dtype), expected)
    assert batch.envs[3].unwrapped.spec.id == reference.envs[3].unwrapped.spec.id
    batch.close()
    assert ray.is_initialized()  # the driver's own connection stays


def test_factory_spreads_workers_over_the_nodes(cluster, closing):
    cluster.wait_idle()
    batch = closing(batch_env_from(make_cartpole, 5, backend="ray", workers=2, timeout=30))
    assert [len(w) for w in batch.workers] == [3, 2]
    assert {w.node_id for w in batch.workers} == {cluster.node_id("head"),
                                                  cluster.node_id("second")}
    batch.close()
    cluster.wait_idle()
    # workers=0: as many as the cluster's 3 CPUs hold at ray_resources each.
    batch = closing(batch_env_from(make_cartpole, 8, backend="ray", workers=0,
                                   ray_resources={"CPU": 1}, timeout=30))
    assert [len(w) for w in batch.workers] == [3, 3, 2]
    np.testing.assert_array_equal(batch.reset(seed=0),
                                  BatchEnv([make_cartpole() for _ in range(8)]).reset(seed=0))


class _AffinityProbe:
    """A Ray actor that starts env workers."""

    def run(self) -> tuple[list[int], list[int], list[list[int]]]:
        return _worker_affinities()


def _worker_affinities() -> tuple[list[int], list[int], list[list[int]]]:
    """(In a Ray actor or task) the cores to pin to, this process's cores, and those of the
    env workers that ``batch_env_from`` starts here."""
    from batchrl.hardware import pinnable_cores
    batch = batch_env_from(make_cartpole, 2, backend="workers", workers=2, timeout=30)
    try:
        own = psutil.Process()
        return (pinnable_cores(), own.cpu_affinity(),
                [child.cpu_affinity() for child in own.children(recursive=True)])
    finally:
        batch.close()


@pytest.mark.parametrize("worker", ["actor", "task"])
def test_env_workers_started_in_a_ray_worker_are_not_pinned(cluster, closing, worker):
    """Ray reserves CPUs, not cores: every actor and task of a node sees all its cores, so env
    workers pinned there (a Ray collector's or learner's) would crowd the node's first cores."""
    if len(pinnable_cores()) < 2:
        pytest.skip("needs an affinity mask of at least two cores and no CPU quota below it")
    cluster.wait_idle()
    options = actor_options(on("head"))
    with ray_pickles_by_value(__name__):
        if worker == "task":
            answer = ray.remote(_worker_affinities).options(**options).remote()
            pinnable, own, workers = ray.get(answer, timeout=PATIENCE)
        else:
            actor = ray.remote(_AffinityProbe).options(**options).remote()
            try:
                pinnable, own, workers = ray.get(actor.run.remote(), timeout=PATIENCE)
            finally:
                ray.kill(actor)
    assert pinnable == [] and len(own) >= 2
    # (its fork server and two env workers at least)
    assert len(workers) >= 3 and all(affinity == own for affinity in workers), (own, workers)
    assert not in_ray_worker() and pinnable_cores()  # (the driver)


# -- errors ---------------------------------------------------------------------------


def test_env_raising_in_an_actor_names_the_env_with_the_remote_traceback(closing):
    batch = closing(BatchEnv([
        closing(RayEnvWorker([CountingEnv] * 2, label="counting", resources=on("head"))),
        closing(RayEnvWorker([CountingEnv, fails_at(3)], label="counting",
                             resources=on("second")))]))
    batch.reset(seed=0)
    batch.step(np.zeros(4, int))
    batch.step(np.zeros(4, int))
    with pytest.raises(EnvRaisedError) as info:
        batch.step(np.zeros(4, int))
    error = info.value
    assert error.env_index == 3 and error.label == "counting" and error.operation == "step"
    assert error.remote_type == "ValueError" and error.remote_message == "boom at step 3"
    assert "Traceback (most recent call last)" in error.remote_traceback
    assert raise_site(CountingEnv.step, "raise ValueError") in error.remote_traceback
    assert str(error).startswith("env 3 (counting) failed in step(): ValueError: boom at step 3")


def test_constructor_error_in_an_actor_is_raised_with_its_env_index(closing):
    def broken():
        raise RuntimeError("cannot build this env")

    with pytest.raises(EnvRaisedError, match="cannot build this env") as info:
        BatchEnv([closing(RayEnvWorker([CountingEnv], label="good")),
                  closing(RayEnvWorker([CountingEnv, broken], label="bad"))])
    assert info.value.env_index == 2 and info.value.operation == "construct"
    assert "Traceback in the env worker" in str(info.value)


def test_killed_actor_is_a_crash_naming_its_env_range(closing):
    batch = closing(BatchEnv([closing(RayEnvWorker([CountingEnv], label="one")),
                              closing(RayEnvWorker([CountingEnv] * 2, label="two"))]))
    batch.reset(seed=0)
    kill_actor(batch.workers[1])
    with pytest.raises(RayWorkerCrashedError) as info:
        batch.step(np.zeros(3, int))
    assert isinstance(info.value, EnvCrashedError)
    assert info.value.env_indices == range(1, 3)
    assert str(info.value).startswith("envs 1-2 (two, one worker process) failed in step(): "
                                      "the Ray actor hosting the env worker")
    assert "died" in str(info.value)


def test_killed_actor_is_replaced_with_max_restarts(closing):
    batch = closing(BatchEnv([closing(RayEnvWorker([CountingEnv], label="one")),
                              closing(RayEnvWorker([CountingEnv] * 2, label="two"))],
                             max_restarts=1))
    batch.reset(seed=0)
    batch.step(np.zeros(3, int))
    kill_actor(batch.workers[1])
    obs, rewards, *_ = batch.step(np.zeros(3, int))
    np.testing.assert_array_equal(obs[:, 0], [2, 0, 0])  # fresh episodes for envs 1-2
    np.testing.assert_array_equal(rewards, [2, 0, 0])
    np.testing.assert_array_equal(batch.restarted[0], [1, 2])
    assert batch.restarts == 1 and "Ray actor" in batch.restart_events[0].error
    obs, *_ = batch.step(np.zeros(3, int))
    np.testing.assert_array_equal(obs[:, 0], [3, 1, 1])


def test_step_timeout_applies_to_ray_calls(closing):
    # (placing the actor and building its env may take longer on a busy machine: the step
    # timeout is what this test is about)
    worker = closing(RayEnvWorker([sleeps_at(2, 30.0)], label="sleepy", timeout=1.0,
                                  construct_timeout=60.0))
    batch = closing(BatchEnv([worker]))
    batch.reset(seed=0)
    batch.step(np.zeros(1, int))
    with pytest.raises(EnvTimeoutError, match=r"env 0 \(sleepy\) failed in step\(\): no answer "
                                              r"from the Ray actor on node .* within 1.0 s"):
        batch.step(np.zeros(1, int))


def test_lost_node_is_a_clear_crash_error(cluster, closing):
    cluster.start("doomed", 1)
    batch = closing(BatchEnv([closing(RayEnvWorker([make_cartpole] * 2, resources=on("head"))),
                              closing(RayEnvWorker([make_cartpole] * 2,
                                                   resources=on("doomed")))]))
    assert batch.workers[1].node_id == cluster.node_id("doomed")
    batch.reset(seed=0)
    assert cluster.kill(["doomed"]) == []
    error = step_until_error(batch, 0)
    assert isinstance(error, RayWorkerCrashedError) and error.env_indices == range(2, 4)
    assert f"on node {batch.workers[1].node_ip}" in str(error)
    # Ray's own error says why: "...because its node has died", or, when the lost connection
    # to the actor's process is noticed before the node's missed heartbeats, that the process
    # exited.
    assert error.reason.split(":")[0] in ("ActorDiedError", "ActorUnavailableError"), error.reason


def test_lost_node_is_replaced_with_restart_crashed_envs(cluster, closing):
    cluster.start("doomed2", 1)
    cluster.wait_idle()
    # Three workers spread over three nodes: one on each.
    batch = closing(batch_env_from(make_cartpole, 6, backend="ray", workers=3, timeout=30,
                                   max_restarts=2))
    nodes = {cluster.node_id(name) for name in ("head", "second", "doomed2")}
    assert {w.node_id for w in batch.workers} == nodes
    lost = [w.node_id for w in batch.workers].index(cluster.node_id("doomed2"))
    batch.reset(seed=0)
    assert cluster.kill(["doomed2"]) == []
    deadline = time.monotonic() + PATIENCE
    while not batch.restarts and time.monotonic() < deadline:
        batch.step(np.zeros(6, int))
    assert batch.restarts == 1
    assert batch.restart_events[0].env_indices == range(2 * lost, 2 * lost + 2)
    assert batch.workers[lost].node_id in nodes - {cluster.node_id("doomed2")}
    obs, *_ = batch.step(np.zeros(6, int))
    assert obs.shape == (6, 4)


# -- connection and configuration ----------------------------------------------------------


def test_batchrl_connects_and_disconnects_the_driver_itself(cluster, closing):
    ray.shutdown()
    batch = batch_env_from(make_cartpole, 2, backend="ray", workers=1,
                           ray_address=cluster.address, timeout=30)
    assert ray.is_initialized()
    batch.reset(seed=0)
    batch.close()
    assert not ray.is_initialized()  # batchrl connected, so batchrl disconnected
    assert guards() == []  # and the guard of that connection ended with it


def test_an_actor_no_node_has_room_for_is_a_construct_timeout_naming_its_resources(closing):
    # (construct_timeout left out: the timeout, which includes placing the actor)
    worker = closing(RayEnvWorker([CountingEnv], label="nowhere", timeout=2.0,
                                  resources={"CPU": 1, "nowhere_node": 1}))
    with pytest.raises(EnvTimeoutError, match=r"env 0 \(nowhere\) failed in construct\(\): the "
                                              r"Ray actor was not placed, or did not build its "
                                              r"envs, within 2.0 s \(it asks for \{'CPU': 1, "
                                              r"'nowhere_node': 1\}; are they free on some "):
        BatchEnv([worker])


def test_resources_the_cluster_lacks_are_an_error_before_any_actor(closing):
    with pytest.raises(EnvSpecError, match=r"2 Ray env workers with env.ray_resources=\{'CPU': 1, "
                                           r"'gpu_node': 1\}: gpu_node=2 needed in all, but "
                                           r"the Ray cluster has "
                                           r"gpu_node=0; lower env.workers"):
        batch_env_from(make_cartpole, 2, backend="ray", workers=2,
                       ray_resources={"CPU": 1, "gpu_node": 1})
    with pytest.raises(EnvSpecError, match="ray_resources must map Ray resource names"):
        batch_env_from(make_cartpole, 2, backend="ray", ray_resources={"CPU": -1})


def test_missing_ray_names_the_extra_to_install(monkeypatch):
    from batchrl.envs.ray import cluster as ray_cluster
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(EnvSpecError, match=r"pip install 'batchrl\[ray\]'"):
        ray_cluster.require_ray()


def test_string_ids_and_handles_reach_the_remote_envs(closing):
    worker = closing(RayEnvWorker(["CartPole-v1", functools.partial(gym.make, "CartPole-v1")]))
    assert worker.label == "CartPole-v1"
    assert worker.get_attr("spec.id", index=1) == "CartPole-v1"
    assert worker.env(0).unwrapped.gravity == 9.8
    with pytest.raises(EnvRaisedError, match="AttributeError"):
        worker.get_attr("no_such_attribute")


def counting_for_two_steps() -> gym.Env:
    return gym.wrappers.TimeLimit(CountingEnv(), 2)


def test_a_vector_env_on_one_actor_resets_on_the_same_step(closing):
    """One actor's observations arrive as Ray's read-only zero-copy arrays: the same-step
    reset writes the first observations into a copy of them."""
    from batchrl.envs.vector import BatchVectorEnv

    env = closing(BatchVectorEnv([counting_for_two_steps] * 2, autoreset_mode="same_step",
                                 backend="ray", workers=1))
    env.reset(seed=0)
    observ = env.step(np.zeros(2, np.int64))[0]
    assert observ.ravel().tolist() == [1, 1]
    observ, _, _, truncated, infos = env.step(np.zeros(2, np.int64))
    assert truncated.tolist() == [True, True] and observ.ravel().tolist() == [0, 0]
    assert infos["final_obs"][0].tolist() == [2]


def test_train_py_runs_its_envs_on_the_cluster(cluster, closing, tmp_path):
    cluster.wait_idle()
    logdir = tmp_path / "run"
    settings = ["env.backend=ray", f"env.ray_address={cluster.address}", "env.num_agents=4",
                "env.workers=2", "env.max_length=50", "algorithm.update_every=4",
                "train.steps=400", "train.eval_episodes=2"]
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "--config", "cartpole", "--logdir",
         str(logdir), "--no-progress", *[arg for s in settings for arg in ("--set", s)]],
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hosts = set()  # the env actors' processes (Ray names them after their class)
    deadline = time.monotonic() + PATIENCE * 2
    while process.poll() is None and time.monotonic() < deadline:
        for each in psutil.process_iter(["pid", "cmdline"]):
            if "ray::RayEnvHost" in " ".join(each.info["cmdline"] or ()):
                hosts.add(each.info["pid"])
        time.sleep(0.2)
    stdout, stderr = process.communicate(timeout=10)
    assert process.returncode == 0, stderr
    assert "Final evaluation:" in stdout
    assert hosts, "no env actor ran on the cluster"
    phases = [json.loads(line)["phase"] for line in (logdir / "metrics.jsonl").open()]
    assert "train" in phases and "eval" in phases
    assert json.loads((logdir / "config.json").read_text())["env"]["backend"] == "ray"


PRIVATE_RAY_SCRIPT = """
import sys, time
from batchrl.envs.factory import batch_env_from  # noqa: E402
from helpers import make_cartpole
batch = batch_env_from(make_cartpole, 2, backend="ray", workers=1, timeout=60)
batch.reset(seed=0)
print("ready", flush=True)
time.sleep(600)
"""


def test_private_ray_instance_dies_with_a_sigkilled_trainer(tmp_path):
    """Without an address batchrl starts Ray itself; when the driver is
    SIGKILLed (no ray.shutdown), every process that Ray start-up made is
    gone within seconds, Ray's agents included (left alone they retry the
    dead GCS for minutes)."""
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    process = subprocess.Popen([sys.executable, "-c", PRIVATE_RAY_SCRIPT], env=env,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # Ray's agents start after the raylet registered
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        names = " ".join(p.name() for p in ray_processes)
        assert "raylet" in names and "gcs_server" in names, names  # a private instance
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        _, alive = psutil.wait_procs(ray_processes, timeout=20)
        assert alive == [], [p.cmdline()[:1] for p in alive]
    finally:  # (the group outlives a dead driver while Ray's processes are left in it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.timeout(180)
def test_sigterm_stops_a_run_on_a_private_ray_instance_with_its_checkpoint(tmp_path):
    """ray.init replaces the SIGTERM handler (with sys.exit, or with killing the Ray it
    started): the trainer's own comes back, so a scheduler's SIGTERM stops the run as on
    any backend, with a checkpoint, and Ray's processes go with it."""
    from batchrl.metrics import read_metrics
    from helpers import finish, sets, start_train_py, wait_for, wait_gone

    logdir = tmp_path / "run"
    process = start_train_py(
        "--config", "cartpole", "--logdir", str(logdir),
        *sets("env.backend=ray", "env.workers=1", "env.num_agents=4", "train.device=cpu",
              "algorithm.update_every=4", "train.eval_episodes=4", "train.steps=1000000"))
    try:
        wait_for(lambda: len(read_metrics(logdir)) >= 2 or process.poll() is not None, 120,
                 "two phases")
        assert process.poll() is None, process.communicate()
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        os.kill(process.pid, signal.SIGTERM)
        code, stdout, stderr = finish(process, 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 143, (stdout, stderr)
    assert "Stopped by SIGTERM; checkpoint at step" in stdout, (stdout, stderr)
    assert wait_gone(children, timeout=30) == []


class TextEnv(gym.Env):
    """Text observations: no array of a fixed shape holds them."""

    observation_space = gym.spaces.Text(5)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return "ab", {}

    def step(self, action):
        return "cd", 1.0, True, False, {}


def test_an_actor_answers_the_reset_an_episode_end_brings_for_values_of_any_space():
    from batchrl.envs.host import StepArrays
    from batchrl.envs.ray.worker import RayEnvHost

    host = RayEnvHost(b"", True, True)  # (the actor's class, here without Ray)
    host.host.envs = [TextEnv()]
    host.arrays = StepArrays(1, TextEnv.observation_space, TextEnv.action_space)
    status, (observ, reward, terminated, _, _, resets) = host.step(np.zeros(1, np.int64))
    assert status == "ok" and observ.tolist() == ["cd"] and terminated.tolist() == [True]
    assert [(index, first) for index, first, _ in resets] == [(0, "ab")]


# -- the pieces that need no cluster ------------------------------------------------------------


def test_actor_options_map_resources_to_ray_arguments():
    from batchrl.envs.ray.cluster import actor_options
    assert actor_options({}) == {"num_cpus": 1}  # CPU 1 when left out
    assert actor_options({"env_node": 0.5}) == {"num_cpus": 1, "resources": {"env_node": 0.5}}
    assert actor_options({"CPU": 2, "GPU": 1, "memory": 2**30, "env_node": 0.5}) == {
        "num_cpus": 2, "num_gpus": 1, "memory": 2**30, "resources": {"env_node": 0.5}}
    for bad in ({"CPU": -1}, {"CPU": True}, {"CPU": "1"}, {1: 1}, [("CPU", 1)]):
        with pytest.raises(EnvSpecError, match="ray_resources must map Ray resource names"):
            actor_options(bad)


class ClusterResources:
    """What ``plan_workers`` and ``missing_resources`` ask of the ``ray`` module: the
    totals of a cluster (one with GPUs or many nodes, which this machine cannot run)."""

    def __init__(self, **total: float):
        self.total = total

    def cluster_resources(self) -> dict[str, float]:
        return dict(self.total)


def test_the_room_for_actors_counts_a_cpu_each_unless_told_and_every_resource_asked():
    from batchrl.envs.ray.cluster import missing_resources, plan_workers
    cluster = ClusterResources(CPU=3, GPU=2, env_node=1)
    assert missing_resources(cluster, 3, {"CPU": 1}) is None  # an exact fit
    assert missing_resources(cluster, 4, {}) == ("CPU=4 needed in all, but the Ray cluster "
                                                 "has CPU=3")
    assert missing_resources(cluster, 4, {"env_node": 0.25}) == (
        "CPU=4 needed in all, but the Ray cluster has CPU=3")
    assert missing_resources(cluster, 2, {"CPU": 0, "GPU": 1.5, "tpu": 0}) == (
        "GPU=3 needed in all, but the Ray cluster has GPU=2")
    # workers=0: as many as every resource holds, at most one per env, at least one.
    assert plan_workers(cluster, 0, 8, {"CPU": 1}) == 3
    assert plan_workers(cluster, 0, 8, {"CPU": 1, "env_node": 0.5}) == 2
    assert plan_workers(cluster, 0, 8, {"CPU": 0, "GPU": 0.5}) == 4
    assert plan_workers(cluster, 0, 2, {"CPU": 1}) == 2
    assert plan_workers(cluster, 5, 2, {"CPU": 1}) == 2
    with pytest.raises(EnvSpecError, match=r"^1 Ray env worker with env.ray_resources="
                                           r"\{'CPU': 1, 'gpu_node': 1\}: gpu_node=1 needed in "
                                           r"all, but the Ray cluster has gpu_node=0; "):
        plan_workers(cluster, 0, 8, {"CPU": 1, "gpu_node": 1})
    with pytest.raises(EnvSpecError, match=r"^3 Ray env workers with .*: GPU=6 needed"):
        plan_workers(cluster, 3, 8, {"CPU": 1, "GPU": 2})


def test_a_ray_error_is_told_in_its_first_lines_without_the_indented_details():
    from batchrl.envs.ray.worker import _reason

    class ActorDiedError(Exception):
        pass

    error = ActorDiedError("The actor died unexpectedly before finishing this task.\n"
                           "\tclass_name: RayEnvHost\n\tactor_id: 1234\n"
                           "The actor is dead because its node has died. Node Id: abcd\n"
                           "  the node's last words\nA third line.")
    assert _reason(error) == ("ActorDiedError: The actor died unexpectedly before finishing "
                              "this task. The actor is dead because its node has died. "
                              "Node Id: abcd")
    assert _reason(ActorDiedError("")) == "ActorDiedError: no reason given"
    assert len(_reason(ActorDiedError("x" * 1000))) == len("ActorDiedError: ") + 400


def test_the_trainers_signal_handlers_outlive_ray_init():
    from batchrl.envs.ray.cluster import _handlers_kept

    def handler(signum, frame):
        pass

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        with _handlers_kept():  # as ray.init does
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


def guards() -> list[psutil.Process]:
    """This process's ``RayGuard`` processes still running."""
    found = []
    for child in psutil.Process().children():
        try:
            if (child.status() != psutil.STATUS_ZOMBIE
                    and any(part.endswith("guard.py") for part in child.cmdline())):
                found.append(child)
        except psutil.Error:
            pass
    return found


def test_a_bad_ray_address_is_an_error_naming_it_and_leaves_no_guard():
    from batchrl.envs.ray import cluster as ray_cluster
    assert not ray.is_initialized(), "the cluster's tests run first and disconnect"
    with pytest.raises(EnvSpecError, match=r"^cannot connect to a Ray cluster at "
                                           r"env.ray_address='no-port': .*'ray start --head'"):
        ray_cluster.acquire("no-port")
    assert not ray.is_initialized()
    assert guards() == []
    assert ray_cluster._users == 0 and not ray_cluster._owned


GUARDED_SCRIPT = """
import subprocess, sys, time
from batchrl.envs.ray.guard import RayGuard
guard = RayGuard.start()
child = subprocess.Popen(["sleep", "60"])  # (as Ray's processes, started after the guard)
time.sleep(1.5)  # the guard notes it
if sys.argv[1] == "stop":
    guard.stop()
print(child.pid, guard._process.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("stopped", [False, True], ids=["killed", "stopped"])
def test_the_guard_kills_what_a_sigkilled_process_started_unless_stopped(stopped):
    process = subprocess.Popen(
        [sys.executable, "-c", GUARDED_SCRIPT, "stop" if stopped else "run"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        child, guard = map(int, process.stdout.readline().split())
        child = psutil.Process(child)
        if stopped:
            assert not psutil.pid_exists(guard) or psutil.Process(guard).status() == "zombie"
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        _, alive = psutil.wait_procs([child], timeout=3 if stopped else 10)
        assert alive == ([child] if stopped else [])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # (the sleep, in its session)
        process.wait()


def test_the_guards_kill_spares_a_recycled_pid_and_takes_later_children():
    from batchrl.envs.ray import guard

    table = {1: (0, "1"), 10: (1, "5"), 11: (10, "6"), 12: (11, "7"), 20: (1, "8")}
    assert guard.descendants(10, table) == {11: "6", 12: "7"}
    assert guard.descendants(1, table) == {10: "5", 11: "6", 12: "7", 20: "8"}
    assert guard.descendants(12, table) == {}

    shell = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not psutil.Process(shell.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        sleep, = psutil.Process(shell.pid).children()
        started = guard._processes()[shell.pid][1]
        guard._kill({shell.pid: str(int(started) + 1)})  # another process, of that pid
        time.sleep(0.2)
        assert shell.poll() is None and sleep.is_running()
        guard._kill({shell.pid: started})  # the shell noted, its child started later
        shell.wait(timeout=10)
        _, alive = psutil.wait_procs([sleep], timeout=10)
        assert alive == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given_in", ["config", "environment"])
def test_a_ray_address_where_no_head_listens_is_an_error_at_once(given_in, monkeypatch):
    """``ray.init`` retries an absent head for ever (every 5 s, without a word to the user):
    batchrl says that nothing listens there instead, naming where the address came from
    (``env.ray_address`` or ``RAY_ADDRESS``)."""
    import socket

    from batchrl.envs.ray import cluster as ray_cluster
    assert not ray.is_initialized(), "the cluster's tests run first and disconnect"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"  # (bound, not listening)
        if given_in == "environment":
            monkeypatch.setenv("RAY_ADDRESS", address)
        where = "env.ray_address" if given_in == "config" else "RAY_ADDRESS"
        started = time.monotonic()
        with pytest.raises(EnvSpecError, match=rf"^cannot connect to a Ray cluster at "
                                               rf"{where}='{address}': no Ray head "
                                               rf"listens at {address} .*'ray start --head'"):
            ray_cluster.acquire(address if given_in == "config" else "")
    assert time.monotonic() - started < 15
    assert not ray.is_initialized() and guards() == []


def test_a_ray_head_is_told_from_other_services_without_the_environments_proxy(
        cluster, monkeypatch):
    """Ray's channels ignore ``http_proxy``: so does the check that a Ray head answers (through
    a proxy that is not there, a real head was "not a Ray head")."""
    from batchrl.envs.ray import cluster as ray_cluster
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    ray_cluster._check_listening(cluster.address, timeout=5.0)


@pytest.mark.timeout(60)
def test_a_ray_address_of_a_service_that_is_not_a_ray_head_is_an_error_soon():
    """An HTTP server at ``env.ray_address`` (a wrong port): ``ray.init`` would retry it for
    ever, deaf to a first Ctrl-C; batchrl says that no Ray head answers there."""
    import http.server
    import threading

    from batchrl.envs.ray import cluster as ray_cluster
    assert not ray.is_initialized(), "the cluster's tests run first and disconnect"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(EnvSpecError, match=rf"^cannot connect to a Ray cluster at "
                                               rf"env.ray_address='{address}': the service at "
                                               rf"{address} is not a Ray head \(it does not "
                                               rf"answer gRPC within 10 s\)\. Start"):
            ray_cluster.acquire(address)
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - started < 30
    assert not ray.is_initialized() and guards() == []


def test_an_interrupted_connection_leaves_no_guard(monkeypatch):
    """A Ctrl-C while ``ray.init`` waits (stood for here by ``ray.init`` raising it: a real
    one reaches Python only when Ray's wait lets it) stops the guard started for it."""
    from batchrl.envs.ray import cluster as ray_cluster
    assert not ray.is_initialized(), "the cluster's tests run first and disconnect"

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ray_cluster.acquire("auto")
    assert guards() == []
    assert ray_cluster._users == 0 and not ray_cluster._owned
