"""Evaluate a trained run: the mean-action return of its latest checkpoint.

  python -m batchrl.evaluate logs/cartpole --episodes 10
  python -m batchrl.evaluate logs/cheetah --video cheetah.mp4 --episodes 3

The run's ``config.json`` rebuilds the env (stepped in this process) and the algorithm,
which loads the checkpoint and acts with its mean (mode) action, or with sampled ones
(``--actions sample``, the default of a run with ``train.eval_actions = "sample"``). ``K`` agents run exactly
``episodes`` whole episodes between them, so short episodes bias nothing. With ``--video``
the episodes are rendered one after another into an MP4 instead (``batchrl.video``; MuJoCo
cameras follow the agent; classic control renders with pygame, which the ``video`` extra
brings). Agent ``i``'s first episode is reset with seed ``seed + i`` and its later ones
continue that env's random stream; a video's episode ``i`` is reset with ``seed + i``, so
with mean actions it films the episodes that ``agents = episodes`` evaluates (sampled actions
are drawn in another order).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchrl.algos.base import Algorithm
from batchrl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from batchrl.config import CONFIG_FILE, EVAL_ACTIONS, Config, ConfigError, load_saved_config
from batchrl.envs.errors import EnvError, EnvSpecError
from batchrl.envs.factory import make_batch_env
from batchrl.errors import error_line, tolerant_console
from batchrl.metrics import episodes_words
from batchrl.tensor_env import TensorBatchEnv
from batchrl.simulation import evaluate_episodes, evaluation_rng
from batchrl.trainer import resolve_device
from batchrl.video import (VIDEO_SUFFIXES, VideoError, find_gl_backend, from_opengl,
                           opengl_failure, record_video, select_gl_backend,
                           video_writer_problem)

__all__ = ["EvaluationError", "evaluate", "find_gl_backend", "video_writer_problem", "main"]


class EvaluationError(RuntimeError):
    """Evaluation cannot run: no run or checkpoint there, a checkpoint that does
    not fit the config, or a video that cannot be rendered or written."""


def _listing(logdir: Path) -> str:
    if not logdir.exists():
        return f"{logdir} does not exist"
    if not logdir.is_dir():
        return f"{logdir} is not a directory"
    names = sorted(path.name + ("/" if path.is_dir() else "") for path in logdir.iterdir())
    if not names:
        return f"{logdir} is empty"
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return f"found in {logdir}: {shown}"


def _load_run(logdir: Path, checkpoint: Path | None) -> tuple[Config, Path]:
    """The run's config and the checkpoint to load (``checkpoint``, or the newest)."""
    if not (logdir / CONFIG_FILE).is_file():
        raise EvaluationError(f"{logdir} holds no training run: no {CONFIG_FILE} "
                              f"({_listing(logdir)})")
    try:
        config = load_saved_config(logdir)
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError, and so is bad JSON
        message = str(exc)
        if CONFIG_FILE not in message:
            message = f"{logdir / CONFIG_FILE}: {message}"
        raise EvaluationError(message) from None
    if checkpoint is None:
        checkpoint = latest_checkpoint(logdir)
        if checkpoint is None:
            raise EvaluationError(f"{logdir} holds no checkpoint (ckpt-<step>.pt) yet; training "
                                  f"writes them after evaluation phases "
                                  f"({_listing(logdir)})")
    elif checkpoint.is_dir():
        raise EvaluationError(f"checkpoint {checkpoint} is a directory: name a checkpoint file "
                              f"(ckpt-<step>.pt) in it, or leave --checkpoint out for the "
                              f"run's latest")
    elif not checkpoint.is_file():
        raise EvaluationError(f"checkpoint {checkpoint} does not exist")
    return config, checkpoint


def _build_algorithm(env: TensorBatchEnv, config: Config, algorithm_state: dict[str, Any],
                     device: torch.device, source: Path) -> Algorithm:
    """The run's algorithm for ``len(env)`` agents with the checkpoint's state, but
    fresh ``per_agent_state`` entries (sized by the training run's agent count). Those of
    the checkpoint are dropped from ``algorithm_state`` first: a replay buffer is gigabytes,
    and the new algorithm allocates its own."""
    for key in config.algorithm.cls.per_agent_state:
        algorithm_state.pop(key, None)
    algo = config.make_algorithm(env.observation_space, env.action_space, len(env), device)
    fresh = algo.state_dict()
    state = {**algorithm_state, **{key: fresh[key] for key in algo.per_agent_state}}
    try:
        algo.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise EvaluationError(f"{source} does not fit the run's config ({config.env.id}, "
                              f"{config.algorithm.name}): {error_line(exc)}") from None
    algo.eval()
    return algo


