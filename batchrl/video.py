"""Render a policy's episodes offscreen into an MP4, with imageio's ffmpeg writer (the
``video`` extra), or into a GIF or WebP animation; MuJoCo cameras follow the agent. A set
``MUJOCO_GL`` is used as it is; else ``select_gl_backend`` sets the first OpenGL backend that
renders before MuJoCo's renderer is imported (Gymnasium would try ``glfw`` first, which
fails without a display)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes.util
import dataclasses
import gc
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np
import torch

from batchrl.algos.base import Algorithm
from batchrl.config import Config
from batchrl.envs.batch import BatchEnv
from batchrl.envs.errors import EnvRaisedError
from batchrl.envs.factory import resolve_constructor
from batchrl.envs.wrappers import wrap_env
from batchrl.simulation import simulate
from batchrl.tensor_env import TensorBatchEnv

__all__ = ["VideoError", "find_gl_backend", "select_gl_backend", "video_writer_problem",
           "from_opengl", "opengl_failure", "mujoco_gl_value_problem",
           "follow_agent", "record_video", "Recording", "FrameRecorder", "FREE_CAMERA",
           "VIDEO_SUFFIXES"]

GL_BACKENDS = ("egl", "osmesa", "glfw")

# Builds MuJoCo's offscreen renderer as an env's render() would; fails where MUJOCO_GL can't.
_GL_PROBE = ("import mujoco\n"
             "mujoco.Renderer(mujoco.MjModel.from_xml_string('<mujoco/>'), 16, 16).close()\n")


class VideoError(RuntimeError):
    """A video cannot be rendered or written here; the message says why and what to do."""


def find_gl_backend(timeout: float = 60.0) -> tuple[str | None, dict[str, str]]:
    """Which MuJoCo OpenGL backend renders offscreen here: ``(backend, failures)``, the first
    that rendered (``None`` if none did) and the last line of each failure. Each candidate is
    tried in a child process (a failed OpenGL set-up cannot be undone): ``MUJOCO_GL`` alone
    when it is set, else the one ``PYOPENGL_PLATFORM`` names, else ``egl``, ``osmesa`` and,
    with a display, ``glfw``."""
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


# Values MuJoCo's ``import mujoco`` accepts for MUJOCO_GL on Linux (it lower-cases them).
_MUJOCO_GL_VALUES = ("egl", "osmesa", "glfw", "glx", "enable", "enabled", "on", "true", "1",
                     "disable", "disabled", "off", "false", "0")

# What each backend needs: what to install, or which MUJOCO_GL to set instead.
_GL_NEEDS = {
    "egl": "install EGL (Debian/Ubuntu: apt-get install libegl1 libegl-mesa0 "
           "libgl1-mesa-dri, or the GPU driver's EGL) or set MUJOCO_GL=osmesa",
    "osmesa": "install OSMesa (Debian/Ubuntu: apt-get install libosmesa6; Fedora: dnf "
              "install mesa-libOSMesa) or set MUJOCO_GL=egl",
    "glfw": "glfw opens a window, which needs a display; without one set MUJOCO_GL=egl "
            "or osmesa",
}
_GL_INSTALL = ("MuJoCo renders offscreen with MUJOCO_GL=egl (Debian/Ubuntu: apt-get install "
               "libegl1 libegl-mesa0 libgl1-mesa-dri) or MUJOCO_GL=osmesa (apt-get install "
               "libosmesa6)")

# Where a failure of MuJoCo's OpenGL set-up is raised: its backend modules and PyOpenGL
# (a worker's traceback names files; a local one, modules).
_GL_FILES = re.compile(r'File "[^"]*[/\\](?:mujoco[/\\](?:rendering|egl|osmesa|glfw|cgl)'
                       r'|OpenGL)[/\\]')
_GL_MODULES = ("mujoco.rendering", "mujoco.egl", "mujoco.osmesa", "mujoco.glfw", "mujoco.cgl",
               "OpenGL")


def mujoco_gl_value_problem() -> str | None:
    """Why ``MUJOCO_GL``'s value is one that ``import mujoco`` rejects, or ``None``."""
    value = os.environ.get("MUJOCO_GL", "")
    if value.strip().lower() in _MUJOCO_GL_VALUES + ("",):
        return None
    return (f"MUJOCO_GL={value} is not an OpenGL backend MuJoCo knows: set MUJOCO_GL to egl, "
            f"osmesa or glfw, or unset it")


