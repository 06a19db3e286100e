"""Stopping a run: Ctrl-C and SIGTERM to real train.py processes, a second
signal, interruptible PPO updates, and an interrupted run that resumes to the
same result as an uninterrupted one.

The signals go to the whole process group, as a terminal's Ctrl-C or a job
scheduler's SIGTERM would, so env workers and the fork server receive them too.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from batchrl.algos.ppo import BatchPPO, PPOConfig
from batchrl.checkpoint import list_checkpoints, load_checkpoint
from batchrl.interrupt import Interrupted, kill_group
from batchrl.metrics import read_metrics
from helpers import (REPO, assert_same, descendants, finish, interrupting_after, run_script,
                     run_stdin_script, sets, start_train_py, wait_for, wait_gone)

# CartPole with 4 agents and an update every 4 episodes: a phase takes ~0.1 s.
CARTPOLE = ["env.num_agents=4", "algorithm.update_every=4", "train.eval_episodes=4",
            "train.device=cpu", "train.checkpoint_every=3", "train.keep_checkpoints=100",
            "algorithm.update_threads=1"]  # several threads crawl on a busy 2-core machine


def comparable(records: list[dict]) -> list[tuple]:
    """What must not depend on where a run was interrupted (not its timings)."""
    return [(r["step"], r["phase"], r["score"], r["score_std"], r["length"], r["episodes"])
            for r in records]


# --- StopSignals on its own, in a child process ------------------------------------------

STOP_SIGNALS_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from batchrl.interrupt import Interrupted, StopSignals

    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIG{first})
        assert stop.requested and stop.signum == signal.SIG{first}
        try:
            stop.check()
        except Interrupted as exc:
            print(exc.exit_code, exc.signal_name, flush=True)
        if "{second}":
            time.sleep({gap})
            os.kill(os.getpid(), signal.SIG{second})
            time.sleep(2 * StopSignals.STUCK_S)  # (nor does the watching thread kill it)
            print("still alive after a second signal", flush=True)
    assert signal.getsignal(signal.SIGTERM) is before
    print("handlers restored", flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first,second,gap,code", [
    ("INT", "", 0, 130), ("TERM", "", 0, 143), ("INT", "TERM", 0.3, 130),
    ("TERM", "INT", 0.3, 143),
    # One request delivered twice (GNU timeout signals its child, then the child's group).
    ("TERM", "TERM", 0, 143)])
def test_stop_signals_flag_the_first_signal_and_die_on_the_second(first, second, gap, code):
    script = STOP_SIGNALS_SCRIPT.format(first=first, second=second, gap=gap)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=50, env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = result.stdout.splitlines()
    assert lines[0] == f"{code} SIG{first}", result.stderr
    if second and gap:
        # The second signal's handler ends the process by the signal's default action at
        # once (the watching thread, which says so, is for a main thread stuck in C).
        assert result.returncode == -getattr(signal, f"SIG{second}"), result
        assert lines == [f"{code} SIG{first}"] and "quitting now" not in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert lines == [f"{code} SIG{first}", *["still alive after a second signal"] * bool(
            second), "handlers restored"]


STUCK_SCRIPT = """
import ctypes, os, signal, threading, time
from batchrl.interrupt import StopSignals

def signal_twice():
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # (beyond the debounce)
    os.kill(os.getpid(), signal.SIGINT)

