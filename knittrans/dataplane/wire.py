"""Compact wire forms of the put path's lists (payloads to a unit, put records back and on to the controller).

Why: a put of a batch's completing trajectories is a list of small frozen dataclasses per trajectory (a
``PutRecord`` with its ``FieldMeta``s and ``Trajectory`` metadata; a ``TrajectoryPayload``), and Ray pickles each
instance through cloudpickle's per-object reducer: ~6.5 ms per 128 records per hop on these machines, and a put's
records cross two hops (unit -> producer -> controller). As rows of plain tuples, one class reference per list,
the same list pickles ~10x faster, and the multimodal raw transfer's critical path (t0 -> the first admission)
shrinks with it (``docs/experiments.md``).

A ``WireList`` wraps the list; its ``__reduce__`` sends the columns and rebuilds the same objects on the other
side (``==`` to the originals). Fields holding a dataclass, or a tuple of dataclasses, of one class are sent as
value tuples; anything else (arrays, dicts, tensors, strings) travels as it is. A list that does not fit (mixed
classes, deeper nesting) is sent as the plain list: the form only ever changes speed, never content.

    >>> from knittrans.dataplane.types import FieldMeta, PutRecord
    >>> import pickle
    >>> recs = [PutRecord(i, "u0", (FieldMeta("input_ids", 8 * i, i),), i) for i in range(3)]
    >>> pickle.loads(pickle.dumps(WireList(recs))).items == recs
    True
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from operator import attrgetter
from typing import Any, Sequence

import numpy as np

_RAW, _DC, _TDC, _ARRS = 0, 1, 2, 3
"""A field's values travel as they are / as a dataclass's values / a tuple of dataclasses' / (dicts of numpy arrays
with the same keys in every row) one concatenated array per key with its row lengths."""


@lru_cache(maxsize=None)
def _names(cls: type) -> tuple[str, ...]:
    """``cls``'s fields in ``__init__`` order, or () if it has a field its ``__init__`` does not take."""
    fs = dataclasses.fields(cls)
    return () if any(not f.init for f in fs) else tuple(f.name for f in fs)


@lru_cache(maxsize=None)
def _dc_type(t: type) -> bool:
    return dataclasses.is_dataclass(t) and bool(_names(t))


def _getter(cls: type):  # noqa: ANN202 - instance -> tuple of its field values
    names = _names(cls)
    g = attrgetter(*names)
    return g if len(names) > 1 else (lambda o: (g(o),))


def _kind(values: Sequence[object]) -> tuple[int, type | None] | None:
    """How a field's values travel: as they are, or as value tuples of one dataclass (None: mixed, send the plain
    list). An empty tuple fits either. Values nested deeper travel as they are (pickled as usual)."""
    types = set(map(type, values))
    types.discard(type(None))
    dcs = [t for t in types if _dc_type(t)]
    if dcs:
        return (_DC, dcs[0]) if len(types) == 1 else None
    if tuple not in types:
        return _RAW, None
    inner = {type(x) for v in values if type(v) is tuple for x in v}
    dcs = [t for t in inner if _dc_type(t)]
    if not dcs:
        return _RAW, None
    return (_TDC, dcs[0]) if len(inner) == 1 and types == {tuple} else None


def _array_columns(col: Sequence[object]) -> tuple | None:
    """Dicts of numpy arrays (ndim >= 1, one dtype and trailing shape per key, the same keys in every row) as one
    array per key plus its row lengths; None if the column is anything else (it then travels as it is). Each
    small array would otherwise be its own out-of-band buffer in Ray's pickle."""
    first = col[0]
    if type(first) is not dict or not first:
        return None
    keys = tuple(first)
    out = []
    for k in keys:
        arrs = []
        for d in col:
            if type(d) is not dict or len(d) != len(keys):
                return None
            a = d.get(k)
            if type(a) is not np.ndarray or a.ndim == 0:
                return None
            arrs.append(a)
        a0 = arrs[0]
        if any(a.dtype != a0.dtype or a.shape[1:] != a0.shape[1:] for a in arrs):
            return None
        out.append((np.concatenate(arrs), np.fromiter((a.shape[0] for a in arrs), np.int64, len(arrs))))
    return keys, tuple(out)


def _split_columns(keys: tuple, cols: tuple) -> list[dict]:
    parts = []
    for values, lengths in cols:
        bounds = np.cumsum(lengths)[:-1]
        parts.append(np.split(values, bounds))
    return [dict(zip(keys, row)) for row in zip(*parts)]


