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
from batchrl.envs.ray.worker import RayEnvWorker  # noqa: E402
from ray_nodes import PATIENCE, ROOT  # noqa: E402
from helpers import (CountingEnv, assert_same_log, fails_at, make_cartpole,  # noqa: E402
                     make_cheetah, raise_site, rollout, sleeps_at)

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


def test_train_py_runs_its_envs_on_the_cluster(cluster, closing, tmp_path):
    cluster.wait_idle()
    logdir = tmp_path / "run"
    settings = ["env.backend=ray", f"env.ray_address={cluster.address}", "env.num_agents=4",
                "env.workers=2", "env.max_length=50", "algorithm.update_every=4",
                "train.steps=400", "train.eval_episodes=2"]
    process = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "cartpole", "--logdir",
         str(logdir), "--no-progress", *[arg for s in settings for arg in ("--set", s)]],
        env=cluster.env, capture_output=True, text=True, timeout=PATIENCE * 2)
    assert process.returncode == 0, process.stderr
    assert "Final evaluation:" in process.stdout
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
    finally:
        if process.poll() is None:
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
