"""The env side of every transport. An ``EnvHost`` runs where a worker's envs live (a child process
or a Ray actor), steps them into ``StepArrays`` and turns every env exception into an error answer:
the transport only moves bytes. A finished env is reset at once ("prefetched reset"), saving the
parent's round trip; the env sees the same calls (step, then reset without seed), so trajectories do
not change. Every method answers ``("ok", value)``, ``("proxy", type_name)`` (an attribute that must
stay remote) or ``("error", (type_name, message, traceback, env_index))``."""

from __future__ import annotations

import contextlib
import copyreg
import functools
import io
import math
import pickle
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from batchrl.envs.infos import info_columns
from batchrl.nested import build, is_nested_space, leaf_spaces, put, take

# Bytes reserved per action value: actions travel in the caller's dtype, as with in-process envs.
ACTION_ITEMSIZE = 8
# An ``autoreset`` value beyond true: reset the env for real, its prefetched reset was handed out.
RESET_AGAIN = 2


class StepArrays:
    """The arrays of one worker's step in one buffer (shared memory, or a bytearray).

    ``observ`` and ``reset_observ`` are ``(num_envs, *obs_shape)`` in the observation space's dtype
    (for a ``Dict`` or ``Tuple`` space, a nested value of such arrays, one per part:
    ``batchrl.nested``), ``reward`` ``(num_envs,)`` float64, ``terminated``/``truncated``
    ``(num_envs,)`` bool, ``autoreset`` ``(num_envs,)`` uint8 (the envs to reset instead of
    step; ``RESET_AGAIN``: not with the prefetched reset);
    ``action_bytes`` is raw storage that ``actions(dtype)`` views as ``(num_envs, *act_shape)``.

    Spaces without a fixed shape and numeric dtype (Text, Graph, a Dict holding one) cannot
    live in a buffer: then ``shared`` is false, ``observ`` and ``reset_observ`` are
    ``(num_envs,)`` object arrays, there is no action storage (actions travel in the request),
    and this is the one place where arrays travel pickled: ``carry`` adds them to the env host's
    answer and ``take`` puts them in place on the other side.
    """

    #: The arrays ``carry`` sends when they are not shared, in this order.
    CARRIED = ("observ", "reset_observ", "reward", "terminated", "truncated")

    def __init__(self, num_envs: int, obs_space: Any, act_space: Any, buffer: Any = None):
        self.shared = self.fits(obs_space, parts=True) and self.fits(act_space)
        if not self.shared:
            self.size = 0
            self.observ = np.empty(num_envs, object)
            self.reset_observ = np.empty(num_envs, object)
            self.reward = np.zeros(num_envs)
            self.terminated, self.truncated = np.zeros((2, num_envs), bool)
            self.autoreset = np.zeros(num_envs, np.uint8)
            self.action_bytes = None
            return
        self._act_shape = (num_envs, *act_space.shape)
        self._obs_space = obs_space
        obs_leaves = [((num_envs, *leaf.shape), leaf.dtype) for _, leaf in leaf_spaces(obs_space)]
        fields = [*((f"observ:{i}", *leaf) for i, leaf in enumerate(obs_leaves)),
                  *((f"reset_observ:{i}", *leaf) for i, leaf in enumerate(obs_leaves)),
                  ("action_bytes", (math.prod(self._act_shape) * ACTION_ITEMSIZE,), np.uint8),
                  ("reward", (num_envs,), np.float64),
                  ("terminated", (num_envs,), np.bool_),
                  ("truncated", (num_envs,), np.bool_),
                  ("autoreset", (num_envs,), np.uint8)]
        offset = 0
        self._layout = []
        for name, shape, dtype in fields:
            offset = -(-offset // 64) * 64  # cache-line aligned
            self._layout.append((name, shape, np.dtype(dtype), offset))
            offset += math.prod(shape) * np.dtype(dtype).itemsize
        self.size = max(offset, 1)
        self.attach(bytearray(self.size) if buffer is None else buffer)

    @staticmethod
    def fits(space: Any, parts: bool = False) -> bool:
        """Whether ``space``'s values fit in a buffer: a fixed shape and a numeric dtype (with
        ``parts``, as observations may: every part of a ``Dict`` or ``Tuple`` space)."""
        if parts and is_nested_space(space):
            return all(StepArrays.fits(leaf) for _, leaf in leaf_spaces(space))
        dtype = getattr(space, "dtype", None)
        return (isinstance(getattr(space, "shape", None), tuple) and dtype is not None
                and np.dtype(dtype).kind in "biuf")

    def attach(self, buffer: Any) -> None:
        """View ``buffer`` (at least ``size`` bytes) as the arrays."""
        views = {name: np.ndarray(shape, dtype, buffer=buffer, offset=offset)
                 for name, shape, dtype, offset in self._layout}
        for name in ("observ", "reset_observ"):
            count = iter(range(len(views)))
            views[name] = build(self._obs_space, lambda _: views.pop(f"{name}:{next(count)}"))
        for name, view in views.items():
            setattr(self, name, view)

    def actions(self, dtype: np.dtype) -> np.ndarray:
        """The action storage viewed as ``(num_envs, *act_shape)`` of ``dtype``."""
        count = math.prod(self._act_shape)
        return self.action_bytes[:count * dtype.itemsize].view(dtype).reshape(self._act_shape)

    def detach(self) -> None:
        """Drop the views (so that shared memory can be closed)."""
        for name, *_ in getattr(self, "_layout", ()):
            setattr(self, name.split(":")[0], None)

    def carry(self, answer: tuple) -> tuple:
        """The env host's ``answer`` to a step or reset, with the arrays' contents added
        (``("ok", (value, arrays))``) when they are not shared; else ``answer`` itself."""
        if self.shared or answer[0] != "ok":
            return answer
        return ("ok", (answer[1], tuple(getattr(self, name) for name in self.CARRIED)))

    def take(self, value: Any) -> Any:
        """The value of an answer ``carry`` made, its arrays put in place of these."""
        if self.shared:
            return value
        value, arrays = value
        for name, array in zip(self.CARRIED, arrays):
            setattr(self, name, array)
        return value


def _reduce_scalar(kind: type, value: np.generic) -> tuple:
    return kind, (value.item(),)


# Numpy scalars pickled as ``type(python_value)``: faster than numpy's own
# reduction for info dicts full of them, and the same objects after unpickling.
_REDUCERS = copyreg.dispatch_table | {
    kind: functools.partial(_reduce_scalar, kind)
    for kind in (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
                 np.uint64, np.uint32, np.uint16, np.uint8, np.bool_)}


def pack(obj: Any) -> bytes:
    """``pickle.dumps(obj)``, faster for info dicts full of numpy scalars."""
    file = io.BytesIO()
    pickler = pickle.Pickler(file, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REDUCERS
    pickler.dump(obj)
    return file.getvalue()


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``, else (as Gymnasium's vector envs look it up) a wrapped env's."""
    try:
        return getattr(obj, name)
    except AttributeError as missing:
        try:
            return obj.get_wrapper_attr(name)
        except AttributeError:
            raise missing from None


def resolve(obj: Any, dotted: str) -> Any:
    """``obj.a.b.c`` for ``dotted == "a.b.c"``; on a Gymnasium env each name may
    also be an attribute of an env it wraps (``get_wrapper_attr``)."""
    return functools.reduce(_attribute, dotted.split("."), obj)


def error_answer(exc: BaseException, env_index: int | None = None) -> tuple:
    """The ``("error", ...)`` answer for ``exc``, raised where the envs live."""
    return ("error", (type(exc).__name__, str(exc), traceback.format_exc(), env_index))


def attribute_answer(env: Any, name: str) -> tuple:
    """The answer to a ``getattr`` request: a copy of the value, or ``("proxy",
    (type name, callable))`` for methods, envs and unpicklable values (a copy would
    detach from the live env)."""
    import gymnasium as gym
    value = resolve(env, name)
    proxy = ("proxy", (type(value).__name__, callable(value)))
    if isinstance(value, gym.Env) or (callable(value) and not isinstance(value, gym.Space)):
        return proxy
    try:
        pickle.dumps(value)
    except Exception:  # not picklable: hand out a proxy
        return proxy
    return ("ok", value)


_NONE = object()  # (no prefetched reset: None is a valid info)


class EnvHost:
    """A worker's envs, where they live. ``prefetch_reset``: reset an env as soon
    as its episode ends; ``send_infos``: answer the info dicts (pickled with
    ``pack``; else the parent sees empty dicts)."""

    def __init__(self, prefetch_reset: bool, send_infos: bool):
        self.prefetch_reset = prefetch_reset
        self.send_infos = send_infos
        self.envs: list[Any] = []
        # Envs reset by prefetch and neither stepped nor reset since: their reset infos (the
        # observations wait in the arrays' reset_observ). A step with autoreset uses that reset.
        self._fresh: dict[int, Any] = {}

    def build(self, constructors: Sequence[Callable[[], Any]]) -> tuple:
        """Build the envs; answers ``[(observation_space, action_space)]``,
        one pair per env, or the first constructor's error."""
        for index, constructor in enumerate(constructors):
            try:
                self.envs.append(constructor())
            except Exception as exc:
                return error_answer(exc, index)
        return ("ok", [(env.observation_space, env.action_space) for env in self.envs])

    def step(self, actions: np.ndarray, arrays: StepArrays, autoreset: Any = None) -> tuple:
        """Step env ``i`` with ``actions[i]`` into ``arrays``, or reset it (no seed or options:
        zero reward, false flags) if ``autoreset[i]`` (with its prefetched reset, unless
        ``RESET_AGAIN``); answers ``(infos, resets)``: the infos
        as an ``info_columns`` payload or a pickled list (``None`` when infos are off) and
        ``(index, pickled info)`` of the envs reset after their episode ended (first
        observations in ``arrays.reset_observ``). An env that raises does not stop the
        others; the first error is the answer."""
        # A copy: the parent may write the next actions meanwhile (after a
        # timeout), and Ray hands over read-only views.
        actions = np.array(actions)
        autoreset = None if autoreset is None or not autoreset.any() else np.array(autoreset)
        send_infos = self.send_infos
        infos, resets, error = [], [], None
        for index, env in enumerate(self.envs):
            try:
                fresh = self._fresh.pop(index, _NONE)
                if autoreset is not None and autoreset[index]:
                    obs, info = ((take(arrays.reset_observ, index), fresh)
                                 if fresh is not _NONE and autoreset[index] != RESET_AGAIN
                                 else env.reset())
                    reward, term, trunc = 0.0, False, False
                else:
                    obs, reward, term, trunc, info = env.step(actions[index])
                put(arrays.observ, index, obs)
                arrays.reward[index] = reward
                arrays.terminated[index] = term
                arrays.truncated[index] = trunc
                if send_infos:
                    infos.append(info)
                if self.prefetch_reset and (term or trunc):
                    reset_obs, reset_info = env.reset()
                    put(arrays.reset_observ, index, reset_obs)
                    resets.append((index, pack(reset_info) if send_infos else None))
                    self._fresh[index] = reset_info
            except Exception as exc:
                error = error or error_answer(exc, index)
                infos.append({})
        if error is not None:
            return error
        # Dicts stay pickled until the parent reads them (most loops never do); columns
        # cost little to unpickle.
        if send_infos:
            try:
                infos = info_columns(infos) or pack(infos)
            except Exception as exc:  # (an info that cannot be pickled: the env's fault)
                return error_answer(exc)
        return ("ok", (infos if send_infos else None, resets))

    def reset(self, indices: Sequence[int], seeds: Sequence[int | None],
              options: dict | None, arrays: StepArrays) -> tuple:
        """Reset the envs at ``indices`` into ``arrays.reset_observ[index]``;
        answers their info dicts."""
        infos, index = [], None
        try:
            for index, seed in zip(indices, seeds):
                self._fresh.pop(index, None)
                obs, info = self.envs[index].reset(seed=seed, options=options)
                put(arrays.reset_observ, index, obs)
                infos.append(info)
        except Exception as exc:
            return error_answer(exc, index)
        return ("ok", infos)

    def getattr(self, index: int, name: str) -> tuple:
        """Env ``index``'s attribute ``name``: a copy, or a proxy marker."""
        try:
            return attribute_answer(self.envs[index], name)
        except Exception as exc:
            return error_answer(exc, index)

    def call(self, index: int, name: str, args: tuple, kwargs: dict) -> tuple:
        """Call env ``index``'s method ``name``."""
        try:
            return ("ok", resolve(self.envs[index], name)(*args, **kwargs))
        except Exception as exc:
            return error_answer(exc, index)

    def close(self) -> None:
        """Close the envs; errors of their ``close`` are ignored."""
        for env in self.envs:
            with contextlib.suppress(Exception):  # closing what may be broken
                env.close()
        self.envs = []