with StopSignals():
    # The main thread waits in C, as in a collective that stopped answering: a locked mutex
    # locked again, through ctypes (which releases the GIL; no Python handler runs).
    mutex = ctypes.create_string_buffer(64)  # (zeroed: PTHREAD_MUTEX_INITIALIZER)
    lock = ctypes.CDLL(None).pthread_mutex_lock
    lock(mutex)
    threading.Thread(target=signal_twice, daemon=True).start()
    lock(mutex)
    print("unreachable", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_watching_thread_kills_a_main_thread_stuck_in_c_by_the_signal():
    began = time.monotonic()
    result = run_stdin_script(STUCK_SCRIPT, timeout=12)
    assert result.returncode == -signal.SIGINT, result
    assert "SIGINT again: quitting now" in result.stderr, result
    assert time.monotonic() - began < 10  # (about STUCK_S after the second signal)


EXIT_SCRIPT = """
import os, signal
from batchrl.interrupt import StopSignals

stop = StopSignals()
with stop:
    pass
assert signal.set_wakeup_fd(-1) == -1, "a wakeup descriptor was left behind"
with stop:  # (entered again: it handles the signals again)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM
print("ok", flush=True)
"""


@pytest.mark.timeout(60)
def test_exit_leaves_no_wakeup_descriptor_and_stop_signals_can_be_entered_again():
    result = run_stdin_script(EXIT_SCRIPT)
    assert result.returncode == 0 and result.stdout == "ok\n", result


RESTORE_SCRIPT = """
import os, signal, threading
from batchrl.interrupt import StopSignals

def own(signum, frame):
    print("own handler", flush=True)

signal.signal(signal.SIGTERM, own)
# (Python's own, unless the parent ignored SIGINT: a test worker may, and children inherit it)
signal.signal(signal.SIGINT, signal.default_int_handler)
with StopSignals():
    pass
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
assert signal.getsignal(signal.SIGTERM) is own
os.kill(os.getpid(), signal.SIGTERM)
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)

def in_a_thread():
    with StopSignals() as stop:  # (Python installs handlers in the main thread only)
        print("thread", stop.requested, flush=True)

thread = threading.Thread(target=in_a_thread)
thread.start()
thread.join()
assert signal.getsignal(signal.SIGTERM) is own
print("ok", flush=True)
"""


@pytest.mark.timeout(60)
def test_exit_gives_back_the_handlers_it_took_and_a_thread_changes_none():
    """After ``StopSignals``, Ctrl-C raises ``KeyboardInterrupt`` again and a handler of the
    caller's runs again (not the default action, which kills Python: a script or notebook
    that trains and then goes on); entered outside the main thread it is a no-op, not an
    error (Python installs signal handlers in the main thread only)."""
    result = run_stdin_script(RESTORE_SCRIPT)
    assert result.returncode == 0, result
    assert result.stdout == "own handler\nKeyboardInterrupt\nthread False\nok\n", result


def test_interrupted_is_pickled_whole():
    again = pickle.loads(pickle.dumps(Interrupted(signal.SIGTERM)))
    assert (again.signum, again.signal_name, again.exit_code) == (signal.SIGTERM, "SIGTERM", 143)
    assert str(again) == "interrupted by SIGTERM"


def test_kill_group_spares_a_live_process_that_has_a_reaped_workers_pid():
    """``reaped``: the worker's pid may be another process's by now; while a live process
    has it, nothing is killed. Without ``reaped`` the group it leads is killed."""
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)  # (it leads a group, as a worker does)
    try:
        kill_group(leader.pid, reaped=True)
        time.sleep(0.3)
        assert leader.poll() is None
        kill_group(leader.pid)
        assert leader.wait(10) == -signal.SIGKILL
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


# --- an interruptible PPO update ---------------------------------------------------------

UNCLOSED_SCRIPT = textwrap.dedent("""
    import weakref

    class Early:
        pass

    early = Early()  # a weakref.finalize made first (tempfile does this) runs after the
    weakref.finalize(early, print)  # exit hook of multiprocessing, which joins its children
    from batchrl.envs import EnvWorker

    if __name__ == "__main__":
        worker = EnvWorker(["CartPole-v1"])
        worker.reset()
        print(worker.pid, flush=True)  # and exit without closing it
""")


def test_a_script_that_leaves_its_worker_open_exits_and_takes_the_worker_along(tmp_path):
    result = run_script(tmp_path / "unclosed.py", UNCLOSED_SCRIPT, timeout=30)
    assert result.returncode == 0, result.stderr
    assert wait_gone([int(result.stdout.split()[0])], 10) == []


STARTING_SCRIPT = textwrap.dedent("""
    import os, signal, time

    time.sleep(1.0)  # a main script's imports, which every worker runs again as it starts
    from batchrl.envs import EnvWorker

    if __name__ == "__main__":
        worker = EnvWorker(["CartPole-v1"])
        time.sleep(0.3)
        os.kill(worker.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends it, too
        print(worker.observation_space.shape, flush=True)
        worker.close()
""")


def test_ctrl_c_while_a_worker_starts_leaves_it_to_the_parent(tmp_path):
    result = run_script(tmp_path / "starting.py", STARTING_SCRIPT)
    assert result.returncode == 0 and result.stdout == "(4,)\n", result.stderr


FORK_SERVER_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import psutil
    from batchrl.envs import EnvWorker
    from batchrl.envs.process.channel import context

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, lambda *_: None)  # this parent handles Ctrl-C itself
        context()  # starts the fork server, which imports batchrl before it ignores signals
        for _ in range(400):
            found = [p for p in psutil.Process().children()
                     if "forkserver" in " ".join(p.cmdline())]
            if found:
                break
            time.sleep(0.005)
        server, = found
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, a scheduler's SIGTERM
            os.kill(server.pid, signum)
        worker = EnvWorker(["CartPole-v1"])
        print(worker.observation_space.shape, server.is_running(), flush=True)
        worker.close()
