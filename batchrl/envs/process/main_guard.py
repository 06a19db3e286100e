"""Catch env workers started from the top level of an unguarded main script: each worker
process (``forkserver`` or ``spawn``) imports the script again, and if its top level starts
workers, every child fails while bootstrapping with a page of tracebacks."""

from __future__ import annotations

import ast
import functools
import inspect
import sys

from batchrl.envs.errors import UnguardedMainError

_MAIN_TESTS = ("__name__ == '__main__'", "'__main__' == __name__")


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
            line = frame.f_lineno
            if not any(start <= line <= end for start, end in _guarded_ranges(path)):
                raise UnguardedMainError(
                    f"{path}, line {line}, starts env worker processes at the "
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
                 if isinstance(node, ast.If) and ast.unparse(node.test) in _MAIN_TESTS)
