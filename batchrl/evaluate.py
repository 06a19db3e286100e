"""Evaluate a trained run: the mean-action return of its latest checkpoint.

  python -m batchrl.evaluate logs/cartpole --episodes 10
  python -m batchrl.evaluate logs/cheetah --episodes 30 --video cheetah.mp4

The run's saved ``config.json`` rebuilds the env (stepped in this process,
so no worker processes) and a ``BatchPPO`` with the same settings, which
loads the checkpoint's weights and observation statistics and acts with its
mean (mode) action, as the trainer's evaluation phases do. ``K`` agents
(default ``min(episodes, env.num_agents)``) run exactly ``episodes`` whole
episodes between them, agent ``i`` its share of them, so the average is not
biased towards short episodes; env ``i`` is seeded with ``seed + i``, so a
result is reproducible.

``--video PATH.mp4`` first renders one mean-action episode (the env made
with ``render_mode="rgb_array"``) and writes it with imageio's ffmpeg writer:
``pip install -e ".[video]"`` (imageio and imageio-ffmpeg, which ships an
ffmpeg binary). Rendering needs, for MuJoCo envs, an offscreen OpenGL
backend; for Gymnasium's classic-control envs, pygame
(``pip install "gymnasium[classic-control]"``).

MuJoCo's OpenGL backend is chosen by the ``MUJOCO_GL`` environment variable
(``egl``, ``osmesa`` or ``glfw``). When it is unset, ``--video`` probes the
backends in a child process -- ``egl``, then ``osmesa``, then ``glfw`` when
a display is set -- and sets ``MUJOCO_GL`` to the first that renders, before
MuJoCo's renderer is imported. (Gymnasium itself would try ``glfw`` first,
which fails without a display.) On our development and CI machines (Debian
12, no GPU, no display) ``MUJOCO_GL=egl`` works with the Mesa packages
already installed there (``libegl1``, ``libegl-mesa0``, ``libgl1-mesa-dri``;
Mesa renders in software); ``osmesa`` would need Debian's
``libosmesa6``, and ``glfw`` a display. A set ``MUJOCO_GL`` is always used
as it is.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np
import torch

from batchrl.algos.ppo import BatchPPO
from batchrl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from batchrl.config import Config, ConfigError
from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import EnvRaisedError, EnvSpecError
from batchrl.envs.factory import make_batch_env, resolve_constructor
from batchrl.tensor_env import TensorBatchEnv
from batchrl.envs.wrappers import wrap_env
from batchrl.simulate import episode_length, simulate
from batchrl.trainer import CONFIG_FILE, load_saved_config, resolve_device

__all__ = ["EvaluationError", "evaluate", "find_gl_backend", "video_writer_problem", "main"]

GL_BACKENDS = ("egl", "osmesa", "glfw")

# Builds MuJoCo's offscreen renderer (GL context and MjrContext), as an env's
# render() would; exits non-zero where the backend in MUJOCO_GL cannot render.
_GL_PROBE = ("import mujoco\n"
             "mujoco.Renderer(mujoco.MjModel.from_xml_string('<mujoco/>'), 16, 16).close()\n")


class EvaluationError(RuntimeError):
    """Evaluation cannot run: no run or checkpoint there, a checkpoint that does
    not fit the config, or a video that cannot be rendered or written."""


# -- offscreen rendering and video ------------------------------------------------------


def find_gl_backend(timeout: float = 60.0) -> tuple[str | None, dict[str, str]]:
    """Which MuJoCo OpenGL backend renders offscreen here.

    Each candidate is tried in a child process (a failed OpenGL set-up cannot
    be undone in this one): ``MUJOCO_GL`` alone when it is set, otherwise
    ``egl``, ``osmesa`` and, when a display is set, ``glfw``, in that order
    (only the one matching ``PYOPENGL_PLATFORM`` when that is set).

    Returns:
      ``(backend, failures)``: the first backend that rendered (``None`` if
      none did) and, for each one that failed, the last line of its error.
    """
    if os.environ.get("MUJOCO_GL"):
        candidates: Sequence[str] = [os.environ["MUJOCO_GL"]]
    elif os.environ.get("PYOPENGL_PLATFORM", "").lower() in ("egl", "osmesa"):
        candidates = [os.environ["PYOPENGL_PLATFORM"].lower()]
    else:
        display = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
        candidates = [name for name in GL_BACKENDS if name != "glfw" or display]
    failures: dict[str, str] = {}
    for backend in candidates:
        env = dict(os.environ, MUJOCO_GL=backend)
        try:
            probe = subprocess.run([sys.executable, "-c", _GL_PROBE], env=env,
                                   capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            failures[backend] = f"no answer within {timeout:.0f} s"
            continue
        if probe.returncode == 0:
            return backend, failures
        lines = [line for line in (probe.stderr or probe.stdout).splitlines() if line.strip()]
        failures[backend] = lines[-1].strip() if lines else f"exit code {probe.returncode}"
    return None, failures


def _gl_hint(failures: dict[str, str], error: str = "") -> str:
    """What to do about MuJoCo's OpenGL backend, for an error message that
    already shows ``error``."""
    backend = os.environ.get("MUJOCO_GL")
    install = ("MuJoCo renders offscreen with EGL (Debian/Ubuntu: apt-get install libegl1 "
               "libegl-mesa0 libgl1-mesa-dri) or OSMesa (apt-get install libosmesa6)")
    if backend and backend in failures:  # set by the user, and it does not work
        reason = "" if error and error in failures[backend] else f" ({failures[backend]})"
        return (f"MUJOCO_GL={backend} does not work here{reason}; unset it to let "
                f"batchrl.evaluate choose a backend that works. {install}")
    if failures:
        tried = "; ".join(f"MUJOCO_GL={name}: {reason}" for name, reason in failures.items())
        return f"no MuJoCo OpenGL backend works here ({tried}). {install}"
    if backend:
        return (f"MuJoCo failed with MUJOCO_GL={backend}: unset it (only --video needs "
                f"OpenGL, and then a working backend is chosen) or set another")
    return install


def _select_gl_backend() -> dict[str, str]:
    """Probe the OpenGL backend for rendering: the one in ``MUJOCO_GL``, or
    when that is unset the first that works, which is then set in
    ``MUJOCO_GL``. Returns the probe failures, for error messages: nothing
    is raised here, as an env that is not MuJoCo may need no OpenGL at all
    (classic control renders with pygame)."""
    backend, failures = find_gl_backend()
    if backend is not None and not os.environ.get("MUJOCO_GL"):
        os.environ["MUJOCO_GL"] = backend
    return failures


def _from_opengl(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in MuJoCo's or PyOpenGL's code (such as
    ``import mujoco`` with a ``MUJOCO_GL`` that cannot work here)."""
    traceback = exc.__traceback__
    while traceback is not None:
        module = str(traceback.tb_frame.f_globals.get("__name__", ""))
        if module.split(".")[0] in ("mujoco", "OpenGL"):
            return True
        traceback = traceback.tb_next
    return False