def evaluate(logdir: str | Path, episodes: int | None = None,
             checkpoint: str | Path | None = None, seed: int = 0, device: str = "auto",
             video: str | Path | None = None, agents: int | None = None,
             camera: str | None = None, width: int | None = None,
             height: int | None = None, max_frames: int | None = None,
             actions: str | None = None) -> dict[str, Any]:
    """Mean-action (or sampled-action) return of a training run's checkpoint.

    Args:
      logdir: the run's log directory (``config.json`` and ``ckpt-*.pt``).
      episodes: whole episodes to average over (default 10, or 1 with ``video``).
      checkpoint: a checkpoint file instead of ``logdir``'s newest (the env and
        networks still follow ``logdir``'s config).
      seed: episode ``i`` (env ``i`` of the batch) is reset with seed ``seed + i`` first.
      device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``...
      video: render the episodes, one after another, into this ``.mp4`` file (or a
        ``.gif``/``.webp`` animation).
      agents: envs stepped in lockstep without a video (default ``min(episodes,
        env.num_agents)``; more than ``episodes``: the last play none, as in a training
        run's evaluations).
      camera, width, height: the video's MuJoCo camera (default: one that follows
        the agent; ``"free"``: one that does not) and frame size (``follow_agent``).
      max_frames: record at most this many frames (the episodes still count whole).
      actions: ``"mean"`` (the mean or most likely action) or ``"sample"`` (sampled with
        torch's generators seeded by ``seed``); default: the run's ``train.eval_actions``.

    Returns:
      A dict with ``score``, ``score_std`` (population std), ``length`` (mean
      episode length), ``episodes``, ``scores`` and ``lengths`` (per episode),
      ``checkpoint`` (path), ``step`` (its training step), ``env_id``, ``env`` (the
      env in words: ``EnvConfig.label``), ``agents``,
      ``video`` (path or ``None``), ``video_frames``, ``camera`` (in words, or ``None``),
      ``notes`` (a line for each argument that could not be followed, and why), ``actions``
      (``"mean"`` or ``"sample"``).

    Raises:
      EvaluationError: no run or checkpoint in ``logdir``, one that does not fit, or a failed video.
      ConfigError, EnvSpecError: a bad argument, saved config or env.
    """
    logdir = Path(logdir)
    if episodes is None:
        episodes = 10 if video is None else 1
    if episodes < 1:
        raise ConfigError(f"episodes must be >= 1, got {episodes}")
    if seed < 0:  # (Gymnasium's seeds)
        raise ConfigError(f"--seed must be >= 0, got {seed}")
    if agents is not None and agents < 1:
        raise ConfigError(f"agents must be >= 1, got {agents}")
    if agents is not None and video is not None:
        raise ConfigError("--agents sets the envs stepped in lockstep without a video; "
                          "--video records its episodes one after another in one env")
    for name, size in (("width", width), ("height", height)):
        if size is not None and size < 16:
            raise ConfigError(f"--{name} must be at least 16 pixels, got {size}")
    if max_frames is not None and max_frames < 1:
        raise ConfigError(f"--max-frames must be >= 1, got {max_frames}")
    if video is None and (camera is not None or width is not None or height is not None
                          or max_frames is not None):
        raise ConfigError("--camera, --width, --height and --max-frames shape the video: add "
                          "--video PATH.mp4")
    video_path = None if video is None else Path(video)
    if video_path is not None:
        if video_path.is_dir():
            raise ConfigError(f"--video {video_path} is a directory; give a file name "
                              f"ending in .mp4")
        if video_path.suffix.lower() not in VIDEO_SUFFIXES:
            raise ConfigError(f"the video is written as MP4, GIF or WebP: give a path ending "
                              f"in {', '.join(VIDEO_SUFFIXES)}, got {str(video_path)!r}")
        problem = video_writer_problem() if video_path.suffix.lower() == ".mp4" else None
        if problem:
            raise EvaluationError(problem)
    if actions is not None and actions not in EVAL_ACTIONS:
        raise ConfigError(f"--actions must be one of {', '.join(EVAL_ACTIONS)}, got {actions!r}")
    config, checkpoint_path = _load_run(logdir, None if checkpoint is None else Path(checkpoint))
    if actions is not None:
        config.train.eval_actions = actions
    torch_device = resolve_device(device, "--device")
    # (agents beyond the episodes play none, but draw sampled actions as a run's would)
    num_agents = 1 if video_path is not None else agents or min(config.env.num_agents, episodes)
    notes = []
    if not config.algorithm.cls.per_agent_state:
        # Its state_dict() may be sized by the training run's agents throughout.
        if agents is not None and agents != config.env.num_agents:
            notes.append(f"--agents {agents} ignored: {config.algorithm.cls.__name__} declares no "
                         f"per_agent_state, so its checkpoint only fits the training run's "
                         f"{config.env.num_agents} agents; evaluating with those (the "
                         f"{episodes} episodes count the same)")
        num_agents = config.env.num_agents
    try:
        state = load_checkpoint(checkpoint_path, torch_device)
    except CheckpointError as exc:
        raise EvaluationError(str(exc)) from None
    step = int(state.get("counters", {}).get("steps", 0))

    # Before any env is built: MuJoCo's renderer reads MUJOCO_GL when it is imported.
    gl_failures = select_gl_backend() if video_path is not None else {}
    try:
        batch_env = make_batch_env(config.env.id, num_agents, config.env.max_length,
                                   config.env.evaluation_kwargs, backend="inline",
                                   normalize_ranges=config.env.normalize_ranges)
    except Exception as exc:
        if not from_opengl(exc):
            raise
        raise EvaluationError(opengl_failure(config.env.id, exc, gl_failures)) from None
    env = TensorBatchEnv(batch_env, torch_device)
    try:
        algo = _build_algorithm(env, config, state["algorithm"], torch_device, checkpoint_path)
        recording = None
        if video_path is not None:
            try:
                with evaluation_rng(seed, torch_device):
                    recording = record_video(config, algo, torch_device, video_path, seed,
                                             gl_failures, episodes, camera, width, height,
                                             max_frames, agents=len(env))
            except VideoError as exc:
                raise EvaluationError(str(exc)) from None
            scores, lengths, num_agents = recording.scores, recording.lengths, 1
        else:
            scores, lengths = evaluate_episodes(env, algo, episodes, seed)
    finally:
        env.close()
    return {"score": float(np.mean(scores)), "score_std": float(np.std(scores)),
            "length": float(np.mean(lengths)), "episodes": len(scores), "scores": scores,
            "lengths": lengths, "checkpoint": str(checkpoint_path), "step": step,
            "env_id": config.env.id, "env": config.env.label(evaluation=True),
            "agents": num_agents,
            "video": None if video_path is None else str(video_path),
            "video_frames": 0 if recording is None else recording.frames,
            "camera": None if recording is None else recording.camera, "notes": notes,
            "actions": config.train.eval_actions}


