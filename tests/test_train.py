"""train.py and the Trainer end to end: the log directory, resume, exact resume, bad input.

Budgets are tiny (a few hundred env steps) so the whole file runs in well under
a minute on two CPU cores; learning itself is tested in test_learning.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from batchrl.checkpoint import list_checkpoints, load_checkpoint
from batchrl.config import (BATCHPPO, RUN_FACTS, SECTIONS, SHIPPED_ALGORITHMS, Config,
                            ConfigError, algorithm_keys, load_config, load_saved_config,
                            save_config)
from batchrl.metrics import METRICS_FILE, RunLog, read_metrics
from batchrl.trainer import Trainer, TrainingInterrupted
from helpers import REPO, TRAIN_PY, assert_same, scalar_events, sets
RECORD_KEYS = {"step", "phase", "score", "score_std", "length", "episodes", "wall_time",
               "steps_per_s"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# CartPole in-process, 4 agents, an update every 4 episodes: a phase takes ~0.1 s.
CARTPOLE = ["env.num_agents=4", "algorithm.update_every=4", "train.eval_episodes=4",
            "train.device=cpu"]
CARTPOLE_STEPS = 600


def train_py(*args: str, cwd: Path = REPO, timeout: float = 120,
             env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN_PY), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_run_of_another_game_is_not_resumed_by_an_atari_config(tmp_path):
    """The Atari configs share env.id (the game is in env.kwargs): --config atari/breakout
    on a Pong run's logdir is refused, not resumed as Pong."""
    from batchrl.config import save_config

    pytest.importorskip("ale_py")
    logdir = tmp_path / "pong"
    logdir.mkdir()
    save_config(load_config("atari/pong"), logdir)
    (logdir / "started_with.json").write_text(json.dumps({"config": "atari/pong"}))
    other = train_py("--config", "atari/breakout", "--logdir", str(logdir), "--no-progress")
    assert other.returncode == 2, other.stderr
    assert "holds a run of batchrl.envs.atari:make {'env_id': 'ALE/Pong-v5'" in other.stderr
    assert "--config atari/breakout trains batchrl.envs.atari:make {'env_id': " \
           "'ALE/Breakout-v5'" in other.stderr


