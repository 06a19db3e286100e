"""Train an algorithm (BatchPPO unless the config names another) on a task of batchrl's configs.

  batchrl-train --config halfcheetah        (python train.py in a checkout, python -m batchrl.train)
  batchrl-train --config pendulum --logdir logs/pendulum --set algorithm.policy_lr=3e-4

Running again with an existing --logdir resumes that run from its latest
checkpoint, with the config saved there; --steps N may then raise its budget
to train a finished run further (--set may then change only where the run
goes on: train.device, train.threads, env.workers, env.timeout):

  batchrl-train --config pendulum --logdir logs/pendulum --steps 600000

Ctrl-C (or SIGTERM) stops a run within seconds: the state at the end of the
last finished phase is written as a checkpoint, the env workers are closed,
and the command to resume is printed; the exit code is 130 (143 for
SIGTERM). A second Ctrl-C quits at once, losing only the phases since the
last checkpoint. Exit codes: 0 done, 1 the env failed (its own error and
traceback are shown), 2 a user error (bad flag, config, env id, space, log
directory or checkpoint, or a MUJOCO_GL backend that cannot load here: a message
says what is wrong and what is valid).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import itertools
import json
import os
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchrl.errors import tolerant_console
from batchrl.files import LOCK_FILE, LogdirInUse, atomic_write, hold_logdir

if TYPE_CHECKING:
    from batchrl.config import Config

# The keys a resume may change with --set: where the run goes on, not what it learns.
MACHINE_KEYS = ("train.device", "train.threads", "env.workers", "env.timeout")
STARTED_WITH = "started_with.json"  # in a run's logdir: the --config it was started with


def _config_help(name: str | None) -> str:
    """The epilog of ``--help``: the configs, the keys of [env] and [train], and the
    [algorithm] keys of the class the config ``name`` trains (of each shipped algorithm
    without one). With a config that loads, each key shows the config's value, and the
    default after it where the two differ."""
    import inspect

    from batchrl.config import (BATCHPPO, SECTIONS, SHIPPED_ALGORITHMS, ConfigError,
                                algorithm_keys, available_configs, load_config)
    config, problem = None, None
    if name is not None:
        try:
            config = load_config(name)
        except ConfigError as exc:
            problem = f"(--config {name}: {exc})"

    def line(key: str, default: object, value: object) -> str:
        shown = "(required)" if value is inspect.Parameter.empty else _toml(value)
        if default is inspect.Parameter.empty or shown == _toml(default):
            return f"  {key} = {shown}"
        return f"  {key} = {shown}  # default {_toml(default)}"

    values = ("" if config is None else
              f" with {name}'s values (after #, the default where it differs)")
    lines = [f"available configs: {', '.join(available_configs())}", "",
             f"config keys{values} (--set section.key=value; values are TOML: 3e-4, true, "
             f"[64, 64], \"Hopper-v5\"):"]
    for section, factory in SECTIONS.items():
        default = factory()
        ours = default if config is None else getattr(config, section)
        lines += [line(f"{section}.{field.name}", getattr(default, field.name),
                       getattr(ours, field.name)) for field in dataclasses.fields(default)]
    classes = SHIPPED_ALGORITHMS if config is None else (config.algorithm.path,)
    given = {} if config is None else config.algorithm.keys  # (without one: the defaults)
    if problem is not None:
        lines += ["", problem]
    for path in classes:
        what = "the default" if path == BATCHPPO else "algorithm.class = " + _toml(path)
        try:
            keys = algorithm_keys(path)
        except ConfigError as exc:
            lines += ["", f"[algorithm] of {path}: {exc}"]
            continue
        lines += ["", f"[algorithm] keys of {path.rpartition(':')[2]} ({what}):"]
        lines += [line(f"algorithm.{key}", value, given.get(key, value))
                  for key, value in keys.items()]
    return "\n".join(lines)


def _count(text: str) -> int:
    """An argparse type: a count of steps, also written ``1e6`` or ``1_000_000``."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}")
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}")
    return int(value)


