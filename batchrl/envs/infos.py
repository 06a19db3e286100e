"""The info dicts of a batch step, unpickled only when someone reads them.

A worker sends its envs' infos as a pickled list of dicts or, when every env
has the same keys with numbers of one type per key (most tasks' step infos),
as ``info_columns``: one record array, cheap to send, to unpickle and to stack
into Gymnasium's dict of arrays (``InfoList.columns``). A vector env in this process
gives its dict of arrays as it is (``InfoColumns``), split into dicts only when read."""

from __future__ import annotations

import collections.abc
import pickle
from typing import Any, Sequence

import numpy as np

# Info values that ``info_columns`` keeps in arrays: the types Gymnasium's
# ``VectorEnv._add_info`` gathers into typed arrays (numpy bools it does not).
_NUMBER_TYPES = {int: "int", float: "float", bool: "bool"}
# A payload names each column's type by a code (a type would cost a module lookup
# per column to unpickle): a Python number type's name, or a numpy type's dtype string.
_kind_types: dict[str, type] = {name: kind for kind, name in _NUMBER_TYPES.items()}
_dtypes: dict[tuple, np.dtype] = {}


def _kind_type(code: str) -> type:
    kind = _kind_types.get(code)
    if kind is None:
        kind = _kind_types[code] = np.dtype(code).type
    return kind


def _record_dtype(keys: tuple, codes: tuple) -> np.dtype:
    dtype = _dtypes.get((keys, codes))
    if dtype is None:
        dtype = _dtypes[(keys, codes)] = np.dtype(
            [(key, _kind_type(code)) for key, code in zip(keys, codes)])
    return dtype


def info_columns(infos: Sequence[dict]) -> tuple | None:
    """``(keys, codes, bytes)``: the infos as one record array (a field per key, of the
    values' type, named by a code), if every info has the same string keys in the same
    order and each key's values share one number type; else ``None``."""
    if not infos or len(set(map(tuple, infos))) != 1:
        return None
    keys = tuple(infos[0])
    if not keys or not all(isinstance(key, str) and key for key in keys):
        return None
    rows = list(map(tuple, map(dict.values, infos)))
    codes = []
    for column in zip(*rows):
        kinds = set(map(type, column))
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        if kind in _NUMBER_TYPES:
            codes.append(_NUMBER_TYPES[kind])
        elif issubclass(kind, np.number):
            codes.append(np.dtype(kind).str)
        else:
            return None
    codes = tuple(codes)
    try:
        return keys, codes, np.array(rows, _record_dtype(keys, codes)).tobytes()
    except (OverflowError, ValueError, TypeError):  # e.g. an int beyond int64
        return None


def info_row(columns: dict[str, Any], index: int) -> dict:
    """Env ``index``'s info dict from a vector env's dict of arrays (a key counts where its
    ``_key`` mask is true, or there is none; dicts, such as ``"episode"``, part by part)."""
    row = {}
    for key, value in columns.items():
        mask = columns.get(f"_{key}")
        if key.startswith("_") or (mask is not None and not mask[index]):
            continue
        row[key] = info_row(value, index) if isinstance(value, dict) else value[index]
    return row


class InfoColumns:
    """A vector env's step infos as Gymnasium gives them (a dict of ``(num_envs,)`` arrays,
    ``_key`` masks where a key is not every env's, dicts such as ``"episode"`` nested),
    copied; split into a dict per env only when a row is read."""

    def __init__(self, columns: dict[str, Any]):
        self.columns = _copied(columns)

    def rows(self, count: int) -> list[dict]:
        """One info dict per env, for the first ``count`` envs."""
        return [info_row(self.columns, index) for index in range(count)]

    def gymnasium(self, count: int) -> dict[str, Any]:
        """The dict of arrays with a ``_key`` mask for every key (all true where the vector
        env gave none), as ``SyncVectorEnv`` builds it."""
        return _with_masks(self.columns, count)


def _copied(value: Any) -> Any:
    return ({key: _copied(child) for key, child in value.items()} if isinstance(value, dict)
            else np.array(value, copy=True))


def _with_masks(columns: dict[str, Any], count: int) -> dict[str, Any]:
    stacked = {}
    for key, value in columns.items():
        if not key.startswith("_"):
            stacked[key] = _with_masks(value, count) if isinstance(value, dict) else value
            mask = columns.get(f"_{key}")
            stacked[f"_{key}"] = np.ones(count, bool) if mask is None else mask
    return stacked


def _records(payload: tuple) -> np.ndarray:
    keys, codes, data = payload
    return np.frombuffer(data, _record_dtype(keys, codes))


def _dicts(payload: tuple) -> list[dict]:
    """The info dicts of an ``info_columns`` payload, with values of their original types."""
    keys, codes, _ = payload
    records = _records(payload)
    columns = [records[key].tolist() if _kind_type(code) in _NUMBER_TYPES else list(records[key])
               for key, code in zip(keys, codes)]
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
                elif isinstance(part, InfoColumns):
                    items.extend(part.rows(count))
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
        payloads = [part for _, part in self._parts]
        if len(payloads) == 1 and isinstance(payloads[0], InfoColumns):
            return payloads[0].gymnasium(self._length)  # (one vector env's own)
        if set(map(type, payloads)) != {tuple}:
            self._unpickle()
            payloads = [part for _, part in self._parts]
            if all(part is None for part in payloads):
                return {}
            payloads = [part if type(part) is tuple
                        else info_columns(part.rows(count) if isinstance(part, InfoColumns)
                                          else part or [])
                        for count, part in self._parts]
            if None in payloads:
                return None
        keys, codes, data = payloads[0]
        for part in payloads[1:]:
            if part[0] != keys or part[1] != codes:
                return None
        if len(payloads) > 1:
            data = b"".join([part[2] for part in payloads])
        merged = np.frombuffer(data, _record_dtype(keys, codes))
        masks = np.empty((len(keys), self._length), bool)
        masks.fill(True)
        stacked: dict[str, np.ndarray] = {}
        for key, mask in zip(keys, masks):
            stacked[key] = merged[key].copy()
            stacked["_" + key] = mask
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