def budget_end(budget: int, num_agents: int) -> int:
    """The step a session with this budget ends at: the last training phase stops at the
    budget, after the batch step that reaches it."""
    return -(-budget // num_agents) * num_agents


def check_records(records: list[dict], config: Config, budgets: list[int]) -> None:
    """Phases alternate as the loop promises: an evaluation after every
    ``eval_every``-th training phase and after the last training phase of each
    session (whose budgets are ``budgets``, where that phase stops); no phase
    repeated or missing."""
    assert records, "no records"
    train_every, eval_every = config.algorithm.keys["update_every"], config.train.eval_every
    ends = {budget_end(budget, config.env.num_agents) for budget in budgets}
    for record in records:
        assert RECORD_KEYS <= set(record), record
        assert record["phase"] in ("train", "eval")
        if record["phase"] == "eval":
            assert record["episodes"] == config.train.eval_episodes
        elif record["step"] in ends:  # stopped at the budget: may end fewer episodes
            assert 0 <= record["episodes"] <= train_every, record
        else:
            assert record["episodes"] == train_every, record
        assert record["step"] % config.env.num_agents == 0
        if record["episodes"]:
            assert 1 <= record["length"] <= config.env.max_length
        else:
            assert record["length"] is None and record["score"] is None, record
        assert record["steps_per_s"] > 0
    for phase in ("train", "eval"):
        steps = [r["step"] for r in records if r["phase"] == phase]
        assert all(a < b for a, b in zip(steps, steps[1:])), (phase, steps)
    wall = [r["wall_time"] for r in records]
    assert wall == sorted(wall)
    train_phases, previous = 0, 0
    for i, record in enumerate(records):
        if record["phase"] == "eval":
            assert i > 0 and records[i - 1]["phase"] == "train"
            assert records[i - 1]["step"] == record["step"]
            continue
        train_phases += 1
        final = any(previous < budget <= record["step"] for budget in budgets)
        expect_eval = train_phases % eval_every == 0 or final
        evaluated = i + 1 < len(records) and records[i + 1]["phase"] == "eval"
        assert evaluated == expect_eval, (i, record, train_phases)
        previous = record["step"]
    train_steps = [r["step"] for r in records if r["phase"] == "train"]
    # Each session ends at its budget, not at the end of a whole phase past it.
    assert ends <= set(train_steps), (ends, train_steps)
    assert train_steps[-1] == budget_end(budgets[-1], config.env.num_agents)
    assert budgets[-1] > (train_steps[-2] if len(train_steps) > 1 else 0)
    assert records[-1]["phase"] == "eval"


def check_logdir(logdir: Path, config: Config, budgets: list[int]) -> list[dict]:
    """Everything a run writes; returns the records of metrics.jsonl."""
    # config.json: valid JSON, the resolved config.
    saved = json.loads((logdir / "config.json").read_text())
    assert saved == json.loads(json.dumps(config.to_dict()))
    assert saved["algorithm"]["class"] == config.algorithm.path
    assert not set(RUN_FACTS) & set(saved["algorithm"])  # the trainer's to pass: not keys
    assert load_saved_config(logdir) == config

    # metrics.jsonl: one JSON object per line, one line per phase.
    lines = (logdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    assert records == read_metrics(logdir)
    check_records(records, config, budgets)

    # TensorBoard: the phase scalars at the records' steps, and the algorithm's.
    assert list(logdir.glob("events.out.tfevents.*"))
    events = scalar_events(logdir)
    for tag in ("train/score", "train/length", "train/steps_per_s", "eval/score",
                "eval/length", "ppo/kl", "ppo/beta", "ppo/policy_loss", "ppo/value_loss",
                "ppo/entropy"):
        assert tag in events, sorted(events)
    for phase in ("train", "eval"):
        logged = events[f"{phase}/score"]
        expected = [(r["step"], r["score"]) for r in records
                    if r["phase"] == phase and r["score"] is not None]
        assert [step for step, _ in logged] == [step for step, _ in expected]
        assert [value for _, value in logged] == pytest.approx([v for _, v in expected])
    kl_steps = [step for step, _ in events["ppo/kl"]]
    assert kl_steps == sorted(set(kl_steps))  # one update per training phase, no repeats

    # learning_curve.png: a real PNG of the figure's size.
    png = logdir / "learning_curve.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 5_000
    from PIL import Image
    with Image.open(png) as image:
        assert image.size == (700, 400)

    # Checkpoints: complete files, the newest at the last record's step.
    checkpoints = list_checkpoints(logdir)
    assert 1 <= len(checkpoints) <= config.train.keep_checkpoints
    assert not list(logdir.glob("*.tmp")) and not list(logdir.glob("*.tmp.png"))
    state = torch.load(checkpoints[-1], map_location="cpu", weights_only=False)
    assert {"algorithm", "counters", "rng", "config"} <= set(state)
    assert state["counters"]["steps"] == records[-1]["step"]
    assert checkpoints[-1].name == f"ckpt-{records[-1]['step']:012d}.pt"
    assert state["counters"]["phases"] == len(records)
    assert state["counters"]["train_phases"] == sum(r["phase"] == "train" for r in records)
    assert state["config"] == config.to_dict()
    assert {"policy", "value", "policy_optimizer", "memory"} <= set(state["algorithm"])
    return records


# --- train.py on CartPole, in a subprocess ---------------------------------------------

@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    """One train.py run on CartPole: (logdir, its config, the process)."""
    logdir = tmp_path_factory.mktemp("cartpole") / "run"
    overrides = CARTPOLE + [f"train.steps={CARTPOLE_STEPS}", "train.eval_every=2"]
    process = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                       *sets(*overrides))
    assert process.returncode == 0, process.stderr
    return logdir, load_config("cartpole", overrides), process


def test_train_py_writes_the_log_directory(cartpole_run):
    logdir, config, process = cartpole_run
    assert "Traceback" not in process.stderr
    assert (f"Training BatchPPO on CartPole-v1 with 4 agents for {CARTPOLE_STEPS:,} steps"
            in process.stdout)
    assert "Final evaluation:" in process.stdout and "episodes (mean action)" in process.stdout
    records = check_logdir(logdir, config, [CARTPOLE_STEPS])
    # eval_every=2: evaluations after the even training phases (and the last one).
    assert records[:3] and [r["phase"] for r in records[:3]] == ["train", "train", "eval"]
    assert f"{records[-1]['score']:.1f}" in process.stdout


@pytest.mark.slow
def test_train_py_resumes_and_extends_the_budget(cartpole_run, tmp_path):
    logdir = tmp_path / "run"
    shutil.copytree(cartpole_run[0], logdir)
    config = cartpole_run[1]
    before = read_metrics(logdir)
    last = before[-1]["step"]

    # Same logdir, nothing else: the finished run resumes and has nothing to do.
    again = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert f"at step {last:,}" in again.stdout
    assert "nothing to train" in again.stdout and "--steps" in again.stdout
    assert again.stderr == ""  # (no note: the config it was started with)
    assert read_metrics(logdir) == before
    # Another config of the same task and algorithm: the saved one holds, and it says so.
    other = tmp_path / "other.toml"
    other.write_text('[env]\nid = "CartPole-v1"\n\n[algorithm]\ndiscount = 0.5\n')
    noted = train_py("--config", str(other), "--logdir", str(logdir), "--no-progress")
    assert noted.returncode == 0 and "nothing to train" in noted.stdout, noted.stderr
    assert noted.stderr.startswith(f"note: --config {other} differs from the saved config of "
                                   f"the run (started with --config cartpole) in "), noted.stderr
    assert noted.stderr.strip().endswith("; the run resumes with its saved config")

    # --set on an existing run is refused: it resumes with the saved config.
    refused = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                       *sets("train.steps=5000"))
    assert refused.returncode == 2
    assert "saved config" in refused.stderr and "--steps" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert read_metrics(logdir) == before
    # ... except for the keys that say where it runs.
    moved = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                     *sets("train.device=cpu", "env.timeout=30"))
    assert moved.returncode == 0, moved.stderr
    assert "nothing to train" in moved.stdout
    assert json.loads((logdir / "config.json").read_text())["env"]["timeout"] == 30
    assert read_metrics(logdir) == before
    config = dataclasses.replace(
        config, env=dataclasses.replace(config.env, timeout=30.0),
        train=dataclasses.replace(config.train, device="cpu"))

    # Another config's task on this run's logdir is refused too, not resumed.
    other = train_py("--config", "pendulum", "--logdir", str(logdir), "--no-progress")
    assert other.returncode == 2
    assert (f"{logdir} holds a run of CartPole-v1 with batchrl.algos.ppo:BatchPPO, but "
            f"--config pendulum trains Pendulum-v1") in other.stderr
    assert read_metrics(logdir) == before

    # --steps raises the budget: the step counter continues from the checkpoint,
    # twice in a row (N also written as 1.2e3 or 1_800).
    budgets = [CARTPOLE_STEPS]
    assert CARTPOLE_STEPS == 600
    for budget, text in ((2 * CARTPOLE_STEPS, "1.2e3"), (3 * CARTPOLE_STEPS, "1_800")):
        start = read_metrics(logdir)
        process = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                           "--steps", text)
        assert process.returncode == 0, process.stderr
        assert "Traceback" not in process.stderr
        assert f"Resuming from {list_checkpoints(logdir)[0].parent}" in process.stdout
        assert f"at step {start[-1]['step']:,}" in process.stdout
        assert f"for {budget:,} steps" in process.stdout
        budgets.append(budget)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                       steps=budget))
        records = check_logdir(logdir, config, budgets)  # config.json holds the new budget
        assert records[:len(start)] == start       # the earlier phases are kept as they were
        assert records[len(start)]["step"] > start[-1]["step"]
        assert records[len(start)]["wall_time"] >= start[-1]["wall_time"]

    # Without --steps, the saved (extended) budget is used and is already reached.
    again = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress")
    assert again.returncode == 0 and "nothing to train" in again.stdout
    assert read_metrics(logdir) == records


# --- the Trainer in-process on Pendulum, with worker processes ---------------------