def _backend_reason(backend: str, error: str) -> str:
    """``error`` in words a user can act on: a missing library or display named as such."""
    library = {"osmesa": "OSMesa", "egl": "EGL"}.get(backend)
    if library and ctypes.util.find_library(library) is None:
        return f"lib{library} is not installed"
    if backend == "glfw" and not (os.environ.get("DISPLAY")
                                  or os.environ.get("WAYLAND_DISPLAY")):
        return "no display: DISPLAY is not set"
    return error


def gl_hint(failures: dict[str, str], error: str = "") -> str:
    """What failed in MuJoCo's OpenGL set-up and what to do about it, in one line:
    ``failures`` from ``find_gl_backend``, ``error`` the failure seen here."""
    value_problem = mujoco_gl_value_problem()
    if value_problem:
        return value_problem
    backend = (os.environ.get("MUJOCO_GL") or "").strip().lower()
    if backend:  # set by the user, and it does not work
        reason = _backend_reason(backend, failures.get(backend) or error or "it failed")
        return (f"MUJOCO_GL={backend} does not work here ({reason}): "
                f"{_GL_NEEDS.get(backend, _GL_INSTALL)}, or unset MUJOCO_GL to let batchrl "
                f"choose a backend that works")
    if failures:
        tried = "; ".join(f"MUJOCO_GL={name}: {_backend_reason(name, reason)}"
                          for name, reason in failures.items())
        return f"no MuJoCo OpenGL backend works here ({tried}). {_GL_INSTALL}"
    return f"{error}; {_GL_INSTALL}" if error else _GL_INSTALL


def select_gl_backend() -> dict[str, str]:
    """Probe ``MUJOCO_GL``'s backend, or when it is unset set it to the first that
    works; returns the probe failures for error messages (nothing is raised: an env
    that is not MuJoCo may need no OpenGL)."""
    backend, failures = find_gl_backend()
    if backend is not None and not os.environ.get("MUJOCO_GL"):
        os.environ["MUJOCO_GL"] = backend
    return failures


def _chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during."""
    seen: list[BaseException] = []
    while exc is not None and not any(exc is other for other in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def from_opengl(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from, or an env worker's exception it reports)
    came from MuJoCo's OpenGL set-up or PyOpenGL, e.g. a ``MUJOCO_GL`` that does not work."""
    for error in _chain(exc):
        if "MUJOCO_GL" in str(getattr(error, "remote_message", error)):
            return True
        remote = getattr(error, "remote_traceback", None)
        if isinstance(remote, str) and _GL_FILES.search(remote):
            return True
        if any(str(frame.f_globals.get("__name__", "")).startswith(_GL_MODULES)
               for frame, _ in traceback.walk_tb(error.__traceback__)):
            return True
    return False


def _root_error(exc: BaseException) -> str:
    """``Type: message`` of the error at the bottom of ``exc``'s chain (a worker's own)."""
    error = _chain(exc)[-1]
    if isinstance(getattr(error, "remote_type", None), str):
        return f"{error.remote_type}: {error.remote_message}"  # type: ignore[attr-defined]
    return f"{type(error).__name__}: {error}"


def opengl_failure(env_id: str, exc: BaseException, failures: dict[str, str]) -> str:
    """The one-line message for an env that cannot be built because of OpenGL
    (``from_opengl(exc)``); ``failures``: ``find_gl_backend``'s, if it ran."""
    return f"cannot build {env_id}: {gl_hint(failures, _root_error(exc))}"


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


#: ``--camera`` value for Gymnasium's default view: a free camera that stays where it starts.
FREE_CAMERA = "free"