def main(argv: list[str] | None = None, command: str = "python -m batchrl.evaluate") -> int:
    """The command line; returns the exit code (2 for a user error). ``command``:
    how the user ran it, for the usage line."""
    tolerant_console()
    parser = argparse.ArgumentParser(
        prog=command,
        description="Mean-action (or sampled-action) return of a training run's latest "
                    "checkpoint.",
        epilog="MuJoCo videos render offscreen with the OpenGL backend in MUJOCO_GL "
               "(egl, osmesa, glfw); when unset, a working one is chosen.")
    parser.add_argument("logdir", type=Path, help="the run's log directory")
    parser.add_argument("--episodes", type=int, default=None,
                        help="episodes to average over (default 10; with --video: episodes "
                             "to record, default 1)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint file (default: the newest in LOGDIR)")
    parser.add_argument("--seed", type=int, default=0, help="env i is seeded with SEED + i")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu or cuda (default auto)")
    parser.add_argument("--video", type=Path, default=None, metavar="PATH.mp4",
                        help="render the episodes one after another into this MP4 file "
                             "(or a .gif or .webp animation)")
    parser.add_argument("--camera", default=None, metavar="NAME",
                        help="the video's MuJoCo camera (default: the model's tracking camera "
                             "or one following the agent; 'free': one that stays put)")
    parser.add_argument("--width", type=int, default=None,
                        help="video frame width in pixels (default: the env's)")
    parser.add_argument("--height", type=int, default=None,
                        help="video frame height in pixels (default: the env's)")
    parser.add_argument("--max-frames", type=int, default=None, metavar="N",
                        help="record at most N frames (a short preview; the episodes still "
                             "run to their end)")
    parser.add_argument("--agents", type=int, default=None, metavar="K",
                        help="envs stepped in lockstep (default: min(episodes, env.num_agents); "
                             "beyond the episodes, the last play none; an algorithm without "
                             "per-agent state uses the training run's)")
    parser.add_argument("--actions", choices=EVAL_ACTIONS, default=None,
                        help="act with the policy's mean (most likely) actions or sampled ones "
                             "(default: the run's train.eval_actions, 'mean' unless set)")
    args = parser.parse_args(argv)
    # A run's "package.module:Name" env id or algorithm class may name a module in the
    # current directory, as for train.py.
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())
    terminated = []

    def stop(signum: int, frame: Any) -> None:  # SIGTERM stops as Ctrl-C does
        terminated.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        result = evaluate(args.logdir, args.episodes, args.checkpoint, args.seed, args.device,
                          args.video, args.agents, args.camera, args.width, args.height,
                          args.max_frames, args.actions)
    except (EvaluationError, ConfigError, EnvSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EnvError as exc:  # the env failed (its own message names why), as in train.py
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (a video cut short is not kept)
        print("Terminated" if terminated else "Interrupted", file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"{result['env']}, {result['checkpoint']} (step {result['step']:,}), "
          f"{'mean' if result['actions'] == 'mean' else 'sampled'} actions, "
          f"{result['agents']} agent{'s' if result['agents'] != 1 else ''}")
    if result["video"] is not None:
        print(f"Video: {result['video']} ({result['video_frames']} frames, "
              f"{result['camera']})")
        for index, (score, length) in enumerate(zip(result["scores"], result["lengths"]), 1):
            print(f"  episode {index}: return {score:,.1f}, {length} steps")
    print(f"{result['score']:.1f} ± {result['score_std']:.1f} return over "
          f"{episodes_words(result['episodes'])}, mean length {result['length']:.1f}")
    return 0


def cli() -> int:
    """The ``batchrl-evaluate`` console command."""
    return main(command="batchrl-evaluate")


if __name__ == "__main__":
    sys.exit(main())
