"""Crashes and kills with real processes: a SIGKILLed trainer leaves no env
worker behind, a signal to the process group leaves the workers to the
parent, a checkpoint write killed at random moments never leaves an
unreadable checkpoint, and a damaged one is reported by name.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from batchrl.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints,
                                load_checkpoint, save_checkpoint, serialize)
from batchrl.config import ConfigError, load_config
from batchrl.files import atomic_write
from batchrl.metrics import read_metrics
from batchrl.trainer import Trainer
from helpers import (LIMIT_TASKS, REPO, TRAIN_PY, assert_same, mount_namespace, pids_cgroup,
                     run_stdin_script, running, sets, wait_gone)

ENVIRON = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
CARTPOLE = ["env.num_agents=4", "algorithm.update_every=4", "train.eval_episodes=4",
            "train.device=cpu"]


def kill_all(pids: list[int]) -> None:
    for pid in running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sigkill_leaves_nothing(process: subprocess.Popen, children: list[int],
                           timeout: float) -> None:
    """SIGKILL ``process``, which has no chance to clean up: its ``children``, all running,
    must exit by themselves within ``timeout`` seconds."""
    assert running(children) == children
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(10) == -signal.SIGKILL
    assert wait_gone(children, timeout=timeout) == []


def reap(process: subprocess.Popen, children: list[int]) -> None:
    """Whatever a test left running: ``process`` and its ``children``."""
    if process.poll() is None:
        process.kill()
    process.communicate()
    kill_all(children)


# --- SIGKILL of the trainer ------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["workers", "process"])
def test_sigkilled_train_py_leaves_no_process_behind(backend, tmp_path):
    """SIGKILL gives train.py no chance to clean up: its env workers (and the
    fork server, and the shared-memory tracker) must exit by themselves."""
    logdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir", str(logdir),
         "--no-progress", *sets(*CARTPOLE, f"env.backend={backend}", "env.workers=2",
                                "env.share_main=false", "train.steps=1000000")],
        env=ENVIRON, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(read_metrics(logdir)) < 2 and process.poll() is None:
            assert time.monotonic() < deadline, "train.py did not train"
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        envs = 2 if backend == "workers" else 4
        assert len(children) >= envs + 1  # the env processes and the fork server
        sigkill_leaves_nothing(process, children, timeout=20)
    finally:
        reap(process, children)


STUCK_ENV = textwrap.dedent("""
    import gymnasium as gym
    import numpy as np

    class HoldsTheGil(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            sum(range(10**13))  # one C call that never lets another thread run
            return np.zeros(1, np.float32), 0.0, False, False, {}
""")

STUCK_PARENT = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from batchrl.envs.factory import make_batch_env

    if __name__ == "__main__":
        batch = None

        def build():  # a thread starts the fork server, then ends
            global batch
            batch = make_batch_env("stuck_env:HoldsTheGil", 2, workers=2, share_main=False)
            batch.reset(seed=0)

        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
        batch.reset(seed=1)  # the fork server and its workers outlived that thread
        print("ready", flush=True)
        batch.step(np.zeros(2, np.int64))
""")


@pytest.mark.timeout(60)
def test_sigkilled_parent_takes_workers_stuck_holding_the_gil_with_it(tmp_path):
    """A worker stuck in a C call that holds the GIL cannot run its watchdog thread, and it
    keeps the fork server's "alive" pipe open: the fork server must still end with the
    killed parent (its own parent-death signal), and so take the worker with it. The fork
    server must not end when only the thread that started it ends."""
    (tmp_path / "stuck_env.py").write_text(STUCK_ENV)
    (tmp_path / "parent.py").write_text(STUCK_PARENT)
    environ = dict(ENVIRON, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    process = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], env=environ,
                               start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert process.stdout.readline() == "ready\n", process.communicate()
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        assert len(children) >= 4  # the fork server, 2 workers, the resource tracker
        time.sleep(0.5)  # the workers are inside step() now
        sigkill_leaves_nothing(process, children, timeout=15)
    finally:
        reap(process, children)


SPAWNING_ENV = textwrap.dedent("""
    import subprocess, sys
    import gymnasium as gym
    import numpy as np

    class Spawns(gym.Env):
        \"\"\"Starts a helper process (as a simulator's server would) and never stops it.\"\"\"
        observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self):
            self.helper = subprocess.Popen([sys.executable, "-c",
                                            "import time; time.sleep(600)"])

        def reset(self, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            return np.zeros(1, np.float32), 0.0, False, False, {}
""")

