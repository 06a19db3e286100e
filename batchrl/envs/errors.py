"""Errors raised by the environment layer; each names the env it came from."""

from __future__ import annotations

import signal

from batchrl.errors import UnsupportedSpaceError  # noqa: F401 - the env layer's too


class EnvError(RuntimeError):
    """A failure of an environment, local or in a worker process.

    Attributes:
      label: the env's name (constructor or Gymnasium id).
      env_index: index in the enclosing ``BatchEnv``, or ``None``.
      env_indices: the ``BatchEnv`` indices of a worker's envs that failed together, or ``None``.
      together: what those envs failed together in (a worker process, a vector env).
      operation: what was being done (``"step"``, ``"reset"``, ``"construct"``...).
    """

    def __init__(self, label: str, operation: str, detail: str):
        super().__init__(detail)
        self.label = label
        self.operation = operation
        self.detail = detail
        self.env_index: int | None = None
        self.env_indices: range | None = None
        self.together = "one worker process"  # what env_indices failed together in

    def __reduce__(self) -> tuple:
        # Pickled whole (to the driver from a Ray actor, for one): the subclasses' __init__
        # take other arguments than the message that ``args`` holds.
        return _unpickled, (type(self), self.args), self.__dict__

    def __str__(self) -> str:
        if self.env_index is not None:
            where = f"env {self.env_index} ({self.label})"
        elif self.env_indices:
            where = (f"envs {self.env_indices.start}-{self.env_indices.stop - 1} "
                     f"({self.label}, {self.together})")
        else:
            where = self.label
        return f"{where} failed in {self.operation}(): {self.detail}"


def _unpickled(cls: type[EnvError], args: tuple) -> EnvError:
    """An ``EnvError`` of class ``cls`` without its ``__init__``: ``__reduce__``'s state
    (its ``__dict__``) is set next."""
    error = cls.__new__(cls)
    error.args = args
    return error


class EnvRaisedError(EnvError):
    """The env raised an exception: ``remote_type`` (its type name),
    ``remote_message`` and ``remote_traceback`` (formatted where it was raised: ``where``,
    the env worker or this process)."""

    def __init__(self, label: str, operation: str, remote_type: str,
                 remote_message: str, remote_traceback: str, where: str = "the env worker"):
        detail = (f"{remote_type}: {remote_message}\n\n"
                  f"Traceback in {where}:\n{remote_traceback.rstrip()}")
        super().__init__(label, operation, detail)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


class EnvAttributeError(EnvRaisedError, AttributeError):
    """The env in the worker has no such attribute (also an ``AttributeError``,
    so ``hasattr`` and ``getattr(..., default)`` work on remote envs)."""


class EnvCrashedError(EnvError):
    """The worker process died (killed by a signal, crashed, or exited);
    ``exitcode`` follows ``multiprocessing`` (negative: a signal number)."""

    def __init__(self, label: str, operation: str, exitcode: int | None, pid: int | None):
        if exitcode is None:
            how = "closed its connection"
        elif exitcode < 0:
            try:
                how = f"was killed by signal {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(label, operation, f"the env worker process (pid {pid}) {how}")
        self.exitcode = exitcode
        self.pid = pid


class EnvTimeoutError(EnvError):
    """The worker did not answer within the configured timeout. The request goes on in the
    worker, whose late answer is dropped: its envs are then a step (or reset) ahead of what
    the caller saw, and an episode may have ended unseen. Restart the worker (as ``BatchEnv``
    does with ``max_restarts``) or reset its envs before relying on them."""


class EnvNonFiniteError(EnvError):
    """An env returned a NaN or infinite ``what`` (``"observation"`` or
    ``"reward"``) at ``episode_step`` of its episode (0: ``reset``, 1: first ``step``)."""

    def __init__(self, label: str, operation: str, what: str, episode_step: int):
        where = (f"at step {episode_step} of its episode" if episode_step
                 else "as its first observation")
        super().__init__(label, operation,
                         f"returned a NaN or infinite {what} {where}; batchrl never "
                         f"trains on non-finite data")
        self.what = what
        self.episode_step = episode_step


class RayWorkerCrashedError(EnvCrashedError):
    """The Ray actor hosting the env worker died, or its node was lost:
    ``node`` (IP address or node id, when known), ``reason`` (Ray's first line)."""

    def __init__(self, label: str, operation: str, node: str | None, reason: str):
        # Not EnvCrashedError.__init__: there is no local process, exit code or pid.
        where = f" on node {node}" if node else ""
        EnvError.__init__(self, label, operation,
                          f"the Ray actor hosting the env worker{where} died or became "
                          f"unreachable: {reason}")
        self.exitcode = None
        self.pid = None
        self.node = node
        self.reason = reason


class EnvSpecError(ValueError):
    """The env named in a config cannot be found or built, or its backend (Ray) is unavailable."""


class UnguardedMainError(RuntimeError):
    """Env worker processes started outside ``if __name__ == "__main__":`` of the main script."""


class SpaceMismatchError(ValueError):
    """The envs of one batch have different observation or action spaces."""


def error_from_answer(label: str, operation: str, value: tuple) -> EnvRaisedError:
    """The exception for an env host's ``(type_name, message, traceback,
    env_index)`` error answer: ``EnvAttributeError`` for an ``AttributeError``,
    else ``EnvRaisedError``, with ``worker_env_index``."""
    remote_type, text, tb, env_index = value
    cls = EnvAttributeError if remote_type == "AttributeError" else EnvRaisedError
    error = cls(label, operation, remote_type, text, tb)
    error.worker_env_index = env_index
    return error
