"""A storage unit: field tensors of the trajectories written by the producers on its node.

Why a unit per node: a producer writes to memory next to it (no hop through a controller), and a trainer rank
on the same node reads through memory. The unit is dumb on purpose: it validates against the schema, refuses
to overwrite a field (so a duplicate put can never corrupt a delivered tensor), hands out references to what it
holds, and forgets trajectories the controller says are fully consumed. All metadata decisions are the
controller's.

Thread-safe: producers and fetching ranks call it concurrently (a lock guards the index; tensors are copied on
put and read-only once stored, so neither the producer nor a reader can change stored bytes). Puts are
idempotent: a retried put of identical bytes is a no-op (its records are returned again so the controller can
register them if the first reply was lost); different bytes under a written field raise ``DuplicatePutError``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import ClassVar, Iterator, Sequence, TypeVar

import numpy as np

from knittrans.dataplane.buffers import BufferPool, aligned, copy_rows
from knittrans.dataplane.columns import PutColumns, check_columns
from knittrans.dataplane.types import (DuplicatePutError, FieldMeta, FieldNotProducedError, PutRecord,
                                       ReadTimeoutError, SchemaMismatchError, TrajectoryPayload, TrajectorySchema,
                                       UnitChunk, as_numpy)
from knittrans.types import Trajectory


@dataclass(frozen=True)
class UnitStats:
    """Occupancy of a unit: trajectories and payload bytes it holds now."""

    unit_id: str
    num_trajectories: int
    nbytes: int


def validate_payload(schema: TrajectorySchema, p: TrajectoryPayload) -> dict[str, np.ndarray]:
    """Schema-check one payload and return its fields as numpy arrays; raises before anything is stored."""
    if not isinstance(p.traj_id, int) or isinstance(p.traj_id, bool) or p.traj_id < 0:
        raise SchemaMismatchError(f"traj_id must be an int >= 0, got {p.traj_id!r}")
    if not p.tensors:
        raise SchemaMismatchError(f"trajectory {p.traj_id}: a put must carry at least one field")
    out: dict[str, np.ndarray] = {}
    for name, value in p.tensors.items():
        if name not in schema.names:
            raise SchemaMismatchError(f"trajectory {p.traj_id}: field {name!r} is not in the schema "
                                      f"(fields: {list(schema.names)})")
        arr = as_numpy(p.traj_id, name, value)
        schema.get(name).check(p.traj_id, arr)
        out[name] = arr
    tok = out.get(schema.token_field)
    if tok is not None and tok.shape[0] == 0:
        raise SchemaMismatchError(f"trajectory {p.traj_id}: token field {schema.token_field!r} is empty (a trajectory "
                                  f"has at least one token)")
    for group in schema.same_length:
        lens = {n: int(out[n].shape[0]) for n in group if n in out}
        empty = sorted(n for n, v in lens.items() if v == 0)  # name only the empty fields, not the whole group
        if empty:
            raise SchemaMismatchError(f"trajectory {p.traj_id}: zero-length response (field(s) {empty} have 0 rows"
                                      f"{'' if len(empty) == len(lens) else f' of {lens}'}; an empty generation "
                                      f"carries nothing to train on)")
        if len(set(lens.values())) > 1:
            raise SchemaMismatchError(f"trajectory {p.traj_id}: fields of mismatched length {lens} (schema: "
                                      f"{list(group)} have one row per response token)")
    if isinstance(p.meta, Trajectory):  # metadata that disagrees with the tensors would mis-count token budgets
        schema.check_num_tokens(p.traj_id, p.meta.num_tokens,
                                {n: int(a.shape[0]) for n, a in out.items() if a.ndim and schema.get(n).ragged})
    if p.checksums is not None:  # the producer's checksums: a message corrupted on its way here is refused
        from knittrans.dataplane.faults import verify_checksums

        verify_checksums(p.traj_id, out, p.checksums, where="put")
    return out


def stored_copy(arr: np.ndarray) -> np.ndarray:
    """The unit's own read-only copy of a field (copy on put: what the producer does with its buffer afterwards,
    and what a reader does with what it got, can never change stored bytes)."""
    own = arr.copy(order="C")
    own.flags.writeable = False
    return own


def packed_chunk(chunk: UnitChunk, pool: BufferPool | None = None) -> UnitChunk:
    """``chunk`` with every rows-form field packed back to back into one array (``UnitChunk``'s packed form),
    written into ``pool``'s reused buffers when given. What a unit actor returns over Ray: a handful of arrays
    serialize into the object store far faster than one small array per trajectory (measured: a 16 MB chunk of
    4 x 128 rows took ~2x longer to ``ray.get`` as rows than packed into a reused buffer), and the buffer is free
    again once Ray has copied it into the object store (nothing else references it then)."""
    rows = {f: vals for f, vals in enumerate(chunk.values) if isinstance(vals, tuple) and vals}
    if not rows:
        return chunk
    sizes = {f: sum(int(a.nbytes) for a in r) for f, r in rows.items()}
    buf = pool.take(sum(aligned(n) for n in sizes.values())) if pool is not None else None
    values, off = list(chunk.values), 0
    for f, r in rows.items():
        ragged = chunk.lengths[f] is not None
        shape = (sum(a.shape[0] for a in r), *r[0].shape[1:]) if ragged else (len(r), *r[0].shape)
        out = (buf[off:off + sizes[f]].view(r[0].dtype).reshape(shape) if buf is not None
               else np.empty(shape, dtype=r[0].dtype))
        copy_rows(r, out, ragged)
        values[f] = out
        off += aligned(sizes[f])
    return replace(chunk, values=tuple(values))


class PutRuns:
    """One put's stored bytes: per field, every payload's new array back to back in one read-only array (ragged
    fields concatenated along their first axis, fixed ones stacked), so that a share's consecutive rows are one
    run a reader copies at once (``ShareRuns``). ``arrays`` (one per field, in first-seen order) is the put's
    source; payload ``i``'s stored field is ``view(name, i)``."""

    def __init__(self, fresh: Sequence[dict[str, np.ndarray]]) -> None:
        names: dict[str, list[tuple[int, np.ndarray]]] = {}
        for i, new in enumerate(fresh):
            for name, arr in new.items():
                names.setdefault(name, []).append((i, arr))
        arrays, self._rows = [], {}
        for col, (name, items) in enumerate(names.items()):
            parts = [a.reshape(1) if a.ndim == 0 else a for _, a in items]  # a scalar field is a row of one
            whole = np.concatenate(parts)  # the schema checked one dtype and trailing shape per field
            whole.flags.writeable = False
            arrays.append(whole)
            off = 0
            for (i, a), part in zip(items, parts):
                n = part.shape[0]
                self._rows[(name, i)] = (col, off, off + n, a.shape)
                off += n
        self.arrays = tuple(arrays)

    def view(self, name: str, i: int) -> np.ndarray:
        col, a, b, shape = self._rows[(name, i)]
        return self.arrays[col][a:b].reshape(shape)

    def where(self, name: str, i: int) -> tuple[int, int, int] | None:
        """(array, first byte, end byte) of payload ``i``'s field ``name`` (None: not new in this put)."""
        got = self._rows.get((name, i))
        if got is None:
            return None
        col, a, b, _ = got
        step = self.arrays[col].strides[0]
        return col, a * step, b * step


def _stored_runs(fresh: Sequence[dict[str, np.ndarray]]) -> PutRuns | None:
    """The put's runs (``PutRuns``), or None when it adds nothing."""
    return PutRuns(fresh) if any(fresh) else None


_V = TypeVar("_V")


def pop_fields(rows: dict[int, dict[str, _V]], traj_ids: Sequence[int],
               fields: Sequence[str] | None) -> Iterator[tuple[int, str, _V]]:
    """Pop ``fields`` (every field when None) of ``traj_ids`` from ``rows`` (trajectory -> field -> value),
    yielding (trajectory, field, value) for each one popped; a trajectory left without fields is removed before its
    last field is yielded. Unknown trajectories and fields are skipped. The caller holds the lock of ``rows``."""
    for t in traj_ids:
        held = rows.get(t)
        if held is None:
            continue
        for name in list(held) if fields is None else fields:
            if name in held:
                value = held.pop(name)
                if not held:
                    del rows[t]
                yield t, name, value


class StorageUnit:
    """Holds ``traj_id -> field -> array``; the in-process transport uses it directly, the Ray transport wraps
    it in an actor (``knittrans.dataplane.ray_transport``)."""

    def __init__(self, unit_id: str, node: str, schema: TrajectorySchema) -> None:
        self.unit_id = unit_id
        self.node = node
        self.schema = schema
        self._data: dict[int, dict[str, np.ndarray]] = {}
        self._sums: dict[int, dict[str, int]] = {}  # the producers' checksums of stored fields (for ``manifest``)
        self._nbytes = 0  # bytes of every stored field (kept up to date by put, drop and clear: ``stats`` is O(1))
        self._lock = threading.Lock()

    def put(self, payloads: Sequence[TrajectoryPayload],
            checked: Sequence[dict[str, np.ndarray] | None] | None = None, copy: bool = True) -> list[PutRecord]:
        """Store every payload or none: all are validated (schema, duplicates within the call and against
        what is stored) before the first is stored. ``checked``: per payload, its fields as ``validate_payload``
        returned them, where a subclass already validated it (None entries are validated here). ``copy=False``:
        a field whose array is read-only is stored as it is, not copied (the caller owns memory nobody can write:
        the Ray unit's object-store objects, ``ray_transport.UnitHost.put_stored``); a writeable one is still
        copied."""
        pre = checked if checked is not None else [None] * len(payloads)
        checked = [c if c is not None else validate_payload(self.schema, p) for p, c in zip(payloads, pre)]
        seen: set[tuple[int, str]] = set()
        with self._lock:
            fresh: list[dict[str, np.ndarray]] = []
            for p, arrs in zip(payloads, checked):
                held = self._data.get(p.traj_id, {})
                new = {}
                for name, arr in arrs.items():
                    if (p.traj_id, name) in seen:
                        raise DuplicatePutError(f"unit {self.unit_id}: field {name!r} of trajectory {p.traj_id} "
                                                f"appears twice in one put")
                    seen.add((p.traj_id, name))
                    if name in held:
                        # A retried put (its reply was lost) is a no-op when it carries the same bytes; different
                        # bytes under the same id are a real duplicate (each field is produced exactly once).
                        if held[name].shape == arr.shape and np.array_equal(held[name], arr, equal_nan=True):
                            continue
                        raise DuplicatePutError(f"unit {self.unit_id}: field {name!r} of trajectory {p.traj_id} "
                                                f"was already written with different content (each field is "
                                                f"produced exactly once; an identical retry is a no-op)")
                    new[name] = arr
                fresh.append(new)
            records = []
            runs = _stored_runs(fresh) if copy else None
            for i, (p, arrs, new) in enumerate(zip(payloads, checked, fresh)):
                # Copy on put: a producer that reuses or edits its buffer after put() cannot change stored bytes
                # (one copy per field, into the put's runs; the stored copy is read-only, so no reader can edit it
                # in place either).
                if runs is not None:
                    stored = {name: runs.view(name, i) for name in new}
                else:
                    stored = {name: arr if not (copy or arr.flags.writeable) else stored_copy(arr)
                              for name, arr in new.items()}
                self._data.setdefault(p.traj_id, {}).update(stored)  # ``new`` holds only fields not yet stored
                self._nbytes += sum(int(a.nbytes) for a in stored.values())
                tok = arrs.get(self.schema.token_field)
                sums = p.checksums or {}
                kept = {n: sums[n] for n in new if sums.get(n) is not None}
                if kept:
                    self._sums.setdefault(p.traj_id, {}).update(kept)
                records.append(PutRecord(
                    traj_id=p.traj_id, unit_id=self.unit_id,
                    fields=tuple(FieldMeta(n, int(a.nbytes), int(a.shape[0]) if a.ndim else 1, sums.get(n))
                                 for n, a in arrs.items()),
                    num_tokens=None if tok is None else int(tok.shape[0]), meta=p.meta,
                    repeated=tuple(n for n in arrs if n not in new),
                    source=None if runs is None else runs.arrays,
                    where=() if runs is None else tuple(runs.where(n, i) for n in arrs)))
        return records

    def put_columns(self, cols: PutColumns, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...] | None:
        """Store a columnar put (``columns``): ``arrays`` are the put's fields, one array per field with every
        trajectory's rows back to back, owned by this unit from now on and never written again (in process the
        concatenation the client made is the put's one copy; on Ray the unit's own object's read-only views).
        Returns the put's source (the arrays, as ``PutRecord.source``). None -- nothing stored -- when a column check
        fails (``check_columns``) or a trajectory already holds one of these fields here (a retry or a duplicate):
        the caller takes the per-payload path, which decides and names it."""
        if not check_columns(self.schema, cols, arrays):
            return None
        ids = cols.traj_ids.tolist()
        offs = [cols.offsets(j) for j in range(len(cols.names))]
        for a in arrays:
            a.flags.writeable = False
        with self._lock:
            for t in ids:
                held = self._data.get(t)
                if held is not None and any(name in held for name in cols.names):
                    return None
            for i, t in enumerate(ids):
                self._data.setdefault(t, {}).update(
                    {name: a[off[i]:off[i + 1]] for name, a, off in zip(cols.names, arrays, offs)})
            self._nbytes += sum(int(a.nbytes) for a in arrays)
        return tuple(arrays)

    BOUNDED_GET: ClassVar[bool] = True
    """``get`` waits on nothing but this unit's lock (``lock_timeout`` bounds that) and runs no unbounded code, so
    an in-process reader may call it on its own thread under a deadline (``inprocess.DeadlineGetter``) instead of
    handing it to a reader thread. A subclass that waits on anything else must set it False."""

    def get(self, traj_ids: Sequence[int], fields: Sequence[str], lock_timeout: float | None = None) -> UnitChunk:
        """The requested fields in rows form (``UnitChunk``): the stored read-only arrays themselves, in
        ``traj_ids`` order. No byte is copied here: the rank's pack is the one copy a ready-to-use tensor needs
        (a concatenation here would be a second one, into freshly faulted-in pages). ``lock_timeout``: raise
        ``ReadTimeoutError`` if the unit's lock is not free within that many seconds (None: wait)."""
        if not self._lock.acquire(timeout=-1 if lock_timeout is None else max(0.0, lock_timeout)):
            raise ReadTimeoutError(f"unit {self.unit_id} did not answer a read within {lock_timeout} s (its lock "
                                   f"is held; the claim is undone; retry, or report the unit lost)")
        try:
            cols = []
            for name in fields:
                col = []
                for t in traj_ids:
                    try:
                        col.append(self._data[t][name])
                    except KeyError:
                        raise FieldNotProducedError(f"unit {self.unit_id} holds no field {name!r} of trajectory "
                                                    f"{t}") from None
                cols.append(tuple(col))
        finally:
            self._lock.release()
        lengths = [np.fromiter((a.shape[0] for a in col), dtype=np.int64, count=len(col))
                   if self.schema.get(name).ragged else None for name, col in zip(fields, cols)]
        return UnitChunk(self.unit_id, tuple(traj_ids), tuple(fields), tuple(cols), tuple(lengths))

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int:
        """Forget ``fields`` (all when None) of ``traj_ids``; returns the bytes freed. Unknown ids are ignored
        (drop is idempotent: it runs after consumption, or to roll back a rejected put)."""
        freed = 0
        with self._lock:
            for t, name, arr in pop_fields(self._data, traj_ids, fields):
                freed += int(arr.nbytes)
                sums = self._sums.get(t, {})
                sums.pop(name, None)
                if t not in self._data:
                    self._sums.pop(t, None)
            self._nbytes -= freed
        return freed

    def manifest(self) -> list[PutRecord]:
        """What this unit holds, as put records (fields with sizes and the producers' checksums, token counts):
        how a restarted controller learns which trajectories survive where (``knittrans.dataplane.recovery``)."""
        tok = self.schema.token_field
        with self._lock:
            return [PutRecord(traj_id=t, unit_id=self.unit_id,
                              fields=tuple(FieldMeta(n, int(a.nbytes), int(a.shape[0]) if a.ndim else 1,
                                                     self._sums.get(t, {}).get(n)) for n, a in held.items()),
                              num_tokens=int(held[tok].shape[0]) if tok in held else None)
                    for t, held in self._data.items()]

    def clear(self) -> int:
        """Forget everything (the unit was lost); returns the bytes freed."""
        with self._lock:
            freed = sum(int(a.nbytes) for d in self._data.values() for a in d.values())
            self._data.clear()
            self._sums.clear()
            self._nbytes = 0
        return freed

    def stats(self) -> UnitStats:
        with self._lock:
            return UnitStats(self.unit_id, len(self._data), self._nbytes)
