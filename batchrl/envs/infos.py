"""The info dicts of a batch step, unpickled only when someone reads them."""

from __future__ import annotations

import collections.abc
import pickle
from typing import Any, Sequence


class InfoList(collections.abc.Sequence):
    """A read-only list of info dicts (``len``, indexing, iteration, ``==``
    with a list), built from ``(count, part)`` pairs: a part is a list of
    dicts, the pickled list, or ``None`` for ``count`` empty dicts."""

    def __init__(self, parts: Sequence[tuple[int, Any]]):
        self._parts = list(parts)
        self._length = sum(count for count, _ in self._parts)
        self._items: list[dict] | None = None

    def _load(self) -> list[dict]:
        if self._items is None:
            items: list[dict] = []
            for count, part in self._parts:
                if part is None:
                    items.extend({} for _ in range(count))
                elif isinstance(part, bytes):
                    items.extend(pickle.loads(part))
                else:
                    items.extend(part)
            self._items = items
            self._parts = []
        return self._items

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - list semantics
        return self._load()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, InfoList)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._load())

    @classmethod
    def join(cls, lists: Sequence[Any]) -> "InfoList":
        """One ``InfoList`` of several (or of plain lists), without unpickling."""
        parts: list[tuple[int, Any]] = []
        for infos in lists:
            if isinstance(infos, InfoList) and infos._items is None:
                parts.extend(infos._parts)
            else:
                parts.append((len(infos), list(infos)))
        return cls(parts)