""")


def test_ctrl_c_and_sigterm_while_the_fork_server_starts_leave_it_to_the_parent(tmp_path):
    result = run_script(tmp_path / "fork_server.py", FORK_SERVER_SCRIPT)
    assert result.returncode == 0 and result.stdout == "(4,) True\n", result.stderr


SPAWNED_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os, signal, sys, time
    from batchrl.interrupt import ignore_stop_signals, signals_held

    def child(results):
        time.sleep(1.0)  # a spawned learner's imports, before it ignores Ctrl-C
        ignore_stop_signals()
        results.put("alive")

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        process = ctx.Process(target=child, args=(results,))
        with signals_held():
            process.start()
        time.sleep(0.3)
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(process.pid, signum)
        print(results.get(timeout=20), flush=True)
        process.join(10)
        print(process.exitcode, flush=True)
""")


def test_a_process_started_with_signals_held_survives_ctrl_c_until_it_ignores_it(tmp_path):
    result = run_script(tmp_path / "spawned.py", SPAWNED_SCRIPT)
    assert result.returncode == 0 and result.stdout == "alive\n0\n", result.stderr


def test_ppo_update_stops_between_gradient_steps():
    observation_space = gym.spaces.Box(-1, 1, (3,), np.float32)
    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    config = PPOConfig(update_every=2, update_epochs=50, inference="eager")
    algo = BatchPPO(observation_space, action_space, 2, config, max_length=5)
    agents = torch.arange(2)
    algo.begin_episodes(agents)
    for step in range(5):
        observ = torch.randn(2, 3)
        action, _ = algo.perform(agents, observ)
        done = torch.full((2,), step == 4)
        algo.experience(agents, observ, action, torch.ones(2), done, torch.randn(2, 3),
                        torch.zeros(2, dtype=torch.bool))
    algo.interrupt_check, calls = interrupting_after(3)
    weights = [p.detach().clone() for p in algo.policy.parameters()]
    with pytest.raises(Interrupted):
        algo.end_episodes(agents)
    # Three of 50 gradient steps ran: the policy moved, the update never finished.
    assert len(calls) == 4
    assert algo.updates == 0
    assert any(not torch.equal(a, b) for a, b in zip(weights, algo.policy.parameters()))


# --- train.py and signals --------------------------------------------------------------

@pytest.mark.timeout(120)
# SIGINT's path is the same flag as SIGTERM's, and test_second_ctrl_c_... sends it too.
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                    signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_process_group_stops_train_py_cleanly(signum, tmp_path):
    """The fork server and the trainer get the signal (the env workers lead groups of their
    own; SIGHUP: a closed terminal or SSH session); the trainer stops within seconds, writes
    the last phase boundary as a checkpoint, closes every child process and exits 130
    (SIGINT), 143 (SIGTERM) or 129 (SIGHUP)."""
    logdir = tmp_path / "run"
    process = start_train_py("--config", "cartpole", "--logdir", str(logdir),
                             *sets(*CARTPOLE, "env.backend=workers", "env.workers=1",
                                   "env.share_main=false", "algorithm.update_epochs=200",
                                   "train.steps=1000000"))
    try:
        wait_for(lambda: len(read_metrics(logdir)) >= 3 or process.poll() is not None, 90,
                 "three phases")
        assert process.poll() is None, process.communicate()
        children = descendants(process.pid)
        assert len(children) >= 2  # the fork server and the env worker at least
        os.killpg(process.pid, signum)
        signalled = time.monotonic()
        code, stdout, stderr = finish(process)
        stopped_in = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 128 + signum, (stdout, stderr)
    assert stopped_in < 20, stopped_in  # a hang guard: it takes about a second
    assert "Traceback" not in stderr, stderr
    # The env workers are closed before train.py exits; the fork server and
    # the shared-memory tracker exit as soon as they see its pipes close.
    assert wait_gone(children, timeout=10) == []
    name = signal.Signals(signum).name
    assert f"{name}: stopping after this step" in stderr
    # The final checkpoint is the last complete phase boundary: every record
    # up to it is in metrics.jsonl, and the resume command is printed.
    latest = list_checkpoints(logdir)[-1]
    state = load_checkpoint(latest)
    records = read_metrics(logdir)
    assert f"Stopped by {name}; checkpoint at step {state['counters']['steps']:,}: {latest}" \
        in stdout
    assert f"Resume with: python train.py --config cartpole --logdir {logdir}" in stdout
    kept = [r for r in records if r["step"] <= state["counters"]["steps"]]
    assert len(kept) == state["counters"]["phases"]
    assert not list(logdir.glob("*.tmp"))