def _toml(value: object) -> str:
    """A default as --set takes it (TOML), e.g. true, "CartPole-v1", [200, 100]."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def main(argv: list[str] | None = None, command: str = "python -m batchrl.train") -> int:
    """The command line; returns the exit code. ``command`` is how the user
    ran it (``batchrl-train``, ``python train.py``): the resume commands
    printed after a stop or a failure start with it."""
    tolerant_console()
    argv = sys.argv[1:] if argv is None else argv
    # "package.module:Name" env ids and algorithm classes may name a module in the current
    # directory, as with `python -m` (a script only gets its own directory); --help imports
    # the class too.
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())
    # --help lists the [algorithm] keys of the class that --config names, when given.
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--config")
    wants_help = any(arg in ("-h", "--help") for arg in argv)
    parser = argparse.ArgumentParser(
        prog=command, description=__doc__.split("\n\n")[0],
        epilog=_config_help(named.parse_known_args(argv)[0].config) if wants_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="a config's name (e.g. halfcheetah; --help lists them) or a "
                             "path to a .toml file")
    parser.add_argument("--logdir", default=None,
                        help="where to write the run (default: a new logs/CONFIG-YYYYmmdd-HHMMSS); "
                             "an existing run there is resumed")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key, e.g. algorithm.discount=0.98 (--help "
                             "--config NAME lists the keys of its algorithm)")
    parser.add_argument("--steps", type=_count, default=None, metavar="N",
                        help="training budget in env steps (train.steps); also allowed when "
                             "resuming, to train a run further (where --set may change "
                             "only train.device, train.threads, env.workers and "
                             "env.timeout)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from batchrl.config import CONFIG_FILE, ConfigError
    from batchrl.envs.errors import (EnvError, EnvRaisedError, EnvSpecError,
                                     SpaceMismatchError, UnsupportedSpaceError)

    # Checked before torch is imported (seconds), so that a typo is reported at once.
    try:
        config, logdir, created = _configure(args, command)
    except (ConfigError, EnvSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("Interrupted before training started", file=sys.stderr)
        return 130
    try:  # (torch's import takes seconds: a Ctrl-C may come now)
        from batchrl.checkpoint import CheckpointError
        from batchrl.collectors import CollectorError
        from batchrl.learners import LearnerError, run
        from batchrl.trainer import TrainingInterrupted
    except KeyboardInterrupt:
        _remove_if_empty(created)
        print("Interrupted before training started", file=sys.stderr)
        return 130

    if not _another_learner():  # (torchrun's other learners write nothing there)
        try:
            hold_logdir(logdir)  # (for the process's lifetime; the Trainer holds it too)
        except LogdirInUse as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not (logdir / CONFIG_FILE).exists():
            # The --config a resume names: its --set overrides are in the saved config.
            with atomic_write(logdir / STARTED_WITH) as file:
                file.write(json.dumps({"config": args.config}) + "\n")

    user_errors = (ConfigError, EnvSpecError, CheckpointError, UnsupportedSpaceError,
                   SpaceMismatchError)
    try:
        if not _another_learner():  # (torchrun's learners: the writer's line)
            learners = (f" ({config.train.learners} learners)" if config.train.learners > 1
                        else "")
            env = config.env
            agents = f"{env.num_agents} agent{'s' if env.num_agents > 1 else ''}"
            algorithm = config.algorithm.path.rpartition(":")[2]
            print(f"Training {algorithm} on {env.label()} with {agents}{learners} for "
                  f"{config.train.steps:,} steps (env backend {env.chosen_backend}); writing "
                  f"to {logdir}", flush=True)
        result = run(config, logdir, progress=not args.no_progress, handle_signals=True)
    except TrainingInterrupted as stop:
        print(_interrupted_message(stop, command, args.config, logdir), flush=True)
        return stop.exit_code
    except KeyboardInterrupt:  # before the trainer took over Ctrl-C, or after it let go
        _remove_if_empty(created)
        # (torchrun's other learners: the writer says how the run stopped)
        if not _another_learner():
            print(_interrupted_anyhow(command, args.config, logdir), file=sys.stderr)
        return 130
    except user_errors as exc:
        _remove_if_empty(created)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EnvError as exc:
        _remove_if_empty(created)
        from batchrl.video import from_opengl, opengl_failure
        if from_opengl(exc):
            # MUJOCO_GL names a backend that cannot load here: a setting to change or a
            # library to install, which the worker's traceback would only bury.
            print(f"error: {opengl_failure(config.env.id, exc, {})}", file=sys.stderr)
            return 2
        # An env's own code rejected its arguments or returned no env: the
        # user's input, not an env failure.
        if isinstance(exc, EnvRaisedError) and exc.remote_type in (
                "EnvSpecError", "UnsupportedSpaceError"):
            print(f"error: {exc.remote_message}", file=sys.stderr)
            return 2
        key = _unknown_env_key(exc, config)
        if key is not None:
            print(f"error: {key}: {exc.label} takes no such keyword ({exc.remote_message})",
                  file=sys.stderr)
            return 2
        print(f"error: {exc}", file=sys.stderr)
        _print_resume(logdir, command, args.config, after=(
            " (env.restart_crashed_envs replaces failed env workers instead of stopping)"))
        return 1
    except (LearnerError, CollectorError, MemoryError) as exc:
        _remove_if_empty(created)
        if isinstance(exc, MemoryError):
            exc = f"out of memory: {exc}" if str(exc) else (
                "out of memory: lower what the config makes large (env.num_agents, an "
                "algorithm's buffer_size or rollout_length)")
        print(f"error: {exc}", file=sys.stderr)
        _print_resume(logdir, command, args.config)
        return 1
    except Exception as exc:  # the algorithm's own code raised (or batchrl's: a bug)
        _remove_if_empty(created)
        shortage = _shortage(exc)
        if shortage is not None:  # (the machine's, not the code's: no traceback)
            print(f"error: {shortage}", file=sys.stderr)
            _print_resume(logdir, command, args.config, "Once there is room, resume it with")
            return 1
        traceback.print_exc()
        _print_resume(logdir, command, args.config, "Once the error is fixed, resume it with")
        return 1
    if result:
        # (imports stay lazy: a quick --help)
        from batchrl.metrics import actions_words, episodes_words
        print(f"Final evaluation: {result['score']:.1f} ± {result['score_std']:.1f} "
              f"over {episodes_words(result['episodes'])} "
              f"({actions_words(config.train.eval_actions)})")
    return 0


# What the machine ran out of, by errno, and where to make room.
_SHORTAGES = {
    errno.ENOSPC: "free space on that file system (df -h)",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EMFILE: "raise the open-file limit (ulimit -n) or lower env.workers",
    errno.ENFILE: "close other programs' files, or raise the system's limit (fs.file-max)",
    errno.EROFS: "choose a --logdir on a file system you can write to",
}


def _shortage(exc: BaseException) -> str | None:
    """The line for an error that a lack of room caused (a full disk, too many open files, no
    thread left): the ``OSError`` (or a thread's ``RuntimeError``) among ``exc`` and the
    errors it came from (torch's writer wraps a full disk's in its own), with what to free;
    ``None`` for any other error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _SHORTAGES:
            where = f": {os.fsdecode(exc.filename)}" if exc.filename else ""
            return f"{exc.strerror or exc}{where}; {_SHORTAGES[exc.errno]}"
        if isinstance(exc, RuntimeError) and str(exc) == "can't start new thread":
            return (f"{exc}; raise the limit on processes and threads (ulimit -u, a "
                    f"container's pids.max) or on virtual memory (ulimit -v)")
        exc = exc.__cause__ or exc.__context__
    return None


def _unknown_env_key(exc: Exception, config: Config) -> str | None:
    """The ``env.kwargs`` (or ``env.eval_kwargs``) key, ``"env.kwargs.NAME"``, that the env's
    constructor refused as an unexpected keyword in ``exc`` (an ``EnvRaisedError`` of its
    construction), if that is what it is."""
    if getattr(exc, "operation", None) != "construct" or \
            getattr(exc, "remote_type", None) != "TypeError":
        return None
    found = re.search(r"unexpected keyword argument '(\w+)'", exc.remote_message)
    if found is None:
        return None
    for table in ("kwargs", "eval_kwargs"):
        if found[1] in getattr(config.env, table):
            return f"env.{table}.{found[1]}"
    return None


def _differences(named: Config, saved: Config) -> list[str]:
    """The keys (``section.key``) whose values differ between two configs, except the budget
    and the keys of where a run goes on (``MACHINE_KEYS``)."""
    def flat(values: dict, prefix: str = "") -> dict[str, object]:
        items: dict[str, object] = {}
        for key, value in values.items():
            if isinstance(value, dict):
                items.update(flat(value, f"{prefix}{key}."))
            else:
                items[f"{prefix}{key}"] = value
        return items

    ours, theirs = flat(named.to_dict()), flat(saved.to_dict())
    return [key for key in sorted(ours.keys() | theirs.keys())
            if key not in ("train.steps", *MACHINE_KEYS) and ours.get(key) != theirs.get(key)]


def _configure(args: argparse.Namespace, command: str) -> tuple[Config, Path, Path | None]:
    """The run's config (new, or the saved one of the run to resume), its log directory
    and that directory if this call created it; ``ConfigError`` or ``EnvSpecError``
    for a user error. Imports no torch (unless the config names a user's module)."""
    from batchrl.config import (CONFIG_FILE, ConfigError, load_config, load_saved_config,
                                parse_override)
    from batchrl.envs.factory import resolve_constructor

    if args.logdir is not None:  # (Path("") would be the current directory)
        if not str(args.logdir).strip():
            raise ConfigError("--logdir is empty (an unset shell variable?): name a "
                              "directory, or leave --logdir out for a new one under logs/")
        args.logdir = Path(args.logdir)
    if args.steps is not None and args.steps < 1:  # (not a fault of a resumed run's config)
        raise ConfigError(f"--steps: train.steps must be >= 1, got {args.steps}")
    steps = [] if args.steps is None else [f"train.steps={args.steps}"]
    if args.logdir is not None and (args.logdir / CONFIG_FILE).exists():
        learning = [text for text in args.overrides
                    if ".".join(parse_override(text)[0]) not in MACHINE_KEYS]
        if learning:
            raise ConfigError(f"{args.logdir} holds a run, which resumes with its saved "
                              f"config; drop --set {learning[0]} (--steps N may raise its "
                              f"budget; --set may change only where it runs: "
                              f"{', '.join(MACHINE_KEYS)}) or choose a new --logdir")
        config = load_saved_config(args.logdir, args.overrides)
        if args.steps is not None:
            if args.steps < config.train.steps:
                # (a lower budget would also change the schedules that anneal over it)
                raise ConfigError(f"--steps {args.steps:,} is below the run's budget "
                                  f"({config.train.steps:,}, train.steps in "
                                  f"{args.logdir / CONFIG_FILE}): --steps only raises it "
                                  f"(Ctrl-C stops a run at any step, with its checkpoint)")
            config = dataclasses.replace(config, train=dataclasses.replace(
                config.train, steps=args.steps))
        started = _started_with(args.logdir)
        # (A resume needs its --config file only to tell another run's config apart.)
        named = config if started == args.config else load_config(args.config, steps)
        if (named.env.id, named.env.kwargs, named.algorithm.name) != (
                config.env.id, config.env.kwargs, config.algorithm.name):
            resume = (f"resume with: {_resume_command(command, started, args.logdir)}"
                      if started else "resume with that run's config")
            # (the Atari configs differ in env.kwargs' game, not env.id; where both are the
            # same, the algorithms differ)
            kwargs_tell = (named.env.id == config.env.id
                           and named.env.kwargs != config.env.kwargs)

            def env_of(run: Config) -> str:
                return run.env.id + (f" {run.env.kwargs}" if kwargs_tell else "")

            raise ConfigError(
                f"{args.logdir} holds a run of {env_of(config)} with "
                f"{config.algorithm.name}, but --config {args.config} trains "
                f"{env_of(named)} with {named.algorithm.name}; {resume} or choose a new "
                f"--logdir")
        differ = [] if started is None or named is config else _differences(named, config)
        if differ:  # (the same env and algorithm, other settings: the saved ones hold)
            print(f"note: --config {args.config} differs from the saved config of the run "
                  f"(started with --config {started}) in {', '.join(differ[:4])}"
                  f"{' and more' if len(differ) > 4 else ''}; the run resumes with its saved "
                  f"config", file=sys.stderr)
    else:
        if args.logdir is not None and any(args.logdir.glob("ckpt-*.pt")):
            # (the checkpoints would resume under a config they were not trained with)
            raise ConfigError(f"{args.logdir} holds checkpoints but no {CONFIG_FILE}, the "
                              f"config they resume with: restore it (each checkpoint holds "
                              f"its run's config, under 'config') or choose a new --logdir")
        config = load_config(args.config, args.overrides + steps)
    resolve_constructor(config.env.id, config.env.kwargs, config.env.max_length)
    if args.logdir is None:
        logdir = created = _new_logdir(Path("logs") / Path(args.config).stem, ConfigError)
        _prepare_logdir(logdir, ConfigError)
    else:
        logdir = args.logdir
        created = _prepare_logdir(logdir, ConfigError)
    return config, logdir, created


def _new_logdir(prefix: Path, error: type[Exception]) -> Path:
    """A new directory ``PREFIX-YYYYmmdd-HHMMSS`` (``-2``, ``-3``, ... after it where runs
    started in the same second: each run claims its own)."""
    base = f"{prefix.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            logdir = prefix.parent / (base if number == 1 else f"{base}-{number}")
            with contextlib.suppress(FileExistsError):
                logdir.mkdir()
                return logdir
    except OSError as exc:
        raise error(f"cannot create a log directory in {prefix.parent}: "
                    f"{exc.strerror or exc}; choose a --logdir you can write to") from None
    raise AssertionError  # (the count never ends)


def _prepare_logdir(logdir: Path, error: type[Exception]) -> Path | None:
    """Create ``logdir`` if needed and check that files can be written there,
    before any env is built; raises ``error`` saying what is wrong. Returns
    the directory when this call created it."""
    if logdir.exists() and not logdir.is_dir():
        raise error(f"--logdir {logdir} is a file, not a directory; give a directory "
                    f"(new, or a run to resume)")
    created = None if logdir.exists() else logdir
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        probe = logdir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise error(f"cannot write to --logdir {logdir}: {exc.strerror or exc}; choose a "
                    f"directory you can write to") from None
    return created


def _remove_if_empty(directory: Path | None) -> None:
    """Undo ``_prepare_logdir`` after a failed start, if nothing but the
    ``STARTED_WITH`` record and the lock were written."""
    if directory is not None:
        try:
            left = {path.name for path in directory.iterdir()}
            if left <= {STARTED_WITH, LOCK_FILE}:
                for name in left:
                    (directory / name).unlink()
            directory.rmdir()
        except OSError:
            pass


def _started_with(logdir: Path) -> str | None:
    """The --config the run in ``logdir`` was started with, if it was recorded."""
    try:
        started = json.loads((logdir / STARTED_WITH).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return started if isinstance(started, str) else None


def _resume_command(command: str, config: str, logdir: Path | None) -> str:
    return " ".join([command, shlex.join(["--config", config, "--logdir", str(logdir)])])


def _print_resume(logdir: Path, command: str, config: str, lead: str = "Resume it with",
                  after: str = "") -> None:
    """After a failure: the run's latest checkpoint, if it has one, and the command that
    resumes it (``lead`` before it, ``after`` after it)."""
    from batchrl.checkpoint import latest_checkpoint
    checkpoint = latest_checkpoint(logdir) if logdir.is_dir() else None
    if checkpoint is not None:
        print(f"\nThe run's latest checkpoint is {checkpoint}. {lead}: "
              f"{_resume_command(command, config, logdir)}{after}", file=sys.stderr)


def _interrupted_message(stop: Any, command: str, config: str, logdir: Path | None) -> str:
    """What a run stopped by ``stop`` (the trainer's ``TrainingInterrupted``)
    saved, and the command that resumes it."""
    resume = _resume_command(command, config, logdir)
    if stop.checkpoint is None:
        return (f"Stopped by {stop.signal_name} before the first phase ended: no checkpoint. "
                f"Run again to start over: {resume}")
    return (f"Stopped by {stop.signal_name}; checkpoint at step {stop.step:,}: "
            f"{stop.checkpoint}\nResume with: {resume}")


def _another_learner() -> bool:
    """Whether this process is one of torchrun's learners other than the writer."""
    from batchrl.parts.distributed import launched_by_torchrun
    return launched_by_torchrun() and os.environ["RANK"] != "0"


def _interrupted_anyhow(command: str, config: str, logdir: Path) -> str:
    """After a Ctrl-C the trainer did not handle (while the run started or closed): what
    the run's directory holds, and the command that resumes it."""
    from batchrl.checkpoint import latest_checkpoint
    checkpoint = latest_checkpoint(logdir) if logdir.is_dir() else None
    if checkpoint is None:
        return "Interrupted before the run's first checkpoint"
    return (f"Interrupted; the run's latest checkpoint is {checkpoint}. Resume it with: "
            f"{_resume_command(command, config, logdir)}")


def cli() -> int:
    """The ``batchrl-train`` console command."""
    return main(command="batchrl-train")


if __name__ == "__main__":
    sys.exit(main())