def follow_agent(env: gym.Env, camera: str | None = None, width: int | None = None,
                 height: int | None = None) -> str:
    """Point a MuJoCo env's ``rgb_array`` renderer (before its first frame) at a camera that
    keeps the agent in view, and set its frame size; returns which camera, in words.

    ``camera``: a camera of the model by name, ``FREE_CAMERA``, or ``None``: the model's first
    tracking camera (``mode="track"``/``"trackcom"``), else a free camera that follows the
    first body under the world. Other envs render as they do (no ``camera`` or size then).
    """
    base = env.unwrapped
    renderer = getattr(base, "mujoco_renderer", None)
    model = getattr(base, "model", None)
    if renderer is None or model is None:
        if camera is not None or width is not None or height is not None:
            raise VideoError(f"--camera, --width and --height apply to MuJoCo envs; "
                             f"{type(base).__name__} renders its own view")
        return "the env's own view"
    import mujoco
    if width is not None or height is not None:
        renderer.width = width or renderer.width
        renderer.height = height or renderer.height
        # MuJoCo's offscreen buffer must hold the frame.
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, renderer.width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, renderer.height)
    names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
    if camera == FREE_CAMERA:
        renderer.camera_id = -1
        return "the free camera"
    if camera is not None:
        if camera not in names:
            named = ", ".join(repr(name) for name in names if name) or "none"
            raise VideoError(f"the model has no camera {camera!r}; its cameras: {named} "
                             f"(or {FREE_CAMERA!r}: a camera that does not follow the agent)")
        renderer.camera_id = names.index(camera)
        return f"camera {camera!r}"
    tracking = {int(mujoco.mjtCamLight.mjCAMLIGHT_TRACK),
                int(mujoco.mjtCamLight.mjCAMLIGHT_TRACKCOM)}
    for index in range(model.ncam):
        if int(model.cam_mode[index]) in tracking:
            renderer.camera_id = index
            return f"the model's tracking camera {names[index] or index!r}"
    roots = [body for body in range(1, model.nbody) if model.body_parentid[body] == 0]
    if not roots:
        renderer.camera_id = -1
        return "the free camera"
    renderer.default_cam_config = {**(renderer.default_cam_config or {}),
                                   "type": mujoco.mjtCamera.mjCAMERA_TRACKING,
                                   "trackbodyid": roots[0]}
    renderer.camera_id = None  # keep the tracking camera (-1 would reset it to a free one)
    body = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, roots[0]) or roots[0]
    return f"a camera following body {body!r}"


class _RenderError(Exception):
    """``env.render()`` failed; wraps the original error."""


class FrameRecorder(gym.Wrapper):
    """Passes each frame rendered after a reset or step to ``sink`` while ``recording``."""

    def __init__(self, env: gym.Env, sink: Callable[[np.ndarray], None]):
        super().__init__(env)
        self.sink = sink
        self.recording = False

    def reset(self, **kwargs: Any) -> Any:
        return self._capture(self.env.reset(**kwargs))

    def step(self, action: Any) -> Any:
        return self._capture(self.env.step(action))

    def _capture(self, result: Any) -> Any:
        if self.recording:
            try:
                frame = self.env.render()
            except Exception as exc:  # the renderers' errors vary: OpenGL, pygame, MuJoCo
                raise _RenderError(exc) from exc
            if not isinstance(frame, np.ndarray) or frame.ndim != 3:
                raise _RenderError(TypeError(
                    f"render() returned {type(frame).__name__}, not an RGB array; the env "
                    f"must accept render_mode='rgb_array'"))
            self.sink(frame)
        return result


def _render_failure(env_id: str, exc: BaseException, failures: dict[str, str],
                    opengl: bool) -> str:
    """The one-line message for ``exc``, the renderer's own error; ``opengl``: whether it may
    come from MuJoCo's OpenGL set-up (else advice on MUJOCO_GL would mislead)."""
    if isinstance(exc, gym.error.DependencyNotInstalled):  # names the package it needs
        return (f"cannot render {env_id}: {exc}; batchrl's video extra brings what its "
                f"configs' envs need to be filmed: pip install \"batchrl[video]\" (in a "
                f"checkout: pip install -e \".[video]\")")
    error = f"{type(exc).__name__}: {exc}"
    if not opengl:
        return f"cannot render {env_id}: {error}"
    return f"cannot render {env_id} offscreen: {gl_hint(failures, error)}"


