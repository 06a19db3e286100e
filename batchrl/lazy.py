"""Names of a package that import their module on first use (PEP 562), so that importing
the package does not import torch: env worker processes import batchrl too, and torch
would add seconds to their start and memory to each."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: dict[str, Any], names: dict[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``package``:
    ``names`` maps each lazy name to the module that defines it."""

    def getattr_(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        package[name] = value  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(package) | set(names))

    return getattr_, dir_
