"""A put as columns: the put path without per-trajectory Python.

Why: a put of a batch's completing trajectories carried one ``TrajectoryPayload`` per trajectory to its unit, which
validated each, stored each field, built a ``PutRecord`` with its ``FieldMeta``s per trajectory and sent them
back, and the producer forwarded them to the controller: ~9 ms of Python per 256 trajectories on an idle core,
~3x that while a raw pass's puts, admission and reads share two cores -- CPU the ranks' reads wait for. The common
put -- every trajectory carrying the same ragged fields as numpy arrays, nothing else -- travels instead as
``PutColumns``: trajectory ids, per field every trajectory's rows back to back in one array and their lengths,
and the admission metadata. The unit checks whole columns at once (``check_columns``: dtype and shape once per
field, equal lengths, one finiteness pass per field, token counts) and answers with where it stored them; the
controller takes the same columns (``Controller.register_columns``).

Anything else keeps the per-payload path, unchanged: checksums, fixed-shape fields, tensors that are not numpy
arrays, payload subclasses (multimodal), differing field sets. A column check that fails, a field the unit already
holds (a retried put) or a trajectory the controller must treat specially (a re-put, a repeat) goes the
per-payload way too, which names the offending trajectory and field exactly as before: the fast form only changes
speed, never what is accepted or how it is refused.

    >>> import numpy as np
    >>> from knittrans.dataplane.types import FieldSpec, TrajectoryPayload, TrajectorySchema
    >>> schema = TrajectorySchema((FieldSpec("ids", "int64"),), token_field="ids")
    >>> cols, arrays = columns_of([TrajectoryPayload(t, {"ids": np.arange(t + 1)}) for t in range(3)], schema)
    >>> cols.traj_ids.tolist(), cols.lengths[0].tolist(), arrays[0].tolist(), check_columns(schema, cols, arrays)
    ([0, 1, 2], [1, 2, 3], [0, 0, 1, 0, 1, 2], True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.dataplane.types import FieldMeta, PutRecord, TrajectoryPayload, TrajectorySchema
from knittrans.dataplane.wire import from_wire, to_wire
from knittrans.types import Trajectory


@dataclass(frozen=True)
class PutColumns:
    """A put of ``len(traj_ids)`` trajectories that all carry the fields ``names`` (ragged): ``lengths[j][i]`` rows
    of field ``names[j]`` for trajectory ``traj_ids[i]``, back to back in the put's ``j``-th array (which travels
    apart: ``columns_of``); ``metas[i]`` its admission metadata (None: this put does not complete it; ``metas``
    None: it completes none)."""

    traj_ids: np.ndarray
    names: tuple[str, ...]
    lengths: tuple[np.ndarray, ...]
    metas: tuple[Trajectory | None, ...] | None = None

    def __len__(self) -> int:
        return int(self.traj_ids.shape[0])

    def offsets(self, j: int) -> np.ndarray:
        """Row offsets of field ``names[j]`` (``len + 1``): trajectory ``i``'s rows are ``[off[i], off[i + 1])``."""
        off = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.lengths[j], out=off[1:])
        return off

    def groups(self) -> dict[int, int]:
        """Trajectory -> its metadata's GRPO group, for the trajectories this put completes (groups >= 0)."""
        if self.metas is None:
            return {}
        return {t: m.group_id for t, m in zip(self.traj_ids.tolist(), self.metas) if m is not None and m.group_id >= 0}

    def byte_bounds(self, schema: TrajectorySchema) -> list[list[int]]:
        """Per field (``names`` order), byte offsets into its array (``len + 1``): trajectory ``i``'s bytes of field
        ``j`` are ``[bounds[j][i], bounds[j][i + 1])``."""
        return [(self.offsets(j) * schema.get(n).row_nbytes).tolist() for j, n in enumerate(self.names)]

    def token_lengths(self, schema: TrajectorySchema) -> list[int] | None:
        """Each trajectory's row count of the schema's token field (None: this put does not carry it)."""
        if schema.token_field not in self.names:
            return None
        return self.lengths[self.names.index(schema.token_field)].tolist()

    def __reduce__(self):  # noqa: ANN204 - the metadata as columns of plain values (``wire``), not objects
        metas = None if self.metas is None else to_wire(list(self.metas))
        return (_rebuild, (self.traj_ids, self.names, self.lengths, metas))


def _rebuild(traj_ids: np.ndarray, names: tuple, lengths: tuple, metas: tuple | None) -> PutColumns:
    return PutColumns(traj_ids, names, lengths, None if metas is None else tuple(from_wire(metas)))