def _release_failed_viewer(exc: BaseException) -> None:
    """Free the Gymnasium MuJoCo viewer that ``exc``'s traceback still holds, now and
    quietly: its OpenGL context was never made, so its ``__del__`` raises an
    ``AttributeError`` that Python would print, traceback and all, under our one-line error."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        source = unraisable.object
        if not (issubclass(unraisable.exc_type, AttributeError)
                and getattr(source, "__module__", "") == "gymnasium.envs.mujoco.mujoco_rendering"
                and getattr(source, "__name__", "") == "__del__"):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        for error in _chain(exc):
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__)
        gc.collect()
    finally:
        sys.unraisablehook = previous


def _runtime_dir() -> None:
    """Give SDL (pygame renders classic control) the runtime directory it wants when the
    session has none; else it prints "XDG_RUNTIME_DIR is invalid or not set"."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    path = tempfile.mkdtemp(prefix="batchrl-runtime-")  # mode 0700, as SDL wants
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["XDG_RUNTIME_DIR"] = path


@dataclasses.dataclass
class Recording:
    """What ``record_video`` wrote: frames, the camera (in words), and each episode's
    return and length."""

    frames: int
    camera: str
    scores: list[float]
    lengths: list[int]


def animation_timing(count: int, fps: float) -> tuple[list[int], list[int]]:
    """Which of ``count`` frames recorded at ``fps`` an animation keeps, and how long each
    kept one shows, in ms. GIF counts whole hundredths of a second, and viewers show frames
    of less than two of them for a tenth: so at most 50 frames a second, each lasting from its
    time to the next kept one's (rounded to hundredths), the whole as long as the recording."""
    step = max(1, math.ceil(fps / 50 - 1e-9))
    kept = list(range(0, count, step))
    times = [round(100 * index / fps) for index in [*kept, count]]
    durations = [10 * max(1, end - start) for start, end in zip(times, times[1:])]
    if len(kept) > 1 and durations[-1] < 20:  # (a short last frame: the one before lasts on)
        kept.pop()
        last = durations.pop()
        durations[-1] += last
    return kept, durations


#: File types ``record_video`` writes: MP4 with ffmpeg, animations with Pillow.
VIDEO_SUFFIXES = (".mp4", ".gif", ".webp")


