"""A real Ray cluster on 127.0.0.1 for the tests: nodes started with
``ray start``, each in its own session so that its processes can be found and
killed without touching any other Ray on this machine. The ``cluster``
fixture (``conftest.py``) starts one for all the tests that ask for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import ray

ROOT = Path(__file__).resolve().parent.parent
# Seconds to wait for the cluster to notice a lost node, an actor to be placed...
# a bound for loops that wait for Ray, not a measured time.
PATIENCE = 60.0
# Detect a lost node within about a second instead of Ray's default ~30 s.
HEAD_SYSTEM_CONFIG = {"health_check_period_ms": 300, "health_check_failure_threshold": 3,
                      "health_check_initial_delay_ms": 0}


def ray_cli() -> str:
    """The ``ray`` command of the Python environment running the tests."""
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else shutil.which("ray") or "ray"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """Ray nodes started by ``ray start``, each in its own session so that
    its processes (Ray's workers included) can be found and killed by
    session id without touching any other Ray on this machine."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="brl-ray-", dir="/tmp"))  # short: socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.sessions: dict[str, int] = {}
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                        PYTHONPATH=os.pathsep.join(
                            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def start(self, name: str, num_cpus: int, head: bool = False) -> None:
        """Start node ``name`` with ``num_cpus`` CPUs and the custom resource
        ``{name}_node`` (1 unit)."""
        args = [ray_cli(), "start", f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
                f"--resources={json.dumps({f'{name}_node': 1})}", "--disable-usage-stats",
                f"--temp-dir={self.tmp / name}"]
        if head:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--system-config={json.dumps(HEAD_SYSTEM_CONFIG)}"]
        else:
            args += [f"--address={self.address}"]
        # A new session: `ray start` daemonises its processes, which keep its sid.
        process = subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, start_new_session=True)
        self.sessions[name] = process.pid
        _, err = process.communicate(timeout=PATIENCE)
        assert process.returncode == 0, err.decode(errors="replace")[-3000:]
        if ray.is_initialized():  # wait until the driver sees the node
            deadline = time.monotonic() + PATIENCE
            while self.node_id(name) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert self.node_id(name) is not None, f"node {name} did not join"

    def node_id(self, name: str) -> str | None:
        """The id of the live node that has the resource ``{name}_node``."""
        for node in ray.nodes():
            if node["Alive"] and f"{name}_node" in node["Resources"]:
                return node["NodeID"]
        return None

    def processes(self, names: list[str] | None = None,
                  command: str | None = None) -> list[psutil.Process]:
        """The running processes of the nodes ``names`` (all by default), only those whose
        command line holds ``command`` if given (a process that ends meanwhile is left out)."""
        sessions = {self.sessions[name] for name in (names or self.sessions)}
        found = []
        for process in psutil.process_iter():
            try:
                if (os.getsid(process.pid) in sessions
                        and process.status() != psutil.STATUS_ZOMBIE
                        and (command is None or command in " ".join(process.cmdline()))):
                    found.append(process)
            except (OSError, psutil.Error):
                pass
        return found

    def kill(self, names: list[str] | None = None) -> list[int]:
        """SIGKILL every process of the nodes ``names`` (as a machine that
        goes down) and wait until they are gone; returns the pids left."""
        deadline = time.monotonic() + 10
        left = self.processes(names)
        while left and time.monotonic() < deadline:
            for process in left:
                try:
                    process.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            psutil.wait_procs(left, timeout=2)
            left = self.processes(names)
        return [process.pid for process in left]

    def wait_idle(self) -> None:
        """Wait until no actor holds CPUs (Ray frees a killed actor's
        resources asynchronously); fails if one stays, i.e. an actor leaked."""
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            total, free = ray.cluster_resources(), ray.available_resources()
            if free.get("CPU", 0) >= total.get("CPU", 0):
                return
            time.sleep(0.1)
        raise AssertionError(f"actors still hold CPUs: {ray.available_resources()} of "
                             f"{ray.cluster_resources()}")


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """A head node (2 CPUs, resource ``head_node``) and a second node (1 CPU,
    ``second_node``) on 127.0.0.1, with this process connected as driver."""
    saved = {key: os.environ.get(key) for key in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE")}
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    nodes = Cluster()
    try:
        nodes.start("head", 2, head=True)
        nodes.start("second", 1)
        ray.init(address=nodes.address, logging_level="warning")
        yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        # Not `ray stop --force`: it kills every Ray process of this machine,
        # also clusters that are none of this test's business.
        left = nodes.kill()
        shutil.rmtree(nodes.tmp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert not left, f"Ray processes left running: {left}"
        stray = [p.pid for p in psutil.process_iter(["cmdline"])
                 if str(nodes.tmp) in " ".join(p.info["cmdline"] or [])]
        assert not stray, f"processes of the test cluster left running: {stray}"
