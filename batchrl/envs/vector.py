"""``BatchVectorEnv``: batchrl's env layout behind Gymnasium's ``VectorEnv`` API, so that a
loop written for ``SyncVectorEnv`` or ``AsyncVectorEnv`` runs on it unchanged."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Iterable, Sequence

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, create_empty_array

from batchrl.envs.errors import EnvSpecError
from batchrl.envs.factory import batch_env_from
from batchrl.envs.infos import InfoList
from batchrl.envs.worker import Closeable, RemoteAttribute
from batchrl.nested import copy_nested, put, take, unstack

#: ``batch_env_from``'s options that ``BatchVectorEnv`` takes as keywords.
LAYOUT_OPTIONS = tuple(name for name in inspect.signature(batch_env_from).parameters
                       if name not in ("constructor", "num_envs", "prefetch_reset"))


def _autoreset_mode(mode: str | AutoresetMode) -> AutoresetMode:
    """``mode`` as an ``AutoresetMode``: given as one, by value (``"NextStep"``)
    or by name in any case (``"next_step"``)."""
    for member in AutoresetMode:
        if mode is member or mode == member.value or (
                isinstance(mode, str) and mode.upper() == member.name):
            return member
    valid = ", ".join(repr(m.name.lower()) for m in AutoresetMode)
    raise ValueError(f"autoreset_mode must be an AutoresetMode or one of {valid}, "
                     f"got {mode!r}")


def _check_env_fns(env_fns: Any) -> list[Callable[[], gym.Env]]:
    if callable(env_fns) or isinstance(env_fns, (str, bytes)) or not isinstance(
            env_fns, Iterable):
        raise TypeError(f"BatchVectorEnv takes a list of functions that build the envs "
                        f"(as AsyncVectorEnv does), got {env_fns!r:.80}")
    env_fns = list(env_fns)
    if not env_fns:
        raise ValueError("BatchVectorEnv needs at least one env function")
    for index, env_fn in enumerate(env_fns):
        if isinstance(env_fn, str):
            raise TypeError(f"env_fns[{index}] is the string {env_fn!r}: pass functions "
                            f"that build envs, or use make_vec({env_fn!r}, num_envs)")
        if not callable(env_fn):
            hint = (": pass a function that builds it (lambda: gym.make(...))"
                    if isinstance(env_fn, gym.Env) else "")
            raise TypeError(f"env_fns[{index}] must be a function returning a "
                            f"gymnasium.Env, got {type(env_fn).__name__}{hint}")
    return env_fns


class BatchVectorEnv(Closeable, VectorEnv):
    """``len(env_fns)`` envs in batchrl's layout as a ``gymnasium.vector.VectorEnv``.

    Args:
      env_fns: functions that each build one ``gymnasium.Env`` (as ``AsyncVectorEnv``'s);
        all envs need equal spaces (Box, Discrete, MultiDiscrete or MultiBinary).
      autoreset_mode: Gymnasium's ``AutoresetMode``: ``NEXT_STEP`` (the default: the step after
        an episode ends resets that env and ignores its action), ``SAME_STEP`` (the step that
        ends an episode returns the first observation of the next, the last one in
        ``infos["final_obs"]``, its info in ``infos["final_info"]``) or ``DISABLED`` (reset
        finished envs yourself with ``reset(options={"reset_mask": mask})``).
      **layout: ``batch_env_from``'s options (``LAYOUT_OPTIONS``): ``backend``, ``workers``,
        ``share_main``, ``pin_workers``, ``infos``, ``timeout``, ``max_restarts``, ``label``,
        ``ray_address``, ``ray_resources``. By default the envs are spread over one pinned
        worker process per usable core, with observations in shared memory.

    ``step`` and ``reset`` return what ``SyncVectorEnv`` returns for the same seeds and actions:
    observations ``(num_envs, *obs_shape)`` in the space's dtype (dicts and tuples of them for Dict
    and Tuple spaces, as ``SyncVectorEnv`` gives them), rewards float64, flags bool,
    and the infos as a dict of arrays with ``_key`` masks. A failed env raises batchrl's
    ``EnvError`` naming it; with ``max_restarts`` its worker is replaced instead, its envs start
    new episodes and ``infos["restarted"]`` marks them. Reset ``options`` that are empty count
    as none. Use it as a context manager or call ``close()``: it stops the worker processes.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]],
                 autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP, **layout: Any):
        env_fns = _check_env_fns(env_fns)
        self.autoreset_mode = _autoreset_mode(autoreset_mode)
        unknown = sorted(set(layout) - set(LAYOUT_OPTIONS))
        if unknown:
            raise TypeError(f"BatchVectorEnv got unknown options {unknown}; valid: "
                            f"autoreset_mode, {', '.join(LAYOUT_OPTIONS)}")
        self.env_fns = env_fns
        # A worker resets an env as its episode ends only where Gymnasium does too (same-step
        # autoreset); else an env keeps its final state until the next step or reset.
        same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
        self.batch = batch_env_from(env_fns, prefetch_reset=same_step, **layout)
        try:
            self.num_envs = len(self.batch)
            self.single_observation_space = self.batch.observation_space
            self.single_action_space = self.batch.action_space
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
            self.action_space = batch_space(self.single_action_space, self.num_envs)
            first = self.batch.envs[0]
            self.metadata = dict(_get_attr(first, "metadata"))
            self.metadata["autoreset_mode"] = self.autoreset_mode
            self.render_mode = _get_attr(first, "render_mode")
        except BaseException:
            self.batch.close()
            raise
        self._observations = create_empty_array(self.single_observation_space, self.num_envs,
                                                np.zeros)
        self._autoreset: np.ndarray | None = None  # envs whose episodes ended: bool (num_envs,)

    def reset(self, *, seed: int | Sequence[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset every env (or those where ``options["reset_mask"]`` is true).

        ``seed``: ``None``, an int (env ``i`` gets ``seed + i``) or one seed per env.
        Returns the observations of all envs and the reset infos.
        """
        num_envs = self.num_envs
        if seed is None:
            seeds: list = [None] * num_envs
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != num_envs:
                raise ValueError(f"seed must be None, an int or {num_envs} seeds (one per "
                                 f"env), got {len(seeds)} seeds")
        options = dict(options) if options else {}
        mask = options.pop("reset_mask", None)
        indices = np.arange(num_envs) if mask is None else self._check_mask(mask)
        observ, infos = self.batch.reset(indices, [seeds[i] for i in indices], options or None,
                                         return_infos=True)
        if mask is None:
            observations = observ
        else:
            observations = copy_nested(self._observations)
            put(observations, indices, observ)
        if self._autoreset is not None:
            self._autoreset[indices] = False
        env_infos: list[dict] = [{}] * num_envs
        for index, info in zip(indices.tolist(), infos):
            env_infos[index] = info
        restarted = self._take_restarts(observations, env_infos)
        self._observations = observations
        shown = np.union1d(indices, restarted) if restarted else indices
        return copy_nested(observations), self._stack_infos(env_infos, reset=shown)

    def _check_mask(self, mask: Any) -> np.ndarray:
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise TypeError(f"options['reset_mask'] must be a bool numpy array of shape "
                            f"({self.num_envs},), got {mask!r:.80}")
        if mask.shape != (self.num_envs,):
            raise ValueError(f"options['reset_mask'] must have shape ({self.num_envs},), "
                             f"got {mask.shape}")
        if not mask.any():
            raise ValueError("options['reset_mask'] must select at least one env")
        return np.flatnonzero(mask)

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        """Step env ``i`` with ``actions[i]`` (``(num_envs, *action_shape)``), resetting
        finished envs as ``autoreset_mode`` says; Gymnasium's 5-tuple."""
        autoreset = self._autoreset  # NEXT_STEP: these envs reset instead of stepping
        if autoreset is not None and self.autoreset_mode is AutoresetMode.DISABLED and \
                autoreset.any():
            raise RuntimeError(
                f"envs {np.flatnonzero(autoreset).tolist()} finished their episodes: "
                f"with autoreset_mode DISABLED, reset them with "
                f"reset(options={{'reset_mask': mask}}) first")
        observ, reward, terminated, truncated, infos = self.batch.step(actions, autoreset)
        done = terminated | truncated
        any_done = done.any()
        same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
        self._autoreset = done if any_done and not same_step else None
        if not (same_step and any_done) and not len(self.batch.restarted[0]):
            # The usual step: the infos go to arrays without becoming dicts.
            self._observations = observ
            return copy_nested(observ), reward, terminated, truncated, self._stack_infos(infos)
        env_infos = list(infos)
        # Written below: a copy (one Ray actor's arrays are its read-only zero-copy ones).
        observ = copy_nested(observ)
        self._take_restarts(observ, env_infos)
        several: dict[int, list[dict]] = {}  # envs with several infos, added in order
        if same_step and any_done:
            ended = np.flatnonzero(done)
            # Served from the resets the workers made as the episodes ended.
            first, infos = self.batch.reset(ended, return_infos=True)
            for row, info in zip(ended.tolist(), infos):
                several[row] = [{"final_obs": copy_nested(take(observ, row)),
                                 "final_info": env_infos[row]}, info]
            put(observ, ended, first)
            for row in self._take_restarts(observ, env_infos):
                if row in several:
                    several[row][1] = {"restarted": True}
        self._observations = observ
        return (copy_nested(observ), reward, terminated, truncated,
                self._stack_infos(env_infos, several))

    def _take_restarts(self, observ: np.ndarray, env_infos: list[dict]) -> list[int]:
        """Put the first observations of envs the last call restarted into ``observ``,
        mark them in their infos and return their indices."""
        rows, first = self.batch.restarted
        rows = rows.tolist()
        for row, row_observ in zip(rows, unstack(first)):
            put(observ, row, row_observ)
            env_infos[row] = {"restarted": True}
            if self._autoreset is not None:
                self._autoreset[row] = False
        return rows

    def _stack_infos(self, env_infos: Sequence[dict], several: dict[int, list[dict]] | None = None,
                     reset: np.ndarray | None = None) -> dict[str, Any]:
        """The info dicts as Gymnasium's dict of arrays with ``_key`` masks, as
        ``SyncVectorEnv`` builds them. ``env_infos``: one per env; ``several``: envs
        whose infos are several dicts, added in order; ``reset``: only these envs
        have infos (a partial reset)."""
        if not several and (reset is None or len(reset) == self.num_envs):
            if not isinstance(env_infos, InfoList):
                env_infos = InfoList([(len(env_infos), env_infos)])
            stacked = env_infos.columns()
            if stacked is not None:
                return stacked
        several = several or {}
        stacked = {}
        for index in range(self.num_envs) if reset is None else reset.tolist():
            for info in several.get(index, (env_infos[index],)):
                stacked = self._add_info(stacked, info, index)
        return stacked

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Each env's method ``name`` called with the arguments (or its attribute ``name``
        when that is not callable); the attribute may belong to a wrapped env."""
        return tuple(_call(env, name, args, kwargs) for env in self.batch.envs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Each env's attribute ``name`` (a method is called without arguments)."""
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` of every env: to ``values[i]`` when ``values`` is a list or
        tuple (one per env), else to ``values``."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"set_attr needs one value per env ({self.num_envs}), got "
                             f"{len(values)}")
        for env, value in zip(self.batch.envs, values):
            if isinstance(env, gym.Env):
                env.set_wrapper_attr(name, value)
            else:
                env.call("set_wrapper_attr", name, value)

    def render(self) -> tuple[Any, ...]:
        """Each env's ``render()``."""
        return self.call("render")

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """Each env's ``np_random_seed``."""
        return self.get_attr("np_random_seed")

    def close_extras(self, **kwargs: Any) -> None:
        """Close the envs and stop the worker processes."""
        self.batch.close()


def _get_attr(env: Any, name: str) -> Any:
    return env.get_wrapper_attr(name) if isinstance(env, gym.Env) else env.get_attr(name)


def _call(env: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """Gymnasium's ``VectorEnv.call`` for one env: in this process or remote."""
    value = _get_attr(env, name)
    if isinstance(value, RemoteAttribute):
        return value(*args, **kwargs) if value.remote_callable else value
    return value(*args, **kwargs) if callable(value) else value


def make_vec(env_id: str, num_envs: int = 1, *,
             autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
             vector_kwargs: dict[str, Any] | None = None,
             wrappers: Sequence[Callable[[gym.Env], gym.Wrapper]] | None = None,
             **kwargs: Any) -> BatchVectorEnv:
    """``num_envs`` copies of the registered env ``env_id`` as a ``BatchVectorEnv``, as
    ``gymnasium.make_vec`` builds them: ``kwargs`` go to ``gymnasium.make``, each env is wrapped
    by ``wrappers`` in order, and ``vector_kwargs`` are ``BatchVectorEnv``'s options (the
    autoreset mode may be given there too)."""
    _check_env_id(env_id)
    if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    options = dict(vector_kwargs or {})
    autoreset_mode = options.pop("autoreset_mode", autoreset_mode)
    build = functools.partial(_build, env_id, kwargs, list(wrappers or []))
    return BatchVectorEnv([build] * int(num_envs), autoreset_mode, **options)


def _check_env_id(env_id: str) -> None:
    """``EnvSpecError`` unless ``env_id`` names a registered env. ``"module:EnvId"`` imports the
    module first, as ``gymnasium.make`` does: importing it registers the env."""
    module, colon, name = env_id.partition(":")
    try:
        if colon:
            importlib.import_module(module)
        gym.spec(name if colon else env_id)
    except ImportError as exc:
        raise EnvSpecError(f"env {env_id!r}: cannot import module {module!r} ({exc})") from None
    except gym.error.Error as exc:
        raise EnvSpecError(f"env {env_id!r}: {exc}") from None


def _build(env_id: str, kwargs: dict[str, Any], wrappers: list) -> gym.Env:
    env = gym.make(env_id, **kwargs)
    for wrapper in wrappers:
        env = wrapper(env)
    return env