def test_trainer_on_pendulum_with_external_envs(tmp_path):
    config = load_config("pendulum", [
        "env.num_agents=2", "env.max_length=50", "env.backend=workers", "algorithm.update_every=2",
        "train.steps=400", "train.eval_episodes=2", "train.device=cpu",
        "train.keep_checkpoints=2"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    result = trainer.run()
    records = check_logdir(tmp_path / "run", config, [400])
    assert all(r["length"] == 50 for r in records)  # Pendulum never terminates early
    assert result == records[-1]
    assert result["phase"] == "eval" and result["episodes"] == 2
    assert trainer.counters.steps == records[-1]["step"] >= 400
    assert trainer.counters.eval_steps == 2 * 50 * sum(r["phase"] == "eval" for r in records)
    assert len(list_checkpoints(tmp_path / "run")) == 2


# --- exact resume ----------------------------------------------------------------------

def comparable(records: list[dict]) -> list[tuple]:
    """What must not depend on where a run was interrupted (not its timings)."""
    return [(r["step"], r["phase"], r["score"], r["score_std"], r["length"], r["episodes"])
            for r in records]


RESUME_OVERRIDES = CARTPOLE + ["train.checkpoint_every=2", "train.keep_checkpoints=50"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """An uninterrupted run of 2 x CARTPOLE_STEPS: (logdir, its config)."""
    full = load_config("cartpole", RESUME_OVERRIDES + [f"train.steps={2 * CARTPOLE_STEPS}"])
    straight = tmp_path_factory.mktemp("straight") / "run"
    Trainer(full, straight, progress=False).run()
    return straight, full


def test_resumed_run_equals_an_uninterrupted_one(straight_run, tmp_path):
    straight, full = straight_run
    expected = comparable(read_metrics(straight))
    straight_state = torch.load(list_checkpoints(straight)[-1], weights_only=False)
    # The first session's budget ends where a training phase of the straight run ends (the
    # last phase of a session stops at its budget, which may cut a phase short: see
    # test_a_budget_inside_a_phase_stops_there_and_the_run_extends).
    half_budget = min(r["step"] for r in read_metrics(straight)
                      if r["phase"] == "train" and r["step"] >= CARTPOLE_STEPS)
    assert half_budget < 2 * CARTPOLE_STEPS
    half = load_config("cartpole", RESUME_OVERRIDES + [f"train.steps={half_budget}"])

    resumed = tmp_path / "resumed"
    Trainer(half, resumed, progress=False).run()
    first = read_metrics(resumed)
    assert first[-1]["step"] == half_budget
    assert comparable(first) == expected[:len(first)]
    Trainer(full, resumed, progress=False).run()
    assert comparable(read_metrics(resumed)) == expected
    check_logdir(resumed, full, [half_budget, 2 * CARTPOLE_STEPS])

    # The same model, and checkpoints at the same phases (checkpoint_every counts
    # the evaluations of every session), plus the first session's final one.
    resumed_state = torch.load(list_checkpoints(resumed)[-1], weights_only=False)
    for name, tensor in straight_state["algorithm"]["policy"].items():
        assert torch.equal(tensor, resumed_state["algorithm"]["policy"][name]), name
    assert resumed_state["counters"] == {**straight_state["counters"],
                                         "wall_time": resumed_state["counters"]["wall_time"]}
    straight_steps = {p.name for p in list_checkpoints(straight)}
    resumed_steps = {p.name for p in list_checkpoints(resumed)}
    assert straight_steps <= resumed_steps
    assert resumed_steps - straight_steps <= {f"ckpt-{first[-1]['step']:012d}.pt"}

    # A crash after a checkpoint: the newest ones are lost, the run is repeated
    # from the one before; neither metrics.jsonl nor TensorBoard repeat a phase.
    for path in list_checkpoints(resumed)[-2:]:
        path.unlink()
    Trainer(full, resumed, progress=False).run()
    assert comparable(read_metrics(resumed)) == expected
    check_logdir(resumed, full, [half_budget, 2 * CARTPOLE_STEPS])

    # A crash before the first checkpoint: the run starts over, cleanly.
    for path in list_checkpoints(resumed):
        path.unlink()
    Trainer(full, resumed, progress=False).run()
    assert comparable(read_metrics(resumed)) == expected
    check_logdir(resumed, full, [2 * CARTPOLE_STEPS])


def test_a_budget_inside_a_phase_stops_there_and_the_run_extends(straight_run, tmp_path):
    straight, full = straight_run
    expected = comparable(read_metrics(straight))
    train_steps = [r["step"] for r in read_metrics(straight) if r["phase"] == "train"]
    assert CARTPOLE_STEPS not in train_steps  # inside a training phase of the straight run
    half = load_config("cartpole", RESUME_OVERRIDES + [f"train.steps={CARTPOLE_STEPS}"])
    resumed = tmp_path / "resumed"
    Trainer(half, resumed, progress=False).run()
    first = read_metrics(resumed)
    # The same phases until the one the budget cuts short, which stops at the budget
    # (then the final evaluation).
    assert comparable(first[:-2]) == expected[:len(first) - 2]
    assert [(r["phase"], r["step"]) for r in first[-2:]] == [("train", CARTPOLE_STEPS),
                                                             ("eval", CARTPOLE_STEPS)]
    assert first[-2]["episodes"] < full.algorithm.keys["update_every"]
    check_logdir(resumed, half, [CARTPOLE_STEPS])
    # A larger budget continues from there, to exactly the new budget.
    Trainer(full, resumed, progress=False).run()
    records = check_logdir(resumed, full, [CARTPOLE_STEPS, 2 * CARTPOLE_STEPS])
    assert records[:len(first)] == first
    assert records[-1]["step"] == 2 * CARTPOLE_STEPS


def test_an_extension_first_completes_the_rollout_phase_the_budget_cut_short(tmp_path):
    """Fixed-length rollouts: a budget inside a training phase stops it mid-rollout; a
    larger budget then trains the rest of that phase first, so that phases end with an
    update again and the run evaluates where a run with the larger budget from the start
    would. (A full-length phase from the cut would end mid-rollout every time: each next
    phase's resets would drop that rollout's running episodes.)"""
    rollouts = ["env.num_agents=2", "algorithm.rollout_length=8", "train.eval_every=3",
                "train.eval_episodes=2", "train.device=cpu", "env.backend=inline"]
    straight = tmp_path / "straight"
    Trainer(load_config("cartpole", rollouts + ["train.steps=192"]), straight,
            progress=False).run()
    # Phases of 3 rollouts: 3 x 8 batch steps of 2 agents, 48 env steps.
    expected = [r["step"] for r in read_metrics(straight) if r["phase"] == "train"]
    assert expected == [48, 96, 144, 192]
    cut = tmp_path / "cut"
    Trainer(load_config("cartpole", rollouts + ["train.steps=68"]), cut, progress=False).run()
    Trainer(load_config("cartpole", rollouts + ["train.steps=192"]), cut, progress=False).run()
    records = read_metrics(cut)
    assert [r["step"] for r in records if r["phase"] == "train"] == [48, 68, 96, 144, 192]
    assert [r["step"] for r in records if r["phase"] == "eval"] == [48, 68, 96, 144, 192]
    # Updates stay every rollout of both agents (16 env steps): the one at 80 learns what the
    # rest of the phase added to the rollout the cut stopped in.
    updates = [step for step, _ in scalar_events(cut)["ppo/policy_loss"]]
    assert updates == [16 * k for k in range(1, 13)]


def test_the_rest_of_a_cut_phase_completes_it_and_evaluations_stay_where_they_were(tmp_path):
    """Phases of env steps (an algorithm without rollouts or whole-episode updates: DQN) with
    an evaluation every second one: the rest of a phase the budget cut short completes that
    phase, so the raised budget's run evaluates where a run with that budget from the start
    would (and at the cut, where every session's last phase evaluates)."""
    (tmp_path / "dqn.toml").write_text(textwrap.dedent("""
        [env]
        id = "CartPole-v1"
        num_agents = 2
        backend = "inline"
        [train]
        phase_steps = 40
        eval_every = 2
        eval_episodes = 2
        device = "cpu"
        [algorithm]
        class = "batchrl.algos:DQN"
        learning_starts = 20
        hidden = [8]
        """))

    def run(logdir, steps):
        config = load_config(str(tmp_path / "dqn.toml"), [f"train.steps={steps}"])
        Trainer(config, logdir, progress=False).run()
        return [(r["phase"], r["step"]) for r in read_metrics(logdir)]

    straight = run(tmp_path / "straight", 160)
    assert [step for phase, step in straight if phase == "eval"] == [80, 160]
    run(tmp_path / "cut", 60)
    records = run(tmp_path / "cut", 160)
    assert [step for phase, step in records if phase == "train"] == [40, 60, 80, 120, 160]
    assert [step for phase, step in records if phase == "eval"] == [60, 80, 160]


def test_a_run_stopped_mid_phase_resumes_from_the_last_phase_boundary(straight_run, tmp_path,
                                                                     monkeypatch):
    """SIGINT (as Ctrl-C) within an evaluation, four times, in this process: each stop
    leaves the last phase boundary as the run's newest checkpoint, whether it was written
    when due (and is not written again), kept in memory, or (stopped in a resumed session
    before its first boundary) the checkpoint that session resumed from. Resumed each time,
    the run goes on as the uninterrupted one: the same phases, and its due checkpoints at the
    same steps, bit for bit."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("only the main thread handles signals")
    straight, full = straight_run
    expected = comparable(read_metrics(straight))
    boundaries = [r["step"] for r in read_metrics(straight) if r["phase"] == "eval"]
    due = {load_checkpoint(path)["counters"]["steps"]: path
           for path in list_checkpoints(straight)}
    resumed = tmp_path / "resumed"
    report = Trainer._report

    def stopped_after(records: int) -> TrainingInterrupted:
        """Start or resume the run; SIGINT once it reported ``records`` phases (the last one a
        training phase: the stop comes within its evaluation)."""
        reported = []

        def report_then_stop(self, record, bar):
            report(self, record, bar)
            reported.append(record)
            if len(reported) == records:
                assert record["phase"] == "train"
                os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(Trainer, "_report", report_then_stop)
        with pytest.raises(TrainingInterrupted) as info:
            Trainer(full, resumed, progress=False, handle_signals=True).run()
        stop = info.value
        assert stop.exit_code == 130 and stop.checkpoint == list_checkpoints(resumed)[-1]
        assert load_checkpoint(stop.checkpoint)["counters"]["steps"] == stop.step
        assert comparable(read_metrics(resumed)) == expected[:len(read_metrics(resumed))]
        return stop

    # checkpoint_every=2: the second evaluation's boundary was written when due.
    assert stopped_after(5).step == boundaries[1] and boundaries[1] in due
    # Stopped before the resumed session's first boundary: the checkpoint it resumed from.
    assert stopped_after(1).step == boundaries[1]
    # The third evaluation's boundary, kept in memory, is written at the stop.
    assert stopped_after(3).step == boundaries[2] and boundaries[2] not in due
    # Past the fourth evaluation's boundary, due (the count of evaluations goes on over the
    # sessions), to the fifth's.
    assert stopped_after(5).step == boundaries[4]
    written = {load_checkpoint(path)["counters"]["steps"]: path
               for path in list_checkpoints(resumed)}
    compared = [step for step in due if step <= boundaries[4]]
    assert boundaries[3] in compared and set(compared) <= set(written)
    for step in compared:
        state, reference = load_checkpoint(written[step]), load_checkpoint(due[step])
        assert state["counters"].pop("wall_time") > 0
        reference["counters"].pop("wall_time")
        assert_same(state, reference)


# --- a custom env via train.py, from the current directory --------------------------

ENV_MODULE = '''
import gymnasium as gym
import numpy as np


class Steps(gym.Env):
    """Episodes of `length` steps; reward 1 - |action|."""

    def __init__(self, length):
        self.length = length
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        reward = 1.0 - abs(float(action[0]))
        return self.observation_space.sample(), reward, self.t >= self.length, False, {}


def make(length=4):
    return Steps(length)
'''


def test_train_py_with_an_env_from_the_current_directory(tmp_path):
    package = tmp_path / "myenvs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "steps.py").write_text(textwrap.dedent(ENV_MODULE))
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Worker processes (env.backend=workers) import myenvs too.
    process = train_py("--config", "pendulum", "--logdir", "run", "--no-progress",
                       *sets("env.id=myenvs.steps:make", "env.kwargs={length = 6}",
                             "env.num_agents=2", "env.max_length=20", "env.backend=workers",
                             "algorithm.update_every=2", "algorithm.update_epochs=2",
                             "train.steps=48", "train.eval_episodes=2"),
                       cwd=tmp_path, env=environ)
    assert process.returncode == 0, process.stderr
    records = read_metrics(tmp_path / "run")
    assert records and {r["length"] for r in records} == {6.0}
    assert records[-1]["step"] >= 48


# --- bad input --------------------------------------------------------------------------

BAD_INPUT = {  # name: (arguments, what stderr must say)
    "unknown config": (["--config", "nosuch"], ["no config named 'nosuch'", "cartpole",
                                                "halfcheetah"]),
    "unknown key": (["--config", "cartpole", *sets("algorithm.bogus=1")],
                    ["BatchPPO (batchrl.algos.ppo:BatchPPO) does not take algorithm.bogus; "
                     "its keys: network, policy_layers, ", "policy_lr"]),
    "bad type": (["--config", "cartpole", *sets("env.num_agents=2.5")],
                 ["env.num_agents", "expected an integer"]),
    "out of range": (["--config", "cartpole", *sets("algorithm.discount=1.5")],
                     ["algorithm.discount must be in [0, 1]"]),
    "bad env id": (["--config", "cartpole", *sets("env.id=NoSuchEnv-v0")],
                   ["NoSuchEnv-v0", "package.module:function"]),
}

MORE_BAD_INPUT = {  # checked in-process through train.main()
    "malformed --set": (["--config", "cartpole", "--set", "algorithm.discount"],
                        ["--set needs section.key=value"]),
    "unknown section": (["--config", "cartpole", *sets("optim.lr=1")], ["[optim]"]),
    "bad device": (["--config", "cartpole", *sets("train.device=tpu")], ["train.device",
                                                                         "'cpu'"]),
    "bad steps": (["--config", "cartpole", "--steps", "0"], ["train.steps must be >= 1"]),
    "shared mlp torso": (["--config", "cartpole", *sets("algorithm.shared_torso=true")],
                         ["algorithm.shared_torso needs a torso with layers to share"]),
    "impala shared mlp torso": (["--config", "impala/cartpole",
                                 *sets("algorithm.shared_torso=true")],
                                ["algorithm.shared_torso needs a torso with layers to share"]),
    "algorithm.max_length": (["--config", "cartpole", *sets("algorithm.max_length=9")],
                             ["algorithm.max_length is the trainer's to pass (from "
                              "env.max_length); remove it from [algorithm] and set "
                              "env.max_length instead"]),
    "algorithm.total_steps": (["--config", "cartpole", *sets("algorithm.total_steps=9")],
                              ["algorithm.total_steps is the trainer's to pass (from "
                               "train.steps); remove it from [algorithm] and set train.steps "
                               "instead"]),
    "--set ppo.key": (["--config", "cartpole", *sets("ppo.discount=0.9")],
                      ["unknown section [ppo]; valid sections: env, train, algorithm "
                       "(BatchPPO's keys go in [algorithm])"]),
    "[ppo] in a file": (["--config", "{tmp}/old.toml"],
                        ["unknown section [ppo]; valid sections: env, train, algorithm "
                         "(BatchPPO's keys go in [algorithm])"]),
    "swapped class": (["--config", "cartpole",
                       *sets("algorithm.class=batchrl.algos.reinforce:Reinforce")],
                      ["Reinforce (batchrl.algos.reinforce:Reinforce) does not take "
                       "algorithm.policy_lr; its keys: discount, learning_rate, update_every, "
                       "hidden, seed"]),
    "non-integral steps": (["--config", "cartpole", *sets("train.steps=1.5")],
                           ["train.steps: expected an integer, got 1.5"]),
    "missing module": (["--config", "cartpole", *sets("env.id=no_such_mod_xyz:make")],
                       ["cannot import module 'no_such_mod_xyz'"]),
    "bad toml file": (["--config", "{tmp}/broken.toml"], ["not valid TOML"]),
}


def test_train_py_bad_input_exits_2_without_a_traceback(tmp_path):
    # Started together: most of each one's time is importing torch.
    running = {}
    for name, (args, _) in BAD_INPUT.items():
        logdir = tmp_path / name.replace(" ", "-")
        running[name] = (logdir, subprocess.Popen(
            [sys.executable, str(TRAIN_PY), *args, "--logdir", str(logdir), "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for name, (logdir, process) in running.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (name, stdout, stderr)
        assert "Traceback" not in stderr, (name, stderr)
        assert stderr.startswith("error: "), (name, stderr)
        for text in BAD_INPUT[name][1]:
            assert text in stderr, (name, text, stderr)
        assert not (logdir / "config.json").exists(), name  # nothing that would resume


@pytest.fixture
def train_main(monkeypatch):
    """train.py's main(), imported from the repository root."""
    spec = importlib.util.spec_from_file_location("train_script", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() may add the cwd
    return module.main


@pytest.mark.parametrize("name", sorted(MORE_BAD_INPUT))
def test_train_main_bad_input(name, train_main, tmp_path, capsys):
    (tmp_path / "broken.toml").write_text("[env\n")
    (tmp_path / "old.toml").write_text("[ppo]\ndiscount = 0.9\n")
    args, expected = MORE_BAD_INPUT[name]
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert train_main([*args, "--logdir", str(tmp_path / "run"), "--no-progress"]) == 2
    stderr = capsys.readouterr().err
    for text in expected:
        assert text in stderr, stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", ["many", "1.5", "1e-1"])
def test_train_main_non_integer_steps_is_a_usage_error(train_main, capsys, steps):
    with pytest.raises(SystemExit) as info:
        train_main(["--config", "cartpole", "--steps", steps])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_train_main_cuda_without_cuda(train_main, tmp_path, capsys):
    args = ["--config", "cartpole", *sets("train.device=cuda"), "--logdir", str(tmp_path / "r")]
    assert train_main(args) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def algorithm_sections(text: str) -> dict[str, list[str]]:
    """The ``[algorithm] keys of NAME (...):`` blocks of ``--help``: header -> keys."""
    blocks: dict[str, list[str]] = {}
    header = None
    for line in text.splitlines():
        if line.startswith("[algorithm] keys of "):
            header = line
            blocks[header] = []
        elif header is not None and line.startswith("  algorithm."):
            blocks[header].append(line.strip().split(" = ")[0].removeprefix("algorithm."))
        else:
            header = None
    return blocks


def algorithm_header(path: str) -> str:
    what = "the default" if path == BATCHPPO else f'algorithm.class = "{path}"'
    return f"[algorithm] keys of {path.rpartition(':')[2]} ({what}):"


def test_train_py_help_lists_the_config_keys():
    process = train_py("--help")
    assert process.returncode == 0, process.stderr
    text = process.stdout
    for option in ("--config", "--logdir", "--set", "--steps", "--no-progress"):
        assert option in text
    for name in ("cartpole", "pendulum", "halfcheetah", "cartpole_reinforce"):
        assert name in text
    # Every key of [env] and [train] (train.phase_steps too), before the algorithms' keys.
    assert set(SECTIONS) == {"env", "train"}
    first_algorithm = text.index("[algorithm] keys of ")
    for section, factory in SECTIONS.items():
        for field in dataclasses.fields(factory):
            key = f"  {section}.{field.name} = "
            assert key in text, key
            assert text.index(key) < first_algorithm, key
    assert "  train.phase_steps = 0" in text
    # Then the [algorithm] keys of each shipped algorithm, in their order; not the run
    # facts, which the trainer passes.
    assert list(algorithm_sections(text)) == [algorithm_header(path)
                                              for path in SHIPPED_ALGORITHMS]
    for path in SHIPPED_ALGORITHMS:
        assert algorithm_sections(text)[algorithm_header(path)] == list(algorithm_keys(path))
    for fact in RUN_FACTS:
        assert f"algorithm.{fact} =" not in text
    # Defaults are shown as --set takes them (TOML).
    assert 'env.id = "CartPole-v1"' in text
    assert "env.backend = \"auto\"" in text
    assert "algorithm.policy_layers = [200, 100]" in text
    assert "algorithm.hidden = [64, 64]" in text  # Reinforce's


def test_train_main_help_with_a_config_lists_its_algorithms_keys(train_main, capsys):
    reinforce = "batchrl.algos.reinforce:Reinforce"
    with pytest.raises(SystemExit) as info:
        train_main(["--config", "cartpole_reinforce", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    # The config's values, each default after "#" where the two differ.
    assert "with cartpole_reinforce's values" in text
    assert "  env.num_agents = 8  # default 30\n" in text
    assert "  train.phase_steps = 8000  # default 0\n" in text
    assert '  env.id = "CartPole-v1"\n' in text and "  algorithm.discount = 0.99\n" in text
    assert algorithm_sections(text) == {algorithm_header(reinforce): [
        "discount", "learning_rate", "update_every", "hidden", "seed"]}
    assert "BatchPPO" not in text.partition("config keys")[2]
    assert "algorithm.policy_lr" not in text and "algorithm.learning_rate = 0.01" in text
    # A BatchPPO config: BatchPPO's keys only.
    with pytest.raises(SystemExit):
        train_main(["--help", "--config", "cartpole"])
    text = capsys.readouterr().out
    assert list(algorithm_sections(text)) == [algorithm_header(BATCHPPO)]
    assert "algorithm.learning_rate" not in text
    # A config that does not load: said so, and every shipped algorithm's keys.
    with pytest.raises(SystemExit) as info:
        train_main(["--config", "nosuch", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "(--config nosuch: no config named 'nosuch'" in text
    assert "  env.num_agents = 30\n" in text and "# default" not in text
    assert list(algorithm_sections(text)) == [algorithm_header(path)
                                              for path in SHIPPED_ALGORITHMS]


def test_run_without_evaluations_still_plots_and_checkpoints(tmp_path):
    config = load_config("cartpole", CARTPOLE + ["train.eval_episodes=0", "train.steps=100"])
    assert Trainer(config, tmp_path / "run", progress=False).run() == {}
    records = read_metrics(tmp_path / "run")
    assert records and {r["phase"] for r in records} == {"train"}
    assert (tmp_path / "run" / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC
    assert list_checkpoints(tmp_path / "run")[-1].name == f"ckpt-{records[-1]['step']:012d}.pt"


def test_evaluations_count_every_agents_episodes_alike(tmp_path):
    """An agent whose episodes end sooner does not fill an evaluation with them: each agent
    counts its first episodes, an equal share. One of the two agents plays episodes of 2 steps
    and return 0, the other of 20 steps and return 20 (the first four episodes to end are
    all short ones)."""
    config = load_config("cartpole", [
        'env.id="batchrl.testing.envs:uneven_episodes"', "env.num_agents=2",
        'env.backend="inline"', "algorithm.update_every=2", "train.eval_episodes=4",
        "train.steps=100", "train.device=cpu"])
    result = Trainer(config, tmp_path / "run", progress=False).run()
    evals = [r for r in read_metrics(tmp_path / "run") if r["phase"] == "eval"]
    assert evals and result["episodes"] == 4
    for record in evals:
        assert record["episodes"] == 4
        assert record["score"] == 10.0 and record["length"] == 11.0, record
        assert record["score_std"] == 10.0, record  # (the population's: returns 0, 0, 20, 20)


def test_each_phase_resets_its_envs_with_seeds_of_its_own(tmp_path):
    """Phase p (training or evaluation) resets env i with seed
    ``train.seed * 1_000_003 + p * env.num_agents + i``: no two phases start alike.
    ``uneven_episodes`` plays short episodes of return 0 after an even seed and long ones
    of 1 a step after an odd one; with 3 agents the parities flip from one phase to the next.
    Evaluations (every third phase: eval_every=2) step envs of their own, built with
    env.eval_kwargs (short episodes of 2 steps, long ones of 30), the training envs with
    env.kwargs (3 and 20); a training phase counts the first update_every episodes to end,
    even when one step ends more."""
    config = load_config("cartpole", [
        'env.id="batchrl.testing.envs:uneven_episodes"', "env.num_agents=3",
        "env.max_length=50", 'env.backend="inline"', "env.kwargs={short=3}",
        "env.eval_kwargs={short=2, long=30}", "algorithm.update_every=3",
        "train.eval_episodes=3", "train.eval_every=2", "train.steps=200",
        "train.device=cpu"])
    Trainer(config, tmp_path / "run", progress=False).run()
    records = read_metrics(tmp_path / "run")  # one per phase, in order
    trains = [r for r in records if r["phase"] == "train"]
    evals = [(phase, r) for phase, r in enumerate(records) if r["phase"] == "eval"]
    assert len(evals) >= 3
    for record in trains[:-1]:  # (the last one stops at the budget)
        # Two short episodes end at once in some steps: the first three are short ones.
        assert (record["episodes"], record["score"], record["length"]) == (3, 0.0, 3.0), record
    for phase, record in evals:  # each agent's first episode
        lengths = [2, 30, 2] if phase % 2 == 0 else [30, 2, 30]
        assert record["episodes"] == 3
        assert record["score"] == (10.0 if phase % 2 == 0 else 20.0), (phase, record)
        assert record["length"] == pytest.approx(sum(lengths) / 3), (phase, record)
        assert record["score_std"] == pytest.approx(200 ** 0.5), (phase, record)


def test_progress_in_a_log_file_is_one_plain_line_per_phase(tmp_path):
    process = train_py("--config", "cartpole", "--logdir", str(tmp_path / "run"),
                       *sets(*CARTPOLE, "train.steps=300"))  # stdout is a pipe, not a terminal
    assert process.returncode == 0, process.stderr
    lines = [line for line in process.stdout.splitlines() if line.startswith("step ")]
    records = read_metrics(tmp_path / "run")
    assert len(lines) == len(records) > 0
    assert lines[0].startswith(f"step {records[0]['step']:,} of 300: train return ")
    assert "\r" not in process.stdout + process.stderr  # no progress bar


# --- the budget: the last training phase stops at train.steps ----------------------------

def test_train_py_ends_at_exactly_the_budget(tmp_path):
    # cartpole: 10 agents, an update every 20 episodes (about 400 steps early on); 1,250 is
    # a multiple of 10 inside a phase, which stops there.
    process = train_py("--config", "cartpole", "--logdir", str(tmp_path / "run"),
                       "--steps", "1250", *sets("train.device=cpu"))
    assert process.returncode == 0, process.stderr
    assert "Training BatchPPO on CartPole-v1 with 10 agents for 1,250 steps" in process.stdout
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if r["phase"] == "train"]
    assert train[-1]["step"] == 1250 and all(r["step"] < 1250 for r in train[:-1])
    assert records[-1] == {**records[-1], "phase": "eval", "step": 1250}
    lines = [line for line in process.stdout.splitlines() if line.startswith("step ")]
    assert lines[-2].startswith("step 1,250 of 1,250: train return ")
    assert lines[-1].startswith("step 1,250 of 1,250: eval return ")
    assert len(lines) == len(records)
    assert all(0 < int(line.split()[1].replace(",", "")) <= 1250 and " of 1,250: " in line
               for line in lines)
    assert list_checkpoints(tmp_path / "run")[-1].name == f"ckpt-{1250:012d}.pt"
    state = torch.load(list_checkpoints(tmp_path / "run")[-1], weights_only=False)
    assert state["counters"]["steps"] == 1250


@pytest.mark.parametrize("name, overrides, budget, plan", [
    # Fixed-length rollouts (as halfcheetah): 10 agents x 16 steps x eval_every 2 = 320
    # steps a phase; a 1,000-step budget trains 1,000, not 1,280.
    ("cartpole", ["algorithm.rollout_length=16", "algorithm.update_epochs=2",
                  "train.eval_every=2"], 1000, [320, 640, 960, 1000]),
    # No update length (Reinforce): phases of train.phase_steps env steps.
    ("cartpole_reinforce", ["train.phase_steps=400"], 1000, [400, 800, 1000]),
    # A budget that is no multiple of env.num_agents ends after the batch step reaching it.
    ("cartpole_reinforce", ["train.phase_steps=400"], 999, [400, 800, 1000]),
])
def test_every_phase_plan_stops_at_the_budget(tmp_path, capsys, name, overrides, budget,
                                              plan):
    config = load_config(name, overrides + [f"train.steps={budget}", "train.eval_episodes=2",
                                            "train.device=cpu"])
    trainer = Trainer(config, tmp_path / "run", progress=False)
    trainer.run()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if r["phase"] == "train"] == plan
    assert trainer.counters.steps == plan[-1]
    assert [r["phase"] for r in records] == ["train", "eval"] * len(plan)
    assert "train.phase_steps is unused" not in capsys.readouterr().err


@pytest.mark.parametrize("name, words", [
    ("cartpole", "BatchPPO learns from every 20 episodes, and a training phase is one such "
                 "update"),
    ("impala/cartpole", "IMPALA learns every 20 batch steps, and a training phase is "
                        "train.eval_every = 50 such updates"),
])
def test_phase_steps_for_an_algorithm_naming_its_update_length_is_a_notice(
        tmp_path, capsys, name, words):
    config = load_config(name, ["train.phase_steps=500", "train.steps=40",
                                "train.eval_episodes=0", "train.device=cpu"])
    Trainer(config, tmp_path / "run", progress=False).run()
    assert f"note: train.phase_steps is unused: {words}\n" in capsys.readouterr().err


# --- resuming a run that an earlier version saved -----------------------------------------

@pytest.mark.parametrize("form", ["ppo with run facts", "algorithm without class"])
def test_train_py_resumes_a_run_saved_by_an_earlier_version(cartpole_run, tmp_path, form):
    """Earlier versions saved BatchPPO's keys as [ppo], with max_length and total_steps,
    later as [algorithm] without class; such a run still resumes and trains further."""
    logdir = tmp_path / "run"
    shutil.copytree(cartpole_run[0], logdir)
    config = cartpole_run[1]
    saved = json.loads((logdir / "config.json").read_text())
    keys = {key: value for key, value in saved.pop("algorithm").items() if key != "class"}
    if form == "ppo with run facts":
        saved["ppo"] = {**keys, "max_length": config.env.max_length,
                        "total_steps": config.train.steps}
    else:
        saved["algorithm"] = keys
    (logdir / "config.json").write_text(json.dumps(saved, indent=2))
    assert load_saved_config(logdir) == config
    before = read_metrics(logdir)

    budget = 2 * CARTPOLE_STEPS
    process = train_py("--config", "cartpole", "--logdir", str(logdir), "--no-progress",
                       "--steps", str(budget))
    assert process.returncode == 0, process.stderr
    assert "Traceback" not in process.stderr
    assert f"Resuming from {logdir}" in process.stdout
    assert f"at step {before[-1]['step']:,}" in process.stdout
    extended = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=budget))
    # config.json is rewritten in today's form (class, no run facts), the budget raised.
    records = check_logdir(logdir, extended, [CARTPOLE_STEPS, budget])
    assert "ppo" not in json.loads((logdir / "config.json").read_text())
    assert records[:len(before)] == before
    assert records[-1]["step"] == budget


def test_runs_started_in_one_second_without_logdir_get_directories_of_their_own(tmp_path):
    from batchrl.train import _new_logdir

    made = [_new_logdir(tmp_path / "logs" / "cartpole", ValueError) for _ in range(3)]
    assert len(set(made)) == 3 and all(path.is_dir() for path in made)
    assert all(path.name.startswith("cartpole-") for path in made)


def test_a_run_resumes_when_the_toml_file_it_was_started_with_is_gone(tmp_path):
    import argparse

    from batchrl.config import save_config
    from batchrl.train import STARTED_WITH, _configure

    toml = tmp_path / "mine.toml"
    toml.write_text((REPO / "configs" / "cartpole.toml").read_text())
    logdir = tmp_path / "run"
    logdir.mkdir()
    save_config(load_config(str(toml)), logdir)
    (logdir / STARTED_WITH).write_text(json.dumps({"config": str(toml)}))
    toml.unlink()
    config, resumed, created = _configure(argparse.Namespace(
        config=str(toml), logdir=logdir, overrides=[], steps=None), "train.py")
    assert config.env.id == "CartPole-v1" and resumed == logdir and created is None


def test_a_resume_may_change_where_the_run_goes_on_and_its_budget_only(tmp_path):
    """A run to resume takes --steps and --set of the machine keys (train.device,
    train.threads, env.workers, env.timeout); a --set of anything else, or a --config that
    trains another env or algorithm, is refused: the run would go on as it was saved."""
    from batchrl.train import STARTED_WITH, _configure

    logdir = tmp_path / "run"
    logdir.mkdir()
    saved = load_config("cartpole", CARTPOLE)
    save_config(saved, logdir)
    (logdir / STARTED_WITH).write_text(json.dumps({"config": "cartpole"}))

    def configure(name: str, *overrides: str, steps: int | None = None) -> Config:
        return _configure(argparse.Namespace(config=name, logdir=logdir,
                                             overrides=list(overrides), steps=steps),
                          "train.py")[0]

    moved = configure("cartpole", "train.device=cpu", "train.threads=2", "env.workers=3",
                      "env.timeout=30", steps=2 * saved.train.steps)
    assert (moved.train.device, moved.train.threads, moved.env.workers, moved.env.timeout,
            moved.train.steps) == ("cpu", 2, 3, 30.0, 2 * saved.train.steps)
    assert moved.algorithm == saved.algorithm and moved.env.num_agents == 4
    for learning in ("algorithm.discount=0.9", "env.num_agents=8", "train.seed=1",
                     "train.eval_episodes=2"):
        with pytest.raises(ConfigError, match=f"^{logdir} holds a run, which resumes with its "
                                              f"saved config; drop --set {re.escape(learning)} "):
            configure("cartpole", "env.timeout=30", learning)
    for name, env, algorithm in (("pendulum", "Pendulum-v1", "ppo:BatchPPO"),
                                 ("cartpole_reinforce", "CartPole-v1",
                                  "reinforce:Reinforce")):
        with pytest.raises(ConfigError) as info:
            configure(name)
        # (env.kwargs follow the env ids only where those match and the kwargs do not)
        assert re.fullmatch(
            rf"{re.escape(str(logdir))} holds a run of CartPole-v1 with "
            rf"batchrl\.algos\.ppo:BatchPPO, but --config {name} trains {env} with "
            rf"batchrl\.algos\.{algorithm}; resume with: train\.py --config cartpole "
            rf"--logdir {re.escape(str(logdir))} or choose a new --logdir", str(info.value)), \
            info.value


def test_summaries_are_numbers_and_another_value_names_its_key(tmp_path):
    """An algorithm's summary of a string or a per-agent tensor is a TypeError naming the
    key when it is logged (TensorBoard's own errors name neither)."""
    log = RunLog(tmp_path)
    try:
        log.scalars({"a": 1, "b": 2.5, "c": torch.tensor(0.5), "d": torch.tensor([1.5]),
                     "e": np.float32(3.0)}, 1)
        for value, shown in (("hello", "'hello'"), (torch.zeros(3), r"tensor\(\[0., 0., 0.\]\)"),
                             (torch.zeros(100), "a Tensor of 100 elements"), (None, "None")):
            with pytest.raises(TypeError, match=f"^the summary 'ppo/x' is {shown}: an "
                                                f"algorithm's summaries map names to numbers"):
                log.scalars({"ppo/x": value}, 2)
    finally:
        log.close()


def test_read_metrics_and_truncate_on_resume(tmp_path):
    """read_metrics: [] without a file, skips blank lines, stops at a line cut by a crash;
    RunLog.truncate(step) keeps exactly the records at or before step, one per line."""
    assert read_metrics(tmp_path) == []
    records = [{"step": 100, "phase": "train", "score": 1.0},
               {"step": 100, "phase": "eval", "score": 2.0},
               {"step": 200, "phase": "update", "lag": 1},
               {"step": 200, "phase": "train", "score": 3.0},
               {"step": 200, "phase": "eval", "score": 4.0}]
    lines = [json.dumps(r) for r in records]
    (tmp_path / METRICS_FILE).write_text("\n".join([*lines[:2], "", *lines[2:]])
                                         + '\n{"step": 300, "phase": "tr')  # (cut by a crash)
    assert read_metrics(tmp_path) == records
    log = RunLog(tmp_path, purge_step=101)
    try:
        log.truncate(100)
        assert (tmp_path / METRICS_FILE).read_text() == "".join(f"{line}\n" for line in lines[:2])
        log.update({"step": 150, "lag": 0})
        log.phase({"step": 150, "phase": "train", "score": None})
        assert read_metrics(tmp_path) == [*records[:2], {"step": 150, "lag": 0, "phase": "update"},
                                          {"step": 150, "phase": "train", "score": None}]
        log.truncate(0)
        assert read_metrics(tmp_path) == [] and (tmp_path / METRICS_FILE).read_text() == ""
    finally:
        log.close()


def test_sessions_of_one_process_reach_tensorboard_in_their_order(tmp_path, monkeypatch):
    """Two sessions of one process on one log directory (a resume through the Python API):
    TensorBoard reads event files in name order, and a name's writer count does not sort as
    a number. With the count at 9 and 10 in one second, the second session's file came
    first and TensorBoard purged its steps as out of order."""
    from tensorboard.summary.writer import event_file_writer
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    for step in (1, 2):
        log = RunLog(tmp_path, purge_step=step)
        log.scalars({"ppo/x": float(step)}, step)
        log.close()
    assert scalar_events(tmp_path)["ppo/x"] == [(1, 1.0), (2, 2.0)]
