"""Shared fixtures.

Every test is checked for leaked env worker processes: after it ends, no child
of this process's multiprocessing fork server may still be running.
``host_path`` runs a test on both paths of the per-step bookkeeping; the tests that use
the Ray ``cluster`` run one after the other in one test process, which starts the cluster
once for them.
"""

from __future__ import annotations

import contextlib
import time

import psutil
import pytest

from batchrl.envs import ExternalProcess
from batchrl.parts import numpy_views


def _running_workers() -> list[psutil.Process]:
    """Env workers started by this test process that are still running.

    ``ExternalProcess`` starts its workers through multiprocessing's fork
    server, so they are the children of our fork-server child. Processes of
    other Python interpreters that tests launch (and their own workers) are not
    counted here; those tests check them themselves.
    """
    workers = []
    for child in psutil.Process().children():
        try:
            if "multiprocessing.forkserver" in " ".join(child.cmdline()):
                workers.extend(child.children())
        except psutil.Error:
            pass
    running = []
    for worker in workers:
        try:
            if worker.status() != psutil.STATUS_ZOMBIE:
                running.append(worker)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.fixture(autouse=True)
def no_leaked_workers():
    """Fail a test that leaves env worker processes behind (and kill them)."""
    yield
    deadline = time.monotonic() + 3.0
    leaked = _running_workers()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = _running_workers()
    if leaked:
        for process in leaked:
            try:
                process.kill()
            except psutil.Error:
                pass
        pytest.fail(f"env worker processes left running after the test: "
                    f"{[p.pid for p in leaked]}")


@pytest.fixture
def external():
    """``external(constructor, **kwargs)`` builds an ``ExternalProcess`` that is
    closed when the test ends, whatever happens in it."""
    created: list[ExternalProcess] = []

    def make(constructor, **kwargs) -> ExternalProcess:
        env = ExternalProcess(constructor, **kwargs)
        created.append(env)
        return env

    yield make
    for env in created:
        env.close()


def wait_until_gone(pids, timeout: float) -> list[int]:
    """Poll until none of ``pids`` runs (zombies count as gone); return the
    pids still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


@pytest.fixture
def gone():
    """The ``wait_until_gone`` helper, as a fixture."""
    return wait_until_gone


@pytest.fixture(params=[True, False], ids=["numpy", "torch"])
def host_path(request, monkeypatch):
    """Run a test with the numpy path of the per-step bookkeeping on the CPU
    (``batchrl.parts.numpy_views``) and with torch operations."""
    monkeypatch.setattr(numpy_views, "enabled", request.param)
    return request.param


@pytest.fixture
def one_torch_thread():
    """Torch with one intra-op thread: the tests' networks are tiny, and more threads only add
    synchronisation, which costs up to 10x in wall time on a busy 2-core machine."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Modules whose tests mostly run commands end to end (train.py, batchrl.evaluate, torchrun, an
# installed wheel): their tests are marked ``e2e``, as is every test of the Ray cluster, and the
# quick loop (``make test-fast``) leaves them out. Other modules have a few such tests too.
E2E_MODULES = ("test_bad_input", "test_hardware", "test_install", "test_learners",
               "test_opengl_errors", "test_reliability", "test_shutdown", "test_train",
               "test_user_algorithm")
# Module-scoped fixtures that build a run or a wheel once for their module's tests. Under
# pytest-xdist (``make test``) every test process that gets one of those tests builds it
# again, so the tests that use one go to one test process together.
SHARED_FIXTURES = ("cartpole_run", "pushed_cheetah_run", "parents", "wheel", "two_learners",
                   "cheetah_run", "finished_run", "straight_run", "results")


class _SharedCluster:
    """The Ray cluster of the ``ray`` group's tests: started by the first of them and stopped
    after the last (``pytest_runtest_teardown``), so that the four modules that use a cluster
    start one between them and the other tests of their test process run without it."""

    def __init__(self) -> None:
        self.stack: contextlib.ExitStack | None = None
        self.nodes = None

    def get(self):
        if self.stack is None:
            from ray_nodes import running_cluster
            with contextlib.ExitStack() as stack:
                self.nodes = stack.enter_context(running_cluster())
                self.stack = stack.pop_all()  # (only once it is up: a failure is raised again)
        return self.nodes

    def stop(self) -> None:
        if self.stack is not None:
            stack, self.stack, self.nodes = self.stack, None, None
            stack.close()


_CLUSTER = _SharedCluster()


@pytest.fixture
def cluster():
    """A real Ray cluster on 127.0.0.1 (``ray_nodes.running_cluster``): a
    head node (2 CPUs, resource ``head_node``) and a second node (1 CPU,
    ``second_node``), with this process connected as driver. Skips the test
    when Ray is not installed. Nodes the test starts are killed after it."""
    pytest.importorskip("ray")
    nodes = _CLUSTER.get()
    yield nodes
    added = [name for name in nodes.sessions if name not in ("head", "second")]
    if added and nodes.processes(added):
        assert nodes.kill(added) == []


def _uses_cluster(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return ("cluster" in getattr(item, "fixturenames", ())
            or (callspec is not None and callspec.params.get("transport") == "ray"))


def pytest_itemcollected(item: pytest.Item) -> None:
    """With ``pytest -n N --dist loadgroup`` (``make test``), run every test that uses
    the Ray cluster in one test process (one cluster at a time on the machine, started
    once), and the tests of a shared module fixture in one process. Marked as each test is
    collected: pytest-xdist reads the groups in its own ``pytest_collection_modifyitems``."""
    names, ray = getattr(item, "fixturenames", ()), _uses_cluster(item)
    if ray or item.module.__name__ in E2E_MODULES:
        item.add_marker(pytest.mark.e2e)
    if ray:
        item.add_marker(pytest.mark.xdist_group("ray"))
    else:
        for name in SHARED_FIXTURES:
            if name in names:
                item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{name}"))
                break


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cluster's tests first, one after the other: the cluster is started once without
    pytest-xdist too, and under it their test process starts on them at once (the longest
    group, which would otherwise come last and be the suite's tail)."""
    items.sort(key=lambda item: not _uses_cluster(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the test's own fixtures are torn down: stop the cluster after its last test."""
    try:
        return (yield)
    finally:
        if _uses_cluster(item) and (nextitem is None or not _uses_cluster(nextitem)):
            _CLUSTER.stop()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the last test's fixtures
def pytest_sessionfinish() -> None:
    _CLUSTER.stop()