def record_video(config: Config, algo: Algorithm, device: torch.device, path: Path,
                 seed: int, failures: dict[str, str], episodes: int = 1,
                 camera: str | None = None, width: int | None = None,
                 height: int | None = None, max_frames: int | None = None,
                 agents: int = 1) -> Recording:
    """Render ``episodes`` episodes of ``algo`` (in its current mode: ``algo.eval()`` for mean
    actions) one after another in ``config``'s env into ``path`` (``VIDEO_SUFFIXES``; a GIF
    or WebP animation is kept in memory until written); episode ``i`` is reset with
    ``seed + i``. ``camera``, ``width``, ``height``: see ``follow_agent``; ``max_frames``: stop
    recording after this many frames (the episodes still run to their end). ``failures``:
    ``select_gl_backend``'s, for the error messages. ``agents``: the agents ``algo`` acts for
    in every call (one unless it only fits its training run's count): the filmed env is the
    first, unfilmed envs beside it (reset with ``seed + i + j``) take the others."""
    import imageio.v2 as imageio
    import imageio.v3 as iio

    _runtime_dir()
    # Without a display the glfw package warns twice before MuJoCo's error, which says more.
    warnings.filterwarnings("ignore", module="glfw")
    env_config = config.env
    kwargs = {**env_config.evaluation_kwargs, "render_mode": "rgb_array"}
    try:
        raw = resolve_constructor(env_config.id, kwargs, env_config.max_length)()
    except Exception as exc:
        if from_opengl(exc):
            raise VideoError(opengl_failure(env_config.id, exc, failures)) from None
        if not isinstance(exc, (gym.error.Error, TypeError)):
            raise
        raise VideoError(f"cannot build {env_config.id} with render_mode='rgb_array': "
                         f"{exc}") from None
    try:
        view = follow_agent(raw, camera, width, height)
    except VideoError:
        raw.close()
        raise
    fps = float(raw.metadata.get("render_fps") or 30)
    frames = 0
    writer = None
    # (an MP4 grows while it is filmed: it takes its name only once the recording is whole)
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")
    animation: list[np.ndarray] | None = None if path.suffix.lower() == ".mp4" else []

    def write(frame: np.ndarray) -> None:
        nonlocal writer, frames
        frames += 1
        if frames == max_frames:
            recorder.recording = False
        if animation is not None:
            animation.append(np.ascontiguousarray(frame[..., :3], dtype=np.uint8))
            return
        try:
            if writer is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                # H.264 in yuv420p needs even sides: keep the env's frame size when it
                # has them (macro_block_size=1), else let imageio round it up to 16s.
                height, width = frame.shape[:2]
                even = height % 2 == 0 and width % 2 == 0
                writer = imageio.get_writer(partial, format="FFMPEG", mode="I", fps=fps,
                                            codec="libx264", pixelformat="yuv420p",
                                            macro_block_size=1 if even else 16,
                                            ffmpeg_log_level="error")
            writer.append_data(np.ascontiguousarray(frame[..., :3], dtype=np.uint8))
        except (OSError, RuntimeError, ValueError) as exc:
            raise VideoError(f"cannot write the video {path}: {exc}") from None

    recorder = FrameRecorder(wrap_env(raw, normalize_ranges=env_config.normalize_ranges),
                             write)
    members = [recorder]
    try:
        for _ in range(agents - 1):
            members.append(wrap_env(resolve_constructor(
                env_config.id, env_config.evaluation_kwargs, env_config.max_length)(),
                normalize_ranges=env_config.normalize_ranges))
    except BaseException:
        for member in members:
            member.close()
        raise
    env = TensorBatchEnv(BatchEnv(members), device)
    scores: list[float] = []
    lengths: list[int] = []
    completed = False
    try:
        recorder.recording = True
        for episode in range(episodes):
            done, score, _ = simulate(env, algo, reset=True, seed=seed + episode)
            length = 1
            while not bool(done[0]):
                done, score, _ = simulate(env, algo)
                length += 1
            scores.append(float(score[0]))
            lengths.append(length)
        completed = True
    except EnvRaisedError as exc:  # the env layer names the env; the cause is ours
        if isinstance(exc.__cause__, VideoError):  # (the file could not be written)
            raise exc.__cause__ from None
        if not isinstance(exc.__cause__, _RenderError):
            raise
        cause = exc.__cause__.args[0]  # (the renderer's error, or ours about its frame)
        opengl = from_opengl(cause) or getattr(raw.unwrapped, "mujoco_renderer", None) is not None
        message = _render_failure(env_config.id, cause, failures, opengl)
        _release_failed_viewer(exc)
        raise VideoError(message) from None
    finally:
        recorder.recording = False
        try:
            if writer is not None:
                writer.close()  # ffmpeg finishes the file
                if completed:
                    os.replace(partial, path)
            if animation and completed:
                path.parent.mkdir(parents=True, exist_ok=True)
                # WebP at quality 60: a preview of a few hundred KB that still looks sharp.
                options = {"quality": 60} if path.suffix.lower() == ".webp" else {}
                kept, durations = animation_timing(len(animation), fps)
                # (Pillow writes a single frame as a still image, whose duration is a number)
                duration = durations if len(kept) > 1 else durations[0]
                iio.imwrite(partial, np.stack([animation[index] for index in kept]),
                            duration=duration, loop=0, extension=path.suffix, **options)
                os.replace(partial, path)
        except Exception as exc:
            if completed:  # else the error on the way out says more
                raise VideoError(f"cannot write the video {path}: {exc}") from None
        finally:
            with contextlib.suppress(OSError):  # (its folder may be what failed)
                partial.unlink(missing_ok=True)  # (unless it became the video)
            env.close()
    return Recording(frames, view, scores, lengths)