def _opengl_failure(env_id: str, exc: BaseException, failures: dict[str, str]) -> str:
    return (f"cannot build {env_id}: {type(exc).__name__}: {exc}; "
            f"{_gl_hint(failures, str(exc))}")


def video_writer_problem() -> str | None:
    """Why an MP4 cannot be written here (a missing package), or ``None``."""
    try:
        import imageio.v2  # noqa: F401
        import imageio_ffmpeg
    except ImportError as exc:
        return (f"writing a video needs imageio and imageio-ffmpeg ({exc}); "
                f"install them with: pip install -e \".[video]\" "
                f"(or pip install imageio imageio-ffmpeg)")
    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as exc:
        return f"imageio-ffmpeg finds no ffmpeg executable: {exc}"
    return None


class _RenderError(Exception):
    """``env.render()`` failed; wraps the original error."""


class _FrameRecorder(gym.Wrapper):
    """Passes every frame rendered after a reset or step to ``sink`` while
    ``recording`` is true."""

    def __init__(self, env: gym.Env, sink: Callable[[np.ndarray], None]):
        super().__init__(env)
        self.sink = sink
        self.recording = False

    def reset(self, **kwargs: Any) -> Any:
        result = self.env.reset(**kwargs)
        self._capture()
        return result

    def step(self, action: Any) -> Any:
        result = self.env.step(action)
        self._capture()
        return result

    def _capture(self) -> None:
        if not self.recording:
            return
        try:
            frame = self.env.render()
        except Exception as exc:  # the renderer's own errors vary: OpenGL, pygame, MuJoCo
            raise _RenderError(exc) from exc
        if not isinstance(frame, np.ndarray) or frame.ndim != 3:
            raise _RenderError(TypeError(
                f"render() returned {type(frame).__name__}, not an RGB array; the env must "
                f"accept render_mode='rgb_array'"))
        self.sink(frame)