def to_wire(items: Sequence[Any]) -> tuple:
    items = list(items)
    if not items:
        return (None, items)
    cls = type(items[0])
    if not _dc_type(cls) or any(type(x) is not cls for x in items):
        return (None, items)
    cols = list(zip(*map(_getter(cls), items)))
    kinds, out_cols = [], []
    for col in cols:
        k = _kind(col)
        if k is None:
            return (None, items)
        if k[0] is _RAW:
            arrs = _array_columns(col)
            if arrs is not None:
                kinds.append((_ARRS, None))
                out_cols.append(arrs)
                continue
        kinds.append(k)
        if k[0] is _RAW:
            out_cols.append(col)
        elif k[0] is _DC:
            g = _getter(k[1])
            out_cols.append(tuple(None if v is None else g(v) for v in col))
        else:
            g = _getter(k[1])
            out_cols.append(tuple(None if v is None else tuple(map(g, v)) for v in col))
    return (cls, tuple(kinds), tuple(out_cols))


def _builder(cls: type):  # noqa: ANN202 - rows of field values -> instances
    """Rebuild instances without ``__init__``: they were valid objects when they were sent (their checks ran
    there), so only the field values are set (a frozen dataclass's ``__init__`` costs ~5 us per object)."""
    names = _names(cls)
    new = object.__new__
    if "__dict__" in dir(cls) and not hasattr(cls, "__slots__"):
        def build(row: tuple) -> object:
            o = new(cls)
            o.__dict__.update(zip(names, row))
            return o
    else:
        setattr_ = object.__setattr__

        def build(row: tuple) -> object:
            o = new(cls)
            for n, v in zip(names, row):
                setattr_(o, n, v)
            return o
    return build


def from_wire(wire: tuple) -> list:
    cls = wire[0]
    if cls is None:
        return list(wire[1])
    kinds, cols = wire[1], wire[2]
    dec = []
    for (k, c), col in zip(kinds, cols):
        if k is _RAW:
            dec.append(col)
            continue
        if k is _ARRS:
            dec.append(_split_columns(*col))
            continue
        b = _builder(c)
        if k is _DC:
            dec.append([None if v is None else b(v) for v in col])
        else:
            dec.append([None if v is None else tuple(b(x) for x in v) for v in col])
    build = _builder(cls)
    return [build(row) for row in zip(*dec)]


def split_arrays(wire: tuple) -> tuple[tuple, tuple[np.ndarray, ...]]:
    """``wire`` (``to_wire``'s form) with the values of its array columns taken out (``None`` in their place),
    and those arrays in order: the Ray put path ships the arrays as one object in the store and the rest as the
    call's argument (``ray_transport.RayUnitProxy.put``). ``join_arrays`` puts them back."""
    if wire[0] is None:
        return wire, ()
    arrays: list[np.ndarray] = []
    cols = list(wire[2])
    for i, (k, _) in enumerate(wire[1]):
        if k is _ARRS:
            keys, pairs = cols[i]
            arrays += [values for values, _ in pairs]
            cols[i] = (keys, tuple((None, lengths) for _, lengths in pairs))
    return (wire[0], wire[1], tuple(cols)), tuple(arrays)


def join_arrays(wire: tuple, arrays: Sequence[np.ndarray]) -> tuple:
    """The inverse of ``split_arrays``: ``arrays`` back into the array columns of ``wire``, in order."""
    if wire[0] is None:
        return wire
    it = iter(arrays)
    cols = list(wire[2])
    for i, (k, _) in enumerate(wire[1]):
        if k is _ARRS:
            keys, pairs = cols[i]
            cols[i] = (keys, tuple((next(it), lengths) for _, lengths in pairs))
    if next(it, None) is not None:
        raise ValueError("join_arrays: more arrays than the wire form's array columns hold")
    return wire[0], wire[1], tuple(cols)


def array_layout(wire: tuple, attr: str) -> tuple[tuple[str, ...], int, tuple[np.ndarray, ...]] | None:
    """Where attribute ``attr`` (a dict of arrays per item, e.g. a payload's ``tensors``) lies in the arrays
    ``split_arrays`` takes out: its keys, the index of the first key's array, and each key's row offsets (item i's
    value of key ``keys[j]`` is ``arrays[first + j][offsets[j][i]:offsets[j][i + 1]]``). None when ``attr`` did not
    travel as an array column."""
    if wire[0] is None:
        return None
    first = 0
    for name, (k, _), col in zip(_names(wire[0]), wire[1], wire[2]):
        if k is not _ARRS:
            continue
        if name == attr:
            offsets = []
            for _, lengths in col[1]:
                off = np.zeros(len(lengths) + 1, dtype=np.int64)
                np.cumsum(lengths, out=off[1:])
                offsets.append(off)
            return col[0], first, tuple(offsets)
        first += len(col[0])
    return None


class WireList:
    """A list that pickles in its compact wire form (see the module doc); ``items`` is the list."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __reduce__(self):  # noqa: ANN204
        return (_rebuild, (to_wire(self.items),))


def _rebuild(wire: tuple) -> WireList:
    return WireList(from_wire(wire))


def unwrap(x: Any) -> list:
    """The list inside a ``WireList`` (a plain sequence is returned as a list)."""
    return x.items if isinstance(x, WireList) else list(x)
