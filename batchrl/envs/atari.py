"""Atari 2600 games from ale-py with Gymnasium's standard preprocessing (``pip install
'batchrl[atari]'``): ``env.id = "batchrl.envs.atari:make"`` in a config; ``make_vector`` builds
ale-py's own ``AtariVectorEnv`` (the same preprocessing in C++, a batch stepped in native threads)
for ``env.backend = "vector"``.

The observation is a stack of the last ``frame_stack`` 84x84 grayscale frames on the last axis,
``Box(0, 255, (84, 84, 4), uint8)`` (the channels-last layout the convolutions read fastest,
which the envs write once per step instead of the network rearranging every frame in every pass
of an update): bytes through every transport and into the rollout memory, scaled to ``[0, 1]``
by the network (``algorithm.torso = "nature_cnn"``). Training envs end an
episode when a life is lost and clip rewards to ``[-1, 1]``; the reset after a lost life plays
on with the lives left, as the papers' wrappers do (``PlayOnAfterLifeLoss``; for ale-py's vector
env, ``PlayOnAfterLifeLossVector``). Evaluation envs (``training=False``, the
configs' ``env.eval_kwargs``) play whole games and report raw scores, as the papers' tables do.
No FIRE is pressed after a reset: the policy learns to serve.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.wrappers import (AtariPreprocessing, ClipReward, FrameStackObservation,
                                TransformObservation)
from gymnasium.wrappers import vector as vector_wrappers

from batchrl.envs.errors import EnvSpecError

try:
    import ale_py
except ImportError as exc:  # (named in the config error train.py prints)
    raise ImportError(f"Atari games need ale-py and OpenCV: pip install 'batchrl[atari]' "
                      f"({exc})") from None

gym.register_envs(ale_py)

__all__ = ["PlayOnAfterLifeLoss", "PlayOnAfterLifeLossVector", "make", "make_vector"]


def _channels_last(frames: np.ndarray) -> np.ndarray:
    """``(..., C, H, W)`` frame stacks as ``(..., H, W, C)`` (a contiguous copy)."""
    return np.ascontiguousarray(np.moveaxis(frames, -3, -1))


def _stack_space(screen_size: int, frame_stack: int) -> gym.spaces.Box:
    return gym.spaces.Box(0, 255, (screen_size, screen_size, frame_stack), np.uint8)


class PlayOnAfterLifeLoss(gym.Wrapper):
    """Around ``AtariPreprocessing(terminal_on_life_loss=True)``: an unseeded ``reset`` after
    an episode that ended with a lost life (the game not over) continues the game with one
    no-op step (its reward, if any, unreported) instead of starting a new one, so training
    sees every life of a game while its episodes still end with each life. A seeded reset,
    or one after the game ended or the emulator truncated it, starts a new game (with the
    preprocessing's no-op starts); a time limit wrapped around this one that ends an episode
    in the step that lost a life leaves the game to go on."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._life_lost = False

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        observ, reward, terminated, truncated, info = self.env.step(action)
        self._life_lost = (terminated and not truncated
                           and not self.env.unwrapped.ale.game_over())
        return observ, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        life_lost, self._life_lost = self._life_lost, False
        if life_lost and seed is None and options is None:
            observ, _, terminated, truncated, info = self.env.step(0)
            if not (terminated or truncated):
                return observ, info
        return self.env.reset(seed=seed, options=options)


class PlayOnAfterLifeLossVector(gym.vector.VectorWrapper):
    """Around ale-py's ``AtariVectorEnv`` built with ``life_loss_info``, which ends an episode
    (``terminated``) when a life is lost and plays the game on at its next step: that next step
    becomes the next-step autoreset Gymnasium's protocol promises, as ``PlayOnAfterLifeLoss`` is
    for ``make``'s envs. The step after an episode ended plays a no-op in that env (not the
    action it was given) and returns its observation as the next episode's first, with no
    reward and neither flag; after a game over it is ale-py's own reset. Where that no-op
    step itself ends an episode (a lost life, the game's end) or reaches the time limit, the
    env starts a new game at once, as ``PlayOnAfterLifeLoss`` does.
    Unlike ``make``'s envs, the frame stack after a lost life holds the frames before it.
    Passes on ``send``/``recv``: the games step in their threads while the caller goes on."""

    def __init__(self, env: gym.vector.VectorEnv):
        super().__init__(env)
        self._ended = np.zeros(self.num_envs, bool)  # episodes that ended at the last step
        self._starting = self._ended.copy()  # envs the step in flight starts again

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple:
        observ, info = self.env.reset(seed=seed, options=options)
        mask = (options or {}).get("reset_mask")
        self._ended[slice(None) if mask is None else np.asarray(mask, bool)] = False
        return observ, info

    def step(self, actions: np.ndarray) -> tuple:
        return self._started(*self.env.step(self._actions(actions)))

    def send(self, actions: np.ndarray) -> None:
        self.env.send(self._actions(actions))

    def recv(self) -> tuple:
        return self._started(*self.env.recv())

    def _actions(self, actions: np.ndarray) -> np.ndarray:
        self._starting = self._ended.copy()
        # (action 0 is NOOP in every game's action set; a game being reset ignores it)
        return np.where(self._starting, 0, actions) if self._starting.any() else actions

    def _started(self, observ: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                 truncated: np.ndarray, info: dict[str, Any]) -> tuple:
        starting = self._starting
        if starting.any():
            again = starting & (terminated | truncated)
            if again.any():  # (the no-op lost the game or reached the limit: a new game)
                new_observ, new_info = self.env.reset(options={"reset_mask": again})
                observ = np.where(again.reshape(-1, *[1] * (observ.ndim - 1)), new_observ,
                                  observ)
                info = {key: (np.where(again, new_info[key], value)
                              if key in new_info and np.shape(value) == again.shape else value)
                        for key, value in info.items()}
            reward = np.where(starting, 0, reward)  # (keeps the rewards' dtype)
            terminated, truncated = terminated & ~starting, truncated & ~starting
        self._ended = terminated | truncated
        return observ, reward, terminated, truncated, info


def check_arguments(env_id: Any, sticky_actions: Any, noop_max: Any, frame_skip: Any,
                    screen_size: Any, frame_stack: Any, **flags: Any) -> None:
    """Raise ``EnvSpecError`` (a config error, exit 2) naming the first of ``make``'s (or
    ``make_vector``'s) arguments that cannot be right."""
    where = "(the Atari env's argument, from env.kwargs or env.eval_kwargs)"
    if not isinstance(env_id, str):
        raise EnvSpecError(f"env_id must be an Atari game's id such as 'ALE/Pong-v5', got "
                           f"{env_id!r} {where}")
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        raise EnvSpecError(f"env_id {env_id!r}: {exc} {where}") from None
    if isinstance(sticky_actions, bool) or not isinstance(sticky_actions, (int, float)) \
            or not 0 <= sticky_actions <= 1:
        raise EnvSpecError(f"sticky_actions must be a probability in [0, 1], got "
                           f"{sticky_actions!r} {where}")
    for name, value, low in (("noop_max", noop_max, 0), ("frame_skip", frame_skip, 1),
                             ("screen_size", screen_size, 1), ("frame_stack", frame_stack, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise EnvSpecError(f"{name} must be an integer >= {low}, got {value!r} {where}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise EnvSpecError(f"{name} must be true or false, got {value!r} {where}")


def make(env_id: str = "ALE/Pong-v5", training: bool = True, sticky_actions: float = 0.25,
         noop_max: int = 30, frame_skip: int = 4, screen_size: int = 84, frame_stack: int = 4,
         terminal_on_life_loss: bool = True, clip_rewards: bool = True,
         full_action_space: bool = False, **kwargs: Any) -> gym.Env:
    """The game ``env_id`` (an ``ALE/<Game>-v5`` id) with Gymnasium's ``AtariPreprocessing``
    (up to ``noop_max`` no-op actions after a reset, each action repeated ``frame_skip``
    frames with the last two max-pooled, ``screen_size`` square grayscale frames) and
    ``FrameStackObservation`` of ``frame_stack`` frames.

    Args:
      training: with ``terminal_on_life_loss``, a lost life terminates the episode (and the
        next episode plays on with the lives left, ``PlayOnAfterLifeLoss``); with
        ``clip_rewards``, rewards are clipped to ``[-1, 1]`` (their sign, for integer
        scores). ``False``: whole games and raw scores, for evaluation.
      sticky_actions: the probability that the emulator repeats the previous action
        instead of the new one (v5's default 0.25, Machado et al., 2018; 0.0: the
        deterministic games of the DQN-era papers).
      full_action_space: all 18 actions instead of the game's minimal set.
      kwargs: further keyword arguments of ``gymnasium.make`` for the ALE env (such as
        ``render_mode="rgb_array"``, which films the game's colour frames).
    """
    check_arguments(env_id, sticky_actions, noop_max, frame_skip, screen_size, frame_stack,
                    training=training, terminal_on_life_loss=terminal_on_life_loss,
                    clip_rewards=clip_rewards, full_action_space=full_action_space)
    # (AtariPreprocessing reads the screens itself: a grayscale inner observation is the
    # cheapest that it accepts)
    env = gym.make(env_id, frameskip=1, repeat_action_probability=sticky_actions,
                   obs_type="grayscale", full_action_space=full_action_space, **kwargs)
    life_episodes = training and terminal_on_life_loss
    env = AtariPreprocessing(env, noop_max=noop_max, frame_skip=frame_skip,
                             screen_size=screen_size, terminal_on_life_loss=life_episodes)
    if life_episodes:
        env = PlayOnAfterLifeLoss(env)
    if training and clip_rewards:
        env = ClipReward(env, -1.0, 1.0)
    env = FrameStackObservation(env, frame_stack)
    env = TransformObservation(env, _channels_last, _stack_space(screen_size, frame_stack))
    # A step shows one frame of frame_skip of the 60 Hz console's: videos play at its pace.
    env.metadata = {**env.metadata, "render_fps": 60 / frame_skip}
    return env


def make_vector(num_envs: int, env_id: str = "ALE/Pong-v5", training: bool = True,
                sticky_actions: float = 0.25, noop_max: int = 30, frame_skip: int = 4,
                screen_size: int = 84, frame_stack: int = 4, terminal_on_life_loss: bool = True,
                clip_rewards: bool = True, full_action_space: bool = False,
                max_episode_steps: int | None = None,
                num_threads: int = 0) -> gym.vector.VectorEnv:
    """``num_envs`` copies of the game ``env_id`` as ale-py's ``AtariVectorEnv``, with
    ``make``'s arguments and observations (``(screen_size, screen_size, frame_stack)`` uint8),
    for ``env.vector_id = "batchrl.envs.atari:make_vector"``. Its preprocessing is ale-py's
    native one: the same steps as Gymnasium's wrappers, not the same pixels (another resize), so
    runs on it do not repeat runs on ``make``'s envs. A lost life ends a training episode and
    the next one plays on with the lives left (ale-py's ``life_loss_info`` with
    ``PlayOnAfterLifeLossVector``), as ``make``'s envs do; no FIRE is pressed after a reset.

    Args:
      max_episode_steps: the time limit in agent steps (``env.max_length``), counted over a
        whole game (ale-py's frame limit, ``frame_skip`` frames a step), where training
        episodes end with each life; none: ale-py's 108,000 frames.
      num_threads: native threads stepping the games (0: ale-py's default, a thread per game).
    """
    from ale_py.vector_env import AtariVectorEnv

    check_arguments(env_id, sticky_actions, noop_max, frame_skip, screen_size, frame_stack,
                    training=training, terminal_on_life_loss=terminal_on_life_loss,
                    clip_rewards=clip_rewards, full_action_space=full_action_space)
    rom = gym.spec(env_id).kwargs["game"]  # (the ROM's name: ALE/MsPacman-v5 -> ms_pacman)
    frames = 108_000 if max_episode_steps is None else max_episode_steps * frame_skip
    env = AtariVectorEnv(
        rom, num_envs, num_threads=num_threads,
        max_num_frames_per_episode=frames, repeat_action_probability=sticky_actions,
        full_action_space=full_action_space, img_height=screen_size, img_width=screen_size,
        stack_num=frame_stack, frameskip=frame_skip, noop_max=noop_max,
        episodic_life=False, life_loss_info=training and terminal_on_life_loss,
        reward_clipping=training and clip_rewards, use_fire_reset=False)
    if training and terminal_on_life_loss:
        env = PlayOnAfterLifeLossVector(env)
    single = _stack_space(screen_size, frame_stack)
    return ChannelsLastVector(env, _channels_last,
                              gym.vector.utils.batch_space(single, num_envs), single)


class ChannelsLastVector(vector_wrappers.TransformObservation):
    """Gymnasium's ``TransformObservation`` of a vector env that also passes on ale-py's
    ``send``/``recv`` (which Gymnasium's wrapper hides), so that ``VectorWorker`` lets the games
    step in their threads while the caller goes on."""

    def send(self, actions: np.ndarray) -> None:
        self.env.send(actions)

    def recv(self) -> tuple:
        observ, *rest = self.env.recv()
        return (self.observations(observ), *rest)