SPAWNING_PARENT = textwrap.dedent("""
    import sys
    import numpy as np
    from batchrl.envs.factory import make_batch_env

    if __name__ == "__main__":
        batch = make_batch_env("spawning_env:Spawns", 2, workers=2, share_main=False)
        batch.reset(seed=0)
        print("ready", flush=True)
        sys.stdin.readline()
        if sys.argv[1] == "crashed":  # the test killed a worker meanwhile
            try:
                batch.step(np.zeros(2, np.int64))
            except Exception as exc:
                print(type(exc).__name__, flush=True)
        batch.close()
        print("closed", flush=True)
        sys.stdin.readline()
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "crashed", "sigkill"])
def test_what_an_env_started_ends_with_its_worker(tmp_path, how):
    """An env that starts a process of its own and never stops it: closing the batch (after
    one of its workers was killed, too) or a SIGKILLed parent leave none of those processes
    behind."""
    (tmp_path / "spawning_env.py").write_text(SPAWNING_ENV)
    (tmp_path / "parent.py").write_text(SPAWNING_PARENT)
    environ = dict(ENVIRON, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    process = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), how],
                               env=environ, start_new_session=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert process.stdout.readline() == "ready\n", process.communicate()
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        helpers = [pid for pid in children if "time.sleep(600)" in
                   " ".join(psutil.Process(pid).cmdline())]
        assert len(helpers) == 2
        if how == "sigkill":
            sigkill_leaves_nothing(process, children, timeout=15)
        else:
            if how == "crashed":
                os.kill(psutil.Process(helpers[0]).ppid(), signal.SIGKILL)  # its worker
            process.stdin.write("\n")
            process.stdin.flush()
            if how == "crashed":
                assert process.stdout.readline() == "EnvCrashedError\n", process.communicate()
            assert process.stdout.readline() == "closed\n", process.communicate()
            assert wait_gone(helpers, timeout=10) == []
    finally:
        reap(process, children)


# --- signals to the whole process group ------------------------------------------------

GROUP_SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from batchrl.envs.factory import make_batch_env

    # This process plays the trainer: it handles the signals itself. (A handler,
    # not SIG_IGN, which the fork server would inherit.)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)
    batch = make_batch_env("CartPole-v1", 4, backend=sys.argv[1], workers=2,
                           share_main=False)
    batch.reset(seed=0)
    print("ready", flush=True)
    sys.stdin.readline()  # the test signals the whole group meanwhile
    for _ in range(5):
        batch.reset(seed=1)
        batch.step(np.zeros(4, np.int64))
    batch.close()
    print("stepped and closed", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["workers", "process"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_group_signal_leaves_the_workers_to_the_parent(backend, signum):
    """Ctrl-C and ``kill -TERM -PGID`` reach every process of the group (the fork server;
    the env workers lead groups of their own, which a scheduler signals too); the fork server
    and the workers must survive them, so that the parent can finish its step, write its
    checkpoint and close them itself."""
    process = subprocess.Popen([sys.executable, "-c", GROUP_SIGNAL_SCRIPT, backend],
                               env=ENVIRON, start_new_session=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert process.stdout.readline() == "ready\n", process.communicate()
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        os.killpg(process.pid, signum)
        # A scheduler signals every process of the job: the workers ignore it too.
        for pid in children:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signum)
        time.sleep(0.5)  # a killed fork server takes its workers with it at once
        stdout, stderr = process.communicate("go\n", timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert stdout == "stepped and closed\n"
    assert wait_gone(children, timeout=10) == []


# --- checkpoint writes killed at random moments ----------------------------------------

WRITER_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from batchrl.checkpoint import latest_checkpoint, save_checkpoint

    logdir = sys.argv[1]
    latest = latest_checkpoint(logdir)
    step = 0 if latest is None else int(latest.stem.split("-")[1])
    print("writing", flush=True)
    while True:  # until killed: checkpoints of 24 MB, each filled with its step
        step += 1
        save_checkpoint(logdir, step, {"algorithm": {"weights": torch.full((6_000_000,), float(step))},
                                       "counters": {"steps": step}}, keep=2)
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_checkpoint_write_killed_at_random_moments_leaves_the_latest_loadable(tmp_path):
    rng = random.Random(0)
    rounds, interrupted_writes, last_step = 8, 0, 0
    for _ in range(rounds):
        writer = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_path)],
                                  env=ENVIRON, stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline() == "writing\n"
            time.sleep(rng.uniform(0.05, 1.0))
            writer.kill()
            writer.wait(10)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            writer.stdout.close()
        interrupted_writes += bool(list(tmp_path.glob("*.tmp")))
        latest = latest_checkpoint(tmp_path)
        if latest is None:
            continue  # killed before the first write completed
        assert not latest.name.endswith(".tmp")
        assert set(list_checkpoints(tmp_path)) <= set(tmp_path.glob("ckpt-*.pt"))
        state = load_checkpoint(latest)
        step = state["counters"]["steps"]
        assert latest.name == f"ckpt-{step:012d}.pt"
        assert torch.equal(state["algorithm"]["weights"],
                           torch.full((6_000_000,), float(step)))
        assert step >= last_step
        last_step = step
    assert last_step > 0
    # Most kills hit a write in progress (the writer does nothing else), and
    # those left a partial .tmp file that was never taken for a checkpoint.
    assert interrupted_writes > 0
    # The next write cleans the partial files up.
    save_checkpoint(tmp_path, last_step + 1, {"algorithm": {}}, keep=2)
    assert not list(tmp_path.glob("*.tmp"))


# --- a damaged checkpoint, a partial one -------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("finished") / "run"
    config = load_config("cartpole", CARTPOLE + ["train.steps=400"])
    Trainer(config, logdir, progress=False).run()
    return logdir


def copy_run(source: Path, target: Path) -> Path:
    import shutil
    shutil.copytree(source, target)
    return target


@pytest.mark.timeout(120)
def test_damaged_latest_checkpoint_is_named_and_nothing_is_overwritten(finished_run,
                                                                       tmp_path):
    logdir = copy_run(finished_run, tmp_path / "run")
    latest = list_checkpoints(logdir)[-1]
    data = latest.read_bytes()
    latest.write_bytes(data[:len(data) // 2])  # as a copy cut short would leave it
    records = read_metrics(logdir)
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {latest}"):
        load_checkpoint(latest)
    result = subprocess.run(
        [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir", str(logdir),
         "--no-progress", "--steps", "800"],
        env=ENVIRON, capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: cannot read checkpoint {latest}")
    assert "Delete it to continue from the previous checkpoint" in result.stderr
    assert latest.read_bytes() == data[:len(data) // 2]  # left for the user to look at
    assert read_metrics(logdir) == records


SAME_FILE_WRITER = textwrap.dedent("""
    import sys
    from batchrl.files import atomic_write

    for round_ in range(300):
        with atomic_write(sys.argv[1]) as file:
            file.write(f"{sys.argv[2]} {round_}\\n")
""")


def resume(logdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir",
                           str(logdir), "--no-progress", *args],
                          env=ENVIRON, capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("case", ["budget lowered", "bad machine key", "edited config"])
def test_a_resume_the_run_cannot_take_is_a_one_line_error(finished_run, tmp_path, case):
    """Each in one line, exit 2, the run left as it was: --steps below the run's budget (it
    would change the schedules that anneal over it), a bad --set of where the run goes on
    (the --set's error, not the saved file's), and a config.json edited so that the
    checkpoint no longer fits its algorithm."""
    logdir = copy_run(finished_run, tmp_path / "run")
    saved = (logdir / "config.json").read_text()
    if case == "budget lowered":
        result = resume(logdir, "--steps", "200")
        expected = (f"error: --steps 200 is below the run's budget (400, train.steps in "
                    f"{logdir / 'config.json'}): --steps only raises it")
    elif case == "bad machine key":
        result = resume(logdir, "--set", "env.workers=-1")
        expected = "error: env.workers must be >= 0"
    else:
        values = json.loads(saved)
        values["algorithm"]["policy_layers"] = [7]
        saved = json.dumps(values)
        (logdir / "config.json").write_text(saved)
        result = resume(logdir)
        expected = (f"error: {list_checkpoints(logdir)[-1]} does not fit the algorithm its "
                    f"run's config.json builds (batchrl.algos.ppo:BatchPPO): ")
        assert result.stderr.rstrip().endswith(
            "; restore that file (each checkpoint holds its run's config, under 'config')")
    assert result.returncode == 2, result
    assert result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert json.loads((logdir / "config.json").read_text()) == json.loads(saved)
    assert read_metrics(logdir) == read_metrics(finished_run)


def test_a_write_that_fails_leaves_the_old_file_as_it_was(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_write(path) as file:
            file.write("new, half")
            file.flush()
            assert path.read_text() == "old"  # (nothing of the new file shows before it ends)
            raise RuntimeError("crash")
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_processes_writing_one_file_at_once_each_write_it_whole(tmp_path):
    path = tmp_path / "started_with.json"
    writers = [subprocess.Popen([sys.executable, "-c", SAME_FILE_WRITER, str(path), name],
                                env=ENVIRON, stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    errors = [writer.communicate(timeout=60)[1] for writer in writers]
    assert [writer.returncode for writer in writers] == [0, 0], errors
    assert path.read_text() in ("a 299\n", "b 299\n")
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.timeout(120)
def test_a_log_directory_in_use_is_refused_and_freed_by_its_runs_end(tmp_path):
    """Two runs in one log directory would write each other's records, events and
    checkpoints: while a run trains there, a second train.py exits 2 naming its pid, and a
    Trainer of the Python API raises; a SIGKILLed run leaves no stale lock."""
    from batchrl.files import LogdirInUse, hold_logdir, release_logdir

    logdir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir", str(logdir),
         "--no-progress", *sets(*CARTPOLE), "--steps", "10000000"],
        env=ENVIRON, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (logdir / "config.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        started = (logdir / "started_with.json").read_text()
        second = resume(logdir, "--steps", "20000000")
        assert second.returncode == 2, second
        assert second.stderr == (f"error: {logdir} is in use by another training run (pid "
                                 f"{first.pid}): wait for it to end or stop it, or choose "
                                 f"another --logdir\n")
        assert (logdir / "started_with.json").read_text() == started
        with pytest.raises(LogdirInUse, match=f"pid {first.pid}"):
            Trainer(load_config("cartpole", CARTPOLE + ["env.backend=inline"]), logdir,
                    progress=False).run()
        assert first.poll() is None
        first.kill()
        first.wait(10)
        hold_logdir(logdir)  # (the system dropped the killed run's lock)
        release_logdir(logdir)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()


NO_THREAD_LEFT_SCRIPT = LIMIT_TASKS + """
from batchrl.train import main

