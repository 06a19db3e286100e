"""The info dicts of a batch step, unpickled only when someone reads them.

A worker sends its envs' infos pickled, as a list of dicts or, when every env
has the same keys with numbers of one type per key (most tasks' step infos),
as ``info_columns``: one record array, cheaper to pickle, to send and to stack
into Gymnasium's dict of arrays (``InfoList.columns``)."""

from __future__ import annotations

import collections.abc
import pickle
from typing import Any, Sequence

import numpy as np

# Info values that ``info_columns`` keeps in arrays: the types Gymnasium's
# ``VectorEnv._add_info`` gathers into typed arrays (numpy bools it does not).
_NUMBER_TYPES = (int, float, bool)
_dtypes: dict[tuple, np.dtype] = {}


def _record_dtype(keys: tuple, kinds: tuple) -> np.dtype:
    dtype = _dtypes.get((keys, kinds))
    if dtype is None:
        dtype = _dtypes[(keys, kinds)] = np.dtype(list(zip(keys, kinds)))
    return dtype


def info_columns(infos: Sequence[dict]) -> tuple | None:
    """``(keys, kinds, bytes)``: the infos as one record array (a field per key, of the
    values' type), if every info has the same string keys in the same order and each key's
    values share one number type; else ``None``."""
    if not infos or len(set(map(tuple, infos))) != 1:
        return None
    keys = tuple(infos[0])
    if not keys or not all(isinstance(key, str) and key for key in keys):
        return None
    rows = list(map(tuple, map(dict.values, infos)))
    kinds = tuple(map(type, rows[0]))
    for kind, column in zip(kinds, zip(*rows)):
        if not (kind in _NUMBER_TYPES or issubclass(kind, np.number)) or len(
                set(map(type, column))) != 1:
            return None
    try:
        return keys, kinds, np.array(rows, _record_dtype(keys, kinds)).tobytes()
    except (OverflowError, ValueError, TypeError):  # e.g. an int beyond int64
        return None


def _records(payload: tuple) -> np.ndarray:
    keys, kinds, data = payload
    return np.frombuffer(data, _record_dtype(keys, kinds))


def _dicts(payload: tuple) -> list[dict]:
    """The info dicts of an ``info_columns`` payload, with values of their original types."""
    keys, kinds, _ = payload
    records = _records(payload)
    columns = [records[key].tolist() if kind in _NUMBER_TYPES else list(records[key])
               for key, kind in zip(keys, kinds)]
    return [dict(zip(keys, values)) for values in zip(*columns)]


class InfoList(collections.abc.Sequence):
    """A read-only list of info dicts (``len``, indexing, iteration, ``==``
    with a list), built from ``(count, part)`` pairs: a part is a list of
    dicts, the pickled list or ``info_columns`` payload, or ``None`` for
    ``count`` empty dicts."""

    def __init__(self, parts: Sequence[tuple[int, Any]]):
        self._parts = list(parts)
        self._length = sum(count for count, _ in self._parts)
        self._items: list[dict] | None = None

    def _unpickle(self) -> None:
        self._parts = [(count, pickle.loads(part) if isinstance(part, bytes) else part)
                       for count, part in self._parts]

    def _load(self) -> list[dict]:
        if self._items is None:
            self._unpickle()
            items: list[dict] = []
            for count, part in self._parts:
                if part is None:
                    items.extend({} for _ in range(count))
                elif isinstance(part, tuple):
                    items.extend(_dicts(part))
                else:
                    items.extend(part)
            self._items = items
            self._parts = []
        return self._items

    def columns(self) -> dict[str, np.ndarray] | None:
        """Gymnasium's dict of arrays with ``_key`` masks (as ``SyncVectorEnv`` builds it),
        made without the dicts when every part arrived as ``info_columns`` with the same keys
        and types; else ``None``."""
        if self._items is not None or not self._parts:
            return None
        self._unpickle()
        if all(part is None for _, part in self._parts):
            return {}
        payloads = [part if isinstance(part, tuple) else info_columns(part or [])
                    for _, part in self._parts]
        if None in payloads or len({part[:2] for part in payloads}) != 1:
            return None
        keys, kinds, _ = payloads[0]
        merged = _records((keys, kinds, b"".join(part[2] for part in payloads)))
        mask = np.ones(self._length, bool)
        stacked: dict[str, np.ndarray] = {}
        for key in keys:
            stacked[key] = merged[key].copy()
            stacked["_" + key] = mask.copy()
        return stacked

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - list semantics
        return self._load()[index]

    def __iter__(self):  # noqa: ANN204 - faster than Sequence's, one __getitem__ per item
        return iter(self._load())

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