def _render_failure(env_id: str, exc: BaseException, failures: dict[str, str]) -> str:
    if isinstance(exc, gym.error.DependencyNotInstalled):
        return f"cannot render {env_id}: {exc}"  # names the package to install
    return (f"cannot render {env_id} offscreen: {type(exc).__name__}: {exc}; "
            f"{_gl_hint(failures, str(exc))}")


def _record_video(config: Config, algo: BatchPPO, device: torch.device, path: Path,
                  seed: int, failures: dict[str, str]) -> int:
    """Render one mean-action episode into ``path``; returns its frame count."""
    import imageio.v2 as imageio

    env_config = config.env
    try:
        raw = resolve_constructor(env_config.id, {**env_config.kwargs,
                                                  "render_mode": "rgb_array"},
                                  env_config.max_length)()
    except Exception as exc:
        if _from_opengl(exc):
            raise EvaluationError(_opengl_failure(env_config.id, exc, failures)) from None
        if not isinstance(exc, (gym.error.Error, TypeError)):
            raise
        raise EvaluationError(f"cannot build {env_config.id} with render_mode='rgb_array': "
                              f"{exc}") from None
    fps = float(raw.metadata.get("render_fps") or 30)
    frames = 0
    writer = None

    def write(frame: np.ndarray) -> None:
        nonlocal writer, frames
        try:
            if writer is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                # H.264 in yuv420p needs even sides: keep the env's frame size when it
                # has them (macro_block_size=1), else let imageio round it up to 16s.
                height, width = frame.shape[:2]
                even = height % 2 == 0 and width % 2 == 0
                writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps,
                                            codec="libx264", pixelformat="yuv420p",
                                            macro_block_size=1 if even else 16,
                                            ffmpeg_log_level="error")
            writer.append_data(np.ascontiguousarray(frame[..., :3], dtype=np.uint8))
        except (OSError, RuntimeError, ValueError) as exc:
            raise EvaluationError(f"cannot write the video {path}: {exc}") from None
        frames += 1

    recorder = _FrameRecorder(wrap_env(raw, normalize_ranges=env_config.normalize_ranges),
                              write)
    env = TensorBatchEnv(BatchEnv([recorder]), device)
    completed = False
    try:
        recorder.recording = True
        reset = True
        while True:
            done, _, _ = simulate(env, algo, reset=reset, seed=seed if reset else None)
            reset = False
            if bool(done[0]):
                break
        completed = True
    except EnvRaisedError as exc:  # the env layer names the env; the cause is ours
        if not isinstance(exc.__cause__, _RenderError):
            raise
        raise EvaluationError(_render_failure(env_config.id, exc.__cause__.__cause__,
                                              failures)) from None
    finally:
        recorder.recording = False
        try:
            if writer is not None:
                writer.close()  # ffmpeg finishes the file
        except Exception as exc:
            if completed:  # else the error on the way out says more
                raise EvaluationError(f"cannot write the video {path}: {exc}") from None
        finally:
            env.close()
    return frames


# -- evaluation -------------------------------------------------------------------------


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
    elif not checkpoint.is_file():
        raise EvaluationError(f"checkpoint {checkpoint} does not exist")
    return config, checkpoint