limit_tasks()
sys.exit(main(["--config", "pendulum", "--logdir", sys.argv[3], "--no-progress", "--set",
               "env.backend=inline", "--set", "train.steps=2000"], "python train.py"))
"""


@pytest.mark.timeout(60)
def test_no_thread_left_is_a_one_line_error(tmp_path):
    """Under a container's pids.max (or a small ulimit -v), the first thread train.py starts
    cannot start: one line says which limits to raise, not a traceback."""
    with pids_cgroup() as group:
        result = run_stdin_script(NO_THREAD_LEFT_SCRIPT, str(group), "0", str(tmp_path / "run"))
    assert result.returncode == 1, result
    assert result.stderr.splitlines()[0] == (
        "error: can't start new thread; raise the limit on processes and threads (ulimit -u, "
        "a container's pids.max) or on virtual memory (ulimit -v)"), result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_a_console_that_cannot_encode_the_output_gets_escapes(tmp_path):
    """stdout in ASCII (``PYTHONIOENCODING``, a terminal's encoding): the "±" of the final
    evaluation raised UnicodeEncodeError once training had finished."""
    result = subprocess.run(
        [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir", str(tmp_path / "r"),
         "--no-progress", "--steps", "400", *sets(*CARTPOLE, "env.backend=inline")],
        env=dict(ENVIRON, PYTHONIOENCODING="ascii"), cwd=REPO, capture_output=True,
        text=True, encoding="ascii", timeout=100)
    assert result.returncode == 0, result.stderr
    assert re.search(r"Final evaluation: [-\d.]+ \\xb1 [\d.]+ over 4 episodes",
                     result.stdout), result.stdout


@pytest.mark.timeout(240)
def test_a_full_disk_is_a_one_line_error_and_the_run_resumes_once_there_is_room(tmp_path):
    """A log directory on a file system of 2 MiB (a tmpfs in a mount namespace of the test's
    own) fills at the second or third checkpoint: one line says so (torch's writer buries
    the OSError in its own RuntimeError), with the resume command; nothing half-written is
    left, and once the file system has room the run resumes to its end."""
    namespace = mount_namespace()
    disk = tmp_path / "disk"
    disk.mkdir()
    logdir = disk / "run"
    resume = f"{sys.executable} {TRAIN_PY} --config cartpole --logdir {logdir} --no-progress"
    train = f"{resume} --steps 8000 " + " ".join(f"--set {override}" for override in CARTPOLE)
    script = (f"mount -t tmpfs -o size=2m tmpfs {disk} && {{ {train}; echo exit=$?; "
              f"ls {logdir}; mount -o remount,size=64m {disk} && {resume}; echo exit=$?; }}")
    result = subprocess.run([*namespace, "sh", "-c", script], env=ENVIRON, cwd=REPO,
                            capture_output=True, text=True, timeout=220)
    first, _, second = result.stdout.partition("exit=1\n")
    assert second, result
    errors = result.stderr.splitlines()
    assert errors[0] == ("error: No space left on device; free space on that file system "
                         "(df -h)"), result.stderr
    assert re.fullmatch(f"The run's latest checkpoint is {logdir}/ckpt-\\d{{12}}.pt. Once "
                        f"there is room, resume it with: python train.py --config cartpole "
                        f"--logdir {logdir}", errors[2]), result.stderr
    assert "Traceback" not in result.stderr
    left = second.split("Training BatchPPO")[0].split()
    assert not [name for name in left if "tmp" in name], left  # (nothing half-written)
    assert second.rstrip().endswith("exit=0"), result
    assert "Final evaluation:" in second


def test_a_log_directory_on_a_file_system_without_record_locks_is_used_unguarded(
        tmp_path, monkeypatch):
    """(Some network file systems refuse record locks: ENOLCK, not a run holding it.)"""
    import errno
    import fcntl

    from batchrl.files import LogdirInUse, hold_logdir, release_logdir

    def refused(code):
        def lockf(fd, operation):
            raise OSError(code, os.strerror(code))
        return lockf

    monkeypatch.setattr(fcntl, "lockf", refused(errno.ENOLCK))
    hold_logdir(tmp_path)
    release_logdir(tmp_path)
    monkeypatch.setattr(fcntl, "lockf", refused(errno.EAGAIN))  # (what a held lock gives)
    with pytest.raises(LogdirInUse):
        hold_logdir(tmp_path)


def test_partial_tmp_file_is_not_taken_for_a_checkpoint(finished_run, tmp_path):
    logdir = copy_run(finished_run, tmp_path / "run")
    latest = list_checkpoints(logdir)[-1]
    step = load_checkpoint(latest)["counters"]["steps"]
    # A write of a later checkpoint that a crash cut short.
    partial = logdir / f"ckpt-{step + 1000:012d}.pt.4242.tmp"
    partial.write_bytes(latest.read_bytes()[:1000])
    assert latest_checkpoint(logdir) == latest
    config = load_config("cartpole", CARTPOLE + ["train.steps=600"])
    Trainer(config, logdir, progress=False).run()
    records = read_metrics(logdir)
    assert records[-1]["step"] >= 600
    assert [r["step"] for r in records if r["phase"] == "train"] == \
        sorted({r["step"] for r in records if r["phase"] == "train"})
    assert not partial.exists()  # cleaned up by the next checkpoint write


def test_a_resumed_session_continues_the_random_generators_of_its_checkpoint(finished_run,
                                                                             tmp_path):
    """Torch's, NumPy's and Python's global generators (an algorithm or an env in this
    process may draw from any of them) go on from the states the checkpoint holds, not from
    train.seed's. Here states no seeding by train.seed gives, and a session with nothing
    left to train, which draws nothing."""
    logdir = copy_run(finished_run, tmp_path / "run")
    state = load_checkpoint(list_checkpoints(logdir)[-1])
    state["rng"] = {"torch": torch.Generator().manual_seed(7).get_state(),
                    "numpy": np.random.RandomState(7).get_state(),
                    "python": random.Random(7).getstate(), "cuda": None}
    save_checkpoint(logdir, state["counters"]["steps"], state)
    Trainer(load_config("cartpole", CARTPOLE + ["train.steps=400"]), logdir,
            progress=False).run()
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    assert_same(np.random.get_state(), state["rng"]["numpy"], "numpy")
    assert random.getstate() == state["rng"]["python"]


def test_a_checkpoint_of_several_learners_is_not_resumed_by_one(finished_run, tmp_path):
    """Each learner's generators (and per-agent state) are its own part of the checkpoint:
    a run of one learner cannot resume exactly from two learners' parts, and says so before
    it trains."""
    logdir = copy_run(finished_run, tmp_path / "run")
    latest = list_checkpoints(logdir)[-1]
    state = load_checkpoint(latest)
    state["learners"] = [{"rng": state["rng"], "algorithm": {}}] * 2  # as two learners write it
    save_checkpoint(logdir, state["counters"]["steps"], state)
    records = read_metrics(logdir)
    with pytest.raises(ConfigError, match=(
            f"^{latest} was written by 2 learner\\(s\\) and resumes exactly only with as many "
            f"\\(train.learners = 2\\); this run has 1$")):
        Trainer(load_config("cartpole", CARTPOLE + ["train.steps=800"]), logdir,
                progress=False).run()
    assert read_metrics(logdir) == records and list_checkpoints(logdir)[-1] == latest


# --- an env failure keeps the last phase boundary --------------------------------------

def test_env_failure_saves_the_last_phase_boundary(tmp_path):
    """No checkpoint is due (checkpoint_every is huge) when an env raises
    mid-run: the trainer still writes the state of the last finished phase,
    and the run resumes from it without repeating or losing a phase."""
    from batchrl.envs.errors import EnvRaisedError
    logdir = tmp_path / "run"
    config = load_config("cartpole", CARTPOLE + [
        "env.id=batchrl.testing.faults:make", 'env.kwargs={fault = "raise", at_step = 300}',
        "train.checkpoint_every=1000", "train.steps=100000"])
    with pytest.raises(EnvRaisedError, match="injected fault in step 300"):
        Trainer(config, logdir, progress=False).run()
    records = read_metrics(logdir)
    checkpoints = list_checkpoints(logdir)
    assert len(checkpoints) == 1 and len(records) >= 2
    state = load_checkpoint(checkpoints[0])
    # The last boundary: after a training phase and its evaluation (eval_every=1).
    assert state["counters"]["steps"] == records[-1]["step"] or \
        (records[-1]["phase"] == "train" and state["counters"]["steps"] == records[-2]["step"])
    assert state["counters"]["phases"] == sum(r["step"] <= state["counters"]["steps"]
                                              for r in records)


def fail_update(monkeypatch, update: int) -> None:
    """BatchPPO's ``update``-th update raises (as a bug or a NaN check would)."""
    from batchrl.algos import BatchPPO
    original, updates = BatchPPO.update, []

    def failing(self):
        updates.append(1)
        if len(updates) == update:
            raise RuntimeError("a bug in the update")
        return original(self)

    monkeypatch.setattr(BatchPPO, "update", failing)


