"""Shared fixtures.

Every test is checked for leaked env worker processes: after it ends, no child
of this process's multiprocessing fork server may still be running.
``host_path`` runs a test on both paths of the per-step bookkeeping; the tests that use
the Ray ``cluster`` run in one test process under pytest-xdist.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def cluster():
    """A real Ray cluster on 127.0.0.1 (``ray_nodes.running_cluster``): a
    head node (2 CPUs, resource ``head_node``) and a second node (1 CPU,
    ``second_node``), with this process connected as driver. Skips the test
    when Ray is not installed."""
    pytest.importorskip("ray")
    from ray_nodes import running_cluster
    with running_cluster() as nodes:
        yield nodes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With ``pytest -n N --dist loadgroup`` (``make test``), run every test that uses
    the Ray cluster in one test process: one cluster at a time on the machine."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