def _build_algorithm(env: TensorBatchEnv, config: Config, algorithm_state: dict[str, Any],
                     device: torch.device, source: Path) -> BatchPPO:
    """A ``BatchPPO`` for ``len(env)`` agents with the checkpoint's learned state.

    The per-agent entries (``BatchPPO.PER_AGENT_STATE``) are sized by the
    training run's agent count and hold nothing evaluation needs, so this
    algorithm keeps its own (fresh) ones.
    """
    algo = BatchPPO(env.observation_space, env.action_space, len(env), config.ppo, device)
    fresh = algo.state_dict()
    state = {**algorithm_state, **{key: fresh[key] for key in BatchPPO.PER_AGENT_STATE}}
    try:
        algo.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise EvaluationError(f"{source} does not fit the run's config ({config.env.id}, "
                              f"{config.ppo.network} policy): {exc}") from None
    algo.eval()
    return algo


def _run_episodes(env: TensorBatchEnv, algo: BatchPPO, episodes: int,
                  seed: int) -> tuple[list[float], list[int]]:
    """Exactly ``episodes`` whole episodes: agent ``i`` counts its first
    ``quota[i]`` ones (later ones it runs meanwhile are ignored)."""
    num_agents = len(env)
    quota = [episodes // num_agents + (i < episodes % num_agents) for i in range(num_agents)]
    results: list[list[tuple[float, int]]] = [[] for _ in range(num_agents)]
    reset = True
    while any(len(results[i]) < quota[i] for i in range(num_agents)):
        done, score, _ = simulate(env, algo, reset=reset, seed=seed if reset else None)
        reset = False
        if bool(done.any()):
            lengths = episode_length(env)
            for i in done.nonzero().squeeze(1).tolist():
                if len(results[i]) < quota[i]:
                    results[i].append((float(score[i]), int(lengths[i])))
    # In episode order: the first episode of every agent, then the second...
    ordered = [results[i][k] for k in range(max(quota)) for i in range(num_agents)
               if k < len(results[i])]
    return [s for s, _ in ordered], [n for _, n in ordered]


def evaluate(logdir: str | Path, episodes: int = 10, checkpoint: str | Path | None = None,
             seed: int = 0, device: str = "auto", video: str | Path | None = None,
             agents: int | None = None) -> dict[str, Any]:
    """Mean-action return of a training run's checkpoint.

    Args:
      logdir: the run's log directory (``config.json`` and ``ckpt-*.pt``).
      episodes: whole episodes to average over (0 only together with ``video``).
      checkpoint: a checkpoint file to load instead of the newest in ``logdir``
        (the env and networks still follow ``logdir``'s config).
      seed: env ``i`` of the batch is reset with seed ``seed + i`` first.
      device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``...
      video: write one rendered mean-action episode to this ``.mp4`` file
        (needs the ``video`` extra; see the module docstring for OpenGL).
      agents: envs stepped in lockstep; default ``min(episodes,
        config.env.num_agents)``.

    Returns:
      A dict with ``score``, ``score_std`` (population std), ``length`` (mean
      episode length), ``episodes``, ``scores`` and ``lengths`` (per episode),
      ``checkpoint`` (path), ``step`` (training steps of the checkpoint),
      ``env_id``, ``agents``, ``video`` (path or ``None``) and
      ``video_frames`` (frames written, 0 without a video). Without episodes,
      ``score``, ``score_std`` and ``length`` are NaN.

    Raises:
      EvaluationError: no run or checkpoint in ``logdir``, a checkpoint that
        does not fit, or a video that cannot be rendered or written.
      ConfigError, EnvSpecError: a bad argument or saved config, or an env
        that cannot be built.
    """
    logdir = Path(logdir)
    if episodes < 0 or (episodes == 0 and video is None):
        raise ConfigError(f"episodes must be >= 1 (or 0 with a video), got {episodes}")
    if agents is not None and agents < 1:
        raise ConfigError(f"agents must be >= 1, got {agents}")
    video_path = None if video is None else Path(video)
    if video_path is not None:
        if video_path.is_dir():
            raise ConfigError(f"--video {video_path} is a directory; give a file name "
                              f"ending in .mp4")
        if video_path.suffix.lower() != ".mp4":
            raise ConfigError(f"the video is written as MP4: give a path ending in .mp4, "
                              f"got {str(video_path)!r}")
        problem = video_writer_problem()
        if problem:
            raise EvaluationError(problem)
    config, checkpoint_path = _load_run(logdir, None if checkpoint is None else Path(checkpoint))
    try:
        torch_device = resolve_device(device)
    except RuntimeError as exc:  # torch's own error for a malformed device string
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r} "
                          f"({exc})") from None
    num_agents = min(agents or config.env.num_agents, max(episodes, 1))

    try:
        state = load_checkpoint(checkpoint_path, torch_device)
    except CheckpointError as exc:
        raise EvaluationError(str(exc)) from None
    step = int(state.get("counters", {}).get("steps", 0))

    # Before any env is built: MuJoCo's renderer reads MUJOCO_GL when it is imported.
    gl_failures = _select_gl_backend() if video_path is not None else {}
    try:
        batch_env = make_batch_env(config.env.id, num_agents, config.env.max_length,
                                   config.env.kwargs, backend="inline",
                                   normalize_ranges=config.env.normalize_ranges)
    except Exception as exc:
        if not _from_opengl(exc):
            raise
        raise EvaluationError(_opengl_failure(config.env.id, exc, gl_failures)) from None
    env = TensorBatchEnv(batch_env, torch_device)
    try:
        algo = _build_algorithm(env, config, state["algorithm"], torch_device, checkpoint_path)
        frames = 0
        if video_path is not None:  # first, so that a rendering problem shows at once
            frames = _record_video(config, algo, torch_device, video_path, seed, gl_failures)
        scores, lengths = _run_episodes(env, algo, episodes, seed) if episodes else ([], [])
    finally:
        env.close()
    return {"score": float(np.mean(scores)) if scores else math.nan,
            "score_std": float(np.std(scores)) if scores else math.nan,
            "length": float(np.mean(lengths)) if lengths else math.nan,
            "episodes": len(scores), "scores": scores, "lengths": lengths,
            "checkpoint": str(checkpoint_path), "step": step, "env_id": config.env.id,
            "agents": num_agents, "video": None if video_path is None else str(video_path),
            "video_frames": frames}


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (2 for a user error)."""
    parser = argparse.ArgumentParser(
        prog="python -m batchrl.evaluate",
        description="Mean-action return of a training run's latest checkpoint.",
        epilog="MuJoCo videos render offscreen with the OpenGL backend in MUJOCO_GL "
               "(egl, osmesa, glfw); when unset, a working one is chosen.")
    parser.add_argument("logdir", type=Path, help="the run's log directory")
    parser.add_argument("--episodes", type=int, default=10,
                        help="episodes to average over (default 10; 0 with --video: video only)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint file (default: the newest in LOGDIR)")
    parser.add_argument("--seed", type=int, default=0, help="env i is seeded with SEED + i")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu or cuda (default auto)")
    parser.add_argument("--video", type=Path, default=None, metavar="PATH.mp4",
                        help="also render one mean-action episode into this MP4 file")
    parser.add_argument("--agents", type=int, default=None, metavar="K",
                        help="envs stepped in lockstep (default: min(episodes, env.num_agents))")
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.logdir, args.episodes, args.checkpoint, args.seed, args.device,
                          args.video, args.agents)
    except (EvaluationError, ConfigError, EnvSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{result['env_id']}, {result['checkpoint']} (step {result['step']:,}), mean actions, "
          f"{result['agents']} agent{'s' if result['agents'] != 1 else ''}")
    if result["video"] is not None:
        print(f"Video: {result['video']} ({result['video_frames']} frames)")
    if result["episodes"]:
        print(f"{result['score']:.1f} ± {result['score_std']:.1f} return over "
              f"{result['episodes']} episodes, mean length {result['length']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