def test_an_algorithm_error_saves_the_last_phase_boundary(tmp_path, monkeypatch):
    """No checkpoint is due when the algorithm raises in an update (a bug, a NaN check):
    as for an env failure, the trainer writes the last finished phase's state from memory,
    so the run can go on from there once it is fixed."""
    fail_update(monkeypatch, 3)
    logdir = tmp_path / "run"
    config = load_config("cartpole", CARTPOLE + ["train.checkpoint_every=1000",
                                                 "train.steps=100000"])
    with pytest.raises(RuntimeError, match="a bug in the update"):
        Trainer(config, logdir, progress=False).run()
    records = read_metrics(logdir)
    # A phase is one update's episodes: the second phase and its evaluation had ended.
    assert [r["phase"] for r in records] == ["train", "eval", "train", "eval"]
    [checkpoint] = list_checkpoints(logdir)
    assert load_checkpoint(checkpoint)["counters"]["steps"] == records[-1]["step"]


def test_a_run_resumed_after_an_env_failure_equals_one_without_it(tmp_path):
    """The state written when an env raises is the last boundary's, not the live one: the
    resumed run ends exactly as a run the fault never hit (it fires once: ``once_file``)."""
    from batchrl.envs.errors import EnvRaisedError
    once = tmp_path / "fired"
    config = load_config("cartpole", CARTPOLE + [
        "env.id=batchrl.testing.faults:make",
        f'env.kwargs={{fault = "raise", at_step = 300, once_file = "{once}"}}',
        "train.checkpoint_every=1000", "train.steps=2000"])
    with pytest.raises(EnvRaisedError, match="injected fault in step 300"):
        Trainer(config, tmp_path / "run", progress=False).run()
    Trainer(config, tmp_path / "run", progress=False).run()  # resumes
    Trainer(config, tmp_path / "straight", progress=False).run()  # (the fault is spent)

    def outcome(logdir: Path) -> tuple[list, dict]:
        records = [(r["step"], r["phase"], r["score"], r["length"], r["episodes"])
                   for r in read_metrics(logdir)]
        return records, load_checkpoint(list_checkpoints(logdir)[-1])["algorithm"]

    (records, state), (expected_records, expected_state) = map(
        outcome, (tmp_path / "run", tmp_path / "straight"))
    assert records == expected_records
    assert_same(state, expected_state, "algorithm")