def columns_of(payloads: Sequence[TrajectoryPayload],
               schema: TrajectorySchema) -> tuple[PutColumns, tuple[np.ndarray, ...]] | None:
    """``payloads`` as columns and one array per field (each field's rows copied back to back: the put's one
    copy), or None when the put is not of the common form (see the module doc)."""
    if not payloads or type(payloads[0]) is not TrajectoryPayload:
        return None
    names = tuple(payloads[0].tensors)
    if not names:
        return None
    for name in names:
        spec = schema._by_name.get(name)  # noqa: SLF001 - the schema's field index
        if spec is None or not spec.ragged:
            return None
    ids, metas, any_meta = [], [], False
    for p in payloads:
        if type(p) is not TrajectoryPayload or p.checksums is not None or tuple(p.tensors) != names:
            return None
        if type(p.traj_id) is not int or p.traj_id < 0 or (p.meta is not None and type(p.meta) is not Trajectory):
            return None
        ids.append(p.traj_id)
        metas.append(p.meta)
        any_meta = any_meta or p.meta is not None
    arrays, lengths = [], []
    for name in names:
        col = [p.tensors[name] for p in payloads]
        first = col[0]
        if type(first) is not np.ndarray or first.ndim == 0:
            return None
        dt, tail = first.dtype, first.shape[1:]
        for a in col:
            if type(a) is not np.ndarray or a.dtype != dt or a.ndim == 0 or a.shape[1:] != tail:
                return None
        arrays.append(np.concatenate(col))
        lengths.append(np.fromiter((a.shape[0] for a in col), np.int64, len(col)))
    return PutColumns(np.array(ids, dtype=np.int64), names, tuple(lengths),
                      tuple(metas) if any_meta else None), tuple(arrays)


def check_columns(schema: TrajectorySchema, cols: PutColumns, arrays: Sequence[np.ndarray]) -> bool:
    """Whether every trajectory of the put passes ``storage.validate_payload``, checked a column at a time (dtype and
    trailing shape once per field, one finiteness pass per field, same-length groups and token counts as array
    comparisons). False: some trajectory fails (the caller validates payload by payload, which says which) or the
    put is not well formed."""
    n = len(cols)
    ids = cols.traj_ids
    if ids.dtype != np.int64 or ids.ndim != 1 or (n and (ids.min() < 0 or np.unique(ids).shape[0] != n)):
        return False
    if len(cols.names) != len(arrays) or len(cols.lengths) != len(arrays) or len(set(cols.names)) != len(cols.names):
        return False
    for name, a, lens in zip(cols.names, arrays, cols.lengths):
        spec = schema._by_name.get(name)  # noqa: SLF001 - the schema's field index
        if spec is None or not spec.ragged or a.dtype != spec.np_dtype or a.shape[1:] != spec.tail:
            return False
        if lens.shape != (n,) or (n and lens.min() < 0) or int(lens.sum()) != a.shape[0]:
            return False
        if spec.finite and a.dtype.kind == "f" and not np.isfinite(a).all():
            return False
    by_name = dict(zip(cols.names, cols.lengths))
    tok = by_name.get(schema.token_field)
    if tok is not None and n and tok.min() == 0:
        return False
    for group in schema.same_length:
        present = [by_name[g] for g in group if g in by_name]
        if any((p == 0).any() for p in present) or any(not np.array_equal(present[0], p) for p in present[1:]):
            return False
    if cols.metas is not None:
        if len(cols.metas) != n:
            return False
        has = np.array([m is not None for m in cols.metas])
        if not has.any():
            return True
        want = np.array([-1 if m is None else m.num_tokens for m in cols.metas], dtype=np.int64)
        for name in schema.response_fields:
            got = by_name.get(name)
            if got is not None and (got[has] != want[has]).any():
                return False
        if tok is not None and (tok[has] < want[has]).any():
            return False
    return True


def payloads_of(cols: PutColumns, arrays: Sequence[np.ndarray]) -> list[TrajectoryPayload]:
    """The per-payload form of a columnar put (views of ``arrays``): the path a put the columns cannot take goes."""
    offs = [cols.offsets(j) for j in range(len(cols.names))]
    metas = cols.metas or (None,) * len(cols)
    return [TrajectoryPayload(int(t), {name: a[off[i]:off[i + 1]] for name, a, off in zip(cols.names, arrays, offs)},
                              meta=metas[i])
            for i, t in enumerate(cols.traj_ids.tolist())]


def records_of(unit_id: str, cols: PutColumns, source: object, schema: TrajectorySchema) -> list[PutRecord]:
    """The put records of a columnar put its unit stored (every field new there, each a plain run of ``source``'s
    arrays, one per field in ``cols.names`` order; ``source`` None: read through the unit): what the controller
    registers when the put is not the plain case (``Controller.register_columns``)."""
    bounds = cols.byte_bounds(schema)
    lens = [ln.tolist() for ln in cols.lengths]
    tokens = cols.token_lengths(schema)
    metas = cols.metas or (None,) * len(cols)
    out = []
    for i, t in enumerate(cols.traj_ids.tolist()):
        fields = tuple(FieldMeta(n, bounds[j][i + 1] - bounds[j][i], lens[j][i]) for j, n in enumerate(cols.names))
        where = () if source is None else tuple((j, bounds[j][i], bounds[j][i + 1]) for j in range(len(cols.names)))
        out.append(PutRecord(t, unit_id, fields, None if tokens is None else tokens[i], metas[i],
                             source=source, where=where))
    return out