@pytest.mark.timeout(120)
def test_a_run_under_nohup_outlives_its_terminal(tmp_path):
    """SIGHUP ignored when train.py starts (nohup): the hangup leaves the run going."""
    logdir = tmp_path / "run"
    process = start_train_py("--config", "cartpole", "--logdir", str(logdir),
                             *sets(*CARTPOLE, "env.backend=workers", "env.workers=1",
                                   "train.steps=1000000"), hangup=signal.SIG_IGN)
    try:
        wait_for(lambda: len(read_metrics(logdir)) >= 1 or process.poll() is not None, 90,
                 "a phase")
        os.killpg(process.pid, signal.SIGHUP)
        time.sleep(3)
        assert process.poll() is None, process.communicate()
        os.killpg(process.pid, signal.SIGTERM)
        code, _, stderr = finish(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 143 and "SIGHUP" not in stderr, stderr


@pytest.mark.timeout(120)
def test_second_ctrl_c_quits_at_once_and_no_worker_survives(tmp_path):
    """A worker hangs in its step (no step timeout): the first Ctrl-C cannot
    be acted on until the step returns; the second ends train.py at once, and
    every worker exits by itself."""
    logdir = tmp_path / "run"
    faults = tmp_path / "faults"  # FaultyEnv touches a file here when it starts to hang
    faults.mkdir()
    process = start_train_py(
        "--config", "cartpole", "--logdir", str(logdir),
        *sets(*CARTPOLE, "env.backend=process", "env.timeout=0",
              "env.id=batchrl.testing.faults:make",
              f'env.kwargs={{fault = "hang", at_step = 30, log_dir = "{faults}"}}'))
    try:
        # The processes exist once the trainer has taken over Ctrl-C.
        wait_for(lambda: len(descendants(process.pid)) >= 5 or process.poll() is not None,
                 90, "the env processes")
        children = descendants(process.pid)
        wait_for(lambda: any(faults.iterdir()) or process.poll() is not None, 60,
                 "an env to hang")
        assert process.poll() is None
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(1.0)
        assert process.poll() is None  # still waiting for the hung step
        os.killpg(process.pid, signal.SIGINT)
        code, stdout, stderr = finish(process, timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == -signal.SIGINT, (stdout, stderr)
    assert "SIGINT: stopping after this step" in stderr and "again quits at once" in stderr
    assert wait_gone(children, timeout=20) == []


# --- interrupted and resumed == uninterrupted ------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interrupted_twice_and_resumed_equals_an_uninterrupted_run(tmp_path):
    """Ctrl-C twice at arbitrary moments (mid-phase or mid-update), resumed
    each time with the printed command: metrics.jsonl ends up exactly as an
    uninterrupted run's, no phase repeated or missing, and the final model is
    the same (CPU, same seed)."""
    args = sets(*CARTPOLE, "algorithm.update_epochs=100", "train.steps=4000")
    straight = tmp_path / "straight"
    process = start_train_py("--config", "cartpole", "--logdir", str(straight), *args)
    code, stdout, stderr = finish(process, timeout=200)
    assert code == 0, stderr
    expected = comparable(read_metrics(straight))
    assert len(expected) > 20

    resumed = tmp_path / "resumed"
    interrupts = []
    for stop_after in (len(expected) // 3, 2 * len(expected) // 3):
        command = ["--config", "cartpole", "--logdir", str(resumed)]
        process = start_train_py(*command, *(args if not interrupts else []))
        try:
            # Some phases after the previous session's checkpoint: a moment
            # no checkpoint boundary is tied to.
            wait_for(lambda: len(read_metrics(resumed)) >= stop_after
                     or process.poll() is not None, 150, f"{stop_after} phases")
            os.killpg(process.pid, signal.SIGINT)
            code, stdout, stderr = finish(process)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        assert code == 130, (stdout, stderr)
        assert f"Resume with: python train.py --config cartpole --logdir {resumed}" in stdout
        interrupts.append(load_checkpoint(list_checkpoints(resumed)[-1])["counters"]["steps"])
        # What is on disk now is a prefix of the uninterrupted run.
        assert comparable(read_metrics(resumed)) == expected[:len(read_metrics(resumed))]

    assert interrupts[0] < interrupts[1] < expected[-1][0]
    process = start_train_py("--config", "cartpole", "--logdir", str(resumed))
    code, stdout, stderr = finish(process, timeout=200)
    assert code == 0, stderr
    assert f"at step {interrupts[1]:,}" in stdout
    assert comparable(read_metrics(resumed)) == expected
    # Networks, optimisers, normalisers, KL penalty, counters and RNG states:
    # the same as the uninterrupted run's, bit for bit (but the wall time).
    final = load_checkpoint(list_checkpoints(resumed)[-1])
    reference = load_checkpoint(list_checkpoints(straight)[-1])
    assert final["counters"].pop("wall_time") != reference["counters"].pop("wall_time")
    assert_same(final, reference)
    # The TensorBoard events of the lost phases were purged too: one update per step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(resumed), size_guidance={"scalars": 0})
    events.Reload()
    kl_steps = [event.step for event in events.Scalars("ppo/kl")]
    assert kl_steps == sorted(set(kl_steps))
    assert json.loads((resumed / "config.json").read_text()) == \
        json.loads((straight / "config.json").read_text())