def test_a_due_checkpoint_is_written_from_the_live_state_without_a_copy_in_memory(
        tmp_path, monkeypatch):
    """Boundaries whose checkpoint is due stream the state to the file (a large replay buffer
    is never copied in memory); only the others keep an in-memory copy (``serialize``), for a
    stop before the next boundary."""
    import batchrl.trainer
    copies = []
    serialize = batchrl.trainer.serialize
    monkeypatch.setattr(batchrl.trainer, "serialize",
                        lambda state: copies.append(state["counters"]["steps"])
                        or serialize(state))
    logdir = tmp_path / "run"
    config = load_config("cartpole", CARTPOLE + ["train.checkpoint_every=2",
                                                 "train.keep_checkpoints=100",
                                                 "train.steps=2500"])
    Trainer(config, logdir, progress=False).run()
    boundaries = [r["step"] for r in read_metrics(logdir) if r["phase"] == "eval"]
    written = [int(load_checkpoint(path)["counters"]["steps"])
               for path in list_checkpoints(logdir)]
    assert written == boundaries[1::2] + ([boundaries[-1]] if len(boundaries) % 2 else [])
    assert copies == [step for step in boundaries if step not in written]
    assert len(copies) >= 2


def test_without_evaluations_checkpoint_every_counts_the_boundaries(tmp_path):
    """``train.eval_episodes = 0``: ``checkpoint_every`` counts the boundaries where an
    evaluation would be due (every one was written)."""
    logdir = tmp_path / "run"
    config = load_config("cartpole", CARTPOLE + ["train.eval_episodes=0",
                                                 "train.checkpoint_every=2",
                                                 "train.keep_checkpoints=100",
                                                 "train.steps=2500"])
    Trainer(config, logdir, progress=False).run()
    boundaries = [r["step"] for r in read_metrics(logdir) if r["phase"] == "train"]
    written = [int(load_checkpoint(path)["counters"]["steps"])
               for path in list_checkpoints(logdir)]
    assert len(boundaries) >= 4
    assert written == boundaries[1::2] + ([boundaries[-1]] if len(boundaries) % 2 else [])


