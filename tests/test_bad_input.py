"""Bad input to real train.py and evaluate processes: each fails fast with a
message that says what is wrong and what is valid, and the exit code says
whose fault it was: 2 for the user's input (no Python traceback), 1 for an
env that failed (its own error and traceback, not the trainer's).

Also the env layer's own checks of spaces, in and out of worker processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cloudpickle
import gymnasium as gym
import pytest

from batchrl.config import load_config
from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import UnsupportedSpaceError
from batchrl.envs.process.external import ExternalProcess
from batchrl.envs.process.shared_memory import EnvWorker
from batchrl.trainer import Trainer
from helpers import REPO, TRAIN_PY, mount_namespace

# Constructors defined here reach the env workers by value: a worker does not import this
# module (and torch with it) to build their envs.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TINY = ["--set", "env.num_agents=2", "--set", "algorithm.update_every=2", "--set",
        "train.eval_episodes=2", "--set", "train.device=cpu", "--set", "train.steps=200"]

USER_ENVS = '''
import gymnasium as gym


def raises(**kwargs):
    raise RuntimeError("the simulator licence file is missing")


def not_an_env():
    return "CartPole-v1"


class DictObservation(gym.ObservationWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"state": env.observation_space,
                                                  "name": gym.spaces.Text(8)})

    def observation(self, observ):
        return {"state": observ, "name": "cart"}


def dict_observation():
    return DictObservation(gym.make("CartPole-v1"))


class TupleAction(gym.ActionWrapper):
    def __init__(self, env):
        super().__init__(env)
        self.action_space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(2)))

    def action(self, action):
        return int(action[0])


def tuple_action():
    return TupleAction(gym.make("CartPole-v1"))


def multi_discrete():
    env = gym.make("CartPole-v1")
    env.action_space = gym.spaces.MultiDiscrete([2, 2])
    return env
'''


def make_cases(tmp: Path) -> dict[str, tuple[list[str], int, list[str]]]:
    """name: (train.py arguments, exit code, texts stderr must contain)."""
    (tmp / "a-file").write_text("")
    corrupt = tmp / "corrupt-config"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"env": {"id": "CartPole-v1"')
    invalid = tmp / "invalid-config"
    invalid.mkdir()
    (invalid / "config.json").write_text(json.dumps({"env": {"num_agents": 0}}))
    deleted = tmp / "deleted-config"  # (the file's contents are never read)
    deleted.mkdir()
    (deleted / "ckpt-000000001000.pt").write_bytes(b"")
    envs = "--config", "cartpole", *TINY
    return {
        "steps 0": (["--config", "cartpole", "--steps", "0"], 2,
                    ["train.steps must be >= 1, got 0"]),
        "steps -5": (["--config", "cartpole", "--steps", "-5"], 2,
                     ["train.steps must be >= 1, got -5"]),
        "set without =": (["--config", "cartpole", "--set", "algorithm.discount"], 2,
                          ["--set needs section.key=value, got 'algorithm.discount'"]),
        "set without section": (["--config", "cartpole", "--set", "discount=0.9"], 2,
                                ["--set key must be section.key"]),
        "unknown config": (["--config", "nosuch"], 2,
                           ["no config named 'nosuch'", "available: ", "cartpole"]),
        "config path not found": (["--config", "elsewhere/nosuch.toml"], 2,
                                  ["config file elsewhere/nosuch.toml not found (a path is "
                                   "relative to the current directory, ", "cartpole"]),
        "unknown env id": ([*envs, "--set", "env.id=CartPol-v1"], 2,
                           ["env 'CartPol-v1': Environment `CartPol` doesn't exist. Did you "
                            "mean: `CartPole`? Use a registered Gymnasium id"]),
        "logdir is a file": (["--config", "cartpole", "--logdir", str(tmp / "a-file")], 2,
                             [f"--logdir {tmp / 'a-file'} is a file, not a directory"]),
        "logdir under a file": (["--config", "cartpole", "--logdir",
                                 str(tmp / "a-file" / "run")], 2,
                                [f"cannot write to --logdir {tmp / 'a-file' / 'run'}: "
                                 f"Not a directory", "choose a directory"]),
        "corrupt saved config": (["--config", "cartpole", "--logdir", str(corrupt)], 2,
                                 [f"cannot read the saved config {corrupt / 'config.json'}",
                                  "restore the file"]),
        "checkpoints without their config": (
            ["--config", "cartpole", "--logdir", str(deleted)], 2,
            [f"{deleted} holds checkpoints but no config.json, the config they resume with: "
             f"restore it"]),
        # (said before the saved config, here an invalid one, is read)
        "steps 0 on resume": (["--config", "cartpole", "--logdir", str(invalid), "--steps",
                               "0"], 2, ["error: --steps: train.steps must be >= 1, got 0\n"]),
        "invalid saved config": (["--config", "cartpole", "--logdir", str(invalid)], 2,
                                 [f"the saved config {invalid / 'config.json'}",
                                  "env.num_agents must be >= 1, got 0"]),
        "empty logdir": (["--config", "cartpole", "--logdir", ""], 2,
                         ["--logdir is empty (an unset shell variable?)"]),
        "env kwarg the env does not take": ([*envs, "--set", "env.kwargs.sutton_barto=1"], 2,
                                            ["env.kwargs.sutton_barto: CartPole-v1 takes no "
                                             "such keyword", "unexpected keyword argument "
                                             "'sutton_barto'"]),
        "unknown env id": ([*envs, "--set", "env.id=NoSuchEnv-v0"], 2,
                           ["NoSuchEnv-v0", "registered Gymnasium id",
                            "package.module:function"]),
        "missing module": ([*envs, "--set", "env.id=no_such_module_xyz:make"], 2,
                           ["cannot import module 'no_such_module_xyz'"]),
        "missing function": ([*envs, "--set", "env.id=userenvs:nosuch"], 2,
                             ["module 'userenvs' has no callable 'nosuch'"]),
        "not an env, in process": ([*envs, "--set", "env.id=userenvs:not_an_env"], 2,
                                   ["userenvs.not_an_env() returned str 'CartPole-v1', "
                                    "not a gymnasium.Env"]),
        "not an env, in a worker": ([*envs, "--set", "env.id=userenvs:not_an_env",
                                     "--set", "env.backend=process"], 2,
                                    ["userenvs.not_an_env() returned str 'CartPole-v1', "
                                     "not a gymnasium.Env"]),
        "text in a dict observation": ([*envs, "--set", "env.id=userenvs:dict_observation",
                              "--set", "env.backend=workers"], 2,
                             ["unsupported observation space Dict('name': Text(",
                              "its part 'name' is Text(", "must be Box, Discrete"]),
        "tuple action": ([*envs, "--set", "env.id=userenvs:tuple_action"], 2,
                         ["unsupported action space Tuple(Discrete(2), Discrete(2))",
                          "Box, Discrete"]),
        "multi-discrete action": ([*envs, "--set", "env.id=userenvs:multi_discrete"], 2,
                                  ["BatchPPO supports Box and Discrete action spaces, "
                                   "got MultiDiscrete([2 2])"]),
        # The env's own code failed: exit 1, with the env's error and where it was raised.
        "constructor raises, in process": (
            [*envs, "--set", "env.id=userenvs:raises"], 1,
            ["userenvs:raises failed in construct(): RuntimeError: the simulator licence "
             "file is missing", 'userenvs.py", line 6, in raises',
             "Traceback in this process:"]),
        "constructor raises, in a worker": (
            [*envs, "--set", "env.id=userenvs:raises", "--set", "env.backend=workers",
             "--set", "env.share_main=false"], 1,
            ["env 0 (userenvs:raises) failed in construct(): RuntimeError: the simulator "
             "licence file is missing", 'userenvs.py", line 6, in raises',
             "Traceback in the env worker:"]),
        "vector env constructor raises": (
            [*envs, "--set", "env.backend=vector", "--set", "env.vector_id=userenvs:raises"], 1,
            ["userenvs:raises failed in construct(): RuntimeError: the simulator licence file "
             "is missing", "Traceback in this process:"]),
        "env raises mid-training": (
            [*envs, "--set", "env.id=batchrl.testing.faults:make", "--set",
             'env.kwargs={fault = "raise", at_step = 40}', "--set", "env.backend=process"], 1,
            ["failed in step(): RuntimeError: injected fault in step 40",
             "Traceback in the env worker", 'faults.py", line']),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's train.py, four at a time (most of each is importing torch)."""
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "userenvs.py").write_text(textwrap.dedent(USER_ENVS))
    cases = make_cases(tmp)
    environ = dict(os.environ, PYTHONPATH=str(REPO))

    def run(name: str) -> subprocess.CompletedProcess:
        args = cases[name][0]
        if "--logdir" not in args:
            args = [*args, "--logdir", str(tmp / "runs" / name.replace(" ", "-"))]
        return subprocess.run([sys.executable, str(TRAIN_PY), *args, "--no-progress"],
                              cwd=tmp, env=environ, capture_output=True, text=True,
                              timeout=120)

    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(cases, pool.map(run, cases)))
    return tmp, cases, done


