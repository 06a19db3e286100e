"""Env workers and the main script: each worker process (``forkserver`` or ``spawn``)
imports the main script again, so workers started from its unguarded top level would start
workers themselves while bootstrapping, and fail with a page of tracebacks; a main script
without a file (``python - <<EOF``) cannot be imported again at all."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import os
import sys
import threading
from multiprocessing import process as mp_process
from typing import Any, Iterator

from batchrl.envs.errors import UnguardedMainError

_MAIN_TESTS = ("__name__ == '__main__'", "'__main__' == __name__")
_HIDING = threading.Lock()


def check_main_guard() -> None:
    """Raise ``UnguardedMainError`` if the caller runs at the top level of
    the main script, outside ``if __name__ == "__main__":``. Does nothing in
    an interactive session, a notebook, ``python -c`` or a script read from
    stdin (no script file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
            if not any(start <= line <= end for start, end in _guarded_ranges(path)):
                error = UnguardedMainError(
                    f"{path}, line {line}: start env workers under "
                    f"if __name__ == \"__main__\": (each worker process imports the script "
                    f"again and would run this line too)")
                _print_without_traceback(error)
                raise error
            return
        frame = frame.f_back


def _print_without_traceback(error: UnguardedMainError) -> None:
    """If ``error`` ends the script, Python prints it alone: the frames inside batchrl
    say nothing, and the message names the script's line. Any other uncaught exception
    is printed as before."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is error:
            print(f"{kind.__name__}: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = hook


@contextlib.contextmanager
def main_not_reimported() -> Iterator[None]:
    """Around starting a worker process: when the main script has no file the worker could
    run again (``python - <<EOF`` names it ``<stdin>``; ``python <(...)`` a pipe),
    ``__main__.__file__`` is hidden from multiprocessing, which then does not make the
    worker import it (that would fail with ``FileNotFoundError``). The worker's envs
    reach it pickled by value (cloudpickle), so it needs nothing from the script."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (not path or getattr(main, "__spec__", None) is not None
            or os.path.isfile(os.path.join(mp_process.ORIGINAL_DIR or os.getcwd(), path))):
        yield
        return
    with _HIDING:
        del main.__file__  # type: ignore[union-attr]
        try:
            yield
        finally:
            main.__file__ = path  # type: ignore[union-attr]


@functools.lru_cache(maxsize=8)
def _guarded_ranges(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of the top-level ``if __name__ == "__main__":`` blocks;
    everything counts as guarded when the file cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
    except (OSError, SyntaxError, ValueError):
        return ((0, sys.maxsize),)
    return tuple((node.lineno, node.end_lineno or node.lineno) for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) in _MAIN_TESTS)