@pytest.mark.parametrize("stop", ["end", "error"])
def test_the_records_up_to_a_checkpoint_are_on_disk_before_it(tmp_path, monkeypatch, stop):
    """Before a checkpoint is written (a due one, or the last boundary's kept in memory when an
    error stops the run), ``metrics.jsonl`` is flushed to disk with every record up to its
    step: after a power loss the run resumed from that checkpoint has its whole curve."""
    fsync, synced = os.fsync, []  # (what a power loss would keep of metrics.jsonl)
    checkpoints = []  # (step, the records synced before it)

    def recording(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)
        if path.name == "metrics.jsonl":
            synced[:] = read_metrics(path.parent)
        elif path.name.startswith("ckpt-"):
            checkpoints.append((int(path.name[5:17]), list(synced)))

    monkeypatch.setattr(os, "fsync", recording)
    if stop == "error":
        fail_update(monkeypatch, 4)
    logdir = tmp_path / "run"
    config = load_config("cartpole", CARTPOLE + ["train.checkpoint_every=2",
                                                 "train.keep_checkpoints=100",
                                                 "train.steps=2500"])
    if stop == "error":
        with pytest.raises(RuntimeError, match="a bug in the update"):
            Trainer(config, logdir, progress=False).run()
    else:
        Trainer(config, logdir, progress=False).run()
    records = read_metrics(logdir)
    assert [step for step, _ in checkpoints] == [
        int(load_checkpoint(path)["counters"]["steps"]) for path in list_checkpoints(logdir)]
    # (the error: the due checkpoint of boundary 2, then boundary 3's from memory)
    assert len(checkpoints) == 2 if stop == "error" else len(checkpoints) >= 3
    for step, before in checkpoints:
        assert [r for r in before if r["step"] <= step] == \
            [r for r in records if r["step"] <= step], step


