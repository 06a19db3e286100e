"""The default layout follows the cores a process may use: its affinity mask and
its cgroup's CPU quota.

Each case runs a fresh interpreter so that its mask, cgroup and environment are
in place before torch and the env workers start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from batchrl.hardware import cgroup_cpu_limit, core_share, usable_cores
from helpers import REPO

SCRIPT = """
import json, os, threading
import torch
from batchrl import BatchPPO, TensorBatchEnv, make_batch_env, simulate
from batchrl.hardware import usable_cores

if __name__ == "__main__":
    env = TensorBatchEnv(make_batch_env("CartPole-v1", 4))
    try:
        algo = BatchPPO(env.observation_space, env.action_space, 4, rollout_length=4,
                        update_epochs=1, inference="eager")
        value_steps_in = set()
        algo.value.out.weight.register_hook(
            lambda grad: value_steps_in.add(threading.current_thread().name))
        simulate(env, algo, reset=True, seed=0)
        for _ in range(8):  # two updates
            simulate(env, algo)
        workers = env.batch_env.workers
        print(json.dumps({
            "usable": usable_cores(), "workers": len(workers),
            "in_process": len(env) - sum(worker.num_envs for worker in workers),
            "worker_cores": [sorted(os.sched_getaffinity(worker.pid)) for worker in workers],
            "value_steps_in": sorted(value_steps_in)}))
    finally:
        env.close()
