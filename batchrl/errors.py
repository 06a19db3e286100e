"""Errors shared by the env layer and the algorithms, which import nothing of each other."""

from __future__ import annotations


class UnsupportedSpaceError(TypeError):
    """An observation or action space that cannot be batched or learned from."""