def test_a_checkpoint_loaded_on_the_cpu_is_mapped_not_copied(tmp_path):
    """A replay buffer of gigabytes is not read into memory of the process's own when its
    checkpoint loads: its tensors are file pages, read where they are used."""
    def anonymous_kib() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))

    size = 64 * 2**20
    path = save_checkpoint(tmp_path, 1, {"algorithm": {"buffer": torch.ones(size // 4)}})
    before = anonymous_kib()
    state = load_checkpoint(path)
    assert anonymous_kib() - before < size / 4 / 1024  # (not a resident copy of 64 MiB)
    assert float(state["algorithm"]["buffer"][-1]) == 1.0  # readable all the same


# --- checkpoint files: order, pruning, atomic writes, errors -----------------------------

def name(step: int) -> str:
    return f"ckpt-{step:012d}.pt"


def test_the_latest_checkpoint_is_the_highest_step_whatever_the_file_times(tmp_path):
    """A log directory copied without its times (cp, rsync without -t) gives the files any
    order of mtimes: the latest is still found by the step in the name."""
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"algorithm": {}, "counters": {"steps": step}}, keep=10)
    # The oldest checkpoint now looks newest, the newest oldest.
    for age, step in enumerate((10, 20, 30)):
        os.utime(tmp_path / name(step), (2e9 - 1000 * age, 2e9 - 1000 * age))
    assert [p.name for p in list_checkpoints(tmp_path)] == [name(10), name(20), name(30)]
    assert latest_checkpoint(tmp_path) == tmp_path / name(30)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_save_checkpoint_keeps_exactly_the_newest_keep(tmp_path, keep):
    """train.keep_checkpoints: after each write the ``keep`` highest steps remain, the one
    just written among them, each holding its own state."""
    for step in range(1, 6):
        path = save_checkpoint(tmp_path, step, {"algorithm": {"step": torch.tensor(step)}},
                               keep=keep)
        assert path == tmp_path / name(step) and path.exists()
        expected = list(range(max(1, step - keep + 1), step + 1))
        assert [p.name for p in list_checkpoints(tmp_path)] == [name(s) for s in expected]
    for step in expected:
        assert int(load_checkpoint(tmp_path / name(step))["algorithm"]["step"]) == step
    assert sorted(p.name for p in tmp_path.iterdir()) == [name(s) for s in expected]


class FailsToPickle:
    """A state entry whose serialisation fails after part of the file was written."""

    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_a_checkpoint_write_that_fails_halfway_leaves_no_file_behind(tmp_path):
    """The write goes to a temporary file renamed only when complete: an error in the middle
    (here while pickling, after 4 MB of tensors went out) leaves neither a partial
    ``ckpt-*.pt`` nor a ``.tmp``, and the previous checkpoint stays the latest."""
    first = save_checkpoint(tmp_path, 1, {"algorithm": {"w": torch.ones(4)}})
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        save_checkpoint(tmp_path, 2, {"algorithm": {"w": torch.ones(2**20),
                                                    "bad": FailsToPickle()}})
    assert sorted(p.name for p in tmp_path.iterdir()) == [name(1)]
    assert latest_checkpoint(tmp_path) == first
    assert torch.equal(load_checkpoint(first)["algorithm"]["w"], torch.ones(4))


def test_the_next_write_removes_partial_files_of_earlier_writes(tmp_path):
    """Temporary files a killed writer left (NAME.PID.tmp, and an older version's NAME.tmp)
    are never listed and are removed by the next write."""
    save_checkpoint(tmp_path, 1, {"algorithm": {}})
    for stray in (name(2) + ".4242.tmp", name(2) + ".tmp"):
        (tmp_path / stray).write_bytes(b"\x00" * 100)
    assert latest_checkpoint(tmp_path) == tmp_path / name(1)
    save_checkpoint(tmp_path, 3, {"algorithm": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == [name(1), name(3)]


def test_a_serialized_state_is_written_as_the_same_checkpoint(tmp_path):
    """The trainer's in-memory snapshot (``serialize``'s bytes) and a streamed dict give the
    same checkpoint."""
    state = {"algorithm": {"w": torch.arange(5.0)}, "counters": {"steps": 7}}
    from_bytes = load_checkpoint(save_checkpoint(tmp_path, 7, serialize(state)))
    from_dict = load_checkpoint(save_checkpoint(tmp_path, 8, state))
    for loaded in (from_bytes, from_dict):
        assert loaded["counters"] == {"steps": 7}
        assert torch.equal(loaded["algorithm"]["w"], torch.arange(5.0))


def test_load_checkpoint_errors_say_what_is_wrong_with_the_file(tmp_path):
    """Each unreadable file is a CheckpointError naming it, with the right advice: only a
    damaged ckpt-*.pt is to be deleted."""
    missing = tmp_path / name(5)
    with pytest.raises(CheckpointError, match=f"^checkpoint {missing} does not exist$"):
        load_checkpoint(missing)

    unreadable = tmp_path / name(6)
    unreadable.mkdir()  # an OSError of the file system, not damage: no "Delete it"
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(unreadable)
    assert str(error.value) == f"cannot read checkpoint {unreadable}: Is a directory"

    damaged = tmp_path / name(7)
    damaged.write_bytes(serialize({"algorithm": {"w": torch.ones(1000)}})[:500])
    with pytest.raises(CheckpointError, match=f"^cannot read checkpoint {damaged} ") as error:
        load_checkpoint(damaged)
    assert "Delete it to continue from the previous checkpoint" in str(error.value)

    # A changed byte in a tensor's data: torch.load of the mapped file would not notice.
    changed = tmp_path / name(9)
    data = bytearray(serialize({"algorithm": {"w": torch.zeros(100_000)}}))
    data[len(data) // 2] ^= 0xFF
    changed.write_bytes(data)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(changed)
    assert re.fullmatch(f"cannot read checkpoint {changed}: its record \\S+/data/0 fails its "
                        f"checksum; the file is damaged .*Delete it to continue from the "
                        f"previous checkpoint", str(error.value)), str(error.value)

    empty = tmp_path / name(10)  # (torch's own message would advise a serialization option)
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(empty)
    assert str(error.value).startswith(f"cannot read checkpoint {empty} (BadZipFile: ")
    assert "Delete it" in str(error.value) and "serialization" not in str(error.value)

    foreign = tmp_path / "config.json"
    foreign.write_text('{"train": {}}')
    with pytest.raises(CheckpointError, match=f"^{foreign} is not a batchrl checkpoint") as error:
        load_checkpoint(foreign)
    assert "Delete it" not in str(error.value)

    # A torch file that is not a checkpoint (a user's model weights), under either name.
    for path in (tmp_path / "policy.pt", tmp_path / name(8)):
        torch.save({"weights": torch.ones(2)}, path)
        with pytest.raises(CheckpointError,
                           match=f"^{path} is not a batchrl checkpoint \\(no 'algorithm' state\\)"):
            load_checkpoint(path)


@pytest.mark.parametrize("change", ["module gone", "class renamed"])
def test_a_checkpoint_whose_class_moved_is_not_called_damaged(tmp_path, monkeypatch, change):
    """A user algorithm's state holding an object of the user's own class, loaded where that
    module or class no longer is: the file is intact, so the error names what is missing and
    does not tell the user to delete the checkpoint (the one before it would fail alike)."""
    import importlib
    module = tmp_path / "my_schedule_module.py"
    module.write_text("import dataclasses\n\n@dataclasses.dataclass\nclass Schedule:\n"
                      "    step: int = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    schedule = importlib.import_module("my_schedule_module").Schedule(5)
    (tmp_path / "run").mkdir()
    path = save_checkpoint(tmp_path / "run", 100, {"algorithm": {"schedule": schedule}})
    monkeypatch.delitem(sys.modules, "my_schedule_module")
    if change == "module gone":
        module.unlink()
        missing = "No module named 'my_schedule_module'"
    else:
        module.write_text(module.read_text().replace("Schedule", "LearningSchedule"))
        missing = "Can't get attribute 'Schedule'"
    importlib.invalidate_caches()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert message.startswith(f"cannot read checkpoint {path}: it holds an object whose class "
                              f"cannot be found here"), message
    assert missing in message and "load it with the code that wrote it" in message
    assert "Delete it" not in message and "damaged" not in message


def test_checkpoints_past_a_trillion_steps_are_found_and_pruned(tmp_path):
    # (the file name's 12 digits become 13: still listed in step order, still pruned)
    for step in (999_999_999_999, 10**12, 10**12 + 1):
        save_checkpoint(tmp_path, step, {"algorithm": {}}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-1000000000000.pt", "ckpt-1000000000001.pt"]