def case_names() -> list[str]:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        return list(make_cases(Path(tmp)))


@pytest.mark.parametrize("name", case_names())
def test_train_py_says_what_is_wrong(results, name):
    tmp, cases, done = results
    _, code, texts = cases[name]
    result = done[name]
    assert result.returncode == code, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: "), result.stderr
    for text in texts:
        assert text in result.stderr, (text, result.stderr)
    if code == 2:
        assert "Traceback" not in result.stderr
    else:
        # The env's traceback, not the trainer's.
        assert "Traceback (most recent call last)" in result.stderr
        assert "trainer.py" not in result.stderr and "train.py" not in result.stderr
    # Nothing that would make the log directory a run to resume.
    run = tmp / "runs" / name.replace(" ", "-")
    if code == 2 or "construct" in texts[0]:
        assert not (run / "config.json").exists()
        assert not run.exists()  # not even an empty directory is left


def test_train_py_read_only_logdir(tmp_path):
    """A directory train.py may not write to: one that its user may not write (root may
    write anywhere: there, a read-only file system in a mount namespace of the test's own)."""
    parent = tmp_path / "read-only"
    parent.mkdir()
    command = [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--logdir",
               str(parent / "run")]
    if os.geteuid() == 0:
        namespace = mount_namespace()
        command = [*namespace, "sh", "-c", f"mount -t tmpfs -o ro tmpfs {parent} && exec "
                                           + " ".join(command)]
        why = "Read-only file system"
    else:
        parent.chmod(0o500)
        why = "Permission denied"
    try:
        result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                capture_output=True, text=True, timeout=120)
    finally:
        parent.chmod(0o700)
    assert result.returncode == 2, result
    assert result.stderr == (f"error: cannot write to --logdir {parent / 'run'}: {why}; choose "
                             f"a directory you can write to\n")