"""


def layout(tmp_path: Path, preexec=None, **environ: str) -> dict:
    script = tmp_path / "layout.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), **environ)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=120, preexec_fn=preexec)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_an_affinity_mask_of_one_core_keeps_workers_and_threads_there(tmp_path):
    core = max(os.sched_getaffinity(0))
    found = layout(tmp_path, preexec=lambda: os.sched_setaffinity(0, {core}))
    assert found["usable"] == 1 and found["workers"] == 1
    assert found["worker_cores"] == [[core]]
    # One core: the value step runs after the policy step, in the same thread.
    assert found["value_steps_in"] == ["MainThread"]


def test_the_default_layout_steps_every_env_in_a_worker(tmp_path):
    found = layout(tmp_path)
    assert found["in_process"] == 0 and found["workers"] == found["usable"]
    # Two or more cores: the value step runs beside the policy step, in its own thread.
    assert found["value_steps_in"] == (["batchrl-value_0"] if found["usable"] > 1
                                       else ["MainThread"])


def one_cpu_cgroup() -> Path:
    """A fresh cgroup (v1 or v2) limited to one CPU, or skip the test."""
    name = f"batchrl-test-{uuid.uuid4().hex[:8]}"
    for directory, files in ((Path("/sys/fs/cgroup/cpu") / name,
                              {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}),
                             (Path("/sys/fs/cgroup") / name, {"cpu.max": "100000 100000"})):
        if not directory.parent.is_dir():
            continue
        try:
            directory.mkdir()
        except OSError:
            continue
        try:
            for file, value in files.items():
                (directory / file).write_text(value)
            return directory
        except OSError:
            directory.rmdir()
    pytest.skip("cannot create a cgroup with a CPU quota here")


def test_a_one_cpu_cgroup_quota_gives_a_one_core_layout(tmp_path):
    group = one_cpu_cgroup()
    try:
        found = layout(tmp_path, preexec=lambda: (group / "cgroup.procs").write_text(
            str(os.getpid())))
    finally:
        # The fork server and workers leave the group a moment after the script.
        deadline = time.monotonic() + 20
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()
    assert found["usable"] == 1 and found["workers"] == 1
    # A quota below the mask: the worker is not pinned to the mask's first core (every
    # container sharing the host would pin there).
    assert found["worker_cores"] == [sorted(os.sched_getaffinity(0))]
    # One core: the value step runs after the policy step, in the same thread.
    assert found["value_steps_in"] == ["MainThread"]


def test_the_quota_is_read_from_the_process_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    for path, quota in (("cpu", "-1"), ("cpu/jobs", "250000"), ("cpu/jobs/run", "-1")):
        (root / path).mkdir(parents=True)
        (root / path / "cpu.cfs_quota_us").write_text(quota)
        (root / path / "cpu.cfs_period_us").write_text("100000")
    (root / "v2" / "run").mkdir(parents=True)
    (root / "v2" / "cpu.max").write_text("max 100000\n")
    (root / "v2" / "run" / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "cgroup-of-process"
    proc.write_text("4:memory:/elsewhere\n1:cpu:/jobs/run\n")
    assert cgroup_cpu_limit(proc, root) == 2.5
    proc.write_text("0::/run\n")
    assert cgroup_cpu_limit(proc, root / "v2") == 1.5
    proc.write_text("0::/\n")
    assert cgroup_cpu_limit(proc, root / "v2") is None
    assert cgroup_cpu_limit(tmp_path / "missing", root) is None
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


def _v1_group(root: Path, path: str, quota: str) -> None:
    (root / path).mkdir(parents=True)
    (root / path / "cpu.cfs_quota_us").write_text(quota)
    (root / path / "cpu.cfs_period_us").write_text("100000")


def test_the_tightest_quota_among_the_cgroup_and_its_ancestors_applies(tmp_path):
    # A looser quota below a tighter one does not lift it, whichever level is tighter.
    root = tmp_path / "cgroup"
    _v1_group(root, "cpu", "-1")
    _v1_group(root, "cpu/jobs", "150000")
    _v1_group(root, "cpu/jobs/run", "300000")
    _v1_group(root, "cpu/other", "300000")
    _v1_group(root, "cpu/other/run", "50000")
    proc = tmp_path / "cgroup-of-process"
    proc.write_text("1:cpu:/jobs/run\n")
    assert cgroup_cpu_limit(proc, root) == 1.5
    proc.write_text("1:cpu:/other/run\n")
    assert cgroup_cpu_limit(proc, root) == 0.5
    # cgroup v2: the same rule over cpu.max files.
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "a" / "cpu.max").write_text("200000 100000\n")
    (v2 / "a" / "b" / "cpu.max").write_text("400000 100000\n")
    proc.write_text("0::/a/b\n")
    assert cgroup_cpu_limit(proc, v2) == 2.0


def test_a_combined_cpu_cpuacct_hierarchy_is_read_where_it_is_mounted(tmp_path):
    # cgroup v1 lists the co-mounted controllers ("cpu,cpuacct"); the hierarchy is found
    # under that name or, where only that link exists, under "cpu".
    proc = tmp_path / "cgroup-of-process"
    proc.write_text("3:cpuset:/\n2:cpu,cpuacct:/jobs\n1:name=systemd:/jobs\n")
    combined = tmp_path / "combined"
    _v1_group(combined, "cpu,cpuacct", "-1")
    _v1_group(combined, "cpu,cpuacct/jobs", "250000")
    assert cgroup_cpu_limit(proc, combined) == 2.5
    linked = tmp_path / "linked"
    _v1_group(linked, "cpu", "-1")
    _v1_group(linked, "cpu/jobs", "250000")
    assert cgroup_cpu_limit(proc, linked) == 2.5


USABLE_UNDER_QUOTAS = """
import sys
from pathlib import Path
from batchrl.hardware import usable_cores
quota = Path(sys.argv[1]) / "cpu.cfs_quota_us"
for value in sys.argv[2:]:
    quota.write_text(value)
    print(usable_cores())
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_usable_cores_rounds_a_fractional_quota_up(tmp_path):
    # A quota of 1.5 CPUs keeps two cores partly busy: two usable cores; 0.5 CPUs: one.
    if usable_cores() < 2:
        pytest.skip("this process's own quota leaves it fewer than two cores")
    group = Path("/sys/fs/cgroup/cpu") / f"batchrl-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
    except OSError:
        pytest.skip("cannot create a cgroup v1 cpu group here")
    try:
        result = subprocess.run(
            [sys.executable, "-c", USABLE_UNDER_QUOTAS, str(group), "150000", "50000"],
            capture_output=True, text=True, timeout=60,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "1"]


def test_core_shares_are_contiguous_and_cover_the_cores_or_share_one_each():
    cores = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert [core_share(cores, i, 4) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    assert [core_share([3, 5], i, 3) for i in range(3)] == [[3], [3], [5]]  # (more parts)
    assert core_share([], 0, 2) == []
