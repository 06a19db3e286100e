"""Catch env workers started from the top level of an unguarded main script.

Worker processes are started with ``forkserver`` (or ``spawn``), and each
imports the user's main script again before it runs. Code at the top level
of that script runs again in every worker; if it starts workers itself, each
child fails while bootstrapping and prints a page of tracebacks. So the
parent checks, before it starts a worker, that the code starting it at the
top level of ``__main__`` sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

from batchrl.envs.errors import UnguardedMainError


def check_main_guard() -> None:
    """Raise ``UnguardedMainError`` if the caller runs at the top level of
    the main script, outside ``if __name__ == "__main__":``. Does nothing in
    an interactive session, a notebook or ``python -c`` (no script file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            if not _guarded(path, frame.f_lineno):
                raise UnguardedMainError(
                    f"{path}, line {frame.f_lineno}, starts env worker processes at the "
                    f"top level of the script. Each worker imports the script again and "
                    f"would run that line too: put the code that builds envs (and heavy "
                    f"imports such as torch) under  if __name__ == \"__main__\":")
            return
        frame = frame.f_back


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
                 if isinstance(node, ast.If) and _is_main_test(node.test))


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    values = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def _guarded(path: str, line: int) -> bool:
    return any(start <= line <= end for start, end in _guarded_ranges(path))