@pytest.mark.parametrize("settings", [["env.backend='ray'"],
                                      ["env.ray_address='auto'", "train.collectors=2"]])
def test_a_cluster_without_ray_installed_says_what_to_install(tmp_path, settings):
    (tmp_path / "ray").mkdir()  # (a ray that cannot be imported, first on the path)
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    command = [sys.executable, str(TRAIN_PY), "--config", "cartpole", "--no-progress",
               "--logdir", str(tmp_path / "run"), *(f"--set={s}" for s in settings)]
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{REPO}"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result
    assert result.stderr.endswith(
        "a Ray cluster (env.backend 'ray', or env.ray_address for collectors or learners) "
        "needs Ray, which cannot be imported here (No module named ray); install it with: "
        "pip install 'batchrl[ray]'\n"), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def _address_space_limit(limit: int) -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_a_replay_buffer_larger_than_the_memory_is_one_line(tmp_path):
    """A buffer that cannot be allocated (here 10.6 GB under an 8 GB address-space limit)
    says how large it is and which setting makes it so."""
    logdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(TRAIN_PY), "--config", "sac/hopper", "--logdir", str(logdir),
         "--no-progress", "--set", "algorithm.buffer_size=100000000", "--set",
         "train.device=cpu"],
        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=120, preexec_fn=lambda: _address_space_limit(8 * 2**30))
    assert result.returncode == 1, result.stderr[-2000:]
    assert ("error: out of memory: a replay buffer of 100,000,000 transitions needs 10.6 GB "
            "on cpu (106 bytes each)") in result.stderr, result.stderr[-2000:]
    assert "buffer_size" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_evaluate_cli_bad_logdirs(tmp_path):
    """``python -m batchrl.evaluate`` on a log directory without checkpoints,
    on one whose checkpoint is damaged, and naming a checkpoint that is not there."""
    logdir = tmp_path / "run"
    Trainer(load_config("cartpole", ["env.num_agents=2", "algorithm.update_every=2",
                                     "train.eval_episodes=2", "train.steps=50",
                                     "train.device=cpu"]), logdir, progress=False).run()
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(logdir / "config.json", empty)
    damaged = sorted(logdir.glob("ckpt-*.pt"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:100])
    environ = dict(os.environ, PYTHONPATH=str(REPO))
    missing = logdir / "ckpt-000000999999.pt"
    for args, texts in (([empty], [f"{empty} holds no checkpoint", "config.json"]),
                        ([logdir], [f"cannot read checkpoint {damaged}", "Delete it"]),
                        ([logdir, "--checkpoint", missing],
                         [f"checkpoint {missing} does not exist"]),
                        ([logdir, "--checkpoint", logdir],
                         [f"checkpoint {logdir} is a directory: name a checkpoint file"]),
                        ([logdir, "--device", "tpu"], ["--device must be 'auto', 'cpu', 'cuda'"]),
                        ([logdir, "--checkpoint", logdir / "config.json"],
                         [f"{logdir / 'config.json'} is not a batchrl checkpoint"]),
                        ([empty, "--seed", "-1"], ["--seed must be >= 0, got -1"])):
        result = subprocess.run([sys.executable, "-m", "batchrl.evaluate", *map(str, args)],
                                cwd=REPO, env=environ, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr
        for text in texts:
            assert text in result.stderr, result.stderr


def test_evaluate_device_without_cuda_names_the_flag(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here")
    from batchrl.trainer import resolve_device
    from batchrl.config import ConfigError
    with pytest.raises(ConfigError, match=r"^--device='cuda' but CUDA is not available here"):
        resolve_device("cuda", "--device")


# --- the env layer's space checks -------------------------------------------------------

def dict_observation_cartpole() -> gym.Env:
    """A Dict observation with a part no batch holds (text)."""
    env = gym.make("CartPole-v1")
    return gym.wrappers.TransformObservation(
        env, lambda observ: {"x": observ, "name": "cart"},
        gym.spaces.Dict({"x": env.observation_space, "name": gym.spaces.Text(8)}))


@pytest.mark.parametrize("where", ["in-process", "process", "worker"])
def test_unsupported_space_names_the_space_on_every_backend(where):
    if where == "in-process":
        members = [dict_observation_cartpole()]
    elif where == "process":
        members = [ExternalProcess(dict_observation_cartpole)]
    else:
        members = [EnvWorker([dict_observation_cartpole] * 2)]
    try:
        with pytest.raises(UnsupportedSpaceError,
                           match=r"unsupported observation space Dict\('name': Text\(.*its "
                                 r"part 'name' is Text\(.*must be Box, Discrete, MultiDiscrete, "
                                 r"MultiBinary"):
            BatchEnv(members)
    finally:
        for member in members:
            member.close()


UNGUARDED = '''
import gymnasium as gym
from batchrl import BatchEnv, EnvWorker, ExternalProcess

make = lambda: gym.make("CartPole-v1")
batch = BatchEnv([{member}])
print("built", batch.reset(seed=0).shape)
batch.close()
'''


@pytest.mark.parametrize("member", ["ExternalProcess(make)", "EnvWorker([make, make])"])
def test_workers_built_at_the_top_level_of_a_script_are_one_clear_error(tmp_path, member):
    script = tmp_path / "script.py"
    script.write_text(UNGUARDED.format(member=member))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and "built" not in done.stdout
    # One line, the script's: the frames inside batchrl would say nothing more.
    assert done.stderr.strip().splitlines() == [
        f'UnguardedMainError: {script}, line 6: start env workers under '
        f'if __name__ == "__main__": (each worker process imports the script again and '
        f'would run this line too)'], done.stderr
    # The same code under the guard runs.
    body = UNGUARDED.format(member=member).strip().splitlines()
    guarded = "\n".join(body[:3] + ['if __name__ == "__main__":']
                        + ["    " + line for line in body[3:]]) + "\n"
    script.write_text(guarded)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "built (2," in done.stdout or "built (1," in done.stdout


def test_an_unguarded_error_that_is_caught_leaves_other_errors_printed_in_full(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "from batchrl.envs import ExternalProcess, UnguardedMainError\n"
        "try:\n"
        "    ExternalProcess('CartPole-v1')\n"
        "except UnguardedMainError as error:\n"
        "    print('caught', error)\n"
        "raise ValueError('later')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout.startswith("caught ")
    assert done.stderr.startswith("Traceback (most recent call last):")
    assert done.stderr.strip().endswith("ValueError: later")


STDIN_SCRIPT = '''
import gymnasium as gym
import batchrl

batch = batchrl.BatchEnv([batchrl.ExternalProcess("CartPole-v1"),
                          batchrl.ExternalProcess(lambda: gym.make("CartPole-v1"))])
print("external", batch.reset(seed=0).shape)
batch.close()
batch = batchrl.make_batch_env("CartPole-v1", 2, backend="workers", workers=2)
print("workers", batch.reset(seed=0).shape)
batch.close()
'''


def test_a_script_read_from_stdin_starts_workers(tmp_path):
    # `python - <<EOF`: the main module's file is "<stdin>", which no worker can import.
    done = subprocess.run([sys.executable, "-"], input=STDIN_SCRIPT, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["external (2, 4)", "workers (2, 4)"]
    assert "Traceback" not in done.stderr
